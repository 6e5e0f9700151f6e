"""Lend a model to the probe and give it back exactly as it was."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ..errors import AutobatchError

__all__ = ["enable_checkpointing", "disable_checkpointing", "borrowed_model", "kept_rng"]


@contextmanager
def kept_rng() -> Iterator[None]:
    """Run the body and give the global torch RNG back as it was (CPU, and CUDA once initialised).

    For the calls around a probe that may draw random numbers: a model factory initialising its
    weights, ``make_batch(1)`` for the fingerprint.
    """
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        yield


@contextmanager
def borrowed_model(
    model: torch.nn.Module, device: torch.device, *, grad_checkpointing: bool = False
) -> Iterator[torch.nn.Module]:
    """Yield ``model`` on ``device``, in train mode, ready to be trained; restore it on exit.

    On exit the parameters, buffers, gradients, ``requires_grad`` flags, train/eval modes and the
    RNG state are what they were, bit for bit, and nothing the probe made is left on ``device``.
    Tensors already on ``device`` are trained in place after a copy is put aside on the CPU (so
    the probe sees the memory training would see, not two copies); tensors elsewhere are trained
    as copies on ``device`` while the originals wait untouched.
    """
    params = dict(model.named_parameters(remove_duplicate=True))
    buffers = [(module, name, buf) for module in model.modules() for name, buf in module._buffers.items() if buf is not None]
    grads = {name: (p.grad, p.requires_grad) for name, p in params.items()}
    modes = [(module, module.training) for module in model.modules()]
    kept = [(module, _hooks_and_names(module)) for module in model.modules()]
    checkpointing_before = _checkpointing_on(model)
    # Per tensor: ("copy", CPU copy) when trained in place on the device, ("moved", original) when
    # a copy is trained on the device instead. Keyed by name: ``p.data`` is a new object each time.
    param_saves: dict[str, tuple[str, torch.Tensor]] = {}
    buffer_saves: list[tuple[str, torch.Tensor]] = []

    def lend(tensor: torch.Tensor) -> tuple[tuple[str, torch.Tensor], torch.Tensor]:
        if tensor.device == device:
            return ("copy", tensor.detach().to("cpu", copy=True)), tensor
        return ("moved", tensor), tensor.detach().to(device, copy=True)

    def give_back(save: tuple[str, torch.Tensor], current: torch.Tensor) -> torch.Tensor:
        how, kept = save
        if how == "copy":
            current.copy_(kept)
            return current
        return kept

    rng_devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=rng_devices):
        try:
            with torch.no_grad():
                for name, p in params.items():
                    param_saves[name], p.data = lend(p.data)
                    p.grad = None
                for module, name, buf in buffers:
                    save, module._buffers[name] = lend(buf)
                    buffer_saves.append(save)
            model.train()
            if grad_checkpointing and not checkpointing_before:
                enable_checkpointing(model)
            yield model
        finally:
            if grad_checkpointing and not checkpointing_before:
                disable_checkpointing(model)
            with torch.no_grad():
                for name, save in param_saves.items():
                    p = params[name]
                    p.data = give_back(save, p.data)
                    p.grad, requires_grad = grads[name]
                    p.requires_grad_(requires_grad)
                for (module, name, _), save in zip(buffers, buffer_saves):
                    module._buffers[name] = give_back(save, module._buffers[name])
            for module, training in modes:
                module.training = training
            for module, before in kept:
                _restore_hooks_and_names(module, before)


# Every hook table a module keeps (forward, pre-forward, backward, state-dict …): read from the module
# itself, so a table a newer torch adds is kept too.
def _hooks_and_names(module: torch.nn.Module) -> tuple[set[str], dict[str, dict[Any, Any]]]:
    tables = {name: dict(value) for name, value in vars(module).items() if "hook" in name and isinstance(value, dict)}
    return set(vars(module)), tables


def _restore_hooks_and_names(module: torch.nn.Module, before: tuple[set[str], dict[str, dict[Any, Any]]]) -> None:
    """Take off what the probe hung on ``module``: hooks it registered (transformers' checkpointing
    leaves an input-grads hook on the embeddings) and attributes it added (``_require_grads_hook``)."""
    names, tables = before
    for name in set(vars(module)) - names:
        delattr(module, name)
    for name, table in tables.items():
        current = getattr(module, name)
        current.clear()
        current.update(table)


def _checkpointing_on(model: torch.nn.Module) -> bool:
    # Newer transformers renamed the flag and warns on the old name; read whichever exists.
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), name) or name in vars(model):
            return bool(getattr(model, name))
    return False


def enable_checkpointing(model: torch.nn.Module) -> None:
    """Turn on the model's gradient checkpointing, as transformers models name it (non-reentrant).

    ``activation_checkpointing_enable`` where the model has it (current transformers, which
    deprecates ``gradient_checkpointing_enable`` with a warning), else the older name; a model
    with neither is refused in one line.
    """
    current = getattr(model, "activation_checkpointing_enable", None)
    if current is not None:
        current(activation_checkpointing_kwargs={"use_reentrant": False})
        return
    enable = getattr(model, "gradient_checkpointing_enable", None)
    if enable is None:
        raise AutobatchError(
            f"gradient checkpointing needs a model with gradient_checkpointing_enable() (transformers models "
            f"have it), but {type(model).__name__} has none; enable checkpointing inside your model instead"
        )
    try:
        enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    except TypeError:  # older transformers take no kwargs
        enable()


def disable_checkpointing(model: torch.nn.Module) -> None:
    """Turn the model's gradient checkpointing off again (by the name it has)."""
    for name in ("activation_checkpointing_disable", "gradient_checkpointing_disable"):
        if callable(getattr(model, name, None)):
            getattr(model, name)()
            return

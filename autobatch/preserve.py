"""Lend a model to the probe and give it back exactly as it was."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from .errors import AutobatchError

__all__ = ["borrowed_model"]


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
    owners = [(module, name) for module in model.modules() for name, buf in module._buffers.items() if buf is not None]
    saved_params = {name: (p.data, p.grad, p.requires_grad) for name, p in params.items()}
    saved_buffers = [(module, name, module._buffers[name]) for module, name in owners]
    modes = [(module, module.training) for module in model.modules()]
    checkpointing_before = bool(getattr(model, "is_gradient_checkpointing", False))
    backups: dict[int, torch.Tensor] = {}  # id(original tensor) -> CPU copy, for in-place training

    def lend(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device == device:
            if id(tensor) not in backups:
                backups[id(tensor)] = tensor.detach().to("cpu", copy=True)
            return tensor
        return tensor.detach().to(device, copy=True)

    rng_devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=rng_devices):
        try:
            with torch.no_grad():
                for p in params.values():
                    p.data = lend(p.data)
                    p.grad = None
                for module, name, buf in saved_buffers:
                    module._buffers[name] = lend(buf)
            model.train()
            if grad_checkpointing and not checkpointing_before:
                _enable_checkpointing(model)
            yield model
        finally:
            if grad_checkpointing and not checkpointing_before:
                model.gradient_checkpointing_disable()
            with torch.no_grad():
                for name, p in params.items():
                    data, grad, requires_grad = saved_params[name]
                    if id(data) in backups:
                        data.copy_(backups[id(data)])
                    p.data = data
                    p.grad = grad
                    p.requires_grad_(requires_grad)
                for module, name, buf in saved_buffers:
                    if id(buf) in backups:
                        buf.copy_(backups[id(buf)])
                    module._buffers[name] = buf
            for module, training in modes:
                module.training = training


def _enable_checkpointing(model: torch.nn.Module) -> None:
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

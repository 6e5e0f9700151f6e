"""What a trial trains: a model, batches of any size, a loss and an optimizer."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Union

import torch

from ..errors import AutobatchError
from .eight_bit import EightBitAdamW

__all__ = ["Workload", "default_loss", "step_loss", "where", "make_optimizer", "resolve_dtype", "weights_dtype",
           "weights_in", "OPTIMIZERS", "DTYPES", "WEIGHTS"]

ModelOrFactory = Union[torch.nn.Module, Callable[[], torch.nn.Module]]
OptimizerFactory = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]

OPTIMIZERS: dict[str, OptimizerFactory] = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-4),
    "adam": lambda params: torch.optim.Adam(params, lr=1e-4),
    "sgd": lambda params: torch.optim.SGD(params, lr=1e-3, momentum=0.9),
    "sgd-nomomentum": lambda params: torch.optim.SGD(params, lr=1e-3),
    "adafactor": lambda params: torch.optim.Adafactor(params, lr=1e-3),
    # bitsandbytes' AdamW8bit as memory: uint8 moments, absmax per 256 (no bitsandbytes needed)
    "adamw8bit": lambda params: EightBitAdamW(params, lr=1e-4),
}
DTYPES: dict[str, torch.dtype | None] = {
    "fp32": None, "float32": None,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16,
    # pure low-precision weights (Lightning's bf16-true and 16-true, torchtune's dtype): no autocast
    "bf16-true": None, "fp16-true": None,
}
#: The weights' own dtype where it is not fp32: the whole model, its gradients and the optimizer's state.
WEIGHTS: dict[str, torch.dtype] = {"bf16-true": torch.bfloat16, "fp16-true": torch.float16}


def default_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    """The loss of one batch, for the shapes batches usually take.

    * a mapping (transformers style): ``model(**batch)``, and its ``loss`` (labels in the batch);
    * a pair ``(inputs, targets)``: cross-entropy of ``model(inputs)`` against ``targets``;
    * a tensor: the mean of ``model(batch)`` (enough to train every parameter for probing).
    """
    if isinstance(batch, dict):
        out = model(**batch)
        loss = _loss_of(out)
        if loss is None:
            raise AutobatchError(
                "default_loss needs the model to return a loss when the batch is a dict, but it returned none; "
                "put labels in the batch or pass loss_fn=…"
            )
        return loss
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        inputs, targets = batch
        logits = model(inputs)
        if not isinstance(logits, torch.Tensor):
            raise AutobatchError(
                f"default_loss takes a batch (inputs, targets) as classification: model(inputs) must return a tensor "
                f"of logits, but {where(model)} returned {type(logits).__name__}; return the logits, or pass "
                "loss_fn=… (a Workload from your --model function)")
        return torch.nn.functional.cross_entropy(logits, targets)
    out = model(batch)
    if isinstance(out, torch.Tensor):
        return out.float().mean()
    loss = _loss_of(out)
    if loss is None:
        raise AutobatchError(
            f"default_loss needs model(batch) to return a tensor or an object with a loss, but it returned "
            f"{type(out).__name__}; pass loss_fn=…"
        )
    return loss


def _loss_of(out: Any) -> torch.Tensor | None:
    """The loss in a model's output, as the HF Trainer reads it: ``out["loss"]`` (or ``out.loss``),
    else the first item of a tuple (``(loss, logits)``, what models return with ``return_dict=False``)."""
    if isinstance(out, dict):
        return out.get("loss")
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor) and out[0].numel() == 1:
        return out[0]
    return loss


def where(fn: Any) -> str:
    """``file.py:12 (name)``: where a function of the user's is defined, for an error to point at."""
    fn = getattr(fn, "forward", fn) if isinstance(fn, torch.nn.Module) else fn
    code = getattr(fn, "__code__", None)
    if code is None:
        return getattr(fn, "__qualname__", type(fn).__name__)
    return f"{code.co_filename}:{code.co_firstlineno} ({getattr(fn, '__qualname__', code.co_name)})"


def step_loss(loss_fn: Callable[[torch.nn.Module, Any], Any], model: torch.nn.Module, batch: Any) -> torch.Tensor:
    """``loss_fn(model, batch)``, refused in one line unless it is a one-element tensor."""
    loss = loss_fn(model, batch)
    if not isinstance(loss, torch.Tensor):
        raise AutobatchError(f"the loss must be a tensor with one element, but loss_fn returned {type(loss).__name__} "
                             f"({where(loss_fn)}); return a torch scalar, e.g. the mean of the batch's losses")
    if loss.numel() != 1:
        raise AutobatchError(f"the loss must be a tensor with one element, but loss_fn returned one of shape "
                             f"{tuple(loss.shape)} ({where(loss_fn)}); reduce it, e.g. .mean()")
    return loss


def make_optimizer(optimizer: str | OptimizerFactory, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    params = list(params)
    if not params:
        raise AutobatchError("the model has no trainable parameters (requires_grad is False on every one), so no "
                             "training step can be probed; unfreeze the layers you train")
    if callable(optimizer):
        return optimizer(params)
    try:
        factory = OPTIMIZERS[optimizer.lower()]
    except KeyError:
        raise AutobatchError(
            f"optimizer must be one of {', '.join(OPTIMIZERS)}, but got {optimizer!r}; "
            "pass an optimizer factory from Python for anything else"
        ) from None
    return factory(params)


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """The autocast dtype, ``None`` for full fp32."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return None if dtype == torch.float32 else dtype
    try:
        return DTYPES[dtype.lower()]
    except KeyError:
        raise AutobatchError(f"dtype must be one of fp32, bf16, fp16, bf16-true, fp16-true, but got {dtype!r}") from None


def weights_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """The dtype the weights themselves are in for ``dtype`` (``"bf16-true"``: bfloat16), else ``None``:
    fp32 weights, under autocast for ``"bf16"`` and ``"fp16"``.

    Example:
        >>> weights_dtype("bf16-true"), weights_dtype("bf16")
        (torch.bfloat16, None)
    """
    resolve_dtype(dtype)
    return WEIGHTS.get(dtype.lower()) if isinstance(dtype, str) else None


@contextmanager
def weights_in(dtype: torch.dtype | None) -> Iterator[None]:
    """Build a model with its weights in ``dtype``: torch's default dtype for the block, as it was after.
    Buffers a model keeps in float32 on purpose (rotary frequencies) stay so, as a checkpoint loaded
    in bf16 keeps them."""
    if dtype is None:
        yield
        return
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def _built_in(factory: Callable[[], torch.nn.Module], dtype: torch.dtype) -> Callable[[], torch.nn.Module]:
    def build() -> torch.nn.Module:
        with weights_in(dtype):
            return factory()

    build.__name__ = getattr(factory, "__name__", "model")
    build._weights_in, build._factory = dtype, factory  # type: ignore[attr-defined]
    return build


@dataclass(frozen=True)
class Workload:
    """One training step, at any batch size.

    Args:
        model: the model, or a function that builds it. A model passed in is trained during
            probing and restored bit for bit afterwards; a factory is called once per probe.
        make_batch: ``make_batch(b)`` returns a batch of ``b`` samples at the worst-case shape
            (the longest sequence you will train on). Tensors are moved to the probed device.
        loss_fn: ``loss_fn(model, batch)`` returns the scalar loss; see :func:`default_loss`.
        optimizer: ``"adamw"``, ``"sgd"``, … or a factory ``params -> Optimizer``.
        dtype: autocast dtype (``"bf16"``, ``"fp16"``), pure low-precision weights (``"bf16-true"``,
            ``"fp16-true"``: a factory builds the model in that dtype, a model passed in must hold
            it already, and floating-point inputs are cast to it, as Lightning's ``bf16-true`` does),
            or ``None`` for fp32.
        grad_checkpointing: call the model's ``gradient_checkpointing_enable()`` while probing.
        grads_held: the gradients stay allocated from one step into the next one's forward, as in
            every accumulation micro-step after the first, or in a loop that zeroes them with
            ``zero_grad(set_to_none=False)``: the forward's peak then holds them too.
        steps: full training steps per trial; at least 2, since optimizer state appears at the
            first ``step()`` and the second step carries it.
        name: shown in reports.

    Example:
        >>> model = torch.nn.Linear(16, 4)
        >>> work = Workload(model, lambda b: (torch.randn(b, 16), torch.randint(0, 4, (b,))))
    """

    model: ModelOrFactory
    make_batch: Callable[[int], Any]
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor] = default_loss
    optimizer: str | OptimizerFactory = "adamw"
    dtype: str | torch.dtype | None = None
    grad_checkpointing: bool = False
    grads_held: bool = False
    steps: int = 2
    name: str = "model"

    def __post_init__(self) -> None:
        if not (isinstance(self.model, torch.nn.Module) or callable(self.model)):
            raise AutobatchError(
                f"model must be a torch.nn.Module or a function returning one, but got {type(self.model).__name__}"
            )
        if not callable(self.make_batch):
            raise AutobatchError("make_batch must be a function b -> batch of b samples")
        if not isinstance(self.steps, int) or self.steps < 2:
            raise AutobatchError(
                f"steps must be an integer ≥ 2 (optimizer state appears at the first step), but got steps={self.steps!r}"
            )
        weights = weights_dtype(self.dtype)
        if weights is not None and isinstance(self.model, torch.nn.Module):
            held = sorted({str(p.dtype).removeprefix("torch.") for p in self.model.parameters()
                           if p.is_floating_point() and p.dtype != weights})
            if held:
                raise AutobatchError(
                    f"dtype {self.dtype} trains {str(weights).removeprefix('torch.')} weights, but the model passed in holds "
                    f"{', '.join(held)} ones; cast it first (model.to(torch.{str(weights).removeprefix('torch.')})) "
                    "or pass a function that builds it")
        elif getattr(self.model, "_weights_in", None) != weights:
            factory = getattr(self.model, "_factory", self.model)  # a factory wrapped for another dtype: its own
            object.__setattr__(self, "model", factory if weights is None else _built_in(factory, weights))
        if isinstance(self.optimizer, str) and self.optimizer.lower() not in OPTIMIZERS:
            raise AutobatchError(
                f"optimizer must be one of {', '.join(OPTIMIZERS)}, but got {self.optimizer!r}; "
                "pass an optimizer factory from Python for anything else"
            )

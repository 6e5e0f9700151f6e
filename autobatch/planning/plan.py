"""The single answer: a :class:`Plan` that reaches the global batch exactly, and shows its arithmetic.

``micro_batch × grad_accum × world_size == global_batch`` holds by construction: ``world_size``
and ``global_batch`` are computed from the other fields, so no Plan can disagree with itself.
Every config writer (DeepSpeed, accelerate, HF, Lightning, launch commands) reads one Plan, so
the numbers are the same in every file (field report 3).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from ..errors import AutobatchError

if TYPE_CHECKING:
    pass

__all__ = ["Plan", "LRAdvice", "TrainedWith", "require_positive_int"]


def require_positive_int(name: str, value: object, *, fix: str = "") -> int:
    """Return ``value`` as an ``int`` or raise an :class:`AutobatchError` that states the rule.

    Booleans and floats are refused even when whole (``224.0``): a float batch size is almost
    always a division that went wrong upstream, and saying so beats rounding it.

    Args:
        name: The argument's name as the user wrote it (``"target"``, ``"--gpus"``).
        value: The value to check.
        fix: Optional advice appended to the message.

    Example:
        >>> require_positive_int("target", 224)
        224
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < 1:
        advice = f"; {fix}" if fix else ""
        raise AutobatchError(f"{name} must be a positive integer, but got {name}={value!r}{advice}")
    return int(value)


def _count(n: int, singular: str, plural: str) -> str:
    return f"{n} {singular if n == 1 else plural}"


@dataclass(frozen=True)
class LRAdvice:
    """Learning rates scaled from a reference run to the plan's global batch (field report 3).

    Linear scaling (Goyal et al.) is the usual rule for SGD; square-root scaling is often the
    better start for Adam-type optimisers. Both are starting points for a sweep, not answers.

    Example:
        >>> LRAdvice(base_lr=3e-4, base_batch=256, global_batch=224).linear
        0.0002625
    """

    base_lr: float
    base_batch: int
    global_batch: int

    @property
    def linear(self) -> float:
        """``base_lr × global_batch / base_batch``."""
        return self.base_lr * self.global_batch / self.base_batch

    @property
    def sqrt(self) -> float:
        """``base_lr × sqrt(global_batch / base_batch)``."""
        return self.base_lr * math.sqrt(self.global_batch / self.base_batch)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready values, including both scaled learning rates."""
        return {**asdict(self), "linear": self.linear, "sqrt": self.sqrt}

    def __str__(self) -> str:
        return (
            f"learning rate for batch {self.global_batch} from {self.base_lr:.4g} at batch {self.base_batch}: "
            f"linear {self.linear:.4g}, square-root {self.sqrt:.4g} "
            "(linear is the usual rule for SGD, square-root a common start for Adam)"
        )


@dataclass(frozen=True)
class TrainedWith:
    """What a plan's micro batch was found under, which training must keep for it to fit.

    Attributes:
        precision: ``"bf16"``/``"fp16"`` autocast, ``"bf16-true"``/``"fp16-true"`` pure weights, or
            ``None`` for fp32.
        grad_checkpointing: whether the probe recomputed activations.
        strategy: the :class:`~autobatch.Strategy` it was probed under (``None``: one device, or DDP).
        probed_zero: the ``zero_optimization`` values a ZeRO probe ran with (its bucket sizes).

    Every config helper (:func:`~autobatch.deepspeed_config`, :func:`~autobatch.hf_training_args`,
    :func:`~autobatch.accelerate_config`, :func:`~autobatch.lightning_settings`, …) reads it from
    ``plan.trained_with`` for any of these not passed, so ``deepspeed_config(autobatch.find(…,
    dtype="bf16", strategy="zero3"))`` trains bf16 under ZeRO-3, as the batch was found.
    """

    precision: str | None = None
    grad_checkpointing: bool = False
    strategy: Any = None
    probed_zero: dict[str, Any] | None = None


@dataclass(frozen=True)
class Plan:
    """Micro batch × gradient accumulation × data-parallel world size = global batch, exactly.

    Args:
        micro_batch: Samples per GPU per forward/backward (DeepSpeed's
            ``train_micro_batch_size_per_gpu``, HF's ``per_device_train_batch_size``).
        grad_accum: Micro batches accumulated per optimizer step.
        gpus_per_node: GPUs (processes) on each node.
        nodes: Number of nodes.
        model_parallel: Tensor × pipeline parallel degree. Those ranks share one batch, so the
            data-parallel ``world_size`` is ``gpus_per_node × nodes / model_parallel``.
        max_micro: The largest micro batch that was allowed (e.g. the probed memory limit).
        min_micro: The smallest micro batch that was allowed (2 for BatchNorm models).
        multiple_of: Micro batches had to be a multiple of this, if given.
        reason: How the micro batch was chosen, in words.
        step_time: Predicted seconds per optimizer step, when step times were given.
        lr_advice: Scaled learning rates, when a base learning rate and batch were given.
        trained_with: What the micro batch was found under (:class:`TrainedWith`), set by
            :func:`~autobatch.find` and :func:`~autobatch.answer`; the config helpers train with it.

    ``world_size`` and ``global_batch`` are computed, never passed, so the identity cannot break.

    Example:
        >>> print(Plan(micro_batch=7, grad_accum=2, gpus_per_node=16, nodes=1))
        7 per GPU × 2 accumulation × 16 GPUs (16 per node × 1 node) = 224
    """

    micro_batch: int
    grad_accum: int
    gpus_per_node: int = 1
    nodes: int = 1
    model_parallel: int = 1
    max_micro: int | None = None
    min_micro: int = 1
    multiple_of: int | None = None
    reason: str = ""
    step_time: float | None = None
    lr_advice: LRAdvice | None = None
    trained_with: TrainedWith | None = field(default=None, compare=False)
    world_size: int = field(init=False)
    global_batch: int = field(init=False)

    def __post_init__(self) -> None:
        for name in ("micro_batch", "grad_accum", "gpus_per_node", "nodes", "model_parallel"):
            object.__setattr__(self, name, require_positive_int(name, getattr(self, name)))
        gpus = self.gpus_per_node * self.nodes
        if gpus % self.model_parallel:
            raise AutobatchError(
                f"model_parallel must divide the GPU count, but got model_parallel={self.model_parallel} "
                f"for {gpus} GPUs ({self.gpus_per_node} per node × {self.nodes} nodes); "
                "use a model-parallel degree that divides the number of GPUs"
            )
        # frozen dataclass: derived fields are set once, here, and never again
        object.__setattr__(self, "world_size", gpus // self.model_parallel)
        object.__setattr__(self, "global_batch", self.micro_batch * self.grad_accum * self.world_size)

    @property
    def num_processes(self) -> int:
        """All GPUs in the job: ``gpus_per_node × nodes`` (accelerate's ``num_processes``)."""
        return self.gpus_per_node * self.nodes

    # --- presentation -----------------------------------------------------------------------

    def __str__(self) -> str:
        topology = f"{self.gpus_per_node} per node × {_count(self.nodes, 'node', 'nodes')}"
        if self.model_parallel == 1:
            ranks = f"{_count(self.world_size, 'GPU', 'GPUs')} ({topology})"
        else:
            ranks = (
                f"{_count(self.world_size, 'data-parallel rank', 'data-parallel ranks')} "
                f"({_count(self.num_processes, 'GPU', 'GPUs')}: {topology} ÷ {self.model_parallel} model-parallel)"
            )
        return f"{self.micro_batch} per GPU × {self.grad_accum} accumulation × {ranks} = {self.global_batch}"

    def describe(self) -> str:
        """The arithmetic, how it was chosen, and learning-rate advice, one per line."""
        lines = [str(self)]
        if self.reason:
            lines.append(f"chosen: {self.reason}")
        if self.lr_advice is not None:
            lines.append(str(self.lr_advice))
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields, plus ``num_processes`` and the printed ``arithmetic``."""
        # the identity's terms first, so the JSON reads like the arithmetic
        data: dict[str, Any] = {
            "global_batch": self.global_batch,
            "micro_batch": self.micro_batch,
            "grad_accum": self.grad_accum,
            "world_size": self.world_size,
            "gpus_per_node": self.gpus_per_node,
            "nodes": self.nodes,
            "model_parallel": self.model_parallel,
            "num_processes": self.num_processes,
            "arithmetic": str(self),
        }
        data.update({k: v for k, v in asdict(self).items() if k not in data and k != "trained_with"})
        data["lr_advice"] = None if self.lr_advice is None else self.lr_advice.to_dict()
        return data

"""What a fake-tensor trace cannot see on a real GPU, as explicit, documented assumptions.

The trace counts live tensor storages exactly, op by op. A GPU needs more than that, and in one
place less:

* **CUDA context** (300–600 MiB per process): not a tensor; taken off the card's memory in the
  catalogue (:attr:`autobatch.estimating.gpus.GpuSpec.usable_bytes`), as the probe's capacity does.
* **Allocator overhead and fragmentation**: the caching allocator rounds blocks (512 B small,
  2 and 20 MiB segments for large ones) and cannot always reuse freed blocks for a larger
  request, so its reserved peak exceeds the allocated peak, and near a full card it flushes its
  cache and retries. By default (``fragmentation=None``) a single-GPU estimate books the traced
  step's requests, in order, through a model of that allocator on the card's memory
  (:func:`~autobatch.estimating.replay.book`): on an H200 (``docs/benchmarks/gpu.md``) that
  booked the reserved peaks the card measured within 0.1 % for gpt2 (fp32, bf16) and bert-base
  (where the card did not flush its cache), whose ratios to the allocated peaks were 1.11, 1.07
  and 1.26, and answered 74, 93 and 349 where the card fit 74, 93 and 348. Sharded estimates book
  each trial's requests as a fresh run at its batch makes them (:mod:`autobatch.estimating.fresh_log`).
  Length tables book each row's trials so too. A number multiplies the traced peak instead (e.g. 1.10,
  :data:`DEFAULT_FRAGMENTATION`).
* **Library workspaces**: cuBLAS keeps a workspace per handle/stream (torch's default is
  ~8 MiB, 32 MiB on Hopper), cuBLASLt and cuDNN their own. ``workspace_bytes`` adds a flat
  64 MiB.
* **Fused attention** (less, not more): on a GPU ``scaled_dot_product_attention`` runs a flash
  or memory-efficient kernel that keeps the output and a log-sum-exp per row for backward, O(seq)
  memory; on fake CPU tensors it falls back to the math path, which keeps the attention
  probabilities, O(seq²). With ``fused_attention`` on, the trace routes SDPA calls to the fused
  CPU kernel, whose saved tensors have the GPU kernels' sizes. Models with hand-written (eager)
  attention keep the probabilities on a GPU too, and are traced as they are.

``docs/estimate.md`` says where each default comes from.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any

from ..errors import AutobatchError
from ..probing.trial import Trial
from ..units import format_bytes
from .gpus import GpuSpec
from .replay import book

__all__ = ["Overheads", "DEFAULT_FRAGMENTATION", "DEFAULT_WORKSPACE_BYTES", "on_gpu", "booked_on_gpu", "on_the_card",
           "beside_the_context",
           "booking_text"]

DEFAULT_FRAGMENTATION = 1.10
DEFAULT_WORKSPACE_BYTES = 64 << 20


@dataclass(frozen=True)
class Overheads:
    """How a traced tensor peak becomes a GPU's reserved peak, and how the trace runs attention.

    Args:
        fragmentation: reserved / allocated peak of the caching allocator (≥ 1); ``None`` (the
            default) books the traced requests through the allocator's model where a log is kept
            (one GPU's and sharded estimates) and takes :data:`DEFAULT_FRAGMENTATION` where none is.
        workspace_bytes: cuBLAS, cuBLASLt and cuDNN workspaces, added once.
        fused_attention: trace SDPA with a fused kernel (O(seq) memory, like flash attention on a
            GPU) instead of the CPU math path (O(seq²)).
        context_bytes: the CUDA context; ``None`` takes the GPU's catalogue value.

    Example:
        >>> Overheads(fragmentation=1.10).reserved(1000 << 20) == int(1.10 * (1000 << 20)) + (64 << 20)
        True
        >>> Overheads.none().reserved(123)
        123
    """

    fragmentation: float | None = None
    workspace_bytes: int = DEFAULT_WORKSPACE_BYTES
    fused_attention: bool = True
    context_bytes: int | None = None

    def __post_init__(self) -> None:
        fragmentation = self.fragmentation
        if fragmentation is not None and (isinstance(fragmentation, bool) or not isinstance(fragmentation, (int, float))
                                          or not math.isfinite(fragmentation) or fragmentation < 1):
            raise AutobatchError(
                f"fragmentation is reserved/allocated memory and must be ≥ 1 and finite, but got "
                f"fragmentation={fragmentation!r}; use e.g. 1.10"
            )
        for name in ("workspace_bytes", "context_bytes"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise AutobatchError(f"{name} must be a non-negative number of bytes, but got {value!r}")

    @classmethod
    def none(cls) -> Overheads:
        """No overheads at all: the trace's exact tensor bytes, the simulated backend's view."""
        return cls(fragmentation=1.0, workspace_bytes=0, fused_attention=False, context_bytes=0)

    @property
    def multiplier(self) -> float:
        """The reserved / allocated ratio taken where no log is booked: ``fragmentation``, or the default."""
        return DEFAULT_FRAGMENTATION if self.fragmentation is None else self.fragmentation

    def reserved(self, allocated: int) -> int:
        """The reserved peak a GPU would reach for a traced (allocated) peak, by :attr:`multiplier`."""
        return int(allocated * self.multiplier) + self.workspace_bytes

    def allocatable(self, usable: int) -> int:
        """The largest traced (allocated) peak whose reserved peak stays within ``usable`` bytes.

        Example:
            >>> Overheads(fragmentation=1.25, workspace_bytes=100).allocatable(600)
            400
        """
        return max(0, int((usable - self.workspace_bytes) / self.multiplier))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def on_gpu(trial: Trial, overheads: Overheads, capacity: int, buckets: int = 0) -> Trial:
    """The traced trial as a GPU holds it, by the overheads' multiplier: fit where its reserved peak fits ``capacity``."""
    # DDP's buckets are allocated when the model is wrapped and live as long as it: a fixed cost.
    trial = replace(trial, peak_bytes=trial.peak_bytes + buckets, reserved_bytes=trial.reserved_bytes + buckets,
                    forward_backward_bytes=trial.forward_backward_bytes + buckets,
                    optimizer_bytes=trial.optimizer_bytes + buckets)
    reserved = overheads.reserved(trial.reserved_bytes)
    return replace(
        trial,
        fits=trial.fits and reserved <= capacity,
        reserved_bytes=reserved,
        forward_backward_bytes=overheads.reserved(trial.forward_backward_bytes),
        optimizer_bytes=overheads.reserved(trial.optimizer_bytes),
        resident_bytes=None if trial.resident_bytes is None else overheads.reserved(trial.resident_bytes),
    )


def booked_on_gpu(trial: Trial, requests: list[tuple[int, int | None]], overheads: Overheads, capacity: int,
                  buckets: int = 0) -> Trial:
    """The traced trial as the GPU's caching allocator books it: its requests replayed on ``capacity``
    after the workspaces and DDP's buckets, fit where every request is served."""
    held = overheads.workspace_bytes + buckets
    booking = book(requests, capacity, first=tuple(n for n in (overheads.workspace_bytes, buckets) if n))
    return replace(
        trial, fits=trial.fits and booking.fits, peak_bytes=trial.peak_bytes + held, reserved_bytes=booking.peak_reserved,
        forward_backward_bytes=trial.forward_backward_bytes + held, optimizer_bytes=trial.optimizer_bytes + held,
        resident_bytes=None if trial.resident_bytes is None else trial.resident_bytes + held,
        alloc_retries=booking.retries)


def on_the_card(trial: Trial, requests: list[tuple[int, int | None]], overheads: Overheads, capacity: int,
                buckets: int = 0) -> Trial:
    """The traced trial as the card holds it: its ``requests`` booked through the caching allocator's model
    (:func:`booked_on_gpu`, the default), or by the multiplier the overheads set (:func:`on_gpu`)."""
    if overheads.fragmentation is None:
        return booked_on_gpu(trial, requests, overheads, capacity, buckets)
    return on_gpu(trial, overheads, capacity, buckets)


def beside_the_context(spec: GpuSpec, overheads: Overheads) -> int:
    """The card's memory less its CUDA context (the overheads' where they set one, else the card's):
    what a process can allocate. Raises when the context takes it all."""
    context = spec.context_bytes if overheads.context_bytes is None else overheads.context_bytes
    capacity = spec.total_bytes - context
    if capacity <= 0:
        fix = ("pass a smaller --cuda-context" if overheads.context_bytes is not None
               else "pass a larger --gpu-memory (the CUDA context takes that much of it)")
        raise AutobatchError(
            f"the GPU's memory ({format_bytes(spec.total_bytes)}) must exceed its CUDA context "
            f"({format_bytes(context)}); {fix}"
        )
    return capacity


def booking_text(overheads: Overheads) -> str:
    """How the traced peaks became a GPU's reserved ones, in words."""
    if overheads.fragmentation is None:
        return "each step's requests booked through the caching allocator's model"
    return f"fragmentation ×{overheads.fragmentation:g}"

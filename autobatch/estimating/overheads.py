"""What a fake-tensor trace cannot see on a real GPU, as explicit, documented assumptions.

The trace counts live tensor storages exactly, op by op. A GPU needs more than that, and in one
place less:

* **CUDA context** (300–600 MiB per process): not a tensor; taken off the card's memory in the
  catalogue (:attr:`autobatch.estimating.gpus.GpuSpec.usable_bytes`), as the probe's capacity does.
* **Allocator overhead and fragmentation**: the caching allocator rounds blocks (512 B small,
  2 MiB segments for large ones) and cannot always reuse freed blocks for a larger request, so
  its reserved peak exceeds the allocated peak. ``fragmentation`` multiplies the traced peak;
  default 1.10. On an H200 (``docs/benchmarks/gpu.md``) the ratio of ``max_memory_reserved`` to
  ``max_memory_allocated`` at the largest batch that fit was 1.07 (gpt2, bf16), 1.11 (gpt2,
  fp32) and 1.17 (bert-base, bf16), with ``expandable_segments`` off; the 1.05 assumed before
  sat below all three.
* **Library workspaces**: cuBLAS keeps a workspace per handle/stream (torch's default is
  ~8 MiB, 32 MiB on Hopper), cuBLASLt and cuDNN their own. ``workspace_bytes`` adds a flat
  64 MiB.
* **Fused attention** (less, not more): on a GPU ``scaled_dot_product_attention`` runs a flash
  or memory-efficient kernel that keeps the output and a log-sum-exp per row for backward, O(seq)
  memory; on fake CPU tensors it falls back to the math path, which keeps the attention
  probabilities, O(seq²). With ``fused_attention`` on, the trace routes SDPA calls to the fused
  CPU kernel, whose saved tensors have the GPU kernels' sizes. Models with hand-written (eager)
  attention keep the probabilities on a GPU too, and are traced as they are.

None of these has been calibrated against a real GPU yet (no GPU was available when this was
written); ``docs/estimate.md`` says how to calibrate them.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from ..errors import AutobatchError

__all__ = ["Overheads", "DEFAULT_FRAGMENTATION", "DEFAULT_WORKSPACE_BYTES"]

DEFAULT_FRAGMENTATION = 1.10
DEFAULT_WORKSPACE_BYTES = 64 << 20


@dataclass(frozen=True)
class Overheads:
    """How a traced tensor peak becomes a GPU's reserved peak, and how the trace runs attention.

    Args:
        fragmentation: reserved / allocated peak of the caching allocator (≥ 1).
        workspace_bytes: cuBLAS, cuBLASLt and cuDNN workspaces, added once.
        fused_attention: trace SDPA with a fused kernel (O(seq) memory, like flash attention on a
            GPU) instead of the CPU math path (O(seq²)).
        context_bytes: the CUDA context; ``None`` takes the GPU's catalogue value.

    Example:
        >>> Overheads().reserved(1000 << 20) == int(1.10 * (1000 << 20)) + (64 << 20)
        True
        >>> Overheads.none().reserved(123)
        123
    """

    fragmentation: float = DEFAULT_FRAGMENTATION
    workspace_bytes: int = DEFAULT_WORKSPACE_BYTES
    fused_attention: bool = True
    context_bytes: int | None = None

    def __post_init__(self) -> None:
        fragmentation = self.fragmentation
        if isinstance(fragmentation, bool) or not isinstance(fragmentation, (int, float)) \
                or not math.isfinite(fragmentation) or fragmentation < 1:
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

    def reserved(self, allocated: int) -> int:
        """The reserved peak a GPU would reach for a traced (allocated) peak."""
        return int(allocated * self.fragmentation) + self.workspace_bytes

    def allocatable(self, usable: int) -> int:
        """The largest traced (allocated) peak whose reserved peak stays within ``usable`` bytes.

        Example:
            >>> Overheads(fragmentation=1.25, workspace_bytes=100).allocatable(600)
            400
        """
        return max(0, int((usable - self.workspace_bytes) / self.fragmentation))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

"""A memory budget on the CPU: real training steps, a peak counted tensor by tensor."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from ...units import format_bytes, parse_bytes
from ..memtrack import MemoryTracker
from ._base import DeviceInfo, MemoryBackend, Peak

__all__ = ["SimulatedBackend"]


class SimulatedBackend(MemoryBackend):
    """Runs trials on the CPU as if the device held ``budget`` bytes.

    Every tensor storage created inside :meth:`track` counts against the budget, as do the
    ``resident`` tensors; the op that would push live memory over the budget raises
    ``torch.OutOfMemoryError`` with the CUDA wording, mid-step, as a real GPU would. Peaks are
    exact tensor bytes (no allocator rounding, no kernel workspaces), so results are
    deterministic: this is what tests, benchmarks and CPU-only users probe with.

    Args:
        budget: the simulated device memory, in bytes or as text such as ``"2GiB"``.

    Example:
        >>> backend = SimulatedBackend("64MiB")
        >>> backend.capacity()
        67108864
    """

    def __init__(self, budget: int | str):
        self.budget = parse_bytes(budget)
        self.device = torch.device("cpu")
        # One tracker for the backend's lifetime: it is the simulated allocator, so tensors that
        # outlive a trial stay counted (and show up in allocated_bytes) until they die.
        self._tracker = MemoryTracker(budget=None)

    def capacity(self) -> int:
        return self.budget

    def info(self) -> DeviceInfo:
        return DeviceInfo(
            kind="simulated",
            name=f"cpu (simulated {format_bytes(self.budget)})",
            index=None,
            total_bytes=self.budget,
            free_bytes=self.budget - self.allocated_bytes(),
            used_by_others_bytes=0,
            capacity_bytes=self.budget,
        )

    @contextmanager
    def track(self, resident: Sequence[torch.Tensor] = ()) -> Iterator[None]:
        tracker = self._tracker
        tracker.add(resident)
        tracker.reset_peak()
        tracker.budget = self.budget
        try:
            with tracker:
                yield
        finally:
            tracker.budget = None

    def reset_peak(self) -> None:
        self._tracker.reset_peak()

    def peak(self) -> Peak:
        # Exact tensor bytes: no allocator cache to add, so both figures agree.
        return Peak(self._tracker.peak_bytes, self._tracker.peak_bytes)

    def allocated_bytes(self) -> int:
        return self._tracker.current_bytes

"""A memory budget on the CPU: real training steps, a peak counted tensor by tensor."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from ...errors import AutobatchError
from ...units import format_bytes, parse_bytes
from ..memtrack import MemoryTracker
from ._base import DeviceInfo, MemoryBackend, Peak
from .caching_allocator import CachingAllocator

__all__ = ["SimulatedBackend", "ALLOCATORS"]

ALLOCATORS = ("exact", "caching")
# torch's DefaultCPUAllocator when malloc fails: the host, not the simulated device, is out of memory.
_HOST_OUT_OF_MEMORY = "DefaultCPUAllocator:"


class SimulatedBackend(MemoryBackend):
    """Runs trials on the CPU as if the device held ``budget`` bytes.

    Every tensor storage created inside :meth:`track` counts against the budget, as do the
    ``resident`` tensors; the op that would push live memory over the budget raises
    ``torch.OutOfMemoryError`` with the CUDA wording, mid-step, as a real GPU would. With
    ``allocator="exact"`` (the default) peaks are exact tensor bytes (no allocator rounding, no
    kernel workspaces), so results are deterministic: this is what tests, benchmarks and CPU-only
    users probe with. With ``allocator="caching"`` each storage is booked in a model of torch's
    CUDA caching allocator (:mod:`~autobatch.probing.backends.caching_allocator`): blocks are rounded,
    carved from 2 and 20 MiB segments and cached, so peaks are reserved bytes and the curve of
    peak against batch is a staircase, as on a GPU.

    The host running out of RAM is not the simulated device running out: it stops the probe
    with an :class:`~autobatch.errors.AutobatchError` that says so.

    Args:
        budget: the simulated device memory, in bytes or as text such as ``"2GiB"``.
        allocator: ``"exact"`` or ``"caching"``.

    Example:
        >>> backend = SimulatedBackend("64MiB")
        >>> backend.capacity()
        67108864
    """

    def __init__(self, budget: int | str, allocator: str = "exact"):
        self.budget = parse_bytes(budget)
        self.device = torch.device("cpu")
        if allocator not in ALLOCATORS:
            raise AutobatchError(f"allocator must be one of {', '.join(ALLOCATORS)}, but got allocator={allocator!r}")
        self.allocator = allocator
        # One tracker for the backend's lifetime: it is the simulated allocator, so tensors that
        # outlive a trial stay counted (and show up in allocated_bytes) until they die.
        self._cache = CachingAllocator(self.budget, device_total=self.budget) if allocator == "caching" else None
        self._tracker = MemoryTracker(budget=None, allocator=self._cache)

    def capacity(self) -> int:
        return self.budget

    def info(self) -> DeviceInfo:
        return DeviceInfo(
            kind="simulated",
            name=f"cpu (simulated {format_bytes(self.budget)}{', caching allocator' if self._cache else ''})",
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
        self.reset_peak()
        tracker.budget = None if self._cache else self.budget  # the allocator model checks its own
        try:
            with tracker:
                yield
        except RuntimeError as exc:
            if _HOST_OUT_OF_MEMORY not in str(exc):
                raise
            raise AutobatchError(
                f"this machine ran out of RAM while simulating a {format_bytes(self.budget)} device "
                f"({str(exc).splitlines()[0][:160]}): the simulated budget is more than the host can hold; "
                "lower --memory (memory=...) to what this machine has free, or probe on a GPU"
            ) from exc
        finally:
            tracker.budget = None

    @contextmanager
    def track_deferred(self, resident: Sequence[torch.Tensor] = ()) -> Iterator[None]:
        # The same count without the budget: the caller compares the peak with capacity() afterwards.
        # The caching-allocator model raises on its own segments, so it cannot defer: track() as usual.
        if self._cache is not None:
            with self.track(resident):
                yield
            return
        tracker = self._tracker
        tracker.add(resident)
        self.reset_peak()
        with tracker:
            yield

    def reset_peak(self) -> None:
        self._tracker.reset_peak()
        if self._cache is not None:
            self._cache.reset_peak()

    def peak(self) -> Peak:
        if self._cache is not None:
            return Peak(self._cache.peak_allocated, self._cache.peak_reserved)
        # Exact tensor bytes: no allocator cache to add, so both figures agree.
        return Peak(self._tracker.peak_bytes, self._tracker.peak_bytes)

    def allocated_bytes(self) -> int:
        return self._cache.allocated if self._cache is not None else self._tracker.current_bytes

    def alloc_retries(self) -> int:
        return self._cache.num_alloc_retries if self._cache is not None else 0

    def release(self) -> None:
        if self._cache is not None:
            self._cache.empty_cache()

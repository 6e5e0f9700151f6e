"""The trace's requests to the allocator, as a log that replays at any batch the way the device books them.

A traced training step is a sequence of requests and frees, and the sequence is the same at
every batch: only the sizes change, and each size is a polynomial in the batch of degree at most
two (``b·seq·hidden`` for activations, ``b²`` for a similarity matrix across the batch). Three
traced batches fix every size; a fourth checks the fit, byte for byte. The log then replays at
any batch in microseconds per request, through the caching-allocator model
(:class:`~autobatch.probing.backends.caching_allocator.CachingAllocator`: 512-byte rounding, 2 and
20 MiB segments, best-fit reuse) or as exact bytes, so the prior the search follows has the
device's staircase at every batch, not a line between traced ones.

Where the logs of two batches differ in shape (an op that runs a batch-dependent number of
times, garbage freed at a moment that varies), :func:`fit_log` says so with ``None``, and the
caller keeps its interpolation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..probing.backends.caching_allocator import CachingAllocator
from ..probing.backends.simulated import ALLOCATORS
from ..probing.memory_curve import quadratic

__all__ = ["AllocationLog", "SizeLaws", "Booking", "book", "fit_log", "check_allocator", "ALLOCATORS"]

_UNLIMITED = 1 << 62


def check_allocator(allocator: str) -> None:
    """``ValueError`` unless ``allocator`` is one the simulated backend books memory as."""
    if allocator not in ALLOCATORS:
        raise ValueError(f"allocator must be one of {', '.join(ALLOCATORS)}, but got allocator={allocator!r}")


class AllocationLog:
    """What a :class:`~autobatch.probing.memtrack.MemoryTracker` books, recorded in order.

    It stands where the tracker's allocator model stands (``malloc``/``free``) and books nothing:
    each request is ``(index of the request, bytes)``, each free ``(index of the request, -1)``.

    Example:
        >>> log = AllocationLog()
        >>> a = log.malloc(1000); b = log.malloc(24); log.free(a)
        >>> log.events
        [(0, 1000), (1, 24), (0, -1)]
    """

    def __init__(self) -> None:
        self.events: list[tuple[int, int]] = []
        self._requests = 0

    def malloc(self, nbytes: int, *, force: bool = False) -> int:
        index, self._requests = self._requests, self._requests + 1
        self.events.append((index, nbytes))
        return index

    def free(self, index: int | None) -> None:
        if index is not None:
            self.events.append((index, -1))

    def shape(self) -> list[tuple[int, bool]]:
        """The log without its sizes: which request is made or freed, in order, up to the last request.

        Frees after the last request cannot move a peak; they are what the collector frees once
        the step is over, in its own order, which need not be the same from one batch to the next.
        """
        events = self.events
        end = len(events)
        while end and events[end - 1][1] < 0:
            end -= 1
        return [(index, nbytes < 0) for index, nbytes in events[:end]]

    def sizes(self) -> list[int]:
        """Each request's bytes, by index."""
        return [nbytes for _, nbytes in self.events if nbytes >= 0]

    def requests(self) -> list[tuple[int, int | None]]:
        """The log as :func:`book` takes it: ``(index, bytes)`` for a request, ``(index, None)`` for a free."""
        return [(index, None if nbytes < 0 else nbytes) for index, nbytes in self.events]


@dataclass(frozen=True)
class Booking:
    """A traced step booked through the caching-allocator model on a device of ``capacity`` bytes."""

    fits: bool            # every request was served (after flushing the cache where needed)
    peak_reserved: int    # the most the allocator held from the device, up to the request it could not serve
    peak_allocated: int   # the most its blocks held (sizes rounded as it rounds them)
    retries: int          # requests served only after the cache was flushed: a fit, but only just


def book(requests: list[tuple[int, int | None]], capacity: int, first: tuple[int, ...] = ()) -> Booking:
    """Book a step's ``requests`` (``(key, bytes)``, ``(key, None)`` to free) as a GPU's caching
    allocator would on ``capacity`` bytes, after ``first`` (blocks held throughout: workspaces, DDP's buckets).

    The allocator model flushes its cache and retries where the device is full, as PyTorch's does,
    and fails a request it still cannot serve: that is the step running out of memory. Traced for
    gpt2 (fp32, bf16) and bert-base, it books the reserved peak an H200 measured within 0.1 % (where
    the card did not flush its cache) and tells fit from failure as the card did, but for one batch
    at bert-base's edge
    (``tests/test_allocator_replay.py``).

    Example:
        >>> MiB = 1 << 20
        >>> book([(0, 12 * MiB), (1, 30 * MiB), (0, None), (2, 12 * MiB)], 64 * MiB)  # the third reuses the first's block
        Booking(fits=True, peak_reserved=44040192, peak_allocated=44040192, retries=0)
        >>> book([(0, 30 * MiB), (1, 40 * MiB)], 64 * MiB).fits
        False
    """
    cache = CachingAllocator(capacity, device_total=capacity)
    for nbytes in first:
        cache.malloc(nbytes, force=True)
    blocks: dict[int, object] = {}
    fits = True
    try:
        for key, nbytes in requests:
            if nbytes is None:
                cache.free(blocks.pop(key, None))  # type: ignore[arg-type]
            else:
                blocks[key] = cache.malloc(nbytes)
    except torch.OutOfMemoryError:
        fits = False
    return Booking(fits, cache.peak_reserved, cache.peak_allocated, cache.num_alloc_retries)


@dataclass(frozen=True)
class SizeLaws:
    """Each request's bytes as ``a + c·b + q·b²``, and the order of requests and frees."""

    shape: tuple[tuple[int, bool], ...]
    laws: tuple[tuple[float, float, float], ...]

    def sizes(self, batch: int) -> list[int]:
        return [max(0, round(a + c * batch + q * batch * batch)) for a, c, q in self.laws]

    def peak(self, batch: int, allocator: str = "exact") -> int:
        """The step's peak at ``batch``: exact bytes, or what the caching allocator reserves."""
        check_allocator(allocator)
        sizes = self.sizes(batch)
        if allocator == "exact":
            live = peak = 0
            for index, freed in self.shape:
                live += -sizes[index] if freed else sizes[index]
                peak = max(peak, live)
            return peak
        return book([(index, None if freed else sizes[index]) for index, freed in self.shape], _UNLIMITED).peak_reserved


def fit_log(logs: dict[int, AllocationLog]) -> SizeLaws | None:
    """The size laws through the three smallest traced batches, checked against every other one.

    ``None`` when the logs differ in shape or a size is no polynomial of degree two in the batch
    (which takes a fourth batch to see).

    Example:
        >>> def traced(b):
        ...     log = AllocationLog(); x = log.malloc(4 * b * b); y = log.malloc(64); log.free(x); return log
        >>> laws = fit_log({b: traced(b) for b in (1, 4, 16, 64)})
        >>> laws.sizes(1000), laws.peak(1000)
        ([4000000, 64], 4000064)
    """
    if len(logs) < 3:
        return None
    batches = sorted(logs)
    shape = logs[batches[0]].shape()
    if any(logs[b].shape() != shape for b in batches[1:]):
        return None
    xs = batches[:3]
    columns = [logs[b].sizes() for b in xs]
    laws = tuple(quadratic(list(zip(xs, ys))) for ys in zip(*columns))
    fitted = SizeLaws(tuple(shape), laws)
    if any(fitted.sizes(b) != logs[b].sizes() for b in batches[3:]):
        return None
    return fitted

"""A model of torch's CUDA caching allocator: which bytes a device reserves for which requests.

The rules are those of ``c10/cuda/CUDACachingAllocator.cpp`` (constants in
``c10/core/AllocatorConfig.h``, default configuration: no ``max_split_size``, no power-of-two
rounding, no expandable segments):

* every request is rounded up to a multiple of 512 bytes (``kMinBlockSize``);
* requests up to 1 MiB (``kSmallSize``) live in the small pool, carved from 2 MiB segments
  (``kSmallBuffer``); larger ones in the large pool, from 20 MiB segments (``kLargeBuffer``)
  below 10 MiB (``kMinLargeAlloc``), else from a segment of their own rounded up to 2 MiB;
* a free block is found best-fit (smallest size, then lowest address) in the request's pool and
  split when the rest is at least 512 bytes (small pool) or more than 1 MiB (large pool);
* freed blocks merge with free neighbours and stay cached (reserved) until :meth:`empty_cache`;
* when no cached block fits and the device cannot give a new segment, every fully free segment is
  released and the request retried once (``num_alloc_retries`` counts it); if that fails too the
  request raises ``torch.OutOfMemoryError`` worded as torch words it (``num_ooms`` counts it);
* a per-process memory fraction caps the bytes reserved from the device.

What it leaves out: streams and events (blocks are reused at once), CUDA graphs' private pools,
``expandable_segments`` and the other ``PYTORCH_CUDA_ALLOC_CONF`` options. The device's free
memory is whatever ``device_free`` says, so a caller can model other processes, the CUDA context
or NCCL's buffers taking part of it.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

__all__ = ["CachingAllocator", "round_size", "allocation_size", "K_MIN_BLOCK", "K_SMALL_SIZE", "K_SMALL_BUFFER",
           "K_LARGE_BUFFER", "K_MIN_LARGE_ALLOC", "K_ROUND_LARGE"]

K_MIN_BLOCK = 512
K_SMALL_SIZE = 1 << 20
K_SMALL_BUFFER = 2 << 20
K_LARGE_BUFFER = 20 << 20
K_MIN_LARGE_ALLOC = 10 << 20
K_ROUND_LARGE = 2 << 20


def round_size(size: int) -> int:
    """A request's size as the allocator books it: at least 512 bytes, a multiple of 512."""
    return max(K_MIN_BLOCK, -(-size // K_MIN_BLOCK) * K_MIN_BLOCK)


def allocation_size(size: int) -> int:
    """The segment the device is asked for when no cached block fits a (rounded) request."""
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return -(-size // K_ROUND_LARGE) * K_ROUND_LARGE


@dataclass(eq=False)
class _Segment:
    address: int
    size: int
    small: bool
    blocks: list[_Block] = field(default_factory=list)  # by address, covering the segment


@dataclass(eq=False)
class _Block:
    segment: _Segment
    address: int
    size: int
    allocated: bool = False
    requested: int = 0


class CachingAllocator:
    """One device's caching allocator.

    Args:
        device_free: the bytes the device can hand out: a number (what it had before this
            allocator reserved anything), or a function called at each request that says what it
            has left now (``cudaMalloc`` fails above it).
        limit: the most this process may reserve (``set_per_process_memory_fraction``); ``None``
            for no limit.
        device_index, device_total: for the out-of-memory message.

    Example:
        >>> a = CachingAllocator(device_free=64 << 20)
        >>> h = a.malloc(1000)
        >>> a.allocated, a.reserved
        (1024, 2097152)
        >>> a.free(h); a.allocated, a.reserved
        (0, 2097152)
        >>> a.empty_cache(); a.reserved
        0
    """

    def __init__(self, device_free: int | Callable[[], int], *, limit: int | None = None,
                 device_index: int = 0, device_total: int | None = None):
        self._device_free = device_free if callable(device_free) else (lambda: device_free - self.reserved)
        self.limit = limit
        self.device_index = device_index
        self.device_total = device_total
        self.segments: list[_Segment] = []
        # The free blocks of each pool (small, large) by (size, address): a best-fit lookup is a bisection
        self._free: dict[bool, list[tuple[int, int]]] = {True: [], False: []}
        self._free_at: dict[int, _Block] = {}
        self.allocated = self.reserved = self.requested = 0
        self.peak_allocated = self.peak_reserved = 0
        self.num_alloc_retries = self.num_ooms = 0
        self.num_device_alloc = self.num_device_free = 0
        self._addresses = itertools.count(start=1 << 32, step=1 << 36)

    # --- requests -----------------------------------------------------------------------------

    def malloc(self, nbytes: int, *, force: bool = False) -> _Block | None:
        """Book ``nbytes``; the handle goes back to :meth:`free`. Zero bytes take no block.

        ``force`` books it even where the device has no room (tensors that exist already).
        """
        if nbytes <= 0:
            return None
        size = round_size(nbytes)
        small = size <= K_SMALL_SIZE
        block = self._free_block(size, small)
        if block is None:
            wanted = allocation_size(size)
            segment = self._new_segment(wanted, small, force=force)
            if segment is None:
                self.release_cached()
                self.num_alloc_retries += 1
                segment = self._new_segment(wanted, small)
            if segment is None:
                self.num_ooms += 1
                raise torch.OutOfMemoryError(self._oom_message(wanted))
            block = segment.blocks[0]
        else:
            self._unlist(block)
        block, tail = self._split(block, size, small)
        if tail is not None:
            self._list(tail)
        block.allocated, block.requested = True, nbytes
        self.allocated += block.size
        self.requested += nbytes
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return block

    def free(self, block: _Block | None) -> None:
        """Give a block back to its pool; it stays reserved (cached)."""
        if block is None:
            return
        if not block.allocated:
            raise ValueError("block freed twice")
        block.allocated = False
        self.allocated -= block.size
        self.requested -= block.requested
        blocks = block.segment.blocks
        i = blocks.index(block)
        if i + 1 < len(blocks) and not blocks[i + 1].allocated:  # merge with the next free block
            self._unlist(blocks[i + 1])
            block.size += blocks.pop(i + 1).size
        if i > 0 and not blocks[i - 1].allocated:  # and with the previous one
            self._unlist(blocks[i - 1])
            blocks[i - 1].size += blocks.pop(i).size
            block = blocks[i - 1]
        self._list(block)

    def release_cached(self) -> None:
        """Give every fully free segment back to the device (what ``empty_cache`` does)."""
        kept = []
        for segment in self.segments:
            if len(segment.blocks) == 1 and not segment.blocks[0].allocated:
                self._unlist(segment.blocks[0])
                self.reserved -= segment.size
                self.num_device_free += 1
            else:
                kept.append(segment)
        self.segments = kept

    empty_cache = release_cached

    def reset_peak(self) -> None:
        """What ``torch.cuda.reset_peak_memory_stats`` does: peaks restart from the current figures."""
        self.peak_allocated, self.peak_reserved = self.allocated, self.reserved

    # --- figures ------------------------------------------------------------------------------

    def memory_stats(self) -> dict[str, int]:
        """The subset of ``torch.cuda.memory_stats()`` keys this model knows, with torch's names."""
        stats = {
            "allocated_bytes.all.current": self.allocated,
            "allocated_bytes.all.peak": self.peak_allocated,
            "reserved_bytes.all.current": self.reserved,
            "reserved_bytes.all.peak": self.peak_reserved,
            "active_bytes.all.current": self.allocated,
            "requested_bytes.all.current": self.requested,
            "segment.all.current": len(self.segments),
            "num_alloc_retries": self.num_alloc_retries,
            "num_ooms": self.num_ooms,
            "num_device_alloc": self.num_device_alloc,
            "num_device_free": self.num_device_free,
        }
        return stats

    # --- inside -------------------------------------------------------------------------------

    def _free_block(self, size: int, small: bool) -> _Block | None:
        """The pool's best fit: the smallest free block of at least ``size``, the lowest address among equals."""
        free = self._free[small]
        i = bisect.bisect_left(free, (size, -1))
        return self._free_at[free[i][1]] if i < len(free) else None

    def _list(self, block: _Block) -> None:
        bisect.insort(self._free[block.segment.small], (block.size, block.address))
        self._free_at[block.address] = block

    def _unlist(self, block: _Block) -> None:
        free = self._free[block.segment.small]
        del free[bisect.bisect_left(free, (block.size, block.address))]
        del self._free_at[block.address]

    def _new_segment(self, size: int, small: bool, force: bool = False) -> _Segment | None:
        if not force and self.limit is not None and self.reserved + size > self.limit:
            return None
        if not force and size > self._device_free():
            return None
        segment = _Segment(next(self._addresses), size, small)
        segment.blocks.append(_Block(segment, segment.address, size))
        self.segments.append(segment)
        self.reserved += size
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        self.num_device_alloc += 1
        return segment

    @staticmethod
    def _split(block: _Block, size: int, small: bool) -> tuple[_Block, _Block | None]:
        """``block`` cut to ``size`` where the rest is worth keeping apart; the rest, free, or ``None``."""
        rest = block.size - size
        if (rest >= K_MIN_BLOCK) if small else (rest > K_SMALL_SIZE):
            blocks = block.segment.blocks
            tail = _Block(block.segment, block.address + size, rest)
            block.size = size
            blocks.insert(blocks.index(block) + 1, tail)
            return block, tail
        return block, None

    def _oom_message(self, size: int) -> str:
        total = self.device_total
        free = max(0, self._device_free())
        allowed = "" if self.limit is None else f"{_torch_size(self.limit)} allowed; "
        return (
            f"CUDA out of memory. Tried to allocate {_torch_size(size)}. GPU {self.device_index} has a total capacity "
            f"of {_torch_size(total if total is not None else free + self.reserved)} of which {_torch_size(free)} is free. "
            f"Including non-PyTorch memory, this process has {_torch_size(self.reserved)} memory in use. {allowed}"
            f"Of the allocated memory {_torch_size(self.allocated)} is allocated by PyTorch, and "
            f"{_torch_size(self.reserved - self.allocated)} is reserved by PyTorch but unallocated. If reserved but "
            "unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid "
            "fragmentation.  See documentation for Memory Management  "
            "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
        )


def _torch_size(size: int) -> str:
    # c10's format_size: bytes up to 1 KiB, then KiB, MiB or GiB with two decimals.
    if size <= 1 << 10:
        return f"{size} bytes"
    if size <= 1 << 20:
        return f"{size / (1 << 10):.2f} KiB"
    if size <= 1 << 30:
        return f"{size / (1 << 20):.2f} MiB"
    return f"{size / (1 << 30):.2f} GiB"

"""One process as rank ``r`` of ``W``: torch's fake process group, for sharded probes without the other ranks.

The fake group (``torch.testing._internal.distributed.fake_pg``) answers every collective at
once without moving data. FSDP and DeepSpeed run their real code on it: they allocate the
shards, buffers and gathered units of rank ``r`` in a world of ``W`` ranks, which is all a
memory probe needs. Its per-rank peaks equal those of a real ``W``-process run
(``tests/test_sharded_probe.py`` compares it with two gloo processes), so ``find`` on one CPU
(or one GPU) answers for ``W`` ranks. Values after a collective are garbage; nothing here reads
them.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist

from ..errors import AutobatchError

__all__ = ["fake_process_group"]


@contextmanager
def fake_process_group(world_size: int, rank: int = 0) -> Iterator[None]:
    """Make this process rank ``rank`` of ``world_size`` on the fake group for the block.

    ``LOCAL_RANK`` (which DeepSpeed requires) is set to ``rank`` for the block when it is unset,
    and removed again after; the group is destroyed on exit.

    Example:
        >>> with fake_process_group(8):
        ...     dist.get_world_size()
        8
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise AutobatchError(f"world_size must be a positive integer, but got {world_size!r}")
    if not 0 <= rank < world_size:
        raise AutobatchError(f"rank must be in [0, {world_size}), but got rank={rank}")
    if dist.is_initialized():
        raise AutobatchError(
            "a process group is already initialized here, so the fake group for a simulated world cannot start; "
            "under a launcher every rank probes itself (drop the simulated world size)")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    had_local_rank = "LOCAL_RANK" in os.environ
    if not had_local_rank:
        os.environ["LOCAL_RANK"] = str(rank)
    try:
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
        try:
            yield
        finally:
            dist.destroy_process_group()
    finally:
        if not had_local_rank:
            os.environ.pop("LOCAL_RANK", None)

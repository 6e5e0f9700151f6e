"""Train with an uneven plan: each rank's micro-batches from one global order, and the loss that keeps it exact.

Every optimizer step takes the next ``T = Σ_r m_r k_r`` indices of one global order (a seeded
permutation per epoch, the same on every rank, as ``DistributedSampler`` draws it). Rank ``r``
takes the slice ``[offset_r, offset_r + m_r k_r)`` of that step in ``k_r`` micro-batches of
``m_r``: the ranks together see exactly the step's ``T`` samples, once each.

The loss: DDP, FSDP and DeepSpeed *average* gradients over the ``W`` ranks, so each rank's loss is
its sum over its samples ÷ ``T`` × ``W`` (:meth:`UnevenBatchSampler.normaliser`); summed over its
micro-steps and averaged over the ranks that is the mean over the ``T`` samples, whatever each
rank's share. For a token mean, count the step's tokens over every rank first
(:func:`~autobatch.count_loss_tokens` on this rank's micro-batches, which all-reduces).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence, Sized
from typing import Any

import torch

from ..checking.accumulation import LossNormaliser
from ..errors import AutobatchError
from ..planning.per_rank import UnevenPlan

__all__ = ["UnevenBatchSampler", "StepBatches", "per_rank_pairs"]


def per_rank_pairs(plan: UnevenPlan | Sequence[Any]) -> list[tuple[int, int]]:
    """``(micro_batch, grad_accum)`` per rank from an :class:`~autobatch.UnevenPlan`, its ``--json``
    ``per_rank`` list, or pairs.

    Example:
        >>> per_rank_pairs([{"micro_batch": 24, "grad_accum": 2}, (16, 3)])
        [(24, 2), (16, 3)]
    """
    rows = plan.ranks if isinstance(plan, UnevenPlan) else plan
    if isinstance(rows, Mapping) and "per_rank" in rows:  # the whole "uneven" object of --json
        rows = rows["per_rank"]
    pairs = []
    for i, row in enumerate(rows):
        if isinstance(row, Mapping):
            row = (row.get("micro_batch"), row.get("grad_accum"))
        elif not isinstance(row, (tuple, list)):
            row = (getattr(row, "micro_batch", None), getattr(row, "grad_accum", None))
        if len(row) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in row):
            raise AutobatchError(f"rank {i} of the plan must give a positive micro_batch and grad_accum, but got "
                                 f"{row!r}; pass an UnevenPlan, its --json 'per_rank' list or (micro, accum) pairs")
        pairs.append((int(row[0]), int(row[1])))
    if not pairs:
        raise AutobatchError("the plan has no ranks; pass an UnevenPlan or its --json 'per_rank' list")
    return pairs


class UnevenBatchSampler(torch.utils.data.Sampler[list[int]]):
    """This rank's micro-batches of an uneven plan, from one global order: a ``DataLoader``'s ``batch_sampler``.

    Args:
        data: the dataset (or its length).
        plan: an :class:`~autobatch.UnevenPlan`, the ``per_rank`` list of ``find --uneven --json``,
            or ``(micro_batch, grad_accum)`` pairs, one per rank in rank order.
        rank: this rank; default the process group's rank (0 without one).
        shuffle: draw a new global order each epoch (``seed + epoch``); else the data's order.
        seed: the same on every rank.

    Each epoch has ``len(data) // T`` full steps (a last partial step is dropped: it would not
    sum to ``T``); ``len()`` is this rank's micro-batches in them, ``grad_accum`` per step.

    Example:
        >>> sampler = UnevenBatchSampler(10, [(2, 2), (1, 1)], rank=0, shuffle=False)
        >>> list(sampler)
        [[0, 1], [2, 3], [5, 6], [7, 8]]
        >>> list(UnevenBatchSampler(10, [(2, 2), (1, 1)], rank=1, shuffle=False))
        [[4], [9]]
    """

    def __init__(self, data: Sized | int, plan: UnevenPlan | Sequence[Any], rank: int | None = None, *,
                 shuffle: bool = True, seed: int = 0):
        self.pairs = per_rank_pairs(plan)
        self.size = data if isinstance(data, int) else len(data)
        world, dist = len(self.pairs), torch.distributed
        if rank is None and dist.is_available() and dist.is_initialized():
            if dist.get_world_size() != world:
                raise AutobatchError(f"the plan is for {world} ranks, but the process group has "
                                     f"{dist.get_world_size()}; plan again for this world")
            rank = dist.get_rank()
        rank = 0 if rank is None else rank
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world:
            raise AutobatchError(f"rank must be in 0..{world - 1} for a plan of {world} ranks, but got {rank!r}; "
                                 "launch as many ranks as the plan has")
        self.rank, self.shuffle, self.seed, self.epoch = rank, shuffle, seed, 0
        self.micro_batch, self.grad_accum = self.pairs[rank]
        self.global_batch = sum(m * k for m, k in self.pairs)
        self.offset = sum(m * k for m, k in self.pairs[:rank])
        if self.size < self.global_batch:
            raise AutobatchError(f"one step takes {self.global_batch} samples, but the data has {self.size}; "
                                 "use more data or a smaller target")

    def set_epoch(self, epoch: int) -> None:
        """A new global order for ``epoch`` (call it on every rank, as with ``DistributedSampler``)."""
        self.epoch = epoch

    @property
    def steps(self) -> int:
        """Full optimizer steps in one epoch."""
        return self.size // self.global_batch

    def __len__(self) -> int:
        return self.steps * self.grad_accum

    def __iter__(self) -> Iterator[list[int]]:
        if self.shuffle:
            order = torch.randperm(self.size, generator=torch.Generator().manual_seed(self.seed + self.epoch))
            order = order.tolist()
        else:
            order = list(range(self.size))
        m = self.micro_batch
        for step in range(self.steps):
            start = step * self.global_batch + self.offset
            for j in range(self.grad_accum):
                yield order[start + j * m: start + (j + 1) * m]

    def by_step(self, loader: Iterable[Any]) -> StepBatches:
        """``loader``'s micro-batches (a DataLoader over this sampler) grouped by optimizer step: one
        list of ``grad_accum`` micro-batches per step, so that every rank yields as many batches as
        the others (Lightning runs a collective per batch)."""
        return StepBatches(loader, self.grad_accum, self.steps)

    def normaliser(self) -> LossNormaliser:
        """The loss scale for a per-sample mean over the whole step: ``sum × world ÷ T``.

        Multiply each micro-batch's summed loss by it (``normaliser()(loss_sum)``), or pass
        per-sample losses to ``normaliser().sample_loss``; no ``/ grad_accum``.
        """
        return LossNormaliser(total=self.global_batch, world_size=len(self.pairs))


class StepBatches:
    """A rank's micro-batches grouped by optimizer step: each item is the list of its ``per_step``
    micro-batches; as many items on every rank (:meth:`UnevenBatchSampler.by_step`)."""

    def __init__(self, loader: Iterable[Any], per_step: int, steps: int):
        self.loader, self.per_step, self.steps = loader, per_step, steps

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[list[Any]]:
        micro = iter(self.loader)
        for _ in range(self.steps):
            yield [next(micro) for _ in range(self.per_step)]

"""UnevenBatchSampler: each rank's micro-batches of an uneven plan from one global order, every sample
of a step on exactly one rank, the same order on every rank, grouped by step for Lightning."""

from __future__ import annotations

import pytest

from autobatch import UnevenBatchSampler, solve_uneven
from autobatch.errors import AutobatchError
from autobatch.planning.per_rank import RankLimit

PAIRS = [(24, 2), (16, 3), (5, 1)]  # 48 + 48 + 5 = 101 per step


@pytest.mark.parametrize("shuffle", [False, True])
def test_the_ranks_share_each_step_exactly_once(shuffle) -> None:
    samplers = [UnevenBatchSampler(1000, PAIRS, rank=r, shuffle=shuffle, seed=3) for r in range(3)]
    order = list(range(1000)) if not shuffle else None
    batches = [list(s) for s in samplers]
    for s, micro in zip(samplers, batches):
        assert len(micro) == len(s) == s.steps * s.grad_accum == 9 * s.grad_accum  # 1000 // 101 steps
        assert all(len(b) == s.micro_batch for b in micro)
    for step in range(9):
        seen = [i for r, s in enumerate(samplers)
                for b in batches[r][step * s.grad_accum:(step + 1) * s.grad_accum] for i in b]
        assert len(seen) == len(set(seen)) == 101  # every sample of the step once
        if order is not None:
            assert seen == order[step * 101:(step + 1) * 101]  # the global order, rank by rank


def test_every_rank_draws_the_same_order_and_set_epoch_draws_a_new_one() -> None:
    a, b = UnevenBatchSampler(500, PAIRS, rank=0, seed=5), UnevenBatchSampler(500, PAIRS, rank=1, seed=5)
    first_a, first_b = list(a), list(b)
    assert not set(sum(first_a[:2], [])) & set(sum(first_b[:3], []))
    a.set_epoch(1)
    assert list(a) != first_a
    assert list(UnevenBatchSampler(500, PAIRS, rank=0, seed=5)) == first_a


def test_it_takes_a_plan_its_json_or_pairs_and_scales_the_loss() -> None:
    plan = solve_uneven(96, [RankLimit(0, 40, 32), RankLimit(1, 20, 16)])
    json_rows = plan.to_dict()["per_rank"]
    for given in (plan, json_rows, plan.to_dict(), [(r.micro_batch, r.grad_accum) for r in plan.ranks]):
        s = UnevenBatchSampler(960, given, rank=1)
        assert (s.micro_batch, s.grad_accum, s.global_batch, s.offset) == (16, 3, 96, 48)
    norm = UnevenBatchSampler(960, plan, rank=1).normaliser()
    assert (norm.total, norm.world_size) == (96, 2)


def test_by_step_groups_a_ranks_micro_batches_so_every_rank_yields_as_many() -> None:
    groups = [list(UnevenBatchSampler(1000, PAIRS, rank=r, shuffle=False).by_step(
        UnevenBatchSampler(1000, PAIRS, rank=r, shuffle=False))) for r in range(3)]
    assert [len(g) for g in groups] == [9, 9, 9]
    assert [len(g[0]) for g in groups] == [2, 3, 1]
    assert groups[2][0] == [list(range(96, 101))]


@pytest.mark.parametrize("args,message", [
    ((1000, PAIRS, 3), "rank must be in 0..2 for a plan of 3 ranks, but got 3"),
    ((50, PAIRS, 0), "one step takes 101 samples, but the data has 50"),
    ((1000, [(0, 2)], 0), "rank 0 of the plan must give a positive micro_batch and grad_accum"),
    ((1000, [], 0), "the plan has no ranks"),
])
def test_bad_plans_are_one_clear_line(args, message) -> None:
    with pytest.raises(AutobatchError, match=message):
        UnevenBatchSampler(args[0], args[1], rank=args[2])

"""A plan per rank for mixed GPUs (autobatch/planning/uneven.py): Σ m_r × k_r is the target exactly,
every micro batch within its rank's safe batch, one accumulation where the strategy needs it, the
ranks balanced by their step times, and never slower than the uniform plan."""

from __future__ import annotations

import doctest
import importlib
import itertools

import pytest

from autobatch.errors import AutobatchError
from autobatch.planning.solver import NoExactPlanError
from autobatch.planning.per_rank import RankLimit, step_line
from autobatch.planning.uneven import solve_uneven


def _limits(safes, lines=None):
    return [RankLimit(r, s + 3, s, None if lines is None else lines[r]) for r, s in enumerate(safes)]


def _check(plan, target, safes, *, same_accum=False, min_micro=1, multiple_of=1):
    assert plan.global_batch == target == sum(r.micro_batch * r.grad_accum for r in plan.ranks)
    for r, safe in zip(plan.ranks, safes):
        assert min_micro <= r.micro_batch <= max(safe, plan.uniform.micro_batch if plan.uniform else safe)
        assert r.micro_batch % multiple_of == 0
    if same_accum:
        assert len({r.grad_accum for r in plan.ranks}) == 1


CASES = list(itertools.product([(32, 16), (40, 13, 7), (64, 64, 16, 16), (5, 9, 17, 3)], [96, 100, 255, 1024]))


@pytest.mark.parametrize("same_accum", [False, True])
@pytest.mark.parametrize("safes,target", CASES)
def test_every_rank_within_its_safe_batch_and_the_sum_is_the_target(safes, target, same_accum) -> None:
    try:
        plan = solve_uneven(target, _limits(safes), same_accum=same_accum)
    except NoExactPlanError:
        # only where no split exists at all: one accumulation needs a divisor k of the target
        # with target / k within the ranks' summed safe batches, and at least one sample each
        assert same_accum and not any(len(safes) <= target // k <= sum(safes)
                                      for k in range(1, target + 1) if target % k == 0)
        return
    _check(plan, target, safes, same_accum=same_accum)
    if plan.uniform is not None:  # never slower than the uniform plan, by the same measure
        assert plan.step_seconds <= plan.uniform_seconds * (1 + 1e-9)


def test_ddp_gives_the_larger_gpus_fewer_micro_steps_at_equal_speed() -> None:
    # A100-80GB beside A100-40GB: the same speed, twice the memory
    plan = solve_uneven(1024, _limits([32, 32, 32, 32, 16, 16, 16, 16]))
    assert [(r.micro_batch, r.grad_accum) for r in plan.ranks] == [(32, 4)] * 4 + [(16, 8)] * 4
    assert plan.uniform.micro_batch == 16 and plan.uniform.grad_accum == 8
    assert plan.step_seconds == plan.uniform_seconds  # the same samples each: no sooner, fewer micro-steps


def test_a_slower_rank_gets_fewer_samples_so_the_ranks_finish_together() -> None:
    # rank 1 takes twice as long per sample: it gets about a third of the samples
    plan = solve_uneven(300, _limits([64, 64], [(0.0, 0.01), (0.0, 0.02)]))
    assert [r.samples for r in plan.ranks] == [200, 100]
    assert plan.step_seconds == pytest.approx(2.0) and plan.uniform_seconds == pytest.approx(3.0)
    assert [r.seconds_per_sample for r in plan.ranks] == pytest.approx([0.01, 0.02])


def test_the_fixed_time_of_a_micro_step_favours_larger_micro_batches() -> None:
    # a 0.5 s overhead per micro-step: the rank with room for 64 carries more in fewer steps
    plan = solve_uneven(192, _limits([64, 16], [(0.5, 0.01), (0.5, 0.01)]))
    big, small = plan.ranks
    assert big.samples > small.samples and big.grad_accum < small.grad_accum
    assert plan.step_seconds < plan.uniform_seconds * 0.95


def test_one_accumulation_for_sharded_strategies() -> None:
    plan = solve_uneven(1000, _limits([32] * 4 + [16] * 4, [(0.05, 0.01)] * 4 + [(0.05, 0.02)] * 4), same_accum=True)
    _check(plan, 1000, [32] * 4 + [16] * 4, same_accum=True)
    assert plan.uniform.micro_batch == 5  # 1000 / 8 = 125 per rank: 5 × 25 within 16
    assert plan.step_seconds < plan.uniform_seconds


def test_measured_times_within_their_noise_keep_the_uniform_plan() -> None:
    # the same card, timings 3 % apart: no reason to split unevenly
    plan = solve_uneven(100, _limits([50, 50], [(0.0, 0.0100), (0.0, 0.0103)]))
    assert plan.is_uniform and "uniform plan" in plan.reason


def test_a_target_the_ranks_do_not_divide_is_reached_exactly() -> None:
    plan = solve_uneven(101, _limits([40, 20]))
    _check(plan, 101, [40, 20])
    assert plan.uniform is None and "no uniform plan" in plan.describe()


def test_limits_on_the_micro_batch_hold_on_every_rank() -> None:
    plan = solve_uneven(256, _limits([40, 20, 20]), min_micro=4, multiple_of=4)
    _check(plan, 256, [40, 20, 20], min_micro=4, multiple_of=4)


def test_no_target_gives_each_rank_its_safe_batch_once() -> None:
    plan = solve_uneven(None, _limits([32, 16]))
    assert [(r.micro_batch, r.grad_accum) for r in plan.ranks] == [(32, 1), (16, 1)]
    assert plan.uniform.global_batch == 32 and "no target given" in plan.reason


def test_no_split_is_one_clear_error() -> None:
    with pytest.raises(NoExactPlanError, match="no exact uneven plan: 7 samples per step cannot be split"):
        solve_uneven(7, _limits([8, 8]), min_micro=4)
    with pytest.raises(AutobatchError, match="limits must give ranks 0..N-1 in order"):
        solve_uneven(8, [RankLimit(1, 4, 4)])
    with pytest.raises(AutobatchError, match="safe_batch .5. must be at most max_batch .4."):
        RankLimit(0, 4, 5)


def test_the_plan_prints_its_arithmetic_per_rank_and_its_json_has_per_rank() -> None:
    plan = solve_uneven(96, _limits([32, 16], [(0.0, 0.01), (0.0, 0.01)]))
    text = plan.describe()
    assert "uneven plan: 24×2 + 16×3 = 96 per step" in text
    assert "rank 0: 24 × 2 = 48 samples (max 35, safe 32, 0.01 s/sample)" in text
    data = plan.to_dict()
    assert [r["micro_batch"] * r["grad_accum"] for r in data["per_rank"]] == [48, 48]
    assert set(data["per_rank"][0]) == {"rank", "micro_batch", "grad_accum", "samples", "max_batch", "safe_batch",
                                        "seconds_per_sample"}
    assert (data["time_unit"], data["speeds"], data["step_time"]) == ("seconds", "measured", pytest.approx(0.48))
    untimed = solve_uneven(96, _limits([32, 16])).to_dict()  # no times: the step counts samples
    assert (untimed["time_unit"], untimed["speeds"], untimed["step_time"]) == ("samples", "equal", 48)
    peak = solve_uneven(96, _limits([32, 16], [(0.0, 0.01), (0.0, 0.02)]), speeds="peak").to_dict()
    assert (peak["time_unit"], peak["speeds"]) == ("relative", "peak")
    assert all(r["seconds_per_sample"] is None for r in peak["per_rank"])  # peak speeds are not seconds


def test_step_line_through_measured_trials() -> None:
    assert step_line([(2, 0.3), (4, 0.5), (8, 0.9)]) == pytest.approx((0.1, 0.1))
    assert step_line([(4, 0.4)]) == (0.0, 0.1)
    assert step_line([]) is None
    a, s = step_line([(2, 0.5), (4, 0.3)])  # noise that slopes down: through the origin
    assert a == 0 and s == pytest.approx(0.8 / 6)


def test_many_ranks_are_planned_quickly_enough_to_count_steps_not_seconds() -> None:
    # 128 ranks of two kinds: the plan exists, is exact, and is not slower than the uniform one
    safes = [320] * 64 + [160] * 64
    lines = [(0.05, 0.001)] * 64 + [(0.05, 0.0015)] * 64
    for same in (False, True):
        plan = solve_uneven(16384, _limits(safes, lines), same_accum=same)
        _check(plan, 16384, safes, same_accum=same)
        assert plan.step_seconds < plan.uniform_seconds


@pytest.mark.parametrize("module", ["autobatch.planning.uneven", "autobatch.planning.per_rank", "autobatch.training.sampler"])
def test_docstring_examples(module) -> None:
    assert doctest.testmod(importlib.import_module(module)).failed == 0

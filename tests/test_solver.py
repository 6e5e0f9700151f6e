"""solve(): the identity always holds, the largest micro batch wins, and errors list true alternatives."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autobatch.errors import AutobatchError
from autobatch.planning.solver import NoExactPlanError, exact_plans, solve

# Small enough for brute force, large enough to hit every branch (prime targets, tiny targets, …).
targets = st.integers(min_value=1, max_value=4096)
gpu_counts = st.integers(min_value=1, max_value=16)
node_counts = st.integers(min_value=1, max_value=4)
max_micros = st.one_of(st.none(), st.integers(min_value=2, max_value=64))
min_micros = st.sampled_from([1, 2])
multiples = st.one_of(st.none(), st.integers(min_value=1, max_value=4))
PROPERTY = settings(max_examples=300, deadline=None)


def allowed(m: int, min_micro: int, max_micro: int | None, multiple_of: int | None) -> bool:
    return m >= min_micro and (max_micro is None or m <= max_micro) and m % (multiple_of or 1) == 0


def brute_force_micros(target, world, min_micro, max_micro, multiple_of):
    """Every micro batch that reaches ``target`` exactly on ``world`` ranks (independent of the solver)."""
    return [m for m in range(1, target + 1) if target % (world * m) == 0 and allowed(m, min_micro, max_micro, multiple_of)]


def achievable(total, world, min_micro, max_micro, multiple_of) -> bool:
    return total % world == 0 and bool(brute_force_micros(total, world, min_micro, max_micro, multiple_of))


@PROPERTY
@given(targets, gpu_counts, node_counts, max_micros, min_micros, multiples)
def test_identity_and_largest_micro_or_true_alternatives(target, gpus, nodes, max_micro, min_micro, multiple_of):
    if max_micro is not None and multiple_of is not None and max_micro < multiple_of * math.ceil(min_micro / multiple_of):
        return  # impossible constraints are a validation error, tested below
    world = gpus * nodes
    valid = brute_force_micros(target, world, min_micro, max_micro, multiple_of)
    try:
        plan = solve(target, gpus, nodes, max_micro, min_micro=min_micro, multiple_of=multiple_of)
    except NoExactPlanError as exc:
        assert not valid, f"solver missed {valid}"
        # the alternatives are real, and nothing closer exists
        assert exc.above > target and achievable(exc.above, world, min_micro, max_micro, multiple_of)
        assert not any(achievable(g, world, min_micro, max_micro, multiple_of) for g in range(target + 1, exc.above))
        if exc.below is None:
            assert not any(achievable(g, world, min_micro, max_micro, multiple_of) for g in range(1, target))
        else:
            assert exc.below < target and achievable(exc.below, world, min_micro, max_micro, multiple_of)
            assert not any(achievable(g, world, min_micro, max_micro, multiple_of) for g in range(exc.below + 1, target))
        for w in exc.world_sizes:
            assert target % w == 0 and brute_force_micros(target, w, min_micro, max_micro, multiple_of)
            assert solve(target, w, 1, max_micro, min_micro=min_micro, multiple_of=multiple_of).global_batch == target
        assert str(target) in str(exc)
        return
    assert plan.micro_batch * plan.grad_accum * plan.world_size == plan.global_batch == target
    assert plan.world_size == world
    assert max_micro is None or plan.micro_batch <= max_micro
    assert allowed(plan.micro_batch, min_micro, max_micro, multiple_of)
    assert plan.micro_batch == max(valid), "a valid plan with a larger micro batch exists"
    assert [p.micro_batch for p in exact_plans(target, gpus, nodes, max_micro, min_micro=min_micro,
                                               multiple_of=multiple_of)] == sorted(valid, reverse=True)


@PROPERTY
@given(
    st.integers(1, 2048),
    st.integers(1, 8),
    st.integers(1, 4),
    st.integers(1, 32),
)
def test_model_parallel_divides_the_world(target, gpus, mp, max_micro):
    if (gpus * 2) % mp:
        with pytest.raises(AutobatchError, match="model_parallel must divide the GPU count"):
            solve(target, gpus, 2, max_micro, model_parallel=mp)
        return
    try:
        plan = solve(target, gpus, 2, max_micro, model_parallel=mp)
    except NoExactPlanError:
        assert not brute_force_micros(target, gpus * 2 // mp, 1, max_micro, None)
        return
    assert plan.world_size == gpus * 2 // mp
    assert plan.micro_batch * plan.grad_accum * plan.world_size == target


@PROPERTY
@given(
    st.integers(1, 512),
    gpu_counts,
    st.dictionaries(st.integers(1, 64), st.floats(0.01, 10.0, allow_nan=False), max_size=12),
)
def test_step_times_choose_the_fastest_optimizer_step(target, gpus, times):
    micros = brute_force_micros(target, gpus, 1, None, None)
    if not micros:
        return
    plan = solve(target, gpus, step_times=times)
    per_rank = target // gpus
    timed = [m for m in micros if m in times]
    if not timed:
        assert plan.micro_batch == max(micros) and plan.step_time is None
        return
    best = min(per_rank // m * times[m] for m in timed)
    assert plan.micro_batch in timed
    assert math.isclose(plan.step_time, best, rel_tol=1e-9)
    # ties go to fewer accumulation steps
    tied = [m for m in timed if math.isclose(per_rank // m * times[m], best, rel_tol=1e-9)]
    assert plan.micro_batch == max(tied)


def test_step_time_ties_go_to_fewer_accumulation_steps():
    # 14 samples per GPU: 2 × 1.0 s, 7 × (2/7) s and 14 × (1/7) s all predict 2.0 s per optimizer step
    plan = solve(224, 16, 1, max_micro=9, step_times={7: 1.0, 2: 2 / 7, 1: 1 / 7})
    assert (plan.micro_batch, plan.grad_accum) == (7, 2)
    assert plan.step_time == pytest.approx(2.0)


def test_step_times_can_prefer_a_smaller_micro_batch():
    # micro 7 is slow per sample (e.g. padding-heavy); 7 steps of micro 2 are faster than 2 of micro 7
    plan = solve(224, 16, 1, max_micro=9, step_times={7: 1.0, 2: 0.25})
    assert (plan.micro_batch, plan.grad_accum) == (2, 7)
    assert plan.step_time == pytest.approx(1.75)
    assert "fastest predicted optimizer step" in plan.reason


# --- the field reports, one named test each --------------------------------------------------


def test_field_report_5_sixteen_gpus_reach_224_with_7_per_gpu_and_ga_2():
    plan = solve(224, gpus_per_node=16, nodes=1, max_micro=9)
    assert (plan.micro_batch, plan.grad_accum, plan.world_size) == (7, 2, 16)
    assert str(plan) == "7 per GPU × 2 accumulation × 16 GPUs (16 per node × 1 node) = 224"
    assert "largest micro batch" in plan.reason


def test_field_report_4_batchnorm_never_gets_one_sample_per_gpu():
    plan = solve(224, 16, 1, max_micro=9, min_micro=2)
    assert plan.micro_batch >= 2
    # 16 samples on 16 GPUs is 1 per GPU: BatchNorm cannot train, so no plan — not a silent micro of 1
    with pytest.raises(NoExactPlanError, match="no micro batch .*≥ 2.* divides 1") as info:
        solve(16, 16, 1, min_micro=2)
    assert info.value.above == 32
    # a total not divisible by the GPU count is refused with the nearest divisible totals
    with pytest.raises(NoExactPlanError, match="not divisible") as info:
        solve(10, 4, 1, min_micro=2)
    assert (info.value.below, info.value.above) == (8, 12)


def test_field_report_1_per_gpu_batch_below_one_is_an_error_not_zero():
    with pytest.raises(NoExactPlanError, match=r"8 / 16 = 0.5 per GPU") as info:
        solve(8, 16, 1)
    assert info.value.below is None and info.value.above == 16
    assert "none below" in str(info.value)


def test_field_report_3_total_is_micro_times_ga_times_gpus_per_node_times_nodes_and_lr_follows():
    plan = solve(512, gpus_per_node=8, nodes=2, max_micro=16, base_lr=2e-5, base_batch=128)
    assert plan.micro_batch * plan.grad_accum * plan.gpus_per_node * plan.nodes == 512
    assert (plan.micro_batch, plan.grad_accum) == (16, 2)
    assert plan.lr_advice is not None
    assert plan.lr_advice.linear == pytest.approx(8e-5)
    assert plan.lr_advice.sqrt == pytest.approx(4e-5)


def test_deepspeed_floor_is_named_and_never_taken():
    with pytest.raises(NoExactPlanError) as info:
        solve(224, 3, 1, max_micro=100)
    message = str(info.value)
    assert "floor that to 74 and train 222" in message
    assert (info.value.below, info.value.above) == (222, 225)
    # every world size that works, when they are few: 14 and 16 run 224 as well as 7 and 8 do
    assert info.value.world_sizes == (1, 2, 4, 7, 8, 14, 16, 28, 32, 56, 112, 224)
    assert "224 exactly: 1, 2, 4, 7, 8, 14, 16, 28, 32, 56, 112, 224. Fix" in message
    assert "\n" not in message


def test_many_working_world_sizes_list_the_nearest_and_say_more_exist():
    with pytest.raises(NoExactPlanError) as info:
        solve(5040, 11, 1)  # 5040 has 60 divisors
    assert info.value.world_sizes == (8, 9, 10, 12, 14, 15)
    assert "exactly: 8, 9, 10, 12, 14, 15 (the nearest; more exist)" in str(info.value)


def test_model_parallel_ranks_share_a_batch():
    plan = solve(224, 8, 2, max_micro=7, model_parallel=2)
    assert plan.world_size == 8 and plan.num_processes == 16
    assert str(plan) == (
        "7 per GPU × 4 accumulation × 8 data-parallel ranks (16 GPUs: 8 per node × 2 nodes ÷ 2 model-parallel) = 224"
    )


def test_multiple_of_constrains_the_micro_batch():
    plan = solve(256, 4, 1, max_micro=30, multiple_of=8)
    assert (plan.micro_batch, plan.grad_accum) == (16, 4)


def test_no_limit_means_one_step():
    plan = solve(224, 16)
    assert (plan.micro_batch, plan.grad_accum) == (14, 1)


# --- argument validation: one line that states the rule, the value and the fix --------------


@pytest.mark.parametrize("bad", [0, -3, 2.5, 224.0, True, "224", None])
def test_target_must_be_a_positive_integer(bad):
    with pytest.raises(AutobatchError, match=rf"^target must be a positive integer, but got target={bad!r}; "):
        solve(bad, 16)


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"gpus_per_node": 0}, "gpus_per_node must be a positive integer, but got gpus_per_node=0"),
        ({"nodes": -1}, "nodes must be a positive integer, but got nodes=-1"),
        ({"max_micro": 0}, "max_micro must be a positive integer, but got max_micro=0"),
        ({"min_micro": 0}, "min_micro must be a positive integer, but got min_micro=0"),
        ({"multiple_of": 0}, "multiple_of must be a positive integer, but got multiple_of=0"),
        ({"max_micro": 1, "min_micro": 2}, "max_micro must be at least min_micro, but got max_micro=1 and min_micro=2"),
        ({"max_micro": 6, "multiple_of": 8}, "raise max_micro to 8"),
        ({"model_parallel": 3}, "model_parallel must divide the GPU count"),
        ({"base_lr": 1e-4}, "base_lr and base_batch go together"),
        ({"base_lr": -1.0, "base_batch": 8}, "base_lr must be a positive number"),
        ({"step_times": {4: 0.0}}, r"step_times values must be positive seconds, but got step_times\[4\]=0.0"),
        ({"step_times": [1, 2]}, "step_times must map micro batch to seconds"),
    ],
)
def test_arguments_are_validated_with_one_line(kwargs, pattern):
    with pytest.raises(AutobatchError, match=pattern) as info:
        solve(224, **{"gpus_per_node": 16, **kwargs})
    assert "\n" not in str(info.value)


def test_a_prime_target_names_the_nearest_targets_a_fuller_micro_batch_reaches():
    plan = solve(997, max_micro=64)
    assert (plan.micro_batch, plan.grad_accum) == (1, 997)
    assert "992 (62 × 16) or 999 (37 × 27) would fill more of it" in plan.reason
    on_eight = solve(997 * 8, gpus_per_node=8, max_micro=64)
    assert "7936 (62 × 16 × 8) or 7992 (37 × 27 × 8)" in on_eight.reason


@PROPERTY
@given(targets, gpu_counts, st.integers(min_value=2, max_value=64), min_micros, multiples)
def test_every_fuller_target_named_is_the_nearest_on_its_side_and_solves_as_named(target, gpus, max_micro, min_micro,
                                                                                 multiple_of):
    """Named only where the plan accumulates a micro batch under half the largest allowed; each target named
    solves to the micro × accumulation named with it, and none nearer on its side takes a micro over that half."""
    try:
        plan = solve(target * gpus, gpus, max_micro=max_micro, min_micro=min_micro, multiple_of=multiple_of)
    except AutobatchError:
        return
    largest = max(m for m in range(1, max_micro + 1) if allowed(m, min_micro, max_micro, multiple_of))
    fuller = plan.grad_accum > 1 and 2 * plan.micro_batch <= largest
    assert ("would fill more of it" in plan.reason) == fuller
    if not fuller:
        return
    named = plan.reason.split("allowed: ")[1].removesuffix(" would fill more of it").split(" or ")
    for text in named:
        total, arithmetic = text.split(" (")
        micro, accum = map(int, arithmetic.rstrip(")").split(" × ")[:2])
        assert solve(int(total), gpus, max_micro=max_micro, min_micro=min_micro, multiple_of=multiple_of).micro_batch == micro
        assert micro * accum * gpus == int(total) and 2 * micro > largest
    totals = sorted(int(t.split(" (")[0]) // gpus for t in named)
    full = [m for m in range(1, largest + 1) if allowed(m, min_micro, max_micro, multiple_of) and 2 * m > largest]
    low = totals[0] if len(totals) == 2 else 0  # none below: no per-GPU count under the target takes one
    assert not [k for k in range(low + 1, totals[-1]) if k != target and any(k % m == 0 for m in full)]

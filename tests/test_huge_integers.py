"""Huge integers answer at once (no O(√n) trial division), and values past 2**64 are refused with the bound."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from autobatch import check_setup, solve
from autobatch.cli import app
from autobatch.errors import AutobatchError
from autobatch.planning.divisors import MAX_INT, divisors, factorize
from autobatch.planning.solver import NoExactPlanError, exact_plans

runner = CliRunner()


def test_divisors_match_trial_division_on_small_numbers():
    for n in range(1, 600):
        assert divisors(n) == [d for d in range(1, n + 1) if n % d == 0]


@pytest.mark.parametrize("n, factors", [
    (10**19 + 1, {11: 1, 909090909090909091: 1}),
    (10**18, {2: 18, 5: 18}),
    (4294967291 * 4294967279, {4294967279: 1, 4294967291: 1}),  # two 32-bit primes: trial division's worst case
    (2**64 - 59, {2**64 - 59: 1}),  # the largest prime below 2**64
])
def test_factorize_huge_numbers(n, factors):
    assert factorize(n) == factors


def test_solve_with_a_twenty_digit_target_on_three_gpus_answers():
    with pytest.raises(NoExactPlanError, match="no exact plan") as info:
        solve(10**19 + 1, gpus_per_node=3)
    assert info.value.below == 10**19 - 1 and info.value.above == 10**19 + 2
    assert 11 in info.value.world_sizes


def test_check_with_a_huge_target_and_micro_7_answers():
    result = check_setup(target=10**18, micro_batch=7)
    assert [p.code for p in result.problems] == ["batch-identity"]


def test_exact_plans_for_a_huge_highly_composite_target():
    plans = exact_plans(10**18, gpus_per_node=8, max_micro=1000)
    assert plans[0].micro_batch == 1000 and plans[0].global_batch == 10**18


def test_targets_past_the_bound_are_refused_with_it():
    with pytest.raises(AutobatchError, match=r"target must be below 2\*\*64"):
        solve(MAX_INT, gpus_per_node=3)
    result = check_setup(target=MAX_INT + 1, gpus_per_node=3)
    assert [p.code for p in result.problems] == ["invalid-value"] and "2**64" in result.problems[0].message


def test_cli_solve_and_check_answer_huge_targets():
    out = runner.invoke(app, ["solve", "--target", "10000000000000000001", "--gpus", "3"])
    assert out.exit_code == 2 and "no exact plan" in out.stderr
    out = runner.invoke(app, ["check", "--target", "1000000000000000000", "--micro-batch", "7", "--json"])
    assert out.exit_code == 1 and json.loads(out.stdout)["problems"][0]["code"] == "batch-identity"

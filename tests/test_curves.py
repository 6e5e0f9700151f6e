"""The search on the coarse grid of synthetic memory curves (``benchmarks/curves.py``), thresholds asserted.

The full grid (``python -m benchmarks.curves``) writes docs/benchmarks/curves.md; this runs the
same families on a few hundred curves per family in seconds.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from autobatch.probing.search import search_max
from autobatch.probing.trial import Trial
from benchmarks.curves import FAMILIES, SMOOTH, Curve, curves, doubling_bisection, measure, oracle, true_max


@pytest.fixture(scope="module")
def results():
    return measure(coarse=True)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_search_is_exact_and_never_far_past_the_answer(results, family):
    for name, families in results.items():
        stats = families[family]
        assert stats.curves > 100
        assert stats.exact == stats.curves, (name, family)
        assert stats.worst_overshoot <= 2.5, (name, family)


@pytest.mark.parametrize("family", FAMILIES)
def test_never_more_than_one_trial_beyond_doubling_and_bisection(results, family):
    for name in ("search_max, trace prior", SMOOTH, "search_max, trials only"):
        assert results[name][family].beyond_reference == 0, (name, family)


@pytest.mark.parametrize("family", FAMILIES)
def test_with_the_trace_as_prior_median_four_trials_and_few_failures(results, family):
    row = results["search_max, trace prior"][family].row()
    assert row["median trials"] <= 4, (family, row)
    assert row["mean OOM trials"] <= 1.5, (family, row)
    assert row["p90"] <= 6 and row["max"] <= 12, (family, row)


def test_the_allocator_model_in_the_prior_is_what_holds_the_staircase_to_the_goal(results):
    # Without it, rounding jitter of up to 80 MiB where a sample is a few KiB leaves the boundary
    # hundreds of batches wide in the worst curves (the full grid: p90 8, max 22).
    modelled, smooth = results["search_max, trace prior"]["staircase"].row(), results[SMOOTH]["staircase"].row()
    assert smooth["max"] > 12 >= modelled["max"]
    assert smooth["mean OOM trials"] > modelled["mean OOM trials"]
    assert results[SMOOTH]["affine"].trials == results["search_max, trace prior"]["affine"].trials


# Trials alone, measured on the coarse grid: (median, p90). The forward's end (Trial.forward_bytes) shows
# the activations that gradients setting a flat peak hide, and bounds the steep pieces a curve may have
# right past the largest fit: two regimes went from 7 / 12 to 4 / 7, affine from 4 / 7 to 4 / 5, the
# staircase from 4 / 10 to 4 / 8. Kinks stay above the goal: their points show the curve as it is, and
# a line or quadratic through them overshoots a b·log b or a switch of slope (docs/search.md); reading the
# new slope a short step past a switch, and a curve that bends throughout at its quadratic after a failure,
# brought their tail from 12 to 10 trials and 1.64 to 1.51 failures (the full grid: p90 10 to 9).
TRIALS_ALONE = {"affine": (4, 5), "staircase": (4, 8), "two regimes": (4, 7), "superlinear": (5, 6),
                "b·log b, kinks": (6, 9)}


@pytest.mark.parametrize("family", FAMILIES)
def test_trials_alone_hold_their_measured_median_and_p90(results, family):
    row = results["search_max, trials only"][family].row()
    median, p90 = TRIALS_ALONE[family]
    assert row["median trials"] <= median and row["p90"] <= p90, (family, row)
    if family != "b·log b, kinks":  # the goal: affine median ≤ 4, every family median ≤ 5 and p90 ≤ 8
        assert row["median trials"] <= (4 if family == "affine" else 5) and row["p90"] <= 8, (family, row)


def test_kinks_from_their_trials_alone_take_at_most_ten_trials_and_few_failures(results):
    row = results["search_max, trials only"]["b·log b, kinks"].row()
    assert row["max"] <= 10 and row["mean OOM trials"] <= 1.55, row


def test_two_regimes_without_the_forward_end_take_what_a_flat_peak_costs(results):
    # A trial that does not measure the forward's end (a user's own training function): 7 / 11 trials on the
    # two regimes against 4 / 7 with it (7 / 11.4 before a failure tried the quadratic through three rising points).
    import benchmarks.curves as module

    blind = lambda curve: (lambda b, run=module.oracle(curve): replace(run(b), forward_bytes=0))  # noqa: E731
    stats = module.Stats()
    for curve in curves(coarse=True):
        if curve.family == "two regimes":
            outcome = search_max(blind(curve), curve.capacity, min_batch=curve.min_batch)
            stats.add(outcome, true_max(curve), 0)
    row = stats.row()
    assert stats.exact == stats.curves and (row["median trials"], row["p90"]) == (7, 11), row


@pytest.mark.parametrize("family", FAMILIES)
def test_trials_only_beats_doubling_and_bisection(results, family):
    ours, reference = results["search_max, trials only"][family].row(), results["doubling + bisection"][family].row()
    assert ours["median trials"] < reference["median trials"]
    assert ours["mean OOM trials"] < reference["mean OOM trials"]


def test_a_failed_trial_reports_no_more_than_the_capacity_as_on_a_device():
    curve = next(c for c in curves(coarse=True) if c.family == "superlinear" and c.scale > 700)
    run, truth = oracle(curve), true_max(curve)
    fit, failed = run(truth), run(truth + 1)
    assert isinstance(fit, Trial) and fit.fits and fit.resident_bytes == curve.resident
    assert not failed.fits and failed.resident_bytes is None and failed.optimizer_bytes == 0
    assert fit.reserved_bytes <= curve.capacity and failed.reserved_bytes <= curve.capacity
    assert "out of memory" in failed.error


def test_doubling_and_bisection_is_the_textbook_sequence():
    curve = Curve("affine", "", 1000, 100, 1, 5.5, shape=lambda x: x)  # fits up to 5
    outcome = doubling_bisection(oracle(curve), curve.capacity, min_batch=1)
    assert [t.batch for t in outcome.trials] == [1, 2, 4, 8, 6, 5] and outcome.max_batch == 5


def test_main_writes_the_tables_under_the_marker_and_keeps_the_text_above(results, tmp_path, monkeypatch):
    import benchmarks.curves as module

    monkeypatch.setattr(module, "measure", lambda coarse=False: results)
    out = tmp_path / "curves.md"
    out.write_text("# hand-written\n\n<!-- measured: python -m benchmarks.curves -->\nstale\n")
    assert module.main(["--coarse", "--out", str(out)]) == 0
    text = out.read_text()
    assert text.startswith("# hand-written") and "stale" not in text
    assert all(f"### {name}" in text for name in results) and "| superlinear |" in text


@pytest.fixture(scope="module")
def wrong():
    from benchmarks.curves import measure_wrong

    return measure_wrong(coarse=True)


def test_priors_wrong_as_a_trace_can_be_still_lead_to_the_exact_answer_in_few_trials(wrong):
    # Staircases and kinks led by a prior 10 % low or high, missing half its constant, missing a
    # kink, its allocator model off by a block at some batches or stepping a batch early.
    assert len(wrong) == 2 * 3 + 1 + 2
    for name, stats in wrong.items():
        row = stats.row()
        assert stats.exact == stats.curves > 100, name
        assert row["p90"] <= 8 and row["max"] <= 16, (name, row)
        assert row["largest tried ÷ answer"] <= 2.5, (name, row)
    # Every failure beyond the one that closes the bracket is a trial the prior misled: at most one
    # in two curves. A prior that steps a batch early is tried a batch past a step of it that fit
    # (1.53 before, 1.10 now); one that misses a kink aims half the headroom low after it failed,
    # reads its error per sample over the last eighth of the batch and stretches its step only
    # after creeping twice (1.64 before, 1.33 now: the rest is its first extrapolation past the
    # kink, which no search that trusts a prior can see; 1.47 on the full grid, docs/benchmarks/curves.md).
    for name, stats in wrong.items():
        assert stats.row()["mean OOM trials"] <= 1.5, (name, stats.row())

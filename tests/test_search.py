from __future__ import annotations

import math
import statistics

import pytest

from autobatch.probing.search import HARD_MAX_BATCH, chord_batch, fit_line, search_max
from autobatch.probing.trial import Trial


def oracle(memory, capacity, resident, optimizer_phase=None):
    """Trials whose peak is ``memory(b)``; with ``optimizer_phase`` that peak is split into a
    forward/backward phase (``memory``) and an optimizer phase, as real trials report it."""

    def run(b):
        fb = memory(b)
        opt = optimizer_phase(b) if optimizer_phase else 0
        m = max(fb, opt)
        return Trial(b, m <= capacity, m, m, forward_backward_bytes=fb, optimizer_bytes=opt,
                     resident_bytes=resident if m <= capacity else None)

    return run


def exhaustive(memory, capacity, min_batch=1):
    b = min_batch
    while memory(b) <= capacity:
        b += 1
    return b - 1


def test_affine_memory_exact_sequences_with_and_without_a_prior():
    run = oracle(lambda b: 100 + 7 * b, 1000, 100)
    # Trials only: one point cannot tell this line from 100 + 7·b², whose answer is 11, so the
    # second trial stays within 2.5× of 11 (25); from two points the most curved quadratic
    # they allow reaches past the line's 128, so the line leads: four trials, the contract.
    outcome = search_max(run, 1000)
    assert [t.batch for t in outcome.trials] == [1, 25, 128, 129]
    assert outcome.max_batch == 128 and outcome.limited_by == "memory"
    # A prior that had the first trial right is trusted: its boundary, then one more.
    assert [t.batch for t in search_max(run, 1000, prior=lambda b: 100 + 7 * b).trials] == [1, 128, 129]
    # One that was off at the first trial aims a fifth of the headroom low, then is calibrated.
    assert [t.batch for t in search_max(run, 1000, prior=lambda b: 7 * b).trials] == [1, 103, 128, 129]


def test_convex_memory_is_never_tried_at_the_chord():
    # 100 + 7·b²: the chord through the first point reaches 128, the answer is 11.
    outcome = search_max(oracle(lambda b: 100 + 7 * b * b, 1000, 100), 1000)
    assert outcome.max_batch == 11 and max(t.batch for t in outcome.trials) <= 2.5 * 11
    # 25 fails; the quadratic through the resident memory and the first point, the batch that fits
    # on every curve that point allows, is 11 here, less one byte's doubt: 10, then up to the edge.
    assert [t.batch for t in outcome.trials] == [1, 25, 10, 11, 12]  # the chord-led search: 1, 128, …, 14 trials


def test_flat_then_steep_is_exact_in_no_more_trials_than_doubling_and_bisection():
    # Gradients set the peak up to b = 300, activations after: nothing in the flat part says
    # where the steep part starts, so the search may not extrapolate the flat line.
    memory = lambda b: 1_000 + max(5_000, 20 * b)  # noqa: E731
    outcome = search_max(oracle(memory, 8_000, 1_000), 8_000)
    assert outcome.max_batch == exhaustive(memory, 8_000) == 350
    assert len(outcome.trials) == 12  # doubling + bisection: 18; the chord-led search: 20
    assert max(t.batch for t in outcome.trials) <= 2 * 350


@pytest.mark.parametrize("kind", ["affine", "flat", "flat-unphased", "convex", "rounded"])
def test_exact_on_many_budgets_and_median_trials(kind):
    trials, with_prior = [], []
    for i in range(25):
        base, per = 50_000 + 7_919 * i, 1_000 + 613 * i
        capacity = base + per * (37 + 97 * i) + 11 * i
        memory = {
            "affine": lambda b: base + per * b,
            "flat": lambda b: base + per * b,
            "flat-unphased": lambda b: max(base + per * 20, base + per * b),
            "convex": lambda b: base + per * b + per * b * b // 2000,
            "rounded": lambda b: -(-(base + per * b) // 65_536) * 65_536,
        }[kind]
        optimizer = (lambda b: base + per * 20) if kind == "flat" else None  # flat, sets the peak below b=20
        outcome = search_max(oracle(memory, capacity, base // 2, optimizer), capacity)
        total = (lambda b: max(memory(b), optimizer(b))) if optimizer else memory
        assert outcome.max_batch == exhaustive(total, capacity), (kind, i)
        trials.append(len(outcome.trials))
        guided = search_max(oracle(memory, capacity, base // 2, optimizer), capacity, prior=total)
        assert guided.max_batch == outcome.max_batch
        with_prior.append(len(guided.trials))
    # Trials only, a line far above the resident memory climbs by bounded steps (a convex curve
    # could hide behind the same points); with the curve as a prior it is three trials.
    if kind in ("affine", "flat"):
        assert statistics.median(trials) <= 6
    assert max(trials) <= 25
    assert statistics.median(with_prior) == 3




def test_cap_is_respected_and_reported():
    outcome = search_max(oracle(lambda b: 10 * b, 10**9, 0), 10**9, max_batch=300)
    assert outcome.max_batch == 300 and outcome.limited_by == "max_batch"
    assert all(t.batch <= 300 for t in outcome.trials)


def test_min_batch_is_the_first_trial_and_nothing_fitting_gives_zero():
    outcome = search_max(oracle(lambda b: 10 * b, 15, 0), 15, min_batch=2)
    assert outcome.max_batch == 0 and [t.batch for t in outcome.trials] == [2]


def test_memory_that_never_grows_stops_at_the_hard_cap():
    outcome = search_max(oracle(lambda b: 10, 100, 10), 100)
    assert outcome.max_batch == HARD_MAX_BATCH and outcome.limited_by == "max_batch"


def test_fit_line_uses_points_far_apart():
    assert fit_line({1: 110, 100: 1100}) == (100.0, 10.0)
    assert fit_line({5: 10}) is None
    assert fit_line({1: 50, 2: 50}) is None  # flat: no bound


def test_chord_is_below_the_boundary_of_a_curve_that_bends_up():
    memory = lambda b: max(2_000 + 10 * b, 1_000 + 20 * b)  # noqa: E731  (resident 1_000)
    chord = chord_batch({50: memory(50)}, 1_000, 10_000)
    assert chord is not None and memory(chord) <= 10_000


def test_gradients_setting_small_batch_peaks_does_not_send_the_search_far_past_the_boundary():
    # gpt2 at short sequences: at small batches the gradients, not the activations, set the
    # forward/backward peak, so a line through the first points is nearly flat.
    resident, grads, per_sample = 2_000_000_000, 500_000_000, 40_000_000
    fb = lambda b: resident + max(grads + b * per_sample // 20, per_sample * b)  # noqa: E731
    capacity = fb(33) + 1000

    def run(b):
        peak = max(fb(b), resident + grads)
        return Trial(b, peak <= capacity, peak, peak, forward_backward_bytes=fb(b),
                     optimizer_bytes=resident + grads, resident_bytes=resident if peak <= capacity else None)

    outcome = search_max(run, capacity)
    assert outcome.max_batch == 33
    assert len(outcome.trials) <= 8
    assert max(t.batch for t in outcome.trials) <= 2.5 * 33  # never a wild jump
    traced = search_max(run, capacity, prior=lambda b: max(fb(b), resident + grads))
    assert [(t.batch, t.fits) for t in traced.trials] == [(1, True), (33, True), (34, False)]


def _flat_then_steep(recompute: float = 1.0, forward: bool = True):
    """Gradients set a flat 700 MB peak (on 100 MB resident) until the activations, 9 kB a sample at the
    forward's end, take over; a backward that recomputes grows ``recompute`` times as fast."""
    def run(b: int) -> Trial:
        peak = max(700_000_000, 100_000_000 + int(recompute * 9_000 * b))
        fits = peak <= 1_000_000_000
        return Trial(b, fits, peak, peak, peak, 0, resident_bytes=100_000_000 if fits else None,
                     forward_bytes=100_000_000 + 9_000 * b if forward and fits else 0)
    return run


def test_the_forward_end_shows_the_activations_a_flat_gradient_peak_hides():
    # Without the forward's end, nothing rules out a steep piece through the resident memory right past
    # the largest fit, and the batch may only grow by about 2.5 ÷ 0.6 a trial (docs/search.md).
    seen = search_max(_flat_then_steep(), 1_000_000_000)
    blind = search_max(_flat_then_steep(forward=False), 1_000_000_000)
    assert seen.max_batch == blind.max_batch == 100_000
    assert [t.batch for t in seen.trials] == [1, 182, 83_332, 100_000, 100_001]
    assert len(blind.trials) == 15


def test_a_peak_that_outgrows_three_times_the_forward_is_still_exact_and_costs_a_trial_more():
    # The backward holds what the forward saved and the gradients of one op's output and input, so the bound
    # grants the steep piece three times the forward's growth; one that grows faster where the points do not
    # show it (a recompute hidden under the gradients' peak, where a real one grows the peak from the first
    # batches) fails at or below that bound, and the forward's points so far are dropped: two failures, then
    # the bracket from the largest fit (15 trials; two more than without the forward's end before the
    # quadratic through three rising points was tried after a failure, trials_alone.py).
    for recompute, answer, more in ((2, 50_000, -7), (4, 25_000, 1)):
        seen = search_max(_flat_then_steep(recompute), 1_000_000_000)
        blind = search_max(_flat_then_steep(recompute, forward=False), 1_000_000_000)
        assert seen.max_batch == blind.max_batch == answer
        assert len(seen.trials) == len(blind.trials) + more, (recompute, [t.batch for t in seen.trials])


def _measured(extra):
    """Trials of a step whose peak is 10 MB resident plus ``extra(b)``, on a 1 GB card; the forward's end is read."""
    def run(b: int) -> Trial:
        peak = 10_000_000 + int(extra(b))
        fits = peak <= 1_000_000_000
        return Trial(b, fits, peak, peak, peak, 10_000_000, resident_bytes=10_000_000 if fits else None,
                     forward_bytes=10_000_000 + int(extra(b) - extra(0)) if fits else 0)
    return run


def test_after_a_switch_of_slope_a_short_step_reads_the_new_slope_and_the_next_trial_is_the_answer():
    # 10 kB a sample, 30 kB from 20,000 on (an algorithm's switch): the line through 10,060 and 30,160 mixes both
    # slopes and overshot (49,315, out of memory, before); 1/32 of the batch past 30,160 reads the new one.
    switch = lambda b: 100_000_000 + 10_000 * b + 20_000 * max(0, b - 20_000)  # noqa: E731
    outcome = search_max(_measured(switch), 1_000_000_000)
    assert [(t.batch, t.fits) for t in outcome.trials] == [
        (1, True), (181, True), (10_060, True), (75_400, False), (30_160, True), (30_160 + 30_160 // 32, True),
        (43_000, True), (43_001, False)]


def test_after_a_failure_a_curve_bending_throughout_is_tried_at_its_quadratic_not_at_the_floor():
    # b·log b (a sort's or an attention kernel's workspace): the line through the two largest points overshoots
    # (40,119); the quadratic through the three largest crosses at 39,870, above the batch that fits on every
    # curve (39,470, tried before, and 10 trials), and two trials later the bracket closes.
    blogb = lambda b: 100_000_000 + 6_000 * b * math.log(1 + b / 1000)  # noqa: E731
    outcome = search_max(_measured(blogb), 1_000_000_000)
    assert outcome.max_batch == 39_955
    assert [t.batch for t in outcome.trials] == [1, 7_866, 24_389, 36_836, 40_119, 39_870, 39_956, 39_955]


def test_a_switch_is_told_from_a_curve_that_bends_throughout_and_from_rounding():
    from autobatch.probing.trials_alone import switched

    assert switched({1: 110, 8: 180, 20: 300, 40: 700})            # straight, then steeper
    assert not switched({1: 110, 8: 180, 20: 320, 40: 800})        # steeper in every span
    assert not switched({8: 180, 20: 300, 40: 700})                # three points: nothing says it was straight
    assert not switched({1: 110, 8: 180, 1000: 10_100, 1010: 10_300})  # the last span is already short


def test_a_peak_that_grows_faster_than_the_forward_where_measured_is_granted_that_ratio():
    from autobatch.probing.memory_curve import steep

    # Checkpointing: the forward's end holds 12 units a sample, the backward recomputes 34 more beside them.
    points = {b: 1_000 + 46 * b for b in (1, 64)}
    assert steep(points, {b: 100 + 12 * b for b in (1, 64)}, 100) == {1: 100 + 46, 64: 100 + 46 * 64}
    assert steep(points, {1: 0}, 100) == {}  # not measured


def test_docstring_example_runs():
    import doctest

    import autobatch.probing.memory_curve
    import autobatch.probing.prior_steps
    import autobatch.probing.search
    import autobatch.probing.trials_alone

    for module in (autobatch.probing.search, autobatch.probing.prior_steps, autobatch.probing.trials_alone,
                   autobatch.probing.memory_curve):
        result = doctest.testmod(module)
        assert result.failed == 0 and result.attempted > 0, module.__name__


def test_trials_alone_start_from_known_trials():
    # A rank that searches again from its earlier trials (an uneven plan): the trials alone take
    # them as their first points, the failure among them too, and run only new batches.
    run = oracle(lambda b: 100 + 7 * b, 1000, 100)
    for known in ([run(1)], [run(1), run(16)], [run(1), run(200)]):
        outcome = search_max(run, 1000, known=known)
        assert outcome.max_batch == 128 and {t.batch for t in outcome.trials}.isdisjoint(t.batch for t in known)
        assert {128, 129} <= {t.batch for t in outcome.trials}


def test_a_prior_that_jitters_within_the_bracket_is_bisected_there_not_crept_along():
    """A booking off by a 2 MiB block at some batches (the staircase's worst curve on the full grid of
    benchmarks/curves.py) falls as the batch grows: within a bracket it jitters over, its guesses only
    creep. Bisected there: 14 trials, where it took 18; led by the right prior, 6 (7 when the prior's
    error per sample was read over the last quarter of the batch, not the last eighth)."""
    from benchmarks.curves import Curve, _poly, oracle as curve_oracle, true_max, wrong_priors

    curve = Curve("staircase", "3 tensors, a − R = 0·B", 24 << 30, 23_192_823_398, 2, 14678.883716149525,
                  shape=_poly(0.0, 1.0, 0.0), tensors=3, prior_shape=_poly(0.0, 1.0, 0.0),
                  missed=0.0028500979156585, unseen=0.008331812985077208)
    jittery = wrong_priors(curve)["2 MiB off"]
    assert any(jittery(b + 1) < jittery(b) for b in range(14_500, 14_510))
    truth = true_max(curve)
    for prior, trials in ((jittery, 14), (curve.prior, 6)):
        outcome = search_max(curve_oracle(curve), curve.capacity, min_batch=2, prior=prior)
        tried = [t.batch for t in outcome.trials]
        assert outcome.max_batch == truth == 14525 and {truth, truth + 1} <= set(tried)
        assert len(tried) == trials, tried

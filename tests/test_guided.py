"""The guided search over lengths, on pure-Python memory curves: exact on every one, and two
trials per length once the fit holds (issue 17)."""

from __future__ import annotations

import doctest
import importlib
import math

import pytest

from autobatch.probing.guided import guided_search, search_lengths
from autobatch.probing.lengthfit import LengthFit, fit_lengths
from autobatch.probing.search import search_max
from autobatch.probing.trial import Trial

LENGTHS = [256, 512, 1024, 2048]


def curve(m0, c1, c2, capacity, rounding=1, transient=(0.0, 0.0)):
    """``run_at(b, s)`` for ``m0 + b·(c1·s + c2·s²) + max(b·t1·s, b·t2·s²)``, rounded up like an allocator."""
    t1, t2 = transient

    def run_at(b, s):
        peak = m0 + b * (c1 * s + c2 * s * s) + max(b * t1 * s, b * t2 * s * s)
        peak = int(math.ceil(peak / rounding) * rounding)
        fits = peak <= capacity
        return Trial(b, fits, peak, peak, peak, int(m0), resident_bytes=int(0.8 * m0) if fits else None)

    return run_at


def exact(run_at, s):
    lo, hi = 0, 1
    while run_at(hi, s).fits:
        lo, hi = hi, 2 * hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if run_at(mid, s).fits else (lo, mid)
    return lo


CURVES = {
    "quadratic": curve(1e8, 11_000, 2, 4e9),
    "quadratic, 2 MiB pages": curve(5e8, 30_000, 20, 20e9, rounding=2 << 20),
    "small batches": curve(1e6, 11_000, 48, 400e6, rounding=512),
    "linear": curve(2e9, 1e5, 0, 70e9, rounding=2 << 20),
    "a kink between lengths": curve(1e8, 8_000, 4, 8e9, rounding=2 << 20, transient=(3_000, 3)),
    "attention transients": curve(1e8, 8_000, 4, 8e9, rounding=512, transient=(1_000, 6)),
}


@pytest.mark.parametrize("name", list(CURVES))
def test_every_row_is_exact(name):
    run_at = CURVES[name]
    rows, _ = search_lengths(run_at, LENGTHS, int(CURVES_CAPACITY[name]))
    for row in rows:
        assert row.outcome.max_batch == exact(run_at, row.seq_len), (name, row.seq_len)
        tried = {t.batch: t.fits for t in row.outcome.trials}
        assert tried[row.outcome.max_batch] and tried[row.outcome.max_batch + 1] is False


CURVES_CAPACITY = {"quadratic": 4e9, "quadratic, 2 MiB pages": 20e9, "small batches": 400e6, "linear": 70e9,
                   "a kink between lengths": 8e9, "attention transients": 8e9}


def test_where_the_model_holds_each_later_length_costs_two_trials():
    run_at = CURVES["quadratic"]
    rows, fit = search_lengths(run_at, LENGTHS, 4_000_000_000)
    by_len = {r.seq_len: r for r in rows}
    # 2048 is searched alone; 1024 from a fit of one length (no quadratic term yet); then exact.
    assert [(t.batch, t.fits) for t in by_len[512].outcome.trials] == [(633, True), (634, False)]
    assert [(t.batch, t.fits) for t in by_len[256].outcome.trials] == [(1323, True), (1324, False)]
    assert by_len[512].predicted == 633 and by_len[2048].predicted is None
    assert fit.per_token_pair_bytes == pytest.approx(2, rel=1e-6)
    separate = sum(len(search_max(lambda b, s=s: run_at(b, s), 4_000_000_000).trials) for s in LENGTHS)
    assert sum(len(r.outcome.trials) for r in rows) < separate


def test_a_prediction_far_too_high_steps_down_and_ends_exact():
    run_at = CURVES["quadratic"]
    wrong = LengthFit(1e8, 5_000, 0, (2048,))  # per sample less than half the truth at 512

    outcome, first = guided_search(lambda b: run_at(b, 512), 4_000_000_000, seq_len=512, fit=lambda _p: wrong)
    assert first == wrong.max_batch(512, 4_000_000_000) and outcome.max_batch == 633
    assert not outcome.trials[0].fits and len(outcome.trials) <= 8


def test_the_cap_limits_a_guided_length():
    run_at = CURVES["quadratic"]
    rows, _ = search_lengths(run_at, [256, 2048], 4_000_000_000, max_batch=500)
    row = {r.seq_len: r for r in rows}[256]
    assert row.outcome.max_batch == 500 and row.outcome.limited_by == "max_batch"


def test_fit_needs_two_points_and_growing_memory():
    assert fit_lengths({128: {4: 1000}}) is None
    assert fit_lengths({128: {4: 1000, 8: 900}}) is None
    fit = fit_lengths({128: {4: 1000 + 4 * 128 * 10, 8: 1000 + 8 * 128 * 10}})
    assert fit.per_sample_bytes(128) == pytest.approx(1280) and fit.per_token_pair_bytes == 0


@pytest.mark.parametrize("module", ["autobatch.probing.lengthfit", "autobatch.probing.guided",
                                    "autobatch.planning.tokens", "autobatch.probing.samples"])
def test_docstring_examples_run(module):
    assert doctest.testmod(importlib.import_module(module)).failed == 0


def test_nothing_fits_at_a_length_is_a_max_of_zero_even_above_batch_one():
    run_at = CURVES["small batches"]
    hopeful = LengthFit(1e6, 1, 0, (256,))  # says thousands fit at 8192 tokens; not even 2 does
    outcome, _ = guided_search(lambda b: run_at(b, 8192), 400_000_000, seq_len=8192, fit=lambda _p: hopeful,
                               min_batch=2)
    assert outcome.max_batch == 0 and outcome.trials[-1].batch == 2 and not outcome.trials[-1].fits

"""What a trace that leads late could save (``autobatch.probing.pending.LATER``) is what the grid measures."""

from __future__ import annotations

import pytest

from autobatch.probing.pending import LATER, SAVES, Pending
from benchmarks import late_prior
from benchmarks.late_prior import LATEST, savings, shares


def test_what_a_late_prior_saves_is_the_share_the_coarse_grid_measures(monkeypatch, capsys):
    saved = savings(coarse=True)
    measured = shares(saved)
    assert len(LATER) == LATEST
    assert [round(measured[k], 2) for k in range(1, LATEST + 1)] == pytest.approx(list(LATER), abs=0.02)
    assert list(LATER) == sorted(LATER, reverse=True)  # later saves less
    assert saved[1] > 1.0  # ready after the first trial, an exact prior saves a trial a curve
    # python -m benchmarks.late_prior prints the table of what was measured
    monkeypatch.setattr(late_prior, "savings", lambda: saved)
    assert late_prior.main() == 0
    assert capsys.readouterr().out.splitlines()[2] == f"| 1 | {saved[1]:.2f} | 1.00 |"


def test_a_trace_that_would_lead_late_is_given_up_where_one_leading_early_is_not():
    class Tracing:  # a trace between the trials, 30 s from done at its pace, that can be given up
        gave_up = None

        def ready(self):
            return False

        def remaining(self):
            return 30.0

        def give_up(self, left, trial):
            self.gave_up = (left, trial)

    early, late = Pending(Tracing()), Pending(Tracing())
    early.trials_run, late.trials_run = 1, 3
    # The next trial costs 18 s: leading from the second trial the trace could save two (36 s), from
    # the fourth 0.86 of one (15.5 s), less than the 30 s it still needs (CLIP on the CPU).
    assert early._given_up(18.0) is False and early.prior.gave_up is None
    assert late._given_up(18.0) is True and late.prior.gave_up == (30.0, 18.0)
    assert early.saves() == SAVES

"""What a prior saves when it leads late: the trace between CPU trials is ready only after some of them.

Run from the repository root (no extra needed)::

    python -m benchmarks.late_prior

On the coarse grid of synthetic memory curves (:mod:`benchmarks.curves`) each curve is searched
from its trials alone, then with an exact prior (the curve's own trace prior) that is ready only
once ``k`` trials have run, and so leads from trial ``k + 1`` on. It prints, for each ``k``, the
trials such a prior saved on average, and that as a share of what it saved ready after the first
trial. :data:`autobatch.probing.pending.LATER` holds those shares: a trace between the trials is
given up once what it still needs passes what it could save from the next trial on
(``tests/test_late_prior.py`` checks the two agree).
"""

from __future__ import annotations

import statistics

from autobatch.probing.search import search_max

from .curves import curves, oracle, true_max

__all__ = ["LATEST", "savings", "shares", "table", "main"]

LATEST = 8  # the most trials run before the prior is ready, measured


class _Late:
    """``prior``, ready once ``count[0]`` trials have run (the search asks ``ready()`` before each)."""

    def __init__(self, prior, ready_after: int, count: list[int]):
        self.prior, self.after, self.count = prior, ready_after, count
        self.from_trial = None

    def ready(self) -> bool:
        return self.count[0] >= self.after

    def __call__(self, batch: int) -> float:
        return self.prior(batch)


def _trials(curve, ready_after: int | None) -> int:
    count, run = [0], oracle(curve)

    def counted(batch: int):
        count[0] += 1
        return run(batch)

    prior = None if ready_after is None else _Late(curve.prior, ready_after, count)
    outcome = search_max(counted, curve.capacity, min_batch=curve.min_batch, prior=prior)
    if outcome.max_batch != true_max(curve):
        raise AssertionError(f"inexact on {curve}")
    return len(outcome.trials)


def savings(coarse: bool = True, latest: int = LATEST) -> dict[int, float]:
    """``{k: trials saved}``: on average over the grid, what an exact prior ready after ``k`` trials saves
    against the trials alone, for ``k`` from 1 to ``latest``."""
    saved: dict[int, list[int]] = {k: [] for k in range(1, latest + 1)}
    for curve in curves(coarse):
        alone = _trials(curve, None)
        for k in saved:
            saved[k].append(alone - _trials(curve, k))
    return {k: statistics.fmean(v) for k, v in saved.items()}


def shares(saved: dict[int, float]) -> dict[int, float]:
    """Each ``k``'s saving as a share of the saving of a prior ready after the first trial."""
    return {k: s / saved[1] for k, s in saved.items()}


def table(saved: dict[int, float]) -> str:
    """The table ``main`` prints: each ``k``, the trials saved, and the share."""
    lines = ["| trials run before the prior is ready | trials saved | share of the first's |", "|---:|---:|---:|"]
    lines += [f"| {k} | {saved[k]:.2f} | {share:.2f} |" for k, share in shares(saved).items()]
    return "\n".join(lines)


def main() -> int:
    print(table(savings()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

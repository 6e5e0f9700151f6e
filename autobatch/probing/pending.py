"""A prior still being traced on a thread: when the search takes it, lends it time, or waits for it.

The trace beside the trials (:class:`~autobatch.estimating.background.TracedBeside`, on a GPU)
runs while they do; the trace between them (:class:`~autobatch.estimating.background.TracedBetween`,
on the CPU they share) runs only when the search lends it time: before each trial, as long as the
trials have taken so far, and is given up once what it still needs passes what it could save
(:data:`SAVES` trials at the next one's cost). Either leads from the first trial after it is ready. The search waits
for it only where the trial it would run next should take longer than the trace still needs.

Example:
    >>> class Ready:  # a trace done at once
    ...     def ready(self): return True
    ...     def __call__(self, batch): return 100 + 7 * batch
    >>> pending = Pending(Ready())
    >>> prior = pending.take(trials_run=1)
    >>> prior.from_trial
    1
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from .trial import Trial

__all__ = ["Pending", "stopped", "SAVES"]

# The trials a trace that leads saves where it pays: trials alone took 1 to 4 more than trace-led ones
# on the models of docs/benchmarks/wall_cpu.md, 2 in the middle.
SAVES = 2


@contextmanager
def stopped(prior: Any) -> Iterator[None]:
    """Run the body, then stop ``prior`` if it is a trace on a thread (it has ``stop()``), however the
    body ends: a trace between the trials waits, paused, for time nobody lends it once they stop."""
    try:
        yield
    finally:
        if callable(getattr(prior, "stop", None)):
            prior.stop()


class Pending:
    """A prior with ``ready()`` (and, where it runs only when lent time, ``lend(seconds)``; where it
    can say how long it still needs, ``remaining()`` and ``finish_within(seconds)``), and the
    seconds of the trials run while it was not ready."""

    def __init__(self, prior: Any):
        self.prior = prior
        self.seconds = 0.0  # what the trials have taken
        self.walls: dict[int, float] = {}  # seconds of each trial that fit, by batch

    def timed(self, run: Callable[[int], Trial], batch: int) -> Trial:
        """``run(batch)``, its seconds kept."""
        start = time.perf_counter()
        trial = run(batch)
        wall = time.perf_counter() - start
        self.seconds += wall
        if trial.fits:
            self.walls[batch] = wall
        return trial

    def take(self, trials_run: int) -> Any | None:
        """The prior, if it is ready now (a trace between the trials first runs for as long as they
        have taken), with ``from_trial`` set to ``trials_run``; else ``None``."""
        lend = getattr(self.prior, "lend", None)
        if callable(lend):
            lend(self.seconds)
        if not self.prior.ready():
            return None
        self.prior.from_trial = trials_run
        return self.prior

    def wait_before(self, batch: int) -> bool:
        """Let the trace end first where it should sooner than a trial at ``batch`` would (the
        largest fit's seconds, grown with the batch); whether it can lead now. A trace run between
        the trials that needs more than :data:`SAVES` such trials is given up (``give_up``)."""
        left = getattr(self.prior, "remaining", lambda: None)()
        if left is None or not self.walls:
            return False
        fit = max(self.walls)
        cost = self.walls[fit] * max(1.0, batch / fit)
        if left > SAVES * cost and callable(getattr(self.prior, "give_up", None)):
            self.prior.give_up(left, cost)
            return False
        return left <= cost and self.prior.finish_within(cost)

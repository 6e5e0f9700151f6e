"""A prior still being traced on a thread: when the search takes it, lends it time, or waits for it.

The trace beside the trials (:class:`~autobatch.estimating.background.TracedBeside`, on a GPU)
runs while they do; the trace between them (:class:`~autobatch.estimating.background.TracedBetween`,
on the CPU they share) runs only when the search lends it time: before each trial, as long as the
trials have taken so far, and is given up once what it still needs passes what it could save
(:data:`SAVES` trials at the next one's cost, fewer the later it would lead: :data:`LATER`). A trace
beside CPU trials in a process of its own (:class:`~autobatch.estimating.spawned_between.SpawnedBetween`)
runs on the CPU they leave idle, and is lent only what it has not had so. Each leads from the first
trial after it is ready. The search waits for it only where the trial it would run next should take
longer than the trace still needs.

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

import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from .trial import Trial

__all__ = ["Pending", "stopped", "SAVES", "LATER", "STEPS"]

# The trials a trace that leads saves where it pays: trials alone took 0 to 4 more than trace-led ones
# on the models of docs/benchmarks/wall_cpu.md, 2 in the middle (CLIP 0, ViT 1, gpt2 3, BERT 4, since the
# prior is read off one symbolic trace; at 1, CLIP's and ViT's traces still led before, and cost more than they saved).
SAVES = 2
# What a trace ready only after k trials saves, as a share of what it saves ready after the first (LATER[k - 1];
# past the table, its last): an exact prior on the coarse grid of synthetic curves saved 1.05 trials a curve
# ready after the first trial, 0.62 after the second, 0.45 after the third, and less each trial later
# (python -m benchmarks.late_prior; tests/test_late_prior.py). The trials alone aim better with each
# trial they learn from, and a prior that leads once they are near the answer has little left to save:
# CLIP's trace, ready after the third of its four trials on the CPU (docs/benchmarks/wall_cpu.md), saved none.
LATER = (1.0, 0.59, 0.43, 0.33, 0.21, 0.12, 0.07, 0.05)
# The fewest training steps a trial runs (a Workload's least and default), each of them grown with the batch.
STEPS = 2


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
    """A prior with ``ready()`` (and, where it runs only when lent time, ``lend(seconds)``, true where it
    paused as its pace became known, with time left to lend; where it can say how long it still needs,
    ``remaining()`` and ``finish_within(seconds)``; how long it has run, ``ran()``), and the seconds of the
    trials run while it was not ready."""

    def __init__(self, prior: Any):
        self.prior = prior
        self.seconds = 0.0  # what the trials have taken
        self.trials_run = 0  # the trials run while it was not ready
        self.walls: dict[int, float] = {}  # seconds of each trial that fit, by batch
        self.steps: dict[int, float] = {}  # and the seconds of its steady step, where it says
        self.gave_up = False  # the trace would cost more than it saves: not lent time or waited for again
        self.unpaced = False  # it was let run once as long again as it had, its pace unknown (wait_before)

    def timed(self, run: Callable[[int], Trial], batch: int) -> Trial:
        """``run(batch)``, its seconds kept."""
        start = time.perf_counter()
        trial = run(batch)
        wall = time.perf_counter() - start
        self.seconds += wall
        self.trials_run += 1
        if trial.fits:
            self.walls[batch] = wall
            if trial.seconds_per_step:
                self.steps[batch] = trial.seconds_per_step
        return trial

    def take(self, trials_run: int) -> Any | None:
        """The prior, if it is ready now, with ``from_trial`` set to ``trials_run``; else ``None``."""
        if not self.prior.ready():
            return None
        self.prior.from_trial = trials_run
        return self.prior

    def cost(self, batch: int) -> float | None:
        """What a trial at ``batch`` should take: the largest fit's seconds, its steps grown with the
        batch and the rest (the wrapper's set-up, the optimizer's state) not; ``None`` before a fit.

        A trial runs at least :data:`STEPS` steps, each as long as its steady one or longer (the first
        also makes the optimizer's state); a trial whose steps are not timed grows whole. A step grows
        along the line through the smallest and the largest fit's steady steps where two are timed
        (:meth:`step_growth`), in proportion to the batch where one is.

        Example:
            >>> from autobatch.probing.trial import Trial
            >>> pending = Pending(None)
            >>> _ = pending.timed(lambda b: (time.sleep(0.2), Trial(b, True, 1, 1, seconds_per_step=0.01))[1], 4)
            >>> 0.2 < pending.cost(16) < 0.3  # set-up, not steps: 16 is not four times 4
            True
        """
        if not self.walls:
            return None
        fit = max(self.walls)
        steps = min(self.walls[fit], STEPS * self.steps[fit]) if fit in self.steps else self.walls[fit]
        return self.walls[fit] - steps + steps * self.step_growth(fit, batch)

    def step_growth(self, fit: int, batch: int) -> float:
        """How many times the step at ``fit`` a step at ``batch`` (above it) should take: in proportion to
        the batch where one fit's step is timed; where two are, along the line through the smallest and
        the largest fit's steady steps, never less than the square root of the batch's ratio nor more than
        the ratio. A step's fixed part (the optimizer's update of every weight, each layer's launch) does
        not grow: CLIP ViT-B/32 on the CPU stepped 2.61 s at 4 and 10.1 s at 32 (3.9 times, not 8;
        docs/benchmarks/wall_cpu.json), and grown in proportion its trial at 32 was priced at 42 s, twice
        what it took. Between small batches the fixed part hides the growth in the clock's noise (2.42 s
        at 1 and 2.87 s at 4 one run, level another): the steps of gpt2, BERT, ViT and CLIP there grew
        2.4 to 3.9 times from 3 to 5 times a batch, above the square root.

        Example:
            >>> pending = Pending(None)
            >>> pending.walls, pending.steps = {1: 5.2, 4: 5.6}, {1: 2.42, 4: 2.87}
            >>> round(pending.step_growth(4, 32), 2)  # the line: 2.87 s + 28 × 0.15 s; less than √8
            2.83
            >>> pending.walls, pending.steps = {1: 2.0, 3: 4.0}, {1: 1.0, 3: 2.0}
            >>> pending.step_growth(3, 9)  # the line: 2 s + 6 × 0.5 s
            2.5
        """
        ratio = max(1.0, batch / fit)
        timed = sorted(b for b in self.steps if b in self.walls)
        if fit not in self.steps or len(timed) < 2 or timed[0] >= fit:
            return ratio
        low, step = timed[0], self.steps[fit]
        line = (step + (step - self.steps[low]) / (fit - low) * (batch - fit)) / step
        return min(ratio, max(math.sqrt(ratio), line))

    def wait_before(self, batch: int) -> bool:
        """Before a trial at ``batch``, lend a trace that runs where it is lent time (``lend``) as long
        as the trials have taken, then let it end first where it should sooner than that trial
        (:meth:`cost`); whether it can lead now. A trace that needs more than it could save (:meth:`saves`
        such trials; ``remaining``) is given up (``give_up``), before it is lent more, and never waited for again.
        One whose pace is not known yet (no batch traced: the symbolic trace, :mod:`autobatch.estimating.curve_prior`,
        answers every batch at once) is let run once as long again as it has (``ran``), never longer than that
        trial: a trace between the trials then costs at most twice what they took, and a symbolic trace a
        little longer than the first trial leads from the second (ViT-B/16 on the CPU). One whose symbolic
        trace stopped without answering has four traces each at its batch still to come, weighed at what
        that trace took (``remaining``; :func:`~autobatch.estimating.prior.left_at_pace`): CLIP's, its batch
        pinned in its loss, was lent time until it traced one (11.7 s) before it was given up; now it is given
        up as its symbolic trace stops (7.2 and 6.7 s, the same hour, the same host)."""
        cost = self.cost(batch)
        if self._given_up(cost):
            return False
        lend = getattr(self.prior, "lend", None)
        if callable(lend):
            paused = lend(self.seconds)  # True where it paused as its pace became known: weighed, then lent the rest
            if self.prior.ready():
                return True
            while paused and not self._given_up(cost):  # twice at most: gone batch by batch, then a batch traced
                paused = lend(self.seconds)
                if self.prior.ready():
                    return True
        if self._given_up(cost):
            return False
        left = getattr(self.prior, "remaining", lambda: None)()
        if left is None:  # its pace unknown (the one trace for every batch still runs): once, as long again as it ran
            ran = getattr(self.prior, "ran", lambda: None)()
            if self.unpaced or not ran or cost is None:
                return False
            self.unpaced = True
            return self.prior.finish_within(min(cost, ran))
        return cost is not None and left <= cost and self.prior.finish_within(cost)

    def saves(self) -> float:
        """The trials the trace could save if it led from the next one: :data:`SAVES`, less as more trials
        have run without it (:data:`LATER`).

        Example:
            >>> pending = Pending(None)
            >>> pending.trials_run = 1
            >>> pending.saves()  # ready now, it leads from the second trial
            2.0
            >>> pending.trials_run = 3
            >>> round(pending.saves(), 2)
            0.86
        """
        return SAVES * LATER[min(max(self.trials_run, 1), len(LATER)) - 1]

    def _given_up(self, cost: float | None) -> bool:
        """Whether the trace was given up, or is now: what it still needs at its pace passes what it could
        save (:meth:`saves`) at ``cost`` a trial. A trace that cannot be given up (beside a GPU's trials) never is."""
        if self.gave_up:
            return True
        give_up = getattr(self.prior, "give_up", None)
        left = getattr(self.prior, "remaining", lambda: None)()
        if not callable(give_up) or left is None or cost is None or left <= self.saves() * cost:
            return False
        give_up(left, cost)
        self.gave_up = True
        return True

"""The search for the exact largest batch that fits, with as few trials as possible.

Each step asks a model of the memory curve (:mod:`autobatch.probing.memory_curve`) for the largest
batch it predicts to fit, ``E``, and tries it, clamped into the open bracket (largest fit,
smallest failure): after ``E`` fits the model is redrawn through it and the next candidate is
``E + 1``; after it fails, one below. The model climbs a ladder with the evidence: a prior
(calibrated to the trials) if one is given, else chord → line → quadratic.

Guards keep a wrong model cheap:

* **bounded reach**: without a prior, no trial goes more than 2.5× past the batch that fits on
  every curve the points allow (a quadratic from the resident memory, a max of affine pieces;
  :func:`~autobatch.probing.memory_curve.curvature_bound`), so a convex curve's chord, which can
  be the square of the answer, is never tried;
* **trials alone** (:mod:`~autobatch.probing.trials_alone`): a model read near the boundary,
  never aiming below the batch that fits on every curve; after a failure that batch; a model
  that creeps has its step doubled; two failures or three stalls running, bisect;
* **misses judged by outcome** (led by a prior): a trial the model said fits but failed, or a model that moves
  the boundary up past its own fit (it creeps), is a miss. After a failure the model aims lower,
  half the headroom, 2.5 times as low each time after; creeping twice running stretches the model's step,
  doubling, never past the middle (once is a model converging as its points come nearer);
  a model that a failure contradicts is not asked again until new points come: bisect;
* **a prior that steps** (the trace booked in the allocator model: 2 MiB segments, a staircase):
  the device crosses the capacity at one of its steps, so after the prior said a failed batch
  fits, the batch just below its last step there is tried, then the step itself; where the
  prior is flat from the largest fit through the smallest failure it cannot tell those batches
  apart (a tensor it does not see grew): bisect; where a batch at one of its steps fits, the
  batch after it is tried, once a search (a prior that rounds a tensor a batch early); a prior
  that falls as the batch grows jitters, and once the bracket is within eight times its jitter
  (in batches) it is bisected;
* **bisection**: when three model-led trials have not halved the bracket, or two failed running,
  bisect — geometrically while the failure is more than four times the largest fit.

It stops only when the largest batch that fits and the smallest that fails are adjacent (or
the cap is reached), so the answer is exact whenever memory grows with the batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .memory_curve import (Curve, bends_up, calibrate, chord_batch, crossing, curvature_bound, fit_line, predict_batch,
                           steep)
from .pending import Pending, stopped
from .prior_steps import blur, step_below
from .trials_alone import REACH, TrialsAlone
from .trial import Trial

__all__ = ["SearchOutcome", "NoTrace", "search_max", "predict_batch", "chord_batch", "bends_up", "fit_line", "HARD_MAX_BATCH"]

HARD_MAX_BATCH = 1 << 20  # a cap even when none is given: memory that never grows is a bug to report
_MARGIN = 0.2            # share of the headroom a one-point model aims low
_LOWER = 2.5             # after each miss the model aims this many times lower (half the headroom at the first)
_TRUSTED = 0.001         # a prior this close to the first trial is trusted without a margin
_STALLS = 3               # model-led trials that did not halve the bracket before it is bisected
_BACK = 4                 # a step back from a failure: a quarter of the model's last move or of the bracket, ×4 on
_BLUR = 8                 # a prior that jitters by an eighth of the bracket or more cannot place the boundary in it


@dataclass(frozen=True)
class SearchOutcome:
    max_batch: int            # largest batch that fits; 0 when not even the smallest does
    limited_by: str           # "memory", or "max_batch" when the cap stopped the search
    trials: tuple[Trial, ...]


class NoTrace:
    """No prior, and why: passed where a prior goes, the search runs from its trials alone and the
    result says why the trace did not lead (``extra["trace_prior"]["reason"]``).

    Example:
        >>> NoTrace("turned off").reason
        'turned off'
    """

    def __init__(self, reason: str):
        self.reason = reason

    def __repr__(self) -> str:
        return f"NoTrace({self.reason!r})"


class _NoPrior(Exception):
    """The prior answered NaN (its trace failed): the search drops it and goes on from its trials."""


class _Search:
    def __init__(self, run: Callable[[int], Trial], capacity: int, min_batch: int, max_batch: int,
                 prior: Curve | None):
        self.run, self.capacity, self.cap, self.prior = run, capacity, max_batch, prior
        self.lo, self.hi = min_batch - 1, None  # largest known fit, smallest known failure
        self.min_batch = min_batch
        self.phases: tuple[dict[int, int], dict[int, int]] = ({}, {})  # forward+backward, optimizer
        self.totals: dict[int, int] = {}  # the whole step's reserved peak, for the prior
        self.growing: dict[int, int] = {}  # the same where forward+backward, not the optimizer, set it
        self.resident: int | None = None
        self.forward: dict[int, int] = {}  # allocated at the end of the forward, where measured
        self.promised: float | None = None  # the last batch the forward's evidence said fits on every curve
        self.trials: list[Trial] = []
        self.last: Trial | None = None  # the last trial learned from
        self.pending: Pending | None = None  # a prior traced on a thread, until it is ready (see adopt)
        self.alone = TrialsAlone()  # what leads without a prior
        self.local = False  # a smooth prior failed: calibrate it near the boundary (memory_curve.calibrate)

    def adopt(self) -> None:
        """Take a prior traced on a thread once it is ready: it leads from the next trial on."""
        if self.pending is not None and (ready := self.pending.take(len(self.trials))) is not None:
            self.prior, self.pending = ready, None

    def waited(self, batch: int) -> bool:
        """Whether the trace still running was let end before a trial at ``batch``, and leads now."""
        if self.pending is None or not self.pending.wait_before(batch):
            return False
        self.adopt()
        return self.prior is not None

    @property
    def upper(self) -> int:
        return self.hi - 1 if self.hi is not None else self.cap

    @property
    def done(self) -> bool:
        return self.lo >= self.upper

    def attempt(self, batch: int) -> bool:
        trial = self.run(batch) if self.pending is None else self.pending.timed(self.run, batch)
        self.trials.append(trial)
        return self.learn(trial)

    def learn(self, trial: Trial) -> bool:
        self.last = trial
        batch = trial.batch
        if trial.fits:
            self.lo = max(self.lo, batch)
            self.phases[0][batch] = trial.forward_backward_bytes or trial.reserved_bytes
            self.phases[1][batch] = trial.optimizer_bytes or trial.reserved_bytes
            self.totals[batch] = trial.reserved_bytes
            if trial.forward_bytes:
                self.forward[batch] = trial.forward_bytes
            if trial.forward_backward_bytes >= trial.optimizer_bytes:
                self.growing[batch] = trial.reserved_bytes
            if trial.resident_bytes is not None:
                self.resident = trial.resident_bytes
        else:
            self.hi = batch if self.hi is None else min(self.hi, batch)
            if self.promised is not None and batch <= self.promised:
                self.forward = {}  # a peak that outgrew three times the forward's: the points so far are dropped
                self.promised = None
        return trial.fits

    def estimate(self, cautious: int = 0) -> int | None:
        """The largest batch the prior predicts to fit (may lie outside the bracket), or ``None``
        when it answered NaN: it is dropped, and the trials alone lead from the next trial on."""
        try:
            return self.from_prior(cautious)
        except _NoPrior:
            self.prior = None  # from here on the trials alone lead, as if none had been given
            return None

    def from_prior(self, cautious: int) -> int:
        """:meth:`estimate` from the prior, calibrated to the trials; :class:`_NoPrior` if it answers NaN."""
        prior = self.prior

        def known(batch: int) -> float:
            value = prior(batch)
            if not math.isfinite(value):
                raise _NoPrior
            return value

        limit = self.capacity
        # Where the optimizer step set a point's peak, the curve changes regime after it: its
        # error there says how many bytes per sample the prior misses, not by what factor.
        points = self.totals
        curve = calibrate(known, points, self.growing, local=self.local)
        # One point: the offset is known, the scale a guess, unless the prior already had
        # that point right (within a tenth of a percent): then it is trusted as it is.
        guessed = abs(points[self.lo] - known(self.lo)) > _TRUSTED * points[self.lo]
        far = len(points) == 1 and guessed and crossing(curve, limit, self.lo, self.cap) > 1.5 * self.lo
        if far or cautious:
            limit -= min(0.9, _MARGIN * _LOWER ** cautious) * max(0, self.capacity - points[self.lo])
        return crossing(curve, limit, self.lo, self.cap)

    def reach(self) -> int:
        """The furthest batch one trial may try."""
        if self.prior is not None:
            return self.cap
        base = self.resident if self.resident is not None else 0
        bound = self.safe(self.phases[0], min(base, min(self.phases[0].values())))
        return int(min(self.cap, max(2 * self.lo, REACH * int(bound)))) if math.isfinite(bound) else self.cap

    def safe(self, points: dict[int, int], base: int) -> float:
        """A batch that fits on every curve through ``points``
        (:func:`~autobatch.probing.memory_curve.curvature_bound`), its pieces through the resident memory
        bounded by what the forward's end showed where it was measured
        (:func:`~autobatch.probing.memory_curve.steep`); a trial that fails at or below such a bound drops the
        forward's points read so far (:meth:`learn`), and the trials after it read their own."""
        bound = curvature_bound(points, base, self.capacity, steep(points, self.forward, base))
        if self.forward and bound > curvature_bound(points, base, self.capacity):
            self.promised = bound  # a failure at or below it refutes the forward's evidence (see learn)
        return bound

    def bisect(self) -> int:
        if self.hi is None:
            return min(2 * self.lo, self.reach())
        if self.hi > 4 * self.lo:
            return int(math.sqrt(self.lo * self.hi))
        return (self.lo + self.hi) // 2

    def clamp(self, batch: int) -> int:
        return max(self.lo + 1, min(batch, self.upper))

    def search(self, known: Sequence[Trial] = ()) -> SearchOutcome:
        for trial in known:
            self.learn(trial)
        if self.lo < self.min_batch:  # no fit known yet: the smallest batch first
            if (self.hi is not None and self.hi <= self.min_batch) or not self.attempt(self.min_batch):
                return SearchOutcome(0, "memory", tuple(self.trials))
        side, streak, stalls = 0, 0, 0  # side: +1 misses that fit (model too low), -1 that failed
        placed = None  # a fit where a settled model put the boundary: does the model stay there?
        bisecting = False
        back, scale = None, 0  # a step back from the failure, and the last one that found a fit
        previous = moved = None  # the settled prior's last guess, and how far its guess last moved
        drop = None  # the next batch to try at one of the prior's steps (see the drop path below)
        at_step = False  # drop is the step itself, tried once after the batch just below it fit
        late = False  # the batch after a step of the prior that fit was tried (once a search)
        misses_below = 0  # batches just below a step that failed running (at two, the model is asked again)
        while not self.done:
            self.adopt()
            if self.prior is None:
                width = self.upper - self.lo
                batch = self.alone.next(self)
                if self.waited(batch):
                    continue  # the trace, done sooner than this trial would have been, leads it
                self.attempt(batch)
                self.alone.tried(self, width)
                continue
            if self.hi is not None and self.upper - self.lo <= _BLUR * blur(self.prior, self.lo, self.hi):
                # A prior that jitters by an eighth of the bracket or more cannot place the boundary in it.
                drop = back = None
                self.attempt(self.clamp(self.bisect()))
                continue
            if drop is not None:
                batch, drop = self.clamp(drop), None
                if self.attempt(batch):
                    # Just below the prior's step: the step itself is the likeliest failure.
                    if not at_step and not self.done:
                        drop = batch + 1
                    at_step = True  # the step is tried once; a fit there leaves the prior flat above
                    continue
                if self.done or at_step:
                    at_step, misses_below = False, 0
                    continue
                # The step below failed too: the prior is off by more than a step; one more.
                misses_below += 1
                drop = step_below(self.prior, batch, self.lo) if misses_below < 2 else None
                continue
            if back is not None:
                below = self.hi - back
                if self.attempt(self.clamp(below if below > self.lo else self.bisect())):
                    scale, back = back, None
                else:
                    back *= _BACK
                continue
            width = self.upper - self.lo
            if width == 1:  # one batch left to try: no model to ask (a prior's traces cost seconds)
                self.attempt(self.lo + 1)
                continue
            settled = side >= 0 and len(self.totals) > 1
            guess = self.estimate(0 if settled else streak)
            if guess is None:
                continue  # the prior answered NaN and is dropped: the trials alone from here
            if settled:
                moved = None if previous is None else abs(guess - previous)
                previous = guess
            if placed is not None:
                if guess > placed:
                    # The model moved the boundary up past its own fit: it creeps (a staircase's
                    # flat stretch, a slope read low); a miss that fit.
                    side, streak = 1, streak + 1 if side > 0 else 1
                else:
                    side, streak = 0, 0
                placed = None
            # A model that puts a failed batch within reach has been contradicted by a trial (a prior
            # too: it misses a change of slope, a kink or a kernel's workspace); nothing says by how
            # much, so bisect.
            contradicted = self.hi is not None and guess >= self.hi
            # Twice past the boundary running, or a bracket the model has stopped halving: the
            # model is off by more than it can tell (a staircase near its edge); bisect from now on.
            # A prior flat from the largest fit through the smallest failure cannot tell the batches
            # between apart: the device crossed where the trace sees nothing grow.
            blind = self.hi is not None and self.prior(self.lo + 1) == self.prior(self.hi)
            if blind and self.prior(self.lo) != self.prior(self.lo + 1):
                drop, at_step = self.lo + 1, True  # the prior steps right above the largest fit: try the step
                continue
            if blind or stalls >= _STALLS or (side < 0 and streak >= 2):
                bisecting, stalls, side, streak = True, 0, 0, 0
            elif bisecting:
                bisecting = False  # one bisection, then the model again on the new bracket
            if bisecting or contradicted:
                batch, led = self.clamp(self.bisect()), False
            else:
                batch, led = self.clamp(min(guess, self.reach())), True
                # A prior that failed near the boundary converges on it from below in shrinking steps:
                # stretch only where it creeps (a staircase's flat stretch), not where it converges.
                creeping = not (self.local and self.hi is not None) or batch - self.lo <= max(2, (self.upper - self.lo) // 64)
                if side > 0 and streak >= 2 and creeping:
                    # The model keeps landing short, twice running (once is a model that converges as its
                    # points come nearer, past a kink it missed): stretch its step, doubling, never past the middle.
                    stride = max(1, batch - self.lo) << streak
                    batch = self.clamp(min(self.lo + stride, self.reach() if self.hi is None else self.bisect()))
            fits = self.attempt(batch)
            if fits and led and settled and not late and not self.done and self.prior(batch) > self.prior(batch - 1) \
                    and self.prior(batch + 1) == self.prior(batch):
                # It fit where the prior steps up: the device's step may come a batch later than the
                # prior's (a tensor the prior rounds a batch early); that batch, once a search.
                drop, at_step, late = batch + 1, True, True
                continue
            if not fits and led and step_below(self.prior, batch, self.lo) is None:
                # A smooth prior (one that does not step there) failed: calibrated far below, it
                # misses the slope near the boundary. (A prior that steps has its own path below.)
                self.local = True
            if self.done:
                break
            if led:
                if self.hi is not None:
                    stalls = stalls + 1 if self.upper - self.lo > width / 2 else 0
                said_fits = batch <= guess
                if said_fits and not fits and settled:
                    # A prior that steps (the allocator's rounding) and said this batch fits: the
                    # device crossed the capacity at one of the prior's steps, most likely the
                    # last one at or below it; try the batch just below that step.
                    drop, at_step, misses_below = step_below(self.prior, batch, self.lo), False, 0
                    if drop is not None:
                        continue
                if said_fits and not fits and settled and moved is not None:
                    # A calibrated prior that failed is off by about what it last moved (or by
                    # what the previous step back needed): step back from the failure by a
                    # quarter of that, growing, instead of trusting it again just below.
                    back = max(1, moved // _BACK, scale // _BACK, (self.hi - self.lo) // _BACK)
                    continue
                if fits and batch == guess and settled:
                    placed = batch
                elif fits != said_fits:
                    side, streak = (1 if fits else -1), (streak + 1 if side == (1 if fits else -1) else 1)
                else:
                    side, streak = 0, 0
        limited = "max_batch" if self.lo == self.cap and self.hi is None else "memory"
        return SearchOutcome(self.lo, limited, tuple(self.trials))


def search_max(
    run: Callable[[int], Trial],
    capacity: int,
    *,
    min_batch: int = 1,
    max_batch: int | None = None,
    prior: Curve | None = None,
    fails_at: int | None = None,
    known: Sequence[Trial] = (),
) -> SearchOutcome:
    """Find the largest batch ``b`` (``min_batch ≤ b ≤ max_batch``) for which ``run(b).fits``.

    Args:
        run: runs one trial; must be monotone (if ``b`` fits, every smaller batch fits).
        capacity: bytes a trial's ``reserved_bytes`` may reach; guides predictions only —
            the answer always rests on trials that fit and fail.
        min_batch: the smallest batch allowed (2 for BatchNorm models).
        max_batch: an explicit cap; the outcome says when the cap, not memory, was the limit.
        prior: a predicted peak in bytes at any batch (nondecreasing), e.g. from the fake-tensor
            trace (:func:`autobatch.trace_prior`); calibrated to the trials as they come, so a
            constant or proportional error in it costs nothing. A prior that answers NaN (its
            trace failed) is dropped, and the search goes on from its trials alone; a
            :class:`NoTrace` is none, with the reason the result records.
        fails_at: a batch already known to fail (one that just ran out of memory): the search
            stays below it and, with nothing else to go on (pass/fail trials), bisects toward it
            instead of doubling up to it.
        known: trials already run at these batches (e.g. on this rank before), taken as the
            search's first points; the outcome's ``trials`` are the new ones only.

    Example:
        >>> from autobatch.probing.trial import Trial
        >>> oracle = lambda b: Trial(b, 100 + 7 * b <= 1000, 100 + 7 * b, 100 + 7 * b, resident_bytes=100)
        >>> outcome = search_max(oracle, 1000)
        >>> outcome.max_batch, [t.batch for t in outcome.trials]
        (128, [1, 25, 128, 129])
        >>> [t.batch for t in search_max(oracle, 1000, prior=lambda b: 100 + 7 * b).trials]
        [1, 128, 129]
    """
    cap = HARD_MAX_BATCH if max_batch is None else max_batch
    # A prior traced beside the trials (it has ready() and stop()) leads once it is ready.
    beside = prior if callable(getattr(prior, "ready", None)) else None
    search = _Search(run, capacity, min_batch, cap, None if isinstance(prior, NoTrace) or beside else prior)
    search.pending = None if beside is None else Pending(beside)
    if fails_at is not None:
        search.hi = max(min_batch, fails_at)
    with stopped(beside):
        return search.search([t for t in known if min_batch <= t.batch <= cap])

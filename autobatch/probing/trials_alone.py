"""The next trial of a search led by its trials alone: no prior, or one that has not come or was dropped.

The search (:mod:`autobatch.probing.search`) asks :meth:`TrialsAlone.next` for each trial while it
has no prior. Two figures are drawn from the trials that fit (:mod:`autobatch.probing.memory_curve`):

* **the model's boundary**: where the curve read near the boundary crosses the capacity (its
  slopes over the last 1/64 of the batch; a quadratic through three points only where a fourth
  below them confirms it, else the line through the two largest: a kink, or gradients giving way
  to activations, lies between them);
* **the batch that fits on every curve** the points allow of the kinds memory makes
  (:func:`~autobatch.probing.memory_curve.curvature_bound`).

Where a trial measured the forward's end (:attr:`~autobatch.probing.trial.Trial.forward_bytes`:
the activations the backward will use, which a flat gradient peak hides at small batches), both
use it: the curve through those points bounds the model's boundary (the peak is at least what the
forward's end holds), and the steep pieces the batch that fits on every curve allows grow at most
three times as fast as the forward's, or as much faster as the peaks grew where they did
(:func:`~autobatch.probing.memory_curve.steep`); a failure at or below such a batch drops the
forward's points read so far (the trials after it read their own).

A trial goes to the model's boundary, never below the batch that fits on every curve and never
more than :data:`REACH` times past it (so a convex curve's chord, the square of the answer on a
pure square, is never tried). After a failure the batch that fits on every curve is tried, or, where the
three largest points rise and the quadratic through them crosses the capacity above that batch and below the
failure, that crossing (the curve bent up past the line through the two largest: b·log b). Where the slope
changed between the two largest points only (straight below them: an algorithm's switch, a kernel's
workspace; :func:`switched`), their line mixes both slopes: a step of 1/32 of the batch past the largest fit
reads the new one, and the trial after it aims there. The
model was wrong low when a trial past its boundary fit, or when its boundary fit and it then puts
the boundary further by as much as its last step, that trial within an eighth of the headroom of
the capacity; twice running, it creeps (a staircase's flat stretch) and its step doubles, up to
the batch below the smallest failure. Two failures running, or three trials that did not halve
the bracket, and it is bisected.

Example:
    >>> from autobatch.probing.search import search_max
    >>> from autobatch.probing.trial import Trial
    >>> line = lambda b: Trial(b, 100 + 7 * b <= 1000, 100 + 7 * b, 100 + 7 * b, resident_bytes=100)
    >>> [t.batch for t in search_max(line, 1000).trials]  # 25: 2.5 × 10, the answer were it 100 + 7·b²
    [1, 25, 128, 129]
    >>> flat = lambda b: Trial(b, max(700, 100 + 9 * b) <= 1000, max(700, 100 + 9 * b), max(700, 100 + 9 * b),
    ...                        resident_bytes=100, forward_bytes=100 + 9 * b)  # gradients' flat peak; activations
    >>> # without forward_bytes the trials are 1, 2, 5, 17, 62, 230, 92, 101, 99, 100
    >>> [t.batch for t in search_max(flat, 1000).trials]
    [1, 5, 82, 100, 101]
"""

from __future__ import annotations

import math
from typing import Any

from .memory_curve import crossing, fit_line, ladder

__all__ = ["REACH", "TrialsAlone", "switched"]

REACH = 2.5    # how far past the batch that fits on every curve (its floor) one trial may go
_SPACING = 64  # slopes are read over the last 1/64 of the batch
_STALLS = 3  # trials that did not halve the bracket, running, before it is bisected
_CREEP = 4     # a model creeps when it moves its boundary by at least a quarter of its last step
_NEAR = 8      # ... from a trial within this share of the headroom of the capacity
_SWITCH = 32   # after a change of slope, a step of 1/32 of the batch reads the new one
_STRAIGHT, _STEEPER = 0.01, 0.05  # slopes that agree within 1 %; one 5 % steeper


def switched(points: dict[int, int]) -> bool:
    """Whether the slope changed between the two largest of ``points``, and only there: over the two
    spans below them the slopes agree within :data:`_STRAIGHT`, over the last it is :data:`_STEEPER`
    steeper (an algorithm's switch, a kernel's workspace from some batch on), and that span is wider
    than a step of 1/:data:`_SWITCH` of the batch (else the line through it reads the new slope).

    Example:
        >>> switched({1: 110, 8: 180, 20: 300, 40: 700})  # 10 bytes a sample, then 20 past some batch
        True
        >>> switched({1: 110, 8: 180, 20: 320, 40: 800})  # steeper in every span: a curve that bends throughout
        False
    """
    xs = sorted(points)[-4:]
    if len(xs) < 4 or xs[3] - xs[2] <= xs[3] // _SWITCH:
        return False
    low, mid, top = ((points[b] - points[a]) / (b - a) for a, b in zip(xs, xs[1:]))
    return mid > 0 and abs(mid - low) <= _STRAIGHT * mid and top > (1 + _STEEPER) * mid


class TrialsAlone:
    """The state a search led by its trials keeps between trials (see the module docstring)."""

    def __init__(self) -> None:
        self.stalls = 0   # trials that did not halve the bracket, running
        self.failures = 0  # failed trials, running
        self.creep = 0    # trials at or past the model's boundary that fit, running (the stretch's doublings)
        self.placed: int | None = None  # the last trial, where it was at or past the model's boundary
        self.step = 0     # how far that trial stepped past the largest fit
        self.beyond = False  # that trial was past the model's boundary

    def next(self, search: Any) -> int:
        """The next batch for ``search`` (a :class:`~autobatch.probing.search._Search`) to try."""
        s = search
        if s.upper - s.lo == 1:
            return s.lo + 1
        points = {b: p for b, p in s.phases[0].items() if p > 0}
        if not points:  # pass/fail trials: nothing to model
            return s.clamp(s.bisect())
        base = min(points.values()) if s.resident is None else min(s.resident, min(points.values()))
        safe = s.safe(points, base)
        model = ladder(points, s.resident, spacing=_SPACING, checked=True)
        guess = math.inf if model is None else crossing(model, s.capacity, s.lo, s.cap)
        # The peak is at least what the forward's end holds: where that crosses first, it bounds (gradients
        # can set a flat peak at small batches that hides the activations' growth).
        acts = ladder({b: f for b, f in s.forward.items() if b in points}, s.resident, spacing=_SPACING, checked=True)
        if acts is not None:
            guess = min(guess, crossing(acts, s.capacity, s.lo, s.cap))
        line = fit_line(s.phases[1])  # the optimizer step grows hardly, but where it crosses first it bounds
        if line is not None:
            bound = max(s.lo, int((s.capacity - line[0]) // line[1]))
            safe, guess = min(safe, bound), min(guess, bound)
        failed = s.last is not None and not s.last.fits  # (the last trial learned: run now, or known)
        self.failures = self.failures + 1 if failed else 0
        placed, self.placed = self.placed, None
        if self.stalls >= _STALLS or self.failures >= 2:
            self.stalls = self.creep = 0
            return s.clamp(s.bisect())
        if s.hi is not None and (failed or guess >= s.hi):
            # Just contradicted: the batch that fits on every curve of the kinds memory makes, or higher, where
            # the quadratic through the three largest points crosses below the failure (past them the curve bent
            # up more than the line through the two largest: b·log b; over a switch it is more curved than the
            # curve, and aims low).
            self.creep = 0
            floor = int(safe) if s.lo < safe < s.hi else s.bisect()
            xs = sorted(points)[-3:]
            rising = len(xs) == 3 and points[xs[0]] < points[xs[1]] < points[xs[2]]  # not a flat peak's points
            bent = ladder(points, s.resident, spacing=_SPACING) if rising else None
            above = -1 if bent is None else crossing(bent, s.capacity, s.lo, s.cap)
            return s.clamp(above if floor < above < s.hi else floor)
        probe = s.lo + max(1, s.lo // _SWITCH)  # a step of 1/32 of the batch past the largest fit
        if s.hi is not None and not failed and switched(points) and probe < min(guess, s.hi):
            # The slope changed between the two largest points: their line mixes both slopes and overshoots.
            # The step reads the slope past the switch; the trial after it aims there.
            self.placed, self.step, self.beyond = None, 0, False
            return s.clamp(probe)
        if math.isfinite(safe) and safe > guess:
            guess = int(safe)  # the model aims below a batch that fits on every curve: no need
        # The model was wrong low when a trial past its boundary fit, or when its boundary fit and it
        # now puts the boundary further by as much as its last step, that trial near the capacity (within
        # an eighth of the headroom: far below it, the model was wrong by much, and its next one, through
        # that point, is nearer); twice running, it creeps.
        wrong_low = placed is not None and not failed and (
            self.beyond or (math.isfinite(guess) and guess > placed and _CREEP * (guess - s.lo) >= self.step)) \
            and s.capacity - points.get(placed, 0) <= (s.capacity - base) / _NEAR
        self.creep = self.creep + 1 if wrong_low else 0
        said = guess  # the model's own boundary, before any stretch
        if self.creep > 1:
            guess = s.lo + (max(1, min(guess, s.cap) - s.lo) << (self.creep - 1))
            if s.hi is not None:
                guess = min(guess, s.upper)
        batch = min(guess, REACH * int(safe)) if math.isfinite(safe) else min(guess, 2 * s.lo)
        batch = s.clamp(int(max(batch, s.lo + 1)))
        self.placed, self.step = (batch, batch - s.lo) if batch >= guess else (None, 0)
        self.beyond = batch > said  # the model said this batch fails
        return batch

    def tried(self, search: Any, width: int) -> None:
        """After a trial: did it halve the bracket (``width`` before it)? Trials at the model's
        boundary do not count; whether they crept is judged by the next one."""
        if search.hi is not None and self.placed is None:
            self.stalls = self.stalls + 1 if search.upper - search.lo > width / 2 else 0

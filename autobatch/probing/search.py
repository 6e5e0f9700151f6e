"""The search for the exact largest batch that fits, with as few trials as possible.

Peak memory is close to affine in the batch, ``peak(b) ≈ a + c·b``. The search:

1. tries the smallest allowed batch; from its peak and the memory that stays between steps
   (parameters, optimizer state) it gets an upper bound on the bytes per sample, hence a batch
   that should still fit, far from the first;
2. fits the line through two measured points far apart and predicts the boundary ``b*``;
3. confirms: every candidate is clamped into the open bracket (largest fit, smallest failure),
   so after ``b*`` fits the next candidate is ``b* + 1``, and after it fails ``b* − 1``;
4. where the curve bends up (the largest point above the line through the two before it),
   tries the chord from the resident memory through that point, a batch that should fit;
   where line and chord are far apart, their geometric mean, never more than 4× past the chord;
5. where predictions keep landing on a bound without ending the search (the line is off by
   more than one), gallops from that bound (never past the middle of the bracket) and predicts
   again from the new points; after a few such misses it bisects.

It stops only when the largest batch that fits and the smallest that fails are adjacent (or
the cap is reached), so the answer is exact whenever memory grows with the batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .trial import Trial

__all__ = ["SearchOutcome", "search_max", "predict_batch", "chord_batch", "bends_up", "fit_line", "HARD_MAX_BATCH"]

HARD_MAX_BATCH = 1 << 20  # a cap even when none is given: memory that never grows is a bug to report
_MAX_MISSES = 4            # predictions stuck against a bound this often: plain bisection from then on
_CHORD_REACH = 4           # how far past the chord (a batch that should fit) one step may reach


@dataclass(frozen=True)
class SearchOutcome:
    max_batch: int            # largest batch that fits; 0 when not even the smallest does
    limited_by: str           # "memory", or "max_batch" when the cap stopped the search
    trials: tuple[Trial, ...]


def fit_line(points: dict[int, int]) -> tuple[float, float] | None:
    """Intercept and slope (bytes per sample) of the line through two measured points.

    The anchor is the largest batch measured, the one nearest the boundary. Its partner is the
    largest batch at least a quarter of the anchor below it (else the smallest): close enough
    to follow any curvature, far enough that allocator rounding does not swamp the slope.
    """
    if len(points) < 2:
        return None
    anchor = max(points)
    spaced = [b for b in points if b <= anchor - max(1, anchor // 4)]
    partner = max(spaced) if spaced else min(points)
    slope = (points[anchor] - points[partner]) / (anchor - partner)
    if slope <= 0:
        return None
    return points[anchor] - slope * anchor, slope


def bends_up(points: dict[int, int], tolerance: float = 0.01) -> bool:
    """True when the largest point lies above the line through the two below it (by ``tolerance``).

    Then the points straddle a change of regime (gradients setting the peak at small batches,
    activations at large ones), and a line through them underestimates the slope ahead.
    """
    if len(points) < 3:
        return False
    b0, b1, b2 = sorted(points)[-3:]
    slope = (points[b1] - points[b0]) / (b1 - b0)
    return points[b2] > (points[b1] + slope * (b2 - b1)) * (1 + tolerance)


def predict_batch(
    phases: Sequence[dict[int, int]], resident: int | None, limit: int
) -> int | None:
    """The largest batch whose predicted peak stays within ``limit`` bytes, or ``None``.

    Args:
        phases: measured peaks per phase, ``{batch: bytes}``; the first is the phase that grows
            with the batch (forward and backward). Each phase's line bounds the batch; the
            tightest bound wins. A phase whose line is flat bounds nothing.
        resident: bytes that stay between steps (for the chord when no line can be drawn).
        limit: the bytes the peak may reach.
    """
    if fit_line(phases[0]) is not None:
        return min(int((limit - line[0]) // line[1]) for line in map(fit_line, phases) if line is not None)
    return chord_batch(phases[0], resident, limit)


def chord_batch(points: dict[int, int], resident: int | None, limit: int) -> int | None:
    """A batch that should fit: the chord from ``(0, resident)`` through the largest point.

    Memory that stays between steps is live at every moment of a step, so each piece of the
    peak's curve starts at or above ``resident``; such a curve stays under the chord beyond the
    point, and the chord's crossing of ``limit`` is a batch that fits even when the curve bends
    up (gradients setting the peak at small batches, activations at large ones).
    """
    if not points or resident is None:
        return None
    anchor = max(points)
    if points[anchor] <= resident:
        return None
    return int((limit - resident) * anchor // (points[anchor] - resident))


class _Search:
    def __init__(self, run: Callable[[int], Trial], capacity: int, min_batch: int, max_batch: int):
        self.run, self.capacity, self.cap = run, capacity, max_batch
        self.lo, self.hi = min_batch - 1, None  # largest known fit, smallest known failure
        self.phases: tuple[dict[int, int], dict[int, int]] = ({}, {})  # forward+backward, optimizer
        self.resident: int | None = None
        self.trials: list[Trial] = []

    @property
    def upper(self) -> int:
        return self.hi - 1 if self.hi is not None else self.cap

    @property
    def done(self) -> bool:
        return self.lo >= self.upper

    def attempt(self, batch: int) -> bool:
        trial = self.run(batch)
        self.trials.append(trial)
        if trial.fits:
            self.lo = max(self.lo, batch)
            self.phases[0][batch] = trial.forward_backward_bytes or trial.reserved_bytes
            self.phases[1][batch] = trial.optimizer_bytes or trial.reserved_bytes
            if trial.resident_bytes is not None:
                self.resident = trial.resident_bytes
        else:
            self.hi = batch if self.hi is None else min(self.hi, batch)
        return trial.fits

    def clamp(self, batch: int) -> int:
        return max(self.lo + 1, min(batch, self.upper))

    def search(self) -> SearchOutcome:
        if not self.attempt(self.lo + 1):
            return SearchOutcome(0, "memory", tuple(self.trials))
        side, stride, misses = 0, 2, 0  # side: +1 predictions stuck above lo, -1 stuck below hi
        while not self.done:
            middle = None if self.hi is None else (self.lo + self.hi) // 2
            prediction = chord = None
            if misses < _MAX_MISSES:
                prediction = predict_batch(self.phases, self.resident, self.capacity)
                chord = chord_batch(self.phases[0], self.resident, self.capacity)
                # The line overshoots where the curve bends up, or where gradients, not activations,
                # set the small batches' peaks (a flat line); the chord should fit. Far apart (or the
                # line past a failure), try their geometric mean, never more than 4× past the chord.
                if prediction is not None and chord is not None and chord > self.lo:
                    ceiling = prediction if self.hi is None else min(prediction, self.hi - 1)
                    if chord < ceiling and bends_up(self.phases[0]):
                        # The largest point sits above the line through the two before it: it is in the
                        # regime that sets the boundary, and so is the chord through it.
                        prediction = chord
                    elif chord < ceiling / 2 or (self.hi is not None and prediction >= self.hi):
                        prediction = min(int((chord * max(chord, ceiling)) ** 0.5), _CHORD_REACH * chord)
            if prediction is None:
                batch = self.clamp(2 * self.lo if middle is None else middle)
            else:
                batch = self.clamp(prediction)
                # Clamped onto a bound means the prediction points outside the bracket: the line is
                # off by more than one. Stepping by one would walk; gallop instead, never past the middle.
                if side > 0 and batch == self.lo + 1:
                    batch = self.clamp(self.lo + stride if middle is None else min(self.lo + stride, middle))
                    stride *= 2
                elif side < 0 and self.hi is not None and batch == self.hi - 1:
                    batch = self.clamp(max(self.hi - stride, middle))
                    stride *= 2
            lo, hi = self.lo, self.hi
            fits = self.attempt(batch)
            if self.done:
                break
            # A first miss sets the gallop's stride to a sixty-fourth of the bracket: allocator
            # rounding makes the boundary fuzzy by a share of the batch, not by a fixed count.
            if prediction is not None and fits and batch == lo + 1:
                if side != 1:
                    stride = max(2, ((self.hi or 2 * self.lo) - self.lo) // 64)
                side, misses = 1, misses + 1
            elif prediction is not None and not fits and hi is not None and batch == hi - 1:
                if side != -1:
                    stride = max(2, (self.hi - self.lo) // 64)
                side, misses = -1, misses + 1
        limited = "max_batch" if self.lo == self.cap and self.hi is None else "memory"
        return SearchOutcome(self.lo, limited, tuple(self.trials))


def search_max(
    run: Callable[[int], Trial],
    capacity: int,
    *,
    min_batch: int = 1,
    max_batch: int | None = None,
) -> SearchOutcome:
    """Find the largest batch ``b`` (``min_batch ≤ b ≤ max_batch``) for which ``run(b).fits``.

    Args:
        run: runs one trial; must be monotone (if ``b`` fits, every smaller batch fits).
        capacity: bytes a trial's ``reserved_bytes`` may reach; guides predictions only —
            the answer always rests on trials that fit and fail.
        min_batch: the smallest batch allowed (2 for BatchNorm models).
        max_batch: an explicit cap; the outcome says when the cap, not memory, was the limit.

    Example:
        >>> from autobatch.probing.trial import Trial
        >>> oracle = lambda b: Trial(b, 100 + 7 * b <= 1000, 100 + 7 * b, 100 + 7 * b, resident_bytes=100)
        >>> outcome = search_max(oracle, 1000)
        >>> outcome.max_batch, [t.batch for t in outcome.trials]
        (128, [1, 128, 129])
    """
    cap = HARD_MAX_BATCH if max_batch is None else max_batch
    return _Search(run, capacity, min_batch, cap).search()

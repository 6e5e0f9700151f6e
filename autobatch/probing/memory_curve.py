"""Models of a step's peak memory against the batch, drawn from the trials that fit.

The search (:mod:`autobatch.probing.search`) asks these models where the capacity is crossed; the
answer always rests on trials, the models only choose which to run. Each model is a curve
``peak(b)`` in bytes, climbing a ladder as the trials give evidence:

* one point: the **chord** from ``(0, resident)`` through it (memory that stays between steps is
  live at every moment of a step, so every piece of the curve starts at or above it);
* two points: the **line** through them;
* a point above the chord through a smaller one proves the curve bends up: the **quadratic**
  through the resident memory and the two points (the most curved the points allow, so its
  crossing is a batch that fits); three points: the quadratic through them;
* a **prior** (a predicted curve, e.g. the fake-tensor trace's) is calibrated to the points:
  shifted to the largest, and scaled by two far apart.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Container, Sequence

__all__ = [
    "Curve", "fit_line", "bends_up", "chord_batch", "predict_batch", "crossing", "ladder", "calibrate", "curvature_bound",
    "quadratic", "last_kept", "steep",
]

Curve = Callable[[int], float]  # predicted peak bytes at a batch
_CHECK = 0.005  # ladder(checked=True): how far a fourth point may lie off the quadratic through three
_CURVED = 0.05  # calibrate: the prior's slopes must differ this much to fit its scale and per-sample bytes apart


def fit_line(points: dict[int, int]) -> tuple[float, float] | None:
    """Intercept and slope (bytes per sample) of the line through two measured points.

    The anchor is the largest batch measured, the one nearest the boundary. Its partner is the
    largest batch at least a quarter of the anchor below it (else the smallest): close enough
    to follow any curvature, far enough that allocator rounding does not swamp the slope.
    """
    if len(points) < 2:
        return None
    anchor = max(points)
    partner = _partner(points)
    slope = (points[anchor] - points[partner]) / (anchor - partner)
    if slope <= 0:
        return None
    return points[anchor] - slope * anchor, slope


def _partner(points: dict[int, int] | Sequence[int], spacing: int = 4) -> int:
    """The point a slope is read against: the largest at least ``1/spacing`` of the batch below the
    largest (close points read an allocator's rounding as slope), else the smallest."""
    anchor = max(points)
    spaced = [b for b in points if b <= anchor - max(1, anchor // spacing)]
    return max(spaced) if spaced else min(points)


def bends_up(points: dict[int, int], tolerance: float = 0.01) -> bool:
    """True when the largest point lies above the line through the two below it (by ``tolerance``)."""
    if len(points) < 3:
        return False
    b0, b1, b2 = sorted(points)[-3:]
    slope = (points[b1] - points[b0]) / (b1 - b0)
    return points[b2] > (points[b1] + slope * (b2 - b1)) * (1 + tolerance)


def predict_batch(phases: Sequence[dict[int, int]], resident: int | None, limit: int) -> int | None:
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
    """Where the chord from ``(0, resident)`` through the largest point reaches ``limit``.

    A curve made of affine pieces that each start at or above ``resident`` stays under this
    chord beyond the point, so for such curves the chord's crossing is a batch that fits.
    """
    if not points or resident is None:
        return None
    anchor = max(points)
    if points[anchor] <= resident:
        return None
    return int((limit - resident) * anchor // (points[anchor] - resident))


def curvature_bound(points: dict[int, int], resident: int, limit: int, reaches: dict[int, int] | None = None) -> float:
    """A batch that fits on every curve the points allow, of the kinds memory makes.

    Those kinds: ``a + c·b + q·b²`` with ``a ≥ resident`` and ``c, q ≥ 0`` (activations,
    attention across the batch), and a max of affine pieces that each start at or above
    ``resident`` (gradients setting the small batches' peak, activations the large ones').
    For the first, the most curved such quadratic through the two largest points; for the
    second, the chord from ``resident`` through the largest. A step may not reach much past
    the smaller of the two: nothing measured rules out the curve that reaches it. ``reaches``
    (:func:`steep`): the most a piece through ``resident`` may reach at each batch; where that lies
    below the largest point, the chord and the pure square are drawn through it instead.
    """
    anchor = max(points)
    rise = points[anchor] - resident
    if rise <= 0:
        return math.inf
    rise += 1  # bytes are whole: a rise read as r bytes may be up to r + 1 (it matters where a sample is a few bytes)
    headroom = max(0.0, limit - resident)
    through = rise  # what a piece through the resident memory may reach at the anchor
    if reaches and anchor in reaches and 0 < reaches[anchor] - resident < rise:
        through = reaches[anchor] - resident + 1
    chord = anchor * headroom / through
    square = anchor * math.sqrt(headroom / through)  # resident + k·b² through the anchor: always allowed
    if len(points) < 2:
        return square
    x1 = max(b for b in points if b < anchor)
    y1, y2, x2 = points[x1] - resident, rise, anchor
    candidates = []
    q = (y2 / x2 - y1 / x1) / (x2 - x1)  # through the resident memory
    if q > 0 and y1 / x1 - q * x1 >= 0:
        candidates.append((q, 0.0, y1 / x1 - q * x1))
    q = (y2 - y1) / (x2 * x2 - x1 * x1)  # no linear term
    if q > 0 and y1 - q * x1 * x1 >= 0:
        candidates.append((q, y1 - q * x1 * x1, 0.0))
    if not candidates:
        return square
    q, a, c = max(candidates)
    reach = (-c + math.sqrt(c * c + 4 * q * max(0.0, headroom - a))) / (2 * q)
    return min(chord, max(square, reach))


def steep(points: dict[int, int], forward: dict[int, int], resident: int) -> dict[int, int]:
    """What a piece of the peak through the resident memory may reach at each batch, from the forward's end.

    At any moment of the backward it holds what the forward saved and not yet freed, the gradient of
    the running op's output and the one of its input, each at most an activation: so the peak's
    batch-dependent part is taken to grow at most three times as fast as the forward's (2.5 on the
    tests' two-layer MLP under AdamW, whose ReLU's two gradients are as large as all it saved). Where
    the peaks grew faster than that between the smallest and largest batch (a backward that
    recomputes what checkpointing dropped), by that ratio. It is a bound of the usual, not a proof:
    the search drops the forward's points read so far once a trial fails below a batch it allowed.
    ``forward``: allocated bytes at the forward's end.

    Example:
        >>> steep({1: 160, 8: 160}, {1: 101, 8: 108}, 100)  # gradients set a flat peak; 1 byte of activations a sample
        {1: 103, 8: 124}
    """
    rise = {b: f - resident for b, f in forward.items() if b in points and f > resident}
    if not rise:
        return {}
    low, high = min(rise), max(rise)
    factor = 3.0
    if high > low and rise[high] > rise[low]:
        factor = max(factor, (points[high] - points[low]) / (rise[high] - rise[low]))
    return {b: resident + math.ceil(factor * r) for b, r in rise.items()}


def last_kept(keeps: Callable[[int], bool], low: int, high: int, asks: Callable[[int], bool] = lambda b: True) -> int:
    """The largest batch in ``[low, high)`` that ``keeps``, by bisection, where ``low`` keeps (or is a floor) and
    ``high`` does not (or is a ceiling); ``keeps`` holds up to a batch and no further. ``asks(b)`` false stops before
    asking at ``b``, with the largest kept so far. Each ask may be a trial or a booking: none is asked twice, none
    outside the bounds (:func:`crossing` gallops up from one bound instead).

    Example:
        >>> last_kept(lambda b: b * b <= 50, 1, 100)
        7
    """
    while high - low > 1 and asks((low + high) // 2):
        mid = (low + high) // 2
        low, high = (mid, high) if keeps(mid) else (low, mid)
    return low


def crossing(curve: Curve, limit: float, lo: int, hi: int) -> int:
    """The largest ``b`` in ``[lo, hi]`` with ``curve(b) ≤ limit`` (``lo − 1`` if none); ``curve`` nondecreasing.

    Gallops up from ``lo`` before bisecting, so the curve is asked about batches near the answer
    only (a traced prior traces where it is asked).
    """
    if curve(lo) > limit:
        return lo - 1
    step = max(1, lo)
    while lo + step < hi and curve(lo + step) <= limit:
        lo, step = lo + step, 2 * step
    hi = min(hi, lo + step)
    if curve(hi) <= limit:
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if curve(mid) <= limit else (lo, mid)
    return lo


def quadratic(p: Sequence[tuple[float, float]]) -> tuple[float, float, float]:
    """``(a, c, q)`` of ``a + c·b + q·b²`` through three points."""
    (x0, y0), (x1, y1), (x2, y2) = p
    d01, d12 = (y1 - y0) / (x1 - x0), (y2 - y1) / (x2 - x1)
    q = (d12 - d01) / (x2 - x0)
    c = d01 - q * (x0 + x1)
    return y0 - c * x0 - q * x0 * x0, c, q


def _rising(a: float, c: float, q: float) -> Curve | None:
    """The quadratic as a nondecreasing curve (flat before its vertex), or ``None`` if it never rises."""
    if q < 0 or (q == 0 and c <= 0):
        return None
    vertex = max(0.0, -c / (2 * q)) if q > 0 else 0.0
    return lambda b: a + c * max(b, vertex) + q * max(b, vertex) ** 2


def ladder(points: dict[int, int], resident: int | None, spacing: int = 4, checked: bool = False) -> Curve | None:
    """The curve the points support (see the module docstring), or ``None`` (a flat line).

    ``spacing``: the points a slope is read over are at least ``1/spacing`` of the batch apart.
    ``checked``: a quadratic through three points must also pass a fourth below them (within
    :data:`_CHECK`), else the curve changed slope between them (a kink, gradients giving way to
    activations) and the line through the two largest is the model.
    """
    if not points:
        return None
    base = 0 if resident is None else min(resident, min(points.values()))
    anchor = max(points)
    if len(points) == 1:
        rise = points[anchor] - base
        return None if rise <= 0 else (lambda b: base + rise * b / anchor)
    partner = _partner(points, spacing)
    ya, yp = points[anchor], points[partner]
    slope = (ya - yp) / (anchor - partner)
    line = None if slope <= 0 else (lambda b: ya + slope * (b - anchor))
    if len(points) >= 3:
        below = [b for b in points if b < partner]
        third = _partner(below + [partner], spacing) if below else max(b for b in points if b not in (anchor, partner))
        curve = _rising(*quadratic(sorted((b, points[b]) for b in (third, partner, anchor))))
        lower = [b for b in points if b < third]
        if checked and curve is not None and lower:
            check = _partner(lower + [third], spacing) if len(lower) > 1 else lower[0]
            if abs(curve(check) - points[check]) > _CHECK * points[check]:
                return line
        if curve is not None:
            return curve
    if (ya - base) * partner > (yp - base) * anchor * 1.001:
        # Above the chord through the partner: the curve bends up.
        return _rising(*quadratic([(0, base), (partner, yp), (anchor, ya)]))
    return line


def calibrate(prior: Curve, totals: dict[int, int], proportional: Container[int] = (), local: bool = False) -> Curve:
    """``prior`` moved onto the measured peaks: ``α + β·prior(b) + γ·b`` through the largest ones.

    One point fixes the offset ``α``; two also the scale ``β`` (a proportional error); three
    also ``γ`` (a per-sample error the trace cannot see, such as a kernel's workspace): the
    prior then only has to have the right curvature. The largest points count: near the
    boundary is where the curve has to be right. ``local`` (a prior that failed near the boundary,
    so it misses a kink there): its error per sample is read over the last 1/64 of the batch, not 1/8
    (over a quarter, a prior that misses a kink or a workspace from some batch on reads its slope across the switch).
    """
    top = sorted(totals)[-3:]
    ys = [totals[b] for b in top]
    ps = [prior(b) for b in top]
    # Three points close together read allocator rounding as curvature: only when spread.
    if len(top) == 3 and top[1] - top[0] >= top[2] // 64 and top[2] - top[1] >= top[2] // 64:
        # Solve the 3×3 system by elimination on differences.
        d1 = ((ys[1] - ys[0]), (ps[1] - ps[0]), (top[1] - top[0]))
        d2 = ((ys[2] - ys[1]), (ps[2] - ps[1]), (top[2] - top[1]))
        det = d1[1] * d2[2] - d2[1] * d1[2]
        # Where the prior is nearly straight over the points, scale and per-sample bytes cannot be
        # told apart: its slopes over the two spans must differ by a twentieth.
        slopes = (d1[1] / d1[2], d2[1] / d2[2])
        # (A prior flat over all three has no slope to tell anything by.)
        if max(map(abs, slopes)) > 0 and abs(slopes[1] - slopes[0]) >= _CURVED * max(map(abs, slopes)):
            beta = (d1[0] * d2[2] - d2[0] * d1[2]) / det
            gamma = (d1[1] * d2[0] - d2[1] * d1[0]) / det
            if 0.25 <= beta <= 4:
                alpha = ys[2] - beta * ps[2] - gamma * top[2]
                return lambda b: alpha + beta * prior(b) + gamma * b
    anchor = max(totals)
    scale = per_sample = 0.0
    if len(totals) >= 2:
        # Local: the prior has failed near the boundary, so its slope far below it is not the slope
        # there (a kink it misses): read its error per sample over the last 1/64 of the batch, not 1/8.
        partner = _partner(totals, 64 if local else 8)
        if partner in proportional:
            spread = prior(anchor) - prior(partner)
            if spread > 0:
                scale = min(2.0, max(0.5, (totals[anchor] - totals[partner]) / spread)) - 1
        else:
            miss = (totals[anchor] - prior(anchor)) - (totals[partner] - prior(partner))
            per_sample = miss / (anchor - partner)
    offset = totals[anchor] - (1 + scale) * prior(anchor) - per_sample * anchor
    return lambda b: offset + (1 + scale) * prior(b) + per_sample * b

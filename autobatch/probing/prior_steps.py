"""What a prior's shape near the boundary tells the search: where it steps, and how much it jitters.

A prior booked as the caching allocator books it (:mod:`autobatch.estimating.replay`) is flat for
tens to thousands of batches, then jumps by a segment: the device crosses the capacity at one of
those jumps (:func:`step_below`). One whose booking is off by a block at some batches falls as the
batch grows: it jitters, and within a bracket a few times its jitter it cannot place the boundary
(:func:`blur`). :mod:`~autobatch.probing.search` asks both; each reads only the prior.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["step_below", "blur"]

Prior = Callable[[int], float]


def step_below(prior: Prior | None, batch: int, lo: int) -> int | None:
    """The batch below the prior's last step at or under ``batch`` (above ``lo``, the largest fit), or
    ``None`` where the prior does not stay flat for two batches there (a smooth prior, or no prior).

    Example:
        >>> stairs = lambda b: (b // 10) * 10.0   # steps at 10, 20, 30, ...
        >>> step_below(stairs, 27, lo=5), step_below(stairs, 27, lo=22), step_below(lambda b: 2.0 * b, 27, lo=5)
        (19, None, None)
    """
    if prior is None or batch - 1 <= lo:
        return None
    top = prior(batch)
    if prior(batch - 1) != top:
        # The prior steps at this very batch: the batch below, if the prior is flat under it.
        flat = batch - 2 > lo and prior(batch - 2) == prior(batch - 1)
        return batch - 1 if flat else None
    low, step = batch - 1, 1  # prior(low) == top; gallop down to a batch below the step
    while low - step > lo and prior(low - step) == top:
        low, step = low - step, 2 * step
    floor = max(lo, low - step)
    if prior(floor) == top:
        return None  # flat down to the largest fit: no step of the prior to try below
    while low - floor > 1:
        mid = (low + floor) // 2
        low, floor = (mid, floor) if prior(mid) == top else (low, mid)
    return low - 1 if low - 1 > lo else None


def blur(prior: Prior | None, lo: int, hi: int | None) -> float:
    """How many batches the prior is unsure by in the bracket (``lo`` fits, ``hi`` fails): where it
    falls as the batch grows, its largest fall over its slope; 0 where it does not fall from a
    batch to the next at either end of the bracket or in its middle (each value of a booked prior
    is a replay: six values, mostly ones the search already asked).

    Example:
        >>> jitter = lambda b: 100.0 * b + 250.0 * (b % 2)   # 250 bytes over at odd batches, 100 a sample
        >>> blur(jitter, 1000, 1100), blur(lambda b: 100.0 * b, 1000, 1100)   # falls 150 bytes from 1099 to 1100
        (1.5, 0.0)
    """
    if prior is None or hi is None or hi - lo < 2:
        return 0.0
    span, mid = hi - lo, (lo + hi) // 2
    fall = max(max(0.0, prior(b) - prior(b + 1)) for b in {lo, mid, hi - 1})
    if fall == 0:
        return 0.0
    slope = (prior(hi) - prior(lo)) / span
    return fall / slope if slope > 0 else float(span)

"""Probe several sequence lengths at once: each exact, later ones guided by the earlier ones.

The first length is searched as a single probe is (:func:`~autobatch.probing.search.search_max`).
After it, the trials so far fit ``peak(b, s) = m0 + b·(c1·s + c2·s²)``
(:mod:`~autobatch.probing.lengthfit`), which predicts the next length's boundary. A guided
search tries the predicted batch, and after each trial that fits predicts again from the
measured peak with the fitted slope (so an error in ``m0`` or in the slope costs one more trial,
not a new search); while only failures are known it steps down from the smallest by growing
strides. It stops, as the single search does, only when the largest batch that fits and the
smallest that fails are adjacent (or the cap is reached): every row is exact. Should the model
be far off, after a few guided trials what is left of the bracket is halved (or, while nothing
has failed, searched upwards by ``search_max``).

Lengths are searched longest first: with one length known the fit has no quadratic term and
over-states the memory of shorter lengths, so the first guesses fit rather than fail (a failed
trial costs more on a GPU than one that fits), and the length most plans use is measured first.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from .lengthfit import LengthFit, fit_lengths
from .probe import MemorySummary, summarise
from .search import HARD_MAX_BATCH, SearchOutcome, search_max
from .trial import Trial

__all__ = ["LengthSearch", "search_lengths", "guided_search", "summarise_length", "GUIDED_TRIALS"]

GUIDED_TRIALS = 10  # guided trials at one length before what is left is halved (or searched upwards)
_STRIDE_GROWTH = 4  # while only failures are known, each step down is this many times the last
_SHRINK = 1 / 16    # after the line through a fit overshot: first step back this share of the bracket
_SPACING = 0.025    # two fits this far apart (share of the larger, and at least _MIN_GAP) give a slope
_MIN_GAP = 4        # of their own: closer, allocator rounding would swamp it


@dataclass(frozen=True)
class LengthSearch:
    """One length's search: its outcome, and what the fit predicted before any trial there."""

    seq_len: int
    outcome: SearchOutcome
    predicted: int | None   # None for a length searched without a fit (the first one)


def _peak(trial: Trial) -> int:
    """The figure the fit follows: the phase that grows with the batch."""
    return trial.forward_backward_bytes or trial.reserved_bytes


def _slope(points: Mapping[int, int], model: LengthFit, seq_len: int) -> float:
    """Bytes per sample at this length, through its largest fit.

    From two of its own fits far enough apart when there are; else the chord from the fit's
    fixed memory through the largest (it follows this length's own curve where the shared
    ``c1``, ``c2`` do not quite); never below the fit's own slope.
    """
    anchor = max(points)
    spaced = [b for b in points if b <= anchor - max(_MIN_GAP, anchor * _SPACING)]
    if spaced:
        partner = max(spaced)
        slope = (points[anchor] - points[partner]) / (anchor - partner)
        if slope > 0:
            return slope
    chord = (points[anchor] - model.fixed_bytes) / anchor
    return max(chord, model.per_sample_bytes(seq_len))


def points_of(trials: Sequence[Trial]) -> dict[int, int]:
    """``{batch: peak}`` of the trials that fit."""
    return {t.batch: _peak(t) for t in trials if t.fits}


def guided_search(
    run: Callable[[int], Trial],
    capacity: int,
    *,
    seq_len: int,
    fit: Callable[[Mapping[int, int]], LengthFit | None],
    min_batch: int = 1,
    max_batch: int | None = None,
    error: float = 1 / 64,
) -> tuple[SearchOutcome, int | None]:
    """The exact largest batch at ``seq_len``, starting from the fit's prediction.

    Args:
        run: one trial at this length; monotone (if ``b`` fits, every smaller batch fits).
        capacity: bytes a trial may reach.
        fit: ``fit(points)``: the fit of every earlier trial plus this length's ``{batch: peak}``.
        min_batch, max_batch: as for :func:`~autobatch.probing.search.search_max`.
        error: the fit's relative error so far; after a first failure the next guess is that
            share of the batch lower (and the step grows while failures go on).

    Returns the outcome and the first prediction (``None`` when ``fit`` had none to give).
    """
    cap = HARD_MAX_BATCH if max_batch is None else max_batch
    lo, hi = min_batch - 1, None
    trials: list[Trial] = []
    points: dict[int, int] = {}
    stride, shrink, climb, first = None, _SHRINK, 2, None

    def upper() -> int:
        return cap if hi is None else hi - 1

    while lo < upper() and len(trials) < GUIDED_TRIALS and (model := fit(points)) is not None:
        if points:  # from the largest fit, so an error in m0 drops out
            anchor = max(points)
            guess = anchor + int((capacity - points[anchor]) // _slope(points, model, seq_len))
            if guess <= lo and trials and trials[-1].fits and trials[-1].batch == lo and lo - 1 in points:
                # Two adjacent fits, and the line still says the next fails: it is off (or the
                # peak is a staircase). Climb by doubling steps instead of one at a time.
                guess, climb = lo + climb, climb * 2
            elif hi is not None and guess >= hi and not trials[-1].fits:
                # The line through the anchor overshot and would again: step into the bracket from
                # the failure, by a growing share of it, until a fit near the boundary re-anchors.
                guess, shrink = hi - max(1, int((hi - lo) * shrink)), shrink * _STRIDE_GROWTH
        elif hi is None:
            guess = model.max_batch(seq_len, capacity)
        else:  # only failures so far: step down by the error the fit has shown, growing
            stride = max(1, int(hi * error)) if stride is None else stride * _STRIDE_GROWTH
            guess = hi - stride
        first = guess if first is None else first
        batch = max(lo + 1, min(guess, upper()))
        trial = run(batch)
        trials.append(trial)
        if trial.fits:
            lo, points[batch] = batch, _peak(trial)
        else:
            hi = batch
    while hi is not None and lo < hi - 1:  # the fit was too far off: halve what is left
        batch = (lo + hi) // 2
        trial = run(batch)
        trials.append(trial)
        lo, hi = (batch, hi) if trial.fits else (lo, batch)
    if lo < upper():  # memory kept fitting beyond every guess: search upwards as a single probe does
        rest = search_max(run, capacity, min_batch=lo + 1, max_batch=upper())
        trials += rest.trials
        lo = max(lo, rest.max_batch)
    limited = "max_batch" if lo == cap and hi is None else "memory"
    return SearchOutcome(lo if lo >= min_batch else 0, limited, tuple(trials)), first


def search_lengths(
    run_at: Callable[[int, int], Trial],
    seq_lens: Sequence[int],
    capacity: int,
    *,
    min_batch: int = 1,
    max_batch: int | None = None,
) -> tuple[list[LengthSearch], LengthFit | None]:
    """Search every length, longest first; the rows come back in the order of ``seq_lens``.

    Args:
        run_at: ``run_at(batch, seq_len)`` runs one trial.
        seq_lens: distinct positive lengths.
        capacity: bytes a trial may reach.
        min_batch, max_batch: as for :func:`~autobatch.probing.search.search_max`.

    Returns the rows and the fit of every trial that fit (``None`` when no fit is possible).

    Example:
        >>> from .trial import Trial
        >>> def run_at(b, s):
        ...     peak = 1000 + b * (10 * s + s * s // 8)
        ...     return Trial(b, peak <= 100_000, peak, peak, resident_bytes=1000)
        >>> rows, fit = search_lengths(run_at, [32, 64, 128], 100_000)
        >>> [(r.seq_len, r.outcome.max_batch, len(r.outcome.trials)) for r in rows]
        [(32, 220, 2), (64, 85, 3), (128, 29, 4)]
    """
    measured: dict[int, dict[int, int]] = {}
    rows: dict[int, LengthSearch] = {}
    error = 1 / 64  # until a prediction has been checked: a sixty-fourth of the batch
    for s in sorted(seq_lens, reverse=True) if len(seq_lens) > 1 else seq_lens:
        def run(b: int, s: int = s) -> Trial:
            return run_at(b, s)

        def fit(points: Mapping[int, int], s: int = s) -> LengthFit | None:
            return fit_lengths({**measured, s: dict(points)})

        if fit({}) is None:
            outcome, predicted = search_max(run, capacity, min_batch=min_batch, max_batch=max_batch), None
        else:
            outcome, predicted = guided_search(run, capacity, seq_len=s, fit=fit, min_batch=min_batch,
                                               max_batch=max_batch, error=error)
            if predicted and outcome.max_batch and outcome.limited_by == "memory":
                error = max(1 / 256, abs(predicted - outcome.max_batch) / outcome.max_batch)
        measured[s] = points_of(outcome.trials)
        rows[s] = LengthSearch(s, outcome, predicted)
    return [rows[s] for s in seq_lens], fit_lengths(measured)


def summarise_length(trials: Sequence[Trial], max_batch: int, limit: int, fit: LengthFit | None,
                     seq_len: int) -> MemorySummary:
    """The safe batch at one length: :func:`~autobatch.probing.probe.summarise` where the trials
    there span enough batches to draw a line, else the fitted slope through the largest that fit.

    A guided row often holds one or two adjacent trials that fit; a slope from those is
    allocator noise, while the fit's slope rests on every length.
    """
    fits = {t.batch: t for t in trials if t.fits}
    if fit is None or not fits or min(fits) <= 0.75 * max(fits):
        return summarise(trials, max_batch, limit)
    slope = fit.per_sample_bytes(seq_len)
    anchor = max(fits)
    grows = _peak(fits[anchor])
    flat = max(t.optimizer_bytes for t in fits.values())  # the phase that hardly grows with the batch
    floor_ = max((b for b, t in fits.items() if t.reserved_bytes <= limit), default=0)
    ceiling = min((b for b, t in fits.items() if t.reserved_bytes > limit), default=max_batch + 1) - 1
    predicted = 0 if flat > limit else anchor + int((limit - grows) // slope)
    safe = min(max(floor_, min(ceiling, predicted)), max_batch)
    if safe in fits:
        peak, measured = fits[safe].reserved_bytes, True
    elif safe < 1:
        peak, measured = None, False
    else:
        peak, measured = int(max(grows - (anchor - safe) * slope, flat)), False
    return MemorySummary(safe, peak, measured, slope, grows - anchor * slope)

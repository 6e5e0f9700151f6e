"""The prior read off one symbolic trace: every batch from a single traced step, where torch can trace it so.

:func:`~autobatch.estimating.prior.trace_prior` traces the step at four batches (2, 4, 16 and the
one that checks the fit, 64) and replays the requests it fits through them. The symbolic trace
(:func:`~autobatch.estimating.estimate.trace_batches`) traces it once with the batch a symbol, every
size a polynomial in it, at about the cost of one or two of those traces (ViT-B/16: 3.3 s against
7.7 s for the four). :func:`curve_prior` traces so first and reads the prior off the curve, booked
as the per-batch prior books it (tensor bytes, or the caching allocator's reserved peak); the
per-batch traces run only where the curve does not answer every batch they would trace (the step
branches on the batch, a size is no polynomial in it, or torch pins the batch to the symbol's hint,
as ``len()`` of a batch-sized tensor does: a contrastive loss's ``arange(len(logits))``), and then
the symbolic trace stops at the first guard that leaves one of them out
(:class:`~autobatch.estimating.symbolic.BatchGuarded`).
``tests/test_trace_prior.py`` checks that both priors give the same bytes at every batch.

Example:
    >>> import torch, autobatch
    >>> from autobatch.estimating.prior import trace_prior
    >>> model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    >>> work = autobatch.Workload(model, lambda b: (torch.randn(b, 32), torch.randint(0, 4, (b,))))
    >>> prior = trace_prior(work)
    >>> prior(256) > prior(16) >= prior(1) > 0, prior.once, sorted(prior.traced)  # one trace, no batch traced alone
    (True, True, [])
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .replay import _UNLIMITED, book, check_allocator
from .symbolic import BatchCurve

__all__ = ["curve_prior"]


def curve_prior(curve_of: Callable[[Callable[[str], None]], BatchCurve | None], per_batch: Callable[[int], float],
                grid: list[int], *, allocator: str = "exact") -> Callable[[int], float]:
    """The prior read off ``curve_of(why)`` (traced on the first call; ``why`` is told the reason where it is
    ``None``), or ``per_batch``'s where that curve is ``None`` or does not answer each batch of ``grid`` (the
    batches ``per_batch`` traces).

    A batch below the curve's smallest (1, where size one broadcasts and torch guards it out) is read
    off its polynomials, as the per-batch prior reads the sizes it fitted from 2 up at 1. ``once`` is
    whether the curve leads (the report's ``traced_once``); ``by_batch``, whether it was traced and did not
    answer, so that every batch is traced at its size, and ``not_once`` why, where ``curve_of`` told one
    (:func:`~.estimate.trace_batches`); ``traced`` and ``first`` are ``per_batch``'s.
    """
    check_allocator(allocator)
    read: dict[str, Any] = {}

    def prior(batch: int) -> float:
        if "curve" not in read:
            why: list[str] = []
            curve = curve_of(why.append)
            read["curve"] = curve if curve is not None and all(curve.answers(b) for b in grid) else None
            prior.once = read["curve"] is not None  # type: ignore[attr-defined]
            prior.by_batch = not prior.once  # type: ignore[attr-defined]
            prior.not_once = why[0] if why and not prior.once else None  # type: ignore[attr-defined]
        curve: BatchCurve | None = read["curve"]
        batch = max(getattr(per_batch, "first", 1), batch)
        if curve is None or not curve.answers(max(batch, curve.smallest)):
            return per_batch(batch)
        if allocator == "exact":
            return float(curve.trial(batch).peak_bytes)
        return float(book(curve.requests(batch), _UNLIMITED).peak_reserved)

    prior.once = prior.by_batch = False  # type: ignore[attr-defined]
    prior.not_once = None  # type: ignore[attr-defined]
    prior.traced = getattr(per_batch, "traced", {})  # type: ignore[attr-defined]
    prior.first = getattr(per_batch, "first", 1)  # type: ignore[attr-defined]
    return prior

"""The fake-tensor trace as a prior for the search: the whole memory curve, predicted on the CPU.

A real trial costs seconds to minutes and can run out of memory; a traced one costs the same
small time at any batch and touches no device. :func:`trace_prior` traces the workload's
training step (the estimate's :func:`~autobatch.estimating.estimate.trace_trial`) at 2 (or the
smallest batch, if larger) and at 4, 16 and 64, recording each request to the allocator, fits every request's size
as a polynomial in the batch and replays the step at any batch (:mod:`~autobatch.estimating.replay`),
booked as the device books it: through the caching-allocator model for a GPU, so the prior has
the staircase the device's 2 MiB segments make, batch by batch. Where the traces differ in
shape it joins each phase's peaks (forward and backward; the optimizer step) by straight lines,
the prior being the larger of the two. The search (:func:`~autobatch.probing.search.search_max`)
calibrates this curve against the real trials (offset, scale, per-sample bytes), so what the
trace cannot see — the CUDA context, a kernel's workspace — costs at most a trial, not a wrong
answer: the answer still rests on real trials only.

:func:`try_trace_prior` is the same for ``find``'s default: a model the trace cannot follow
(weights read from disk, data-dependent shapes, a custom op without a fake kernel) gives no
prior, or a prior that answers NaN from its first failed trace on, and the search then goes on
from its trials alone.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

import torch

from ..modelinfo import min_batch_for
from ..probing.trial import Trial
from ..probing.workload import Workload
from .curve_prior import curve_prior
from .estimate import trace_batches, trace_trial, training_copy
from .fake_backends import _mode_of, _new_fake_mode
from .replay import AllocationLog, SizeLaws, check_allocator, fit_log
from .symbolic import BatchCurve

__all__ = ["trace_prior", "try_trace_prior", "replayed_prior", "guarded_prior", "GuardedPrior", "phase_peaks",
           "WARM_TRACES", "NOT_READY", "left_at_pace", "beside_report", "traced_nothing"]

_GRID = 4  # traced batches: the smallest, then 4, 16, …
_FIT = 4    # traces the size laws are fitted through (three) and checked against (one, once the search goes past them)
WARM_TRACES = _FIT  # the traces a prior makes before it leads (warm_batches asks for them)
NOT_READY = "the trials ended the search before the trace beside them was ready"
log = logging.getLogger("autobatch.estimating.prior")


def trace_prior(workload: Workload, *, min_batch: int | None = None, allocator: str = "exact",
                device_type: str = "cuda") -> Callable[[int], float]:
    """The traced peak (bytes) at any batch, for ``search_max(..., prior=...)`` or ``probe(..., prior=...)``.

    The fake copy of the model is made now, while the model is where its owner left it (a probe
    that has lent it to a GPU would otherwise copy GPU tensors). The first call traces
    batch 2 (or the smallest, if larger) and the next two powers of four (a third checks the fit
    once the search asks past them), recording every request to the allocator
    (:mod:`~autobatch.estimating.replay`); from then on the step replays at any batch, booked as
    ``allocator`` books it (``"caching"``: the CUDA caching allocator's rounding and segments, a
    staircase; ``"exact"``: tensor bytes). Where the traces differ in shape the prior joins the
    traced peaks by straight lines instead, tracing a further power of four as the search asks.
    The user's model is not touched and the random number generator's state is restored after
    the copy and each trace.

    Args:
        workload: what to train.
        min_batch: the smallest batch traced (and the prior's value below it); default 2 for
            models with BatchNorm (which cannot train on one sample), else 1.
        allocator: ``"caching"`` for a CUDA device (or a simulated one with its allocator model),
            ``"exact"`` for the simulated budget's exact bytes.
        device_type: where the trials run, whose autocast casts the trace follows (``"cuda"``:
            a GPU's, ``"cpu"``: a simulated budget's).

    Example:
        >>> import torch, autobatch
        >>> model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
        >>> work = autobatch.Workload(model, lambda b: (torch.randn(b, 32), torch.randint(0, 4, (b,))))
        >>> prior = trace_prior(work)
        >>> prior(256) > prior(16) >= prior(1) > 0
        True
        >>> trace_prior(work, allocator="caching")(256) % 512  # whole blocks
        0.0
    """
    check_allocator(allocator)  # before the model is copied
    mode = _mode_of(workload.model) or _new_fake_mode()
    with torch.random.fork_rng(devices=[]):  # a factory built in the fake mode may still draw
        model = training_copy(workload, mode)
    first = min_batch if min_batch is not None else min_batch_for(model)

    def trace(batch: int, record: AllocationLog) -> tuple[float, float]:
        with torch.random.fork_rng(devices=[]):
            return phase_peaks(trace_trial(workload, model, batch, fake_mode=mode, log=record,
                                           cuda_autocast=device_type == "cuda", primed=allocator == "exact"))

    def curve(why: Callable[[str], None]) -> BatchCurve | None:
        with torch.random.fork_rng(devices=[]):
            return trace_batches(workload, model, fake_mode=mode, cuda_autocast=device_type == "cuda",
                                 primed=allocator == "exact", needs=tuple(grid), why=why)

    grid = _grid(first)[:_FIT]  # the batches the per-batch prior traces: the curve must answer each
    per_batch = replayed_prior(trace, first, allocator=allocator, name=workload.name)
    return curve_prior(curve, per_batch, grid, allocator=allocator)


def phase_peaks(trial: Trial) -> tuple[float, float]:
    """A traced trial's peaks, forward and backward then the optimizer step, as a prior's trace returns them."""
    return (float(trial.forward_backward_bytes or trial.reserved_bytes),
            float(trial.optimizer_bytes or trial.reserved_bytes))


def _grid(first: int) -> list[int]:
    # A batch of one often takes other paths (a dimension of one is squeezed, a copy skipped):
    # fit from two up, and read the replay at one.
    grid = [max(first, 2)]
    while len(grid) < _FIT + 1:
        grid.append(next(g for g in (_GRID ** k for k in range(1, 64)) if g > grid[-1]))
    return grid


def warm_batches(first: int) -> tuple[int, int]:
    """Two batches whose prior values make every trace the prior needs: the laws' (asked at
    ``first``) and the one that checks them (asked past the last batch they were fitted at).

    Example:
        >>> warm_batches(1)
        (1, 17)
    """
    return first, _grid(first)[_FIT - 2] + 1


def replayed_prior(trace: Callable[[int, AllocationLog], tuple[float, float]], first: int, *,
                   allocator: str = "exact", name: str = "the model") -> Callable[[int], float]:
    """The prior from any traced step: ``trace(batch, log)`` runs it at ``batch``, recording its
    requests in ``log``, and returns its two phases' peaks (forward and backward; the optimizer
    step). :func:`trace_prior` passes a plain step; a sharded probe passes its wrapped one.

    Traces run on the first call (``first``, or 2 if it is one, and the next two powers of four; one
    more checks the fit once a batch past them is asked), then the log replays at any batch; where
    the traces differ in shape, the phases' peaks are joined by lines.
    """
    check_allocator(allocator)
    grid = _grid(first)
    peaks: dict[int, tuple[float, float]] = {}
    logs: dict[int, AllocationLog] = {}
    replayed: dict[int, float] = {}
    fitted: dict[str, Any] = {}  # the laws (or None), the largest batch they were fitted at, the batch that checks them

    def traced(batch: int) -> tuple[float, float]:
        if batch not in peaks:
            logs[batch] = AllocationLog()
            peaks[batch] = trace(batch, logs[batch])
        return peaks[batch]

    def laws(batch: int) -> SizeLaws | None:
        if not fitted:
            for start in (0, 1):  # the smallest batch may still take other paths: then from the next
                through = grid[start:start + _FIT - 1]
                for b in through:
                    traced(b)
                found = fit_log({b: logs[b] for b in through})
                if found is not None:
                    break
            else:
                log.debug("the traces of %s differ in shape between batches; the prior joins them by lines", name)
            fitted.update(laws=found, beyond=through[-1], check=grid[start + _FIT - 1])
        laws, check = fitted["laws"], fitted["check"]
        if laws is not None and check is not None and batch > fitted["beyond"]:
            # Past the traced batches: one more trace checks the laws, byte for byte, before they extrapolate.
            traced(check)
            if laws.shape != tuple(logs[check].shape()) or laws.sizes(check) != logs[check].sizes():
                log.debug("the traces of %s differ in shape or in sizes no polynomial follows; the prior joins them "
                          "by lines", name)
                fitted["laws"] = None
                replayed.clear()
            fitted["check"] = None
        return fitted["laws"]

    def prior(batch: int) -> float:
        batch = max(first, batch)
        replay = laws(batch)
        if replay is not None:
            if batch not in replayed:
                replayed[batch] = float(replay.peak(batch, allocator))
            return replayed[batch]
        low, high = first, _GRID
        while high <= first:
            high *= _GRID
        while high <= batch:
            low, high = high, high * _GRID
        if low == batch:
            return max(traced(batch))
        # Each phase joined by a line, then the larger: the optimizer's flat peak and the
        # activations' slope each interpolate well, their maximum (a corner) does not.
        t = (batch - low) / (high - low)
        return max(y0 + (y1 - y0) * t for y0, y1 in zip(traced(low), traced(high)))

    prior.traced = peaks  # type: ignore[attr-defined]  # the batches traced so far, for GuardedPrior.report
    prior.first = first  # type: ignore[attr-defined]  # the smallest batch, for warm_batches
    return prior


def try_trace_prior(workload: Workload, *, min_batch: int | None = None,
                    allocator: str = "exact", device_type: str = "cuda") -> GuardedPrior | None:
    """:func:`trace_prior`, or a prior that says why not where the model cannot be copied onto fake tensors.

    A trace that fails later (at some batch) makes the prior answer NaN from then on, which
    the search takes as "no prior" and goes on from its trials alone. Either failure is one
    debug line on the ``autobatch.estimating.prior`` logger, never an error: the prior only
    saves trials.

    Example:
        >>> import math, torch, autobatch
        >>> work = autobatch.Workload(torch.nn.Linear(8, 2), lambda b: 1 / 0)  # a batch the trace cannot build
        >>> prior = try_trace_prior(work)
        >>> math.isnan(prior(4))
        True
    """
    start = time.perf_counter()
    try:
        prior = trace_prior(workload, min_batch=min_batch, allocator=allocator, device_type=device_type)
    except Exception as exc:  # any failure only costs the prior: the trials still answer, and say why
        log.debug("no trace prior for %s (%s: %s); the search uses its trials alone",
                  workload.name, type(exc).__name__, exc)
        return GuardedPrior.failed(workload.name, exc, time.perf_counter() - start)
    return guarded_prior(prior, workload.name)


def failure_text(exc: BaseException) -> str:
    """``RuntimeError: the first line of its message`` (at most 160 characters): why a trace stopped."""
    said = str(exc).splitlines()[0][:160] if str(exc) else ""
    return f"{type(exc).__name__}: {said}" if said else type(exc).__name__


def guarded_prior(prior: Callable[[int], float], name: str) -> GuardedPrior:
    """``prior`` answering NaN from its first failed trace on, with one debug line, never an error."""
    return GuardedPrior(prior, name)


class GuardedPrior:
    """A traced prior that answers NaN from its first failed trace on, and keeps what it cost.

    :meth:`report` is what a probe records of it (``extra["trace_prior"]``, printed under the
    trials): the batches traced, the seconds spent tracing and replaying, and the failure, if
    the trace could not follow the model.
    """

    def __init__(self, prior: Callable[[int], float], name: str):
        self._prior, self.name = prior, name
        self.seconds = 0.0
        self.failure: str | None = None
        self.first: int = getattr(prior, "first", 1)  # the smallest batch it traces

    def __call__(self, batch: int) -> float:
        if self.failure is not None:
            return math.nan
        start = time.perf_counter()
        try:
            return self._prior(batch)
        except Exception as exc:
            self.failure = failure_text(exc)
            log.debug("the trace of %s failed at batch %d (%s: %s); the search goes on from its trials alone",
                      self.name, batch, type(exc).__name__, exc)
            return math.nan
        finally:
            self.seconds += time.perf_counter() - start

    @classmethod
    def failed(cls, name: str, exc: BaseException, seconds: float = 0.0) -> GuardedPrior:
        """A prior whose trace could not even start (the model does not copy onto fake tensors): it
        answers NaN, and its report says why, so a probe says the trace could not lead."""
        prior = cls(lambda batch: math.nan, name)
        prior.failure, prior.seconds = failure_text(exc), seconds
        return prior

    @property
    def traced_batches(self) -> list[int]:
        """The batches traced each at its own size so far."""
        return sorted(getattr(self._prior, "traced", {}))

    @property
    def by_batch(self) -> bool:
        """Whether the one trace for every batch did not answer, and each batch is traced at its size."""
        return bool(getattr(self._prior, "by_batch", False))

    @property
    def traced_once(self) -> bool:
        """Whether one trace with the batch a symbol answers every batch (:mod:`.curve_prior`)."""
        return bool(getattr(self._prior, "once", False))

    def report(self) -> dict[str, Any] | None:
        """``{"traced_batches", "traced_once", "seconds", "failure"}``, and ``not_traced_once`` where the one trace
        for every batch stopped (why, and where), or ``None`` when the search never asked."""
        traced, once = self.traced_batches, self.traced_once
        if not traced and not once and self.failure is None:
            return None
        why = getattr(self._prior, "not_once", None)
        return {"traced_batches": traced, "traced_once": once, "seconds": round(self.seconds, 3),
                "failure": self.failure, **({"not_traced_once": why} if why else {})}


def traced_nothing(seconds: float = 0.0) -> dict[str, Any]:
    """The report of a trace that has traced nothing yet, with the keys :meth:`GuardedPrior.report` has."""
    return {"traced_batches": [], "traced_once": False, "seconds": seconds, "failure": None}


def left_at_pace(spent: float, traced: int, by_batch: bool = False) -> float | None:
    """The seconds a trace beside the trials still needs at its pace so far (``spent`` seconds for
    ``traced`` batches, its first, slowest, counted in); before one batch is traced, ``None``, or where
    its one trace for every batch did not answer (``by_batch``), :data:`WARM_TRACES` traces each as long
    as that one took (``spent``).

    The symbolic trace stops at the guard that pins the batch, most often in the loss (``len()`` of the
    logits, an ``.item()``), its forward traced with symbols; a trace at one batch runs the whole step
    without them, in about that time: CLIP ViT-B/32 on the CPU, 4.2 s to its pin in the contrastive
    loss, then 4.4 s a batch. A pin earlier in the step is weighed low, and again at the first traced
    batch; one at the step's end up to 1.7 times high (ViT-B/16's whole symbolic step, 3.9 s, against
    2.2 s a batch).

    Example:
        >>> left_at_pace(4.6, 0) is None, left_at_pace(4.6, 0, by_batch=True), left_at_pace(9.0, 1)
        (True, 18.4, 27.0)
    """
    if traced:
        return spent / traced * max(0, WARM_TRACES - traced)
    return spent * WARM_TRACES if by_batch else None


def beside_report(said: dict[str, Any], from_trial: int | None, asked: bool) -> dict[str, Any]:
    """A trace beside the trials' report: what it ``said`` of its traces and ``from_trial``; one that
    neither led nor was asked outright, and did not fail, says the trials ended first (a failed one is
    said by :func:`~autobatch.probing.result.trace_record`, as for any prior)."""
    if said["failure"] is None and from_trial is None and not asked:
        return {"led": False, "reason": NOT_READY, "from_trial": None, **said}
    return {"from_trial": from_trial, **said}

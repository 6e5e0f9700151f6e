"""Probe a workload on a device: the exact largest batch, a safe batch, and every trial."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..errors import AutobatchError, MinimumBatchError, NoBatchFitsError, assigned
from ..modelinfo import batchnorm_record, min_batch_for, require_materialized
from ..units import format_bytes, parse_bytes
from .backends import CudaBackend, MemoryBackend, SimulatedBackend
from .oom import is_oom_error
from .heap import frozen_heap
from .memory_curve import last_kept
from .preserve import borrowed_model, kept_rng
from .result import ProbeResult, not_led, trace_record
from .pending import stopped
from .search import NoTrace, SearchOutcome, fit_line, predict_batch, search_max
from .trial import Trial, run_trial
from .workload import Workload

__all__ = ["probe", "result_from_search", "make_backend", "resolve_headroom", "summarise", "MemorySummary", "phase_points", "DEFAULT_HEADROOM", "NOTHING_FITS_FIX",
           "weights_error", "for_data_parallel", "training_trial", "prior_report", "NO_PRIOR"]

DEFAULT_HEADROOM = 0.05  # of the device's capacity, kept free for fragmentation and other tenants
_BATCHNORM_MESSAGE = "Expected more than 1 value per channel when training"


def make_backend(device: str | torch.device | None = None, memory: int | str | None = None,
                 allocator: str = "exact") -> MemoryBackend:
    """The backend for a device name: ``"cuda"``/``"cuda:1"`` real, ``"cpu"`` with a simulated ``memory``.

    ``allocator`` is the simulated backend's (``"exact"`` bytes, or ``"caching"``: a model of
    the CUDA caching allocator); a real GPU has its own.
    """
    name = str(device) if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda"):
        if memory is not None:
            raise AutobatchError(
                f"memory={memory!r} simulates a budget on the CPU and cannot limit a real GPU; "
                "drop --memory, or probe on --device cpu"
            )
        return CudaBackend(name)
    if name == "cpu":
        if memory is None:
            raise AutobatchError(
                "probing on the CPU needs a simulated memory budget, but none was given; "
                f"pass {assigned('memory', '8GiB')} with {assigned('device', 'cpu')}"
            )
        return SimulatedBackend(memory, allocator=allocator)
    raise AutobatchError(f"device must be 'cuda', 'cuda:N' or 'cpu', but got {name!r}")


def for_data_parallel(result: ProbeResult, data_parallel: int) -> ProbeResult:
    """The probe's answer for training on ``data_parallel`` ranks under DDP.

    DDP keeps a flat copy of every gradient in its buckets (as many bytes as the gradients), so
    a probe of one bare device overstates what fits on each of several ranks. When the plan has
    more than one data-parallel rank and the probe did not run under DDP, the safe batch is
    re-derived from the same trials with the buckets' bytes taken off the limit.
    """
    under_ddp = result.extra.get("distributed", {}).get("wrapped") == "ddp"
    gradient_bytes = getattr(result, "gradient_bytes", None)  # an estimate books the buckets in its own trials
    if data_parallel <= 1 or under_ddp or not gradient_bytes or "ddp_buckets_bytes" in result.extra:
        return result  # one rank, buckets measured, nothing to train, or counted already
    limit = result.capacity_bytes - result.headroom_bytes - gradient_bytes
    summary = summarise(result.trials, result.max_batch, limit)
    peak = None if summary.safe_peak_bytes is None else summary.safe_peak_bytes + gradient_bytes
    return replace(
        result, safe_batch=summary.safe_batch, safe_peak_bytes=peak, safe_peak_measured=summary.safe_peak_measured,
        extra={**result.extra, "ddp_buckets_bytes": gradient_bytes},
    )


NO_PRIOR = "no prior was given to the search"


def prior_report(prior: Callable[[int], float] | NoTrace | None, absent: str = NO_PRIOR) -> dict[str, Any]:
    """What a result's ``extra`` records of the trace: ``{"trace_prior": {"led", "reason", …}}``, always.

    ``led`` is true where the fake-tensor trace led the search to its end; otherwise ``reason``
    says why not: a :class:`~autobatch.probing.search.NoTrace`'s reason, the trace's failure, a
    prior of the caller's own, a search that never asked, or ``absent`` for no prior at all. A
    prior that can say what it cost (``report()``, as the traced prior of
    :func:`autobatch.estimating.prior.try_trace_prior` has) adds the batches traced and the seconds.
    """
    report = getattr(prior, "report", None)
    said = report() if callable(report) else None
    if said is not None:
        return {"trace_prior": trace_record(said)}
    if isinstance(getattr(prior, "reason", None), str):  # a NoTrace, or another prior that is not the trace
        reason = prior.reason
    elif prior is None:
        reason = absent
    elif callable(report):
        reason = "the search ended before it asked the trace"
    else:
        reason = "a prior of the caller's own led the search, not the trace"
    led_by = getattr(prior, "led_by", None)  # another row's traced trials (an estimate's rows lead one another)
    return {"trace_prior": {**not_led(reason), **({"led_by": led_by} if isinstance(led_by, str) else {})}}


def weights_error(exc: Exception, backend: MemoryBackend, what: str) -> Exception:
    """The error to raise when putting ``what`` on the device failed: "nothing fits" for an OOM.

    Moving the weights happens before any trial, so an out-of-memory error there would otherwise
    surface as a raw traceback. Any other error is returned as it is.
    """
    if not is_oom_error(exc):
        return exc
    return NoBatchFitsError(
        f"{what} alone do not fit on {backend.info().name} (capacity {format_bytes(backend.capacity())}): "
        f"{'. '.join(str(exc).splitlines()[0].split('. ')[:2])[:160]}; use bf16 weights, a smaller model, sharding (FSDP, ZeRO-3) "
        "or a larger device"
    )


#: What frees memory when even the smallest batch runs out of it, said by every "nothing fits" error.
NOTHING_FITS_FIX = ("use smaller inputs (shorter sequences, smaller images), lower precision (bf16 or fp16, or their "
                    "pure weights, bf16-true or fp16-true, where one is on already), gradient checkpointing, a smaller "
                    "model or a larger device")


def resolve_headroom(headroom: float | int | str, capacity: int) -> int:
    """Headroom in bytes, from a fraction of capacity (``0.05``, ``"5%"``) or a size (``"2GiB"``)."""
    if isinstance(headroom, str) and headroom.strip().endswith("%"):
        headroom = float(headroom.strip()[:-1]) / 100
    elif isinstance(headroom, str) and headroom.strip().replace(".", "", 1).isdigit():  # "2": 2 bytes, or 2 %?
        raise AutobatchError(f"headroom as text needs its unit or a % sign, but got {headroom!r}; write e.g. '5%', "
                             "'2GiB', or the fraction 0.05 as a number")
    if isinstance(headroom, float) or (isinstance(headroom, int) and headroom == 0):
        if not 0 <= headroom < 1:
            raise AutobatchError(
                f"headroom as a fraction of memory must be in [0, 1), but got {headroom!r}; write e.g. 0.05 or 5% or 2GiB"
            )
        return int(capacity * headroom)
    size = parse_bytes(headroom)
    if size >= capacity:
        raise AutobatchError(
            f"headroom must be smaller than the device capacity ({format_bytes(capacity)}), but got {format_bytes(size)}; "
            "keep a share of it, e.g. headroom=0.05 (5 %), or a size below the capacity"
        )
    return size


def phase_points(trials: tuple[Trial, ...] | list[Trial]) -> tuple[dict[int, int], dict[int, int]]:
    """Measured peaks of the trials that fit, per phase: (forward+backward, optimizer)."""
    fits = [t for t in trials if t.fits]
    return ({t.batch: t.forward_backward_bytes for t in fits}, {t.batch: t.optimizer_bytes for t in fits})


@dataclass(frozen=True)
class MemorySummary:
    """What the trials say beyond the max: the safe batch and the fitted memory line."""

    safe_batch: int
    safe_peak_bytes: int | None   # measured when a trial ran at safe_batch, else predicted
    safe_peak_measured: bool
    bytes_per_sample: float | None
    fixed_bytes: float | None


def summarise(trials: tuple[Trial, ...] | list[Trial], max_batch: int, limit: int,
              curve: Callable[[int], float] | None = None) -> MemorySummary:
    """The largest batch ≤ ``max_batch`` whose peak stays within ``limit`` bytes, and the line.

    Measured peaks bound the answer from both sides; between them the per-phase lines decide, or
    ``curve`` where given (a booked peak at any batch, nondecreasing: a sharded estimate's own).
    Shared by the probe, the lockstep probe across ranks and the estimate.
    """
    # A batch that fit only after the allocator flushed its cache and retried is no safe batch.
    fits = {t.batch: t.reserved_bytes for t in trials if t.fits and not t.alloc_retries}
    retried = min((t.batch for t in trials if t.fits and t.alloc_retries), default=max_batch + 1)
    floor_ = max((b for b, peak in fits.items() if peak <= limit), default=0)
    ceiling = min(min((b for b, peak in fits.items() if peak > limit), default=max_batch + 1), retried) - 1
    phases = phase_points(trials)
    growing = fit_line(phases[0])
    lines = [line for line in map(fit_line, phases) if line is not None]
    # Where the phase figures are allocated bytes, what the allocator held on top of them was
    # seen too: add the largest such cache to the lines (0 where the phases are reserved figures).
    cache = max((t.reserved_bytes - max(t.forward_backward_bytes, t.optimizer_bytes)
                 for t in trials if t.fits and max(t.forward_backward_bytes, t.optimizer_bytes) > 0), default=0)
    cache = max(cache, 0)
    predicted = predict_batch(phases, None, limit - cache) if growing is not None else None
    if curve is not None:  # bisected on the curve between the trials either side of the limit
        predicted = last_kept(lambda b: curve(b) <= limit, floor_, min(ceiling, max_batch) + 1)
    safe = floor_ if predicted is None else max(floor_, min(ceiling, predicted))
    safe = min(safe, max_batch)
    if safe in fits:
        peak, measured = fits[safe], True
    elif curve is not None and safe:
        peak, measured = int(curve(safe)), False
    elif safe == 0 or not lines:
        peak, measured = None, False
    else:
        peak, measured = int(max(line[0] + line[1] * safe for line in lines)) + cache, False
    return MemorySummary(safe, peak, measured, growing[1] if growing else None, growing[0] if growing else None)


def training_trial(workload: Workload, model: torch.nn.Module, backend: MemoryBackend, batch: int) -> Trial:
    """:func:`~autobatch.probing.trial.run_trial`, with BatchNorm's error at a batch of one turned
    into a :class:`~autobatch.errors.MinimumBatchError` that says what to pass instead."""
    try:
        return run_trial(workload, model, backend, batch)
    except ValueError as exc:
        if batch == 1 and _BATCHNORM_MESSAGE in str(exc):
            raise MinimumBatchError(
                "the model needs a per-device batch of at least 2 (BatchNorm cannot compute statistics "
                f"of one sample), but the probe started at 1; use {assigned('min_micro', 2)}",
                min_batch=2,
            ) from exc
        raise


def probe(
    workload: Workload,
    backend: MemoryBackend | None = None,
    *,
    max_batch: int | None = None,
    min_batch: int | None = None,
    headroom: float | int | str = DEFAULT_HEADROOM,
    on_trial: Callable[[Trial], None] | None = None,
    prior: Callable[[int], float] | None = None,
) -> ProbeResult:
    """Find the exact largest per-device batch that trains, by running real training steps.

    Args:
        workload: what to train (see :class:`~autobatch.probing.workload.Workload`).
        backend: where; default the current CUDA device (see :func:`make_backend`).
        max_batch: an explicit cap on the batch.
        min_batch: the smallest batch allowed; default 2 for models with BatchNorm, else 1.
        headroom: memory kept free for ``safe_batch``: a fraction of capacity or a size.
        on_trial: called with each :class:`~autobatch.probing.trial.Trial` as it finishes.
        prior: a predicted peak (bytes) at any batch, such as
            :func:`autobatch.estimating.prior.trace_prior`'s; the search calibrates it against
            the trials and needs fewer of them. The answer rests on the trials either way.

    Example:
        >>> import torch, autobatch
        >>> model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
        >>> work = autobatch.Workload(model, lambda b: (torch.randn(b, 32), torch.randint(0, 4, (b,))))
        >>> result = autobatch.probe(work, autobatch.SimulatedBackend("1MiB"))
        >>> result.max_batch > 0 and len(result.trials) <= 6
        True
    """
    with stopped(prior):  # a trace on a thread ends with the probe, even one that raised before searching
        backend = backend if backend is not None else make_backend()
        for name, value in (("max_batch", max_batch), ("min_batch", min_batch)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise AutobatchError(f"{name} must be a positive integer, but got {name}={value!r}")
        capacity = backend.capacity()
        headroom_bytes = resolve_headroom(headroom, capacity)
        owned = not isinstance(workload.model, torch.nn.Module)
        with kept_rng():  # the factory's weight init must not move the caller's RNG
            model = workload.model() if owned else workload.model
        if not isinstance(model, torch.nn.Module):
            raise AutobatchError(f"the model factory must return a torch.nn.Module, but it returned {type(model).__name__}")
        require_materialized(model)
        if min_batch is None:
            min_batch = min_batch_for(model)
        if max_batch is not None and max_batch < min_batch:
            raise AutobatchError(f"max_batch ({max_batch}) must be at least min_batch ({min_batch})")
        batchnorm = batchnorm_record(model)
        gradient_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)

        def run(batch: int) -> Trial:
            trial = training_trial(workload, lent, backend, batch)
            if on_trial is not None:
                on_trial(trial)
            return trial

        # Each trial's release() collects garbage: with the heap frozen it walks only what the probe made.
        with frozen_heap(), ExitStack() as stack:
            try:
                lent = stack.enter_context(
                    borrowed_model(model, backend.device, grad_checkpointing=workload.grad_checkpointing))
            except Exception as exc:
                error = weights_error(exc, backend, "the model's weights")
                if error is exc:
                    raise
                raise error from exc
            outcome = search_max(run, capacity, min_batch=min_batch, max_batch=max_batch, prior=prior)
            lent = None
        if owned:
            del model, lent
        backend.release()  # a full collection again, the model built here included
        return result_from_search(
            outcome, backend, capacity=capacity, headroom_bytes=headroom_bytes, min_batch=min_batch,
            workload=workload.name, fix=NOTHING_FITS_FIX,
            gradient_bytes=gradient_bytes, extra={**prior_report(prior), **batchnorm},
        )


def result_from_search(outcome: SearchOutcome, backend: MemoryBackend, *, capacity: int, headroom_bytes: int, min_batch: int,
                       workload: str, fix: str, context: str = "", curve: Callable[[int], float] | None = None,
                       **fields: Any) -> ProbeResult:
    """The :class:`ProbeResult` of a finished search, or :class:`NoBatchFitsError` when nothing fit.

    ``context`` opens the error (e.g. the strategy and world size), ``fix`` ends it; ``fields`` are
    the result's remaining fields (``extra``, ``gradient_bytes``).
    """
    if outcome.max_batch == 0:
        first = outcome.trials[0]
        smallest = f" (the smallest allowed: {assigned('min_micro', min_batch)})" if min_batch > 1 else ""
        raise NoBatchFitsError(
            f"{context}even a batch of {min_batch}{smallest} runs out of memory on {backend.info().name} "
            f"(capacity {format_bytes(capacity)}, reached {format_bytes(first.reserved_bytes)}); {fix}"
        )
    summary = summarise(outcome.trials, outcome.max_batch, capacity - headroom_bytes, curve)
    return ProbeResult(
        max_batch=outcome.max_batch,
        safe_batch=summary.safe_batch,
        limited_by=outcome.limited_by,
        min_batch=min_batch,
        trials=outcome.trials,
        device=backend.info(),
        capacity_bytes=capacity,
        headroom_bytes=headroom_bytes,
        bytes_per_sample=summary.bytes_per_sample,
        fixed_bytes=summary.fixed_bytes,
        safe_peak_bytes=summary.safe_peak_bytes,
        safe_peak_measured=summary.safe_peak_measured,
        workload=workload,
        **fields,
    )

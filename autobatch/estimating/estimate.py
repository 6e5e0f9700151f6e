"""Estimate the largest batch for a named GPU without one: trace training steps on fake tensors.

The training step is the probe's own (:func:`autobatch.probing.trial.run_trial`: forward, backward,
optimizer step, ``workload.steps`` times), run under PyTorch's ``FakeTensorMode`` — tensors with
shapes and dtypes but no memory and no compute — while :class:`~autobatch.probing.memtrack.MemoryTracker`
counts live storages op by op, exactly as the simulated backend does with real tensors. The
probe's search (:func:`autobatch.probing.search.search_max`) then drives these fake trials, a trial
"fitting" when its peak, turned into a GPU's reserved peak by :class:`~autobatch.estimating.overheads.Overheads`,
stays within the GPU's usable memory. A trial costs the same at any batch (shapes only), so the answer is the
exact boundary of that model.

Example:
    >>> import torch, autobatch
    >>> from autobatch.estimating.estimate import estimate
    >>> model = lambda: torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    >>> work = autobatch.Workload(model, lambda b: (torch.randn(b, 64), torch.randint(0, 10, (b,))))
    >>> result = estimate(work, gpu_memory="1GiB")
    >>> result.estimated, result.max_batch > 10_000
    (True, True)
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..errors import AutobatchError, NoBatchFitsError
from ..modelinfo import batchnorm_record, min_batch_for, require_materialized
from ..probing.memory_curve import last_kept
from ..probing.preserve import enable_checkpointing
from ..probing.probe import DEFAULT_HEADROOM, NOTHING_FITS_FIX, resolve_headroom, summarise
from ..probing.progress import working
from ..probing.result import BatchResult, not_led
from ..probing.search import search_max
from ..probing.trial import Trial, run_trial
from ..probing.workload import Workload, make_optimizer, resolve_dtype, weights_dtype

# An estimate's extra["trace_prior"]["reason"]: its trials are traces, there are no real ones to lead.
IS_THE_TRACE = "every trial of an estimate is itself a trace on fake tensors, so no separate trace leads them"
from ..units import format_bytes
from .fake_backends import _FakeBackend, _mode_of, _new_fake_mode, _ZeroScalars
from .gpus import GpuSpec, resolve_gpu
from .overheads import Overheads, beside_the_context, booking_text, on_the_card
from .replay import AllocationLog
from .symbolic import BatchCurve, NotWhole, trace_curve

__all__ = ["Estimate", "estimate", "trace_trial", "trace_batches", "fake_model", "training_copy", "load_fake_model",
           "dtype_label", "reads_to_the_safe_batch"]


@dataclass(frozen=True, kw_only=True)
class Estimate(BatchResult):
    """The answer of :func:`estimate`: like :class:`~autobatch.ProbeResult`, but predicted.

    ``max_batch`` is the largest batch whose traced peak, with overheads, stays within
    ``capacity_bytes`` (the GPU's usable memory); ``safe_batch`` keeps ``headroom_bytes`` free
    too. Trials hold GPU-reserved figures (overheads applied); ``traced`` holds the raw tensor
    bytes of each trial, with the same ``fits`` verdict as ``trials``. ``estimated`` is always
    true: nothing ran on a GPU.
    """

    gpu: GpuSpec
    overheads: Overheads
    traced: tuple[Trial, ...]
    seconds: float
    dtype: str = "fp32"
    estimated: bool = True

    def _details(self) -> dict[str, Any]:
        return {"estimated": True, "gpu": self.gpu.to_dict(), "dtype": self.dtype, "overheads": self.overheads.to_dict(),
                "seconds": round(self.seconds, 3), "traced": [t.to_dict() for t in self.traced]}

    def __str__(self) -> str:
        lines = [
            f"estimate for {self.gpu.name} (no GPU used; fake-tensor trace, {self.dtype}): "
            f"{self.workload}, usable {format_bytes(self.capacity_bytes)}",
            f"estimated max batch {self.max_batch} (limited by {self.limit_text()}), {len(self.trials)} traced trials: "
            + self.trials_text(),
            f"estimated safe batch {self.safe_batch} (peak {format_bytes(self.safe_peak_bytes)} predicted, "
            f"headroom {format_bytes(self.headroom_bytes)}{self.retried_text()})",
        ]
        if self.memory_line():
            lines.append(
                f"{self.memory_line()} "
                f"({booking_text(self.overheads)}, workspaces {format_bytes(self.overheads.workspace_bytes)})"
            )
        once, why = self.extra.get("traced_once_for") or [], self.extra.get("not_traced_once")
        read = (f" ({', '.join(map(str, once))} read off one trace with the batch a symbol)" if once else
                f"; each batch at its size, since the one trace with the batch a symbol stopped: {why}" if why else "")
        lines.append(f"traced in {self.seconds:.1f} s{read}")
        return "\n".join(lines)


# The names the rest of the output uses for an autocast dtype ("bf16", as --dtype takes it).
_SHORT_DTYPE = {"torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float32": "fp32"}


def dtype_label(dtype: Any) -> str:
    """How an estimate names a workload's ``dtype``: ``"bf16-true"`` for pure low-precision weights,
    ``"bf16"``/``"fp16"`` for autocast, ``"fp32"`` without either, as ``--dtype`` takes them.

    Example:
        >>> dtype_label("bf16-true"), dtype_label(torch.bfloat16), dtype_label(None)
        ('bf16-true', 'bf16', 'fp32')
    """
    if weights_dtype(dtype) is not None:
        return str(dtype).lower()
    resolved = resolve_dtype(dtype)
    return "fp32" if resolved is None else _SHORT_DTYPE.get(str(resolved), str(resolved).removeprefix("torch."))


def load_fake_model(spec: str, **load_kwargs: Any) -> Any:
    """:func:`autobatch.models.load_model` with the model built on fake tensors (no weight memory).

    Returns the :class:`~autobatch.models.ModelSource`; its model's parameters are fake, and
    :func:`estimate` traces them under their own fake mode. Where a model cannot be built on fake
    tensors (weights read from disk), it is loaded for real and converted by :func:`estimate`.
    """
    from ..models import load_model

    mode = _new_fake_mode()
    try:
        with mode:
            return load_model(spec, **load_kwargs)
    except AutobatchError:
        raise
    except Exception:  # a loader that needs real tensors: the real model, converted later
        return load_model(spec, **load_kwargs)


def fake_model(model: torch.nn.Module | Callable[[], torch.nn.Module], fake_mode: Any) -> torch.nn.Module:
    """The model with fake parameters and buffers: built inside ``fake_mode``, or converted.

    A model whose parameters are already fake tensors of ``fake_mode`` is used as it is. A factory is called inside the mode, so the weights never take real memory. A module passed
    in is copied with each parameter and buffer replaced by a fake tensor of the same shape,
    dtype and ``requires_grad`` (``fake_mode.from_tensor`` copies no data); the user's model is
    left untouched.
    """
    if not isinstance(model, torch.nn.Module):
        # Weight initialisers read values (a truncated normal checks its bounds): on fake tensors
        # they read a stand-in, since no value changes what the weights take.
        with fake_mode, _ZeroScalars(), working(f"building {getattr(model, '__name__', 'the model')} on fake tensors"):
            built = model()
        if not isinstance(built, torch.nn.Module):
            raise AutobatchError(f"the model factory must return a torch.nn.Module, but it returned {type(built).__name__}")
        return _rehome(require_materialized(built), fake_mode)
    require_materialized(model)
    if _mode_of(model) is fake_mode:
        return model
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = torch.nn.Parameter(fake_mode.from_tensor(p.detach()), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = fake_mode.from_tensor(b)
    return copy.deepcopy(model, memo)


def _rehome(model: torch.nn.Module, fake_mode: Any) -> torch.nn.Module:
    """Give every fake parameter and buffer ``fake_mode``: a module deep-copied while the model
    was built (``nn.TransformerEncoder`` copies its layer) holds fake tensors of a mode of its own,
    which cannot meet the inputs' in one step."""
    from torch._subclasses.fake_tensor import FakeTensor

    moved: dict[int, torch.Tensor] = {}  # by the old tensor, so tied weights stay tied
    for table in [t for module in model.modules() for t in (module._parameters, module._buffers)]:
        for name, t in table.items():
            if isinstance(t, FakeTensor) and t.fake_mode is not fake_mode:
                if id(t) not in moved:
                    with fake_mode:
                        fresh = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
                    is_param = isinstance(t, torch.nn.Parameter)
                    moved[id(t)] = torch.nn.Parameter(fresh, requires_grad=t.requires_grad) if is_param else fresh
                table[name] = moved[id(t)]
    return model


def training_copy(workload: Workload, fake_mode: Any) -> torch.nn.Module:
    """The workload's model on fake tensors of ``fake_mode`` (:func:`fake_model`), with gradient
    checkpointing on where the workload asks for it, in train mode: what a trace steps."""
    model = fake_model(workload.model, fake_mode)
    if workload.grad_checkpointing:
        with fake_mode:
            enable_checkpointing(model)
    model.train()
    return model


def trace_trial(workload: Workload, model: torch.nn.Module, batch: int, *, fake_mode: Any,
                fused_attention: bool = True, log: Any = None, cuda_autocast: bool = True,
                primed: bool | None = None) -> Trial:
    """One fake trial: :func:`~autobatch.probing.trial.run_trial` on fake tensors. Bytes are exact tensor bytes.

    ``model`` must already be fake (see :func:`fake_model`) under the same ``fake_mode``. A
    ``log`` (:class:`~autobatch.estimating.replay.AllocationLog`) records every request and free.
    ``cuda_autocast``: mixed precision casts as on a GPU (:mod:`.cuda_autocast`), else as on the CPU.
    ``primed``: the optimizer's state made by a step on zero gradients instead of a whole first step
    (the same bytes, half the time); by default unless a ``log`` is kept, whose replay through the
    caching allocator needs the blocks the first step leaves (an exact-bytes replay does not).
    """
    primed = log is None if primed is None else primed
    backend, work = _tracing(workload, fake_mode, fused_attention, log, cuda_autocast, primed)
    raw = run_trial(work, model, backend, batch, steps=1 if primed else None)
    return replace(raw, seconds_per_step=None)


def trace_batches(workload: Workload, model: torch.nn.Module, *, fake_mode: Any, fused_attention: bool = True,
                  cuda_autocast: bool = True, primed: bool = True, needs: tuple[int, ...] = (),
                  why: Callable[[str], None] | None = None) -> BatchCurve | None:
    """:func:`trace_trial`'s steps traced once with a symbolic batch: its figures, and its requests to
    the allocator, at every batch the curve answers (:class:`~.symbolic.BatchCurve`), or ``None``
    where torch cannot trace it so. ``primed``: the one steady step after a step on zero gradients,
    else a log of whole steps for the allocator's model, made from that one step where it can be
    (:func:`~.made_log.whole_steps`), else traced whole (held gradients: the first backward makes them).
    ``needs``: batches the curve must answer, or ``None`` as soon as a guard leaves one out (``why`` told why)."""
    steps = max(2, workload.steps)
    if primed or not workload.grads_held:
        backend, work = _tracing(workload, fake_mode, fused_attention, None, cuda_autocast, True)
        try:
            return trace_curve(work, model, backend, whole=0 if primed else steps, primed=True, needs=needs, why=why)
        except NotWhole:  # the steps traced whole, below
            pass
    backend, work = _tracing(workload, fake_mode, fused_attention, None, cuda_autocast, False)
    return trace_curve(work, model, backend, steps=steps, needs=needs, why=why)


def _tracing(workload: Workload, fake_mode: Any, fused_attention: bool, log: Any, cuda_autocast: bool,
             primed: bool) -> tuple[_FakeBackend, Workload]:
    """The backend a trace runs on and the workload it steps: the optimizer as on a GPU, primed or not."""
    backend = _FakeBackend(fake_mode, fused_attention, log=log, cuda_autocast=cuda_autocast,
                           recomputed=workload.grad_checkpointing)
    optimizer = optimizer_as_on_a_gpu(workload.optimizer) if cuda_autocast else workload.optimizer
    if primed:
        # The first of a trial's steps makes the optimizer's state; the rest repeat the steady step. On
        # fake tensors an optimizer step on zero gradients makes that state for the price of no forward.
        optimizer = _primed(optimizer, backend, workload.grads_held)
    return backend, replace(workload, optimizer=optimizer)


def _primed(optimizer: Any, backend: Any, grads_held: bool) -> Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]:
    """``optimizer`` made, and stepped once on zero gradients, as after a trial's first step: its state
    stays, the gradients are freed (or zeroed and kept, when held), and the peaks start afresh."""
    def make(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        opt = make_optimizer(optimizer, params)
        for p in params:
            p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad(set_to_none=not grads_held)
        backend.reset_peak()
        return opt
    return make


# torch's optimizers whose step takes the multi-tensor (foreach) path by default when every parameter is on a GPU
_FOREACH_ON_A_GPU = tuple(getattr(torch.optim, name) for name in (
    "Adam", "AdamW", "SGD", "Adagrad", "Adamax", "ASGD", "NAdam", "RAdam", "RMSprop", "Rprop", "Adadelta"))


def optimizer_as_on_a_gpu(optimizer: Any) -> Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]:
    """``optimizer`` (a name or factory) stepping as on a GPU: where torch's own optimizer was left to
    choose (``foreach=None``), on a GPU it takes the multi-tensor path, whose step holds a temporary
    the size of all parameters (Adam's ``sqrt`` of the second moments); on fake CPU tensors it would
    take the one-tensor path and hold one parameter's. A ``fused`` or an explicit choice is kept."""
    def make(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        opt = make_optimizer(optimizer, params)
        if type(opt) in _FOREACH_ON_A_GPU:
            for group in opt.param_groups:
                if group.get("foreach") is None and not group.get("fused") and not group.get("differentiable"):
                    group["foreach"] = True
        return opt
    return make


def estimate(
    workload: Workload,
    gpu: str | GpuSpec | None = None,
    *,
    gpu_memory: int | str | None = None,
    overheads: Overheads | None = None,
    headroom: float | int | str = DEFAULT_HEADROOM,
    max_batch: int | None = None,
    min_batch: int | None = None,
    on_trial: Callable[[Trial], None] | None = None,
    data_parallel: int = 1,
) -> Estimate:
    """Estimate the largest and a safe per-GPU batch for ``gpu``, on any machine, without a GPU.

    Args:
        workload: what to train; its model (module or factory) is traced on fake tensors.
        gpu: a catalogue name (``"a100-80gb"``, ``"h100"``, see :data:`autobatch.estimating.gpus.GPUS`) or a
            :class:`~autobatch.estimating.gpus.GpuSpec`; default :data:`autobatch.estimating.gpus.DEFAULT_GPU`.
        gpu_memory: the card's total memory instead of a name (``"40GiB"``).
        overheads: what the trace cannot see (default :class:`~autobatch.estimating.overheads.Overheads`);
            ``Overheads.none()`` gives the exact tensor bytes the simulated backend measures.
        headroom: kept free for ``safe_batch``: a fraction of usable memory or a size.
        max_batch: an explicit cap on the batch.
        min_batch: the smallest batch; default 2 for models with BatchNorm, else 1.
        on_trial: called with each traced trial (GPU figures) as it finishes.
        data_parallel: data-parallel ranks the plan trains on; above 1 each GPU also holds DDP's
            gradient buckets (a copy of the gradients), counted in every trial.

    Raises:
        NoBatchFitsError: when even ``min_batch`` does not fit the GPU.
    """
    started = time.perf_counter()
    spec = resolve_gpu(gpu, gpu_memory)
    overheads = overheads if overheads is not None else Overheads()
    capacity = beside_the_context(spec, overheads)
    headroom_bytes = resolve_headroom(headroom, capacity)
    for name, value in (("max_batch", max_batch), ("min_batch", min_batch)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise AutobatchError(f"{name} must be a positive integer, but got {name}={value!r}")
    fake_mode = _mode_of(workload.model) or _new_fake_mode()
    model = training_copy(workload, fake_mode)
    min_batch = min_batch_for(model) if min_batch is None else min_batch
    if max_batch is not None and max_batch < min_batch:
        raise AutobatchError(f"max_batch ({max_batch}) must be at least min_batch ({min_batch})")
    traced: list[Trial] = []
    buckets = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad) if data_parallel > 1 else 0

    # One trace with the batch a symbol answers every batch it allows; any other is traced at its size (not_once:
    # why, where it answers none). Booked through the caching allocator's model (the default): two whole steps.
    booked, not_once = overheads.fragmentation is None, {}
    curve = trace_batches(workload, model, fake_mode=fake_mode, fused_attention=overheads.fused_attention,
                          primed=not booked, why=lambda reason: not_once.update(not_traced_once=reason))
    answered: list[int] = []

    def run(batch: int) -> Trial:
        if curve is not None and curve.answers(batch):
            raw, requests = curve.trial(batch), (curve.requests(batch) if booked else [])
            answered.append(batch)
        else:
            log = AllocationLog() if booked else None
            raw = trace_trial(workload, model, batch, fake_mode=fake_mode, fused_attention=overheads.fused_attention,
                              log=log)
            requests = log.requests() if log is not None else []
        trial = on_the_card(raw, requests, overheads, capacity, buckets)
        traced.append(replace(raw, fits=trial.fits))  # one verdict per batch: the GPU's
        if on_trial is not None:
            on_trial(trial)
        return trial

    # The curve's smallest batch (2: size one broadcasts) first, where it fits the smaller need not be
    # traced at its own size: memory only grows with the batch.
    first = None if curve is None else max(min_batch, curve.smallest)
    start = (run(first),) if first is not None and first > min_batch and curve.answers(first) and (
        max_batch is None or first <= max_batch) else ()
    # The curve's tensor bytes lead the search over the booked trials (it calibrates them to each
    # booking), read past its guards too: a guide there, never an answer.
    lead = None if curve is None or not booked else (lambda b: float(curve.trial(b).peak_bytes))
    outcome = search_max(run, capacity, min_batch=min_batch, max_batch=max_batch, known=start, prior=lead)
    outcome = replace(outcome, trials=start + outcome.trials)
    if outcome.max_batch == 0:
        first = outcome.trials[0]
        raise NoBatchFitsError(f"estimate: even a batch of {min_batch} needs about {format_bytes(first.reserved_bytes)} "
                               f"on {spec.name} (usable {format_bytes(capacity)}); {NOTHING_FITS_FIX}")
    limit = capacity - headroom_bytes
    if curve is not None and booked:  # every batch is a read off the curve: the safe one too
        outcome = replace(outcome, trials=outcome.trials + reads_to_the_safe_batch(
            run, outcome.trials, limit, min_batch, outcome.max_batch, curve.answers))
    summary = summarise(outcome.trials, outcome.max_batch, limit)
    return Estimate(
        max_batch=outcome.max_batch,
        safe_batch=summary.safe_batch,
        limited_by=outcome.limited_by,
        min_batch=min_batch,
        gpu=spec,
        capacity_bytes=capacity,
        headroom_bytes=headroom_bytes,
        bytes_per_sample=summary.bytes_per_sample,
        fixed_bytes=summary.fixed_bytes,
        safe_peak_bytes=summary.safe_peak_bytes,
        overheads=overheads,
        trials=outcome.trials,
        traced=tuple(traced),
        seconds=time.perf_counter() - started,
        workload=workload.name,
        dtype=dtype_label(workload.dtype),
        extra={**({"ddp_buckets_bytes": buckets} if buckets else {}), "trace_prior": not_led(IS_THE_TRACE),
               # the batches read off the one symbolic trace; the others were traced at their size
               "traced_once_for": answered, **not_once, **batchnorm_record(model)},
    )


def reads_to_the_safe_batch(read: Callable[[int], Trial], trials: tuple[Trial, ...], limit: int, min_batch: int,
                             max_batch: int, answers: Callable[[int], bool]) -> tuple[Trial, ...]:
    """The batches read off the curve, by bisection, between the largest trial that keeps ``limit`` and
    the smallest that does not: the safe batch rests on adjacent reads, not a line's guess (a batch low)."""
    def keeps(trial: Trial) -> bool:
        return trial.fits and not trial.alloc_retries and trial.reserved_bytes <= limit

    low = max([min_batch - 1] + [t.batch for t in trials if keeps(t)])
    high = min([max_batch + 1] + [t.batch for t in trials if t.batch > low and not keeps(t)])
    more: list[Trial] = []
    last_kept(lambda batch: keeps(more.append(read(batch)) or more[-1]), low, high, asks=answers)
    return tuple(more)

"""One sharded trial: wrap a fresh copy of the model for the strategy, train, decide at the step's end.

A rank that runs out of memory in the middle of a sharded step leaves the others waiting in a
collective, and FSDP does not reshard cleanly after it. So each trial builds its own wrapped
copy (a failed trial leaves nothing behind for the next), runs ``workload.steps`` full steps
with the budget deferred where the backend can defer it (the simulated budget), and decides
fit or fail from the measured peak once the steps are done. The ranks then agree on the
outcome (:mod:`autobatch.distributed.lockstep`), or, on the fake group, the one rank speaks for all.

Besides the :class:`~autobatch.probing.trial.Trial`, a trial reports where this rank's memory
went (:class:`MemoryBreakdown`), measured in the last step: parameters, the wrapper's own
buffers (DDP's gradient buckets, DeepSpeed's flat and bucket buffers), optimizer state,
gradients, and what a forward and backward add on top (activations and gathered units).
"""

from __future__ import annotations

import copy
import gc
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass
from typing import Any

import torch

from ..probing.backends import MemoryBackend
from ..probing.oom import is_oom_error, oom_message
from ..probing.preserve import enable_checkpointing
from ..probing.progress import working
from ..probing.trial import PhasePeaks, Trial, batch_on, drain_autograd, to_device
from ..probing.workload import Workload, resolve_dtype, step_loss
from ..strategy import Strategy
from .fence import TrialFence
from .sharding import Wrapped, is_fake, local_bytes, wrap_model
from .zero import engine_dtype

__all__ = ["MemoryBreakdown", "ShardedTrial", "run_sharded_trial", "off_the_gpu", "train_steps", "assemble", "wrap_copy",
           "quiet_wrappers"]


@dataclass(frozen=True)
class MemoryBreakdown:
    """Where one rank's memory goes at its peak, in bytes (measured, not assumed); the terms add up to ``peak``.

    Each term is held at the peak, once: nothing is counted in two of them.
    """

    parameters: int         # this rank's parameters (its shard when they are sharded)
    buffers: int            # what wrapping added besides them: module buffers, DDP's buckets, flat copies
    optimizer_state: int    # what the first optimizer step left for good (its state; ZeRO's gradient partitions)
    gradients: int          # what backward leaves until the step (none under ZeRO-3: reduced into its partitions)
    activations: int        # the rest at the peak: activations, gathered units, the step's temporaries
    other: int              # memory held before the wrap, and the allocator's cache and rounding (reserved − allocated)
    peak: int               # the reserved peak: the sum of the terms above

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


def _breakdown(figures: dict[str, int], before: int, peaks: PhasePeaks) -> MemoryBreakdown:
    """The measured terms, what else the allocated peak held on top of them, and the rest of the reserved peak."""
    held = sum(figures.values())
    activations = max(0, peaks.allocated - before - held)
    return MemoryBreakdown(**figures, activations=activations, other=max(0, peaks.reserved - held - activations),
                           peak=peaks.reserved)


@dataclass(frozen=True)
class ShardedTrial:
    trial: Trial
    breakdown: MemoryBreakdown | None
    config: dict[str, Any]


@contextmanager
def quiet_wrappers() -> Iterator[None]:
    """Within a trial, the wrappers' warnings that say nothing about the user's setup (undone after)."""
    with warnings.catch_warnings():
        # FSDP and DeepSpeed call collectives torch has renamed: its deprecation notes, once per
        # trial, say nothing about the user's setup.
        warnings.filterwarnings("ignore", message=r".*torch\.distributed\.\w+` is deprecated", category=FutureWarning)
        # FSDP1 reads its parameters' data pointers (to tell shared storage apart); on the fake tensors
        # of an estimate torch warns that this is "almost definitely a bug": not here, where nothing is read.
        warnings.filterwarnings("ignore", message=r"Accessing the data pointer of FakeTensor")
        yield


@contextmanager
def _current_gpu(device: torch.device) -> Iterator[None]:
    """``device`` as the current GPU for the trial, then the caller's again.

    FSDP2 builds its mesh on the current GPU, DeepSpeed takes it for the engine, and object
    collectives run on it: each trial must run on the GPU it measures, not on GPU 0.
    """
    if device.type != "cuda" or device.index is None:
        yield
        return
    previous = torch.cuda.current_device()
    torch.cuda.set_device(device)
    try:
        yield
    finally:
        torch.cuda.set_device(previous)


@contextmanager
def off_the_gpu(template: torch.nn.Module) -> Iterator[None]:
    """The user's model in host memory while sharded trials run, then back where it was, bit for bit.

    Each trial wraps its own copy, which the wrapper puts on the GPU as a shard. A model left on
    the GPU beside it would hold a whole unsharded copy that the job never holds (its model *is*
    the one sharded), and every batch would be answered that much too small. Parameters stay the
    same objects (their ``.data`` moves), so hooks, optimizers and ties that refer to them hold.
    """
    moved: list[tuple[torch.Tensor, torch.device]] = []
    for tensor in [*template.parameters(), *template.buffers()]:
        if tensor.device.type not in ("cpu", "meta") and not is_fake(tensor):
            moved.append((tensor, tensor.device))
            tensor.data = tensor.data.to("cpu")
            if tensor.grad is not None:
                tensor.grad.data = tensor.grad.data.to("cpu")
    try:
        yield
    finally:
        for tensor, device in moved:
            tensor.data = tensor.data.to(device)
            if tensor.grad is not None:
                tensor.grad.data = tensor.grad.data.to(device)


def _copy_model(template: torch.nn.Module, grad_checkpointing: bool, device: torch.device | None = None
                ) -> torch.nn.Module:
    """A private copy of ``template`` to wrap; fake weights are made afresh, on ``device`` where given
    (a trace whose host is apart: see :func:`~autobatch.estimating.fake_backends.fake_backend`)."""
    memo: dict[int, Any] = {}
    for t in [*template.parameters(), *template.buffers()]:
        if is_fake(t):  # fake weights hold no data: a fresh fake tensor of each costs nothing
            with t.fake_mode:
                fresh = torch.empty_like(t, device=device)
            memo[id(t)] = torch.nn.Parameter(fresh, requires_grad=t.requires_grad) if isinstance(
                t, torch.nn.Parameter) else fresh
    model = copy.deepcopy(template, memo)
    for p in model.parameters():
        p.grad = None
    model.train()
    if grad_checkpointing:
        enable_checkpointing(model)
    return model


def _step(workload: Workload, wrapped: Wrapped, batch_size: int, device: torch.device, peaks: PhasePeaks) -> None:
    batch = batch_on(workload, batch_size, device)
    dtype = resolve_dtype(workload.dtype)
    engine = engine_dtype(wrapped.config)
    if engine is not None:
        # DeepSpeed's bf16/fp16 is its engine's: the weights in that dtype and no autocast (accelerate, the
        # HF Trainer and Lightning all run it so), the batch's floating-point tensors cast to it as they cast them.
        batch, dtype = to_device(batch, device, engine), None
    autocast = torch.autocast(device_type=device.type, dtype=dtype) if dtype is not None else nullcontext()
    with autocast:
        loss = step_loss(workload.loss_fn, wrapped.module, batch)
    peaks.forward_end()
    wrapped.backward(loss)


def run_sharded_trial(workload: Workload, template: torch.nn.Module, strategy: Strategy, backend: MemoryBackend,
                      batch_size: int, *, deepspeed_config: dict[str, Any] | None = None,
                      fence: TrialFence | None = None) -> ShardedTrial:
    """Train a wrapped copy of ``template`` for ``workload.steps`` steps at ``batch_size``; fit if the peak fits.

    The copy is made on the CPU and wrapped onto ``backend.device`` inside the backend's tracking,
    so only what this rank holds after wrapping counts. Out-of-memory errors the backend cannot
    defer (a real GPU) make a failed trial; any other exception propagates untouched.

    Under a launcher the trial runs on ``fence``'s group (:class:`~autobatch.distributed.fence.TrialFence`):
    a rank out of memory takes it down, and a rank whose collective then breaks records the trial
    as failed because of that rank, instead of waiting for it.
    """
    capacity = backend.capacity()
    backend.release()
    devices = [backend.device.index or 0] if backend.device.type == "cuda" else []
    with quiet_wrappers(), torch.random.fork_rng(devices=devices), _current_gpu(backend.device):
        peaks = PhasePeaks(backend, phase_by="reserved")  # fit is decided on the reserved peak
        # Everything that refers to the wrapped copy lives in _train's frame alone: when it returns,
        # nothing of the trial is referenced, and one collection frees it all before the next trial
        # (a parameter list kept here held ZeRO-1/2's flat fp32 copy into the next trial).
        traced = getattr(backend, "fake_mode", None) is not None
        with working(f"{'tracing' if traced else 'training'} {workload.name} under {strategy.label} at batch "
                     f"{batch_size}{' on fake tensors' if traced else ''}"):
            done = _train(workload, template, strategy, backend, batch_size, peaks, deepspeed_config, fence)
        if done[3] is not None:
            drain_autograd(backend.device)  # a backward that raised leaves its saved tensors in the engine's queue
        gc.collect()
        if fence is not None and done[3] is not None:
            fence.take_down()  # nothing refers to the trial's groups now: the ranks waiting on this one are freed
        backend.release()
    figures, times, resident_bytes, error, config, before = done
    return assemble(batch_size, peaks, capacity, figures, times, resident_bytes, error, config, before)


def assemble(batch_size: int, peaks: PhasePeaks, capacity: int, figures: dict[str, int], times: list[float],
             resident_bytes: int | None, error: str | None, config: dict[str, Any] | None, before: int) -> ShardedTrial:
    """The trial's record from what its steps measured: fit when no error and the reserved peak fits."""
    if error is None and peaks.reserved > capacity:
        error = (f"out of memory at the step's end: peak {peaks.reserved} bytes over the capacity of "
                 f"{capacity} bytes")
    fits = error is None
    trial = Trial(
        batch=batch_size, fits=fits, peak_bytes=peaks.allocated, reserved_bytes=peaks.reserved,
        forward_backward_bytes=peaks.phase["forward_backward"], optimizer_bytes=peaks.phase["optimizer"],
        resident_bytes=resident_bytes if fits else None,
        seconds_per_step=(sorted(times[1:])[len(times[1:]) // 2] if fits and len(times) > 1 else None),
        error=error, forward_bytes=peaks.forward if fits else 0,
    )
    breakdown = None
    if len(figures) == 4:
        breakdown = _breakdown(figures, before, peaks)
    return ShardedTrial(trial, breakdown, config or {})


def wrap_copy(model: torch.nn.Module, workload: Workload, strategy: Strategy, backend: MemoryBackend,
              batch_size: int, deepspeed_config: dict[str, Any] | None = None, group: Any = None) -> tuple[Wrapped, int]:
    """``model`` (a private copy, see :func:`_copy_model`) wrapped for ``strategy`` inside the backend's
    tracking, so only what this rank holds after wrapping counts; and what was allocated before it."""
    with backend.track_deferred(()):
        before = backend.allocated_bytes()
        wrapped = wrap_model(model, strategy, workload, backend.device, batch=batch_size,
                             deepspeed_config=deepspeed_config, group=group)
    return wrapped, before


def _train(workload: Workload, template: torch.nn.Module, strategy: Strategy, backend: MemoryBackend,
           batch_size: int, peaks: PhasePeaks, deepspeed_config: dict[str, Any] | None, fence: TrialFence | None,
           ) -> tuple[dict[str, int], list[float], int | None, str | None, dict[str, Any], int]:
    """Wrap a copy of ``template`` and train it; the measured figures, step times, what stayed, the error if out of memory."""
    model = _copy_model(template, workload.grad_checkpointing, backend.device)
    wrapped: Wrapped | None = None
    error = None
    config: dict[str, Any] = {}
    figures: dict[str, int] = {}
    times: list[float] = []
    resident_bytes = None
    before = 0
    at = ["forward_backward"]  # the phase running, for the peaks of a step that ran out of memory
    try:
        wrapped, before = wrap_copy(model, workload, strategy, backend, batch_size, deepspeed_config,
                                    group=None if fence is None else fence.group)
        config = wrapped.config
        del model
        params = list(wrapped.module.parameters())
        figures["parameters"] = local_bytes(params, backend.device)
        with backend.track_deferred(params + list(wrapped.module.buffers())):
            del params
            wrapped_bytes = backend.allocated_bytes() - before
            figures["buffers"] = max(0, wrapped_bytes - figures["parameters"])
            resident_bytes = train_steps(workload, wrapped, backend, batch_size, workload.steps, peaks, figures,
                                         times, before + wrapped_bytes, at)
    except Exception as exc:
        if is_oom_error(exc):
            error = oom_message(exc)
            if fence is not None:
                fence.out_of_memory()  # before anything else: the other ranks may be waiting on this one
        else:
            error = None if fence is None else fence.peer_failure()
            if error is None:
                raise
        peaks.read(at[0] if wrapped is not None else "forward_backward")
    finally:
        if wrapped is not None:
            wrapped.close()
    return figures, times, resident_bytes, error, config, before


def train_steps(workload: Workload, wrapped: Wrapped, backend: MemoryBackend, batch_size: int, steps: int,
                peaks: PhasePeaks, figures: dict[str, int], times: list[float], after_wrap: int,
                at: list[str]) -> int:
    """``steps`` steps of ``wrapped`` at ``batch_size`` inside the backend's tracking, each phase's peak
    read into ``peaks``; fills the optimizer state and gradients of ``figures`` (the last step's) and
    ``times``, keeps the running phase in ``at[0]``, and returns what stays allocated after them.
    ``after_wrap``: what was allocated once the model was wrapped (before any optimizer state)."""
    for _ in range(steps):
        backend.synchronize()
        start = time.perf_counter()
        at[0] = "forward_backward"
        ahead = backend.allocated_bytes()
        figures["optimizer_state"] = max(0, ahead - after_wrap)
        _step(workload, wrapped, batch_size, backend.device, peaks)
        figures["gradients"] = max(0, backend.allocated_bytes() - ahead)
        peaks.read(at[0])
        at[0] = "optimizer"
        wrapped.step()
        peaks.read(at[0])
        times.append(time.perf_counter() - start)
    return backend.allocated_bytes()

"""Probe every rank's device in lockstep: the ranks agree after each trial; the answer is their minimum.

Every rank runs the same search (:func:`~autobatch.probing.search.search_max`) over the same oracle: the
oracle runs the rank's own trial, then one ``all_gather`` shares each rank's outcome and figures.
Every rank builds the same agreed :class:`~autobatch.probing.trial.Trial` from them (it fits only if it
fit everywhere; its bytes are the largest any rank measured), so the search sees identical
inputs everywhere and takes identical next steps: the trial sequences cannot diverge, and no
rank waits in a collective that another rank skipped. A non-OOM error on one rank is agreed the
same way, so every rank stops together, at once, instead of hanging.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from ..errors import AutobatchError, NoBatchFitsError
from ..modelinfo import min_batch_for
from ..probing.backends import DeviceInfo, MemoryBackend
from ..probing.preserve import borrowed_model
from ..probing.probe import (
    DEFAULT_HEADROOM,
    make_backend,
    phase_points,
    resolve_headroom,
    summarise,
    weights_error,
)
from ..probing.search import predict_batch, search_max
from ..probing.trial import Trial, run_trial
from ..probing.workload import Workload
from ..strategy import Strategy, parse_strategy
from ..units import format_bytes
from .ddp import ddp_for_trials
from .launch import DEFAULT_TIMEOUT_S
from .result import DistributedProbeResult, RankFailedError, RankReport
from .sharded_trial import run_sharded_trial
from .sharding import with_unit
from .simulated_world import sharding_report

__all__ = ["probe_distributed"]

_BUCKET_BYTES = 25 << 20  # DistributedDataParallel's default bucket_cap_mb

# The figures each rank shares after a trial, in this order (float64: exact for bytes below 8 PiB).
_FIELDS = ("fits", "peak", "reserved", "forward_backward", "optimizer", "resident", "seconds", "retries")


# --- agreement ------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Comm:
    """Where the agreement's tensors live and how long any rank may keep the others waiting."""

    device: torch.device
    timeout_s: float


def _comm_device(backend: MemoryBackend | None = None) -> torch.device:
    # NCCL only moves CUDA tensors, and must move them on the GPU this rank probes (the current
    # device may still be GPU 0 on every rank); gloo only CPU ones.
    if dist.get_backend() == "nccl":
        if backend is not None and backend.device.type == "cuda":
            return backend.device
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _collective(comm: _Comm, what: str, start: Callable[[], Any], after: Callable[[], Any] = lambda: None) -> Any:
    """Run one collective to completion within ``comm.timeout_s``, and ``after`` (reading the result).

    NCCL's collectives return at once and fail later, at the next synchronisation or as a
    watchdog abort; waiting on the work with a timeout and synchronising here makes any failure
    one clear error, raised at this step, in time.
    """
    try:
        work = start()
        if work is not None:
            # Poll rather than wait(timeout): gloo's wait ignores a timeout shorter than the group's.
            deadline, pause = time.monotonic() + comm.timeout_s, 0.0005
            while not work.is_completed():
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the collective did not complete within {comm.timeout_s:.0f} s")
                time.sleep(pause)
                pause = min(2 * pause, 0.05)
            work.wait()  # the collective's own error, if it failed
        if comm.device.type == "cuda":
            torch.cuda.synchronize(comm.device)
        return after()
    except RuntimeError as exc:  # DistBackendError, gloo/NCCL timeouts and aborts are RuntimeErrors
        raise AutobatchError(
            f"lost contact with the other ranks while {what} (no answer within {comm.timeout_s:.0f} s: "
            f"{str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__}); "
            "a rank crashed, hung or was not started — read every rank's log"
        ) from exc


def _agree_on_errors(comm: _Comm, exc: BaseException | None, stage: str) -> None:
    """Collective: if any rank failed, every rank raises.

    The failing rank raises its own error, the others :class:`RankFailedError` naming it; when
    the error is that nothing fits (:class:`NoBatchFitsError`), every rank raises that same
    error, word for word.
    """
    flag = torch.tensor([0.0 if exc is None else 1.0], device=comm.device)
    failed = _collective(comm, stage, lambda: dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True),
                         lambda: flag.item())
    if failed == 0:
        return
    mine = None if exc is None else (
        type(exc).__name__, str(exc).splitlines()[0][:500] if str(exc) else "", isinstance(exc, NoBatchFitsError))
    messages: list[Any] = [None] * dist.get_world_size()
    _collective(comm, stage, lambda: dist.all_gather_object(messages, mine))
    rank, (name, message, no_fit) = next((r, m) for r, m in enumerate(messages) if m is not None)
    if no_fit:
        raise NoBatchFitsError(f"rank {rank}: {message}") from exc
    if exc is not None:
        raise exc
    raise RankFailedError(
        f"rank {rank} failed while {stage} with {name}: {message}; every rank stopped with it "
        f"(the traceback is in rank {rank}'s log)",
        rank=rank,
    )


def _share_trial(comm: _Comm, trial: Trial | None) -> list[Trial | None]:
    """Collective: every rank's trial figures (``None`` for a rank whose trial raised)."""
    if trial is None:
        row = [-1.0] * len(_FIELDS)
    else:
        row = [float(trial.fits), trial.peak_bytes, trial.reserved_bytes, trial.forward_backward_bytes,
               trial.optimizer_bytes, -1.0 if trial.resident_bytes is None else trial.resident_bytes,
               -1.0 if trial.seconds_per_step is None else trial.seconds_per_step, trial.alloc_retries]
    mine = torch.tensor(row, dtype=torch.float64, device=comm.device)
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    return _collective(comm, "sharing a trial", lambda: dist.all_gather(rows, mine, async_op=True),
                       lambda: [_row_to_trial(trial.batch if trial else 0, r.tolist()) for r in rows])


def _row_to_trial(batch: int, row: list[float]) -> Trial | None:
    if row[0] < 0:
        return None
    fits, peak, reserved, fb, opt, resident, seconds, retries = row
    return Trial(
        batch=batch, fits=bool(fits), peak_bytes=int(peak), reserved_bytes=int(reserved),
        forward_backward_bytes=int(fb), optimizer_bytes=int(opt),
        resident_bytes=None if resident < 0 else int(resident), seconds_per_step=None if seconds < 0 else seconds,
        error=None if fits else "out of memory", alloc_retries=int(retries),
    )


def _agreed(batch: int, trials: list[Trial]) -> Trial:
    failed = [r for r, t in enumerate(trials) if not t.fits]
    fits = not failed
    return Trial(
        batch=batch,
        fits=fits,
        peak_bytes=max(t.peak_bytes for t in trials),
        reserved_bytes=max(t.reserved_bytes for t in trials),
        forward_backward_bytes=max(t.forward_backward_bytes for t in trials),
        optimizer_bytes=max(t.optimizer_bytes for t in trials),
        resident_bytes=max(t.resident_bytes or 0 for t in trials) if fits else None,
        # The slowest rank sets the pace of a synchronous step.
        seconds_per_step=max(t.seconds_per_step or 0.0 for t in trials) if fits else None,
        error=None if fits else "out of memory on rank " + ", ".join(map(str, failed)),
        alloc_retries=max(t.alloc_retries for t in trials),
    )


def _warm_up(comm: _Comm, model: torch.nn.Module) -> None:
    """Collective: one all-reduce the size of a DDP gradient bucket (at most 25 MiB) on the comm device."""
    grads = sum(p.numel() for p in model.parameters() if p.requires_grad)
    size = max(1, min(grads, _BUCKET_BYTES // 4)) if comm.device.type == "cuda" else 1
    bucket = torch.zeros(size, dtype=torch.float32, device=comm.device)
    _collective(comm, "setting up the communicator", lambda: dist.all_reduce(bucket, async_op=True))
    del bucket


# --- the probe ------------------------------------------------------------------------------


def _rank_report(rank: int, local_rank: int, host: str, device: DeviceInfo, trials: list[Trial]) -> RankReport:
    fits = [t.batch for t in trials if t.fits]
    fails = [t.batch for t in trials if not t.fits]
    phases = phase_points(tuple(trials))
    resident = next((t.resident_bytes for t in reversed(trials) if t.resident_bytes is not None), None)
    predicted = predict_batch(phases, resident, device.capacity_bytes) if fits else None
    return RankReport(
        rank=rank, local_rank=local_rank, host=host, device=device,
        largest_fit=max(fits, default=0), smallest_failure=min(fails, default=None),
        predicted_max=predicted, trials=tuple(trials),
    )


def probe_distributed(
    workload: Workload,
    backend: MemoryBackend | None = None,
    *,
    max_batch: int | None = None,
    min_batch: int | None = None,
    headroom: float | int | str = DEFAULT_HEADROOM,
    wrap: str | None = "ddp",
    local_rank: int | None = None,
    on_trial: Callable[[Trial], None] | None = None,
    timeout_s: float | None = None,
    strategy: Strategy | str | None = None,
    deepspeed_config: dict[str, Any] | None = None,
) -> DistributedProbeResult:
    """Probe the largest per-rank batch on every rank of the process group, in lockstep.

    Call it on every rank (under ``torchrun``, ``accelerate launch`` or
    :func:`autobatch.distributed.spawn_local`), inside an initialized process group; each rank
    probes its own device. All ranks return the same result.

    Args:
        workload: what to train; the same on every rank.
        backend: this rank's device; default this rank's GPU (``cuda:<local rank>``).
        max_batch: an explicit cap on the per-rank batch.
        min_batch: the smallest batch allowed; default 2 for models with BatchNorm, else 1.
        headroom: kept free for ``safe_batch``, of the smallest capacity: a fraction or a size.
        wrap: ``"ddp"`` trains under ``DistributedDataParallel`` when the world has more than
            one rank (its gradient buckets cost memory, as in training); ``None`` trains the bare model.
        local_rank: for the report; default ``LOCAL_RANK`` from the environment.
        on_trial: called with each agreed trial (on every rank; print on rank 0 only).
        timeout_s: seconds a rank waits for the others at each agreement before it stops with
            one clear error (whatever the process group's own timeout); default
            :data:`DEFAULT_TIMEOUT_S`.
        strategy: ``"ddp"``, ``"fsdp2"``, ``"fsdp1"``, ``"zero1"``, ``"zero2"`` or ``"zero3"``:
            each trial wraps a fresh copy of the model as that strategy shards it over this
            process group (:func:`~autobatch.distributed.sharded_trial.run_sharded_trial`), and
            decides fit at the step's end, so no rank leaves the others inside a collective on a
            simulated budget. ``wrap`` is then ignored.
        deepspeed_config: the user's DeepSpeed config, whose bucket sizes a ZeRO strategy uses.

    Example:
        >>> # torchrun --nproc-per-node 2 script.py, with in script.py:
        >>> # with autobatch.distributed.process_group():
        >>> #     result = probe_distributed(work, SimulatedBackend("1GiB"))
        >>> #     if dist.get_rank() == 0: print(result)
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise AutobatchError(
            "probe_distributed needs an initialized torch.distributed process group, but there is none; "
            "run under torchrun, or inside `with autobatch.distributed.process_group():`, or use autobatch.probe"
        )
    chosen = parse_strategy(strategy) if strategy is not None else None
    if wrap not in (None, "ddp"):
        raise AutobatchError(f"wrap must be 'ddp' or None, but got wrap={wrap!r}")
    for name, value in (("max_batch", max_batch), ("min_batch", min_batch)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise AutobatchError(f"{name} must be a positive integer, but got {name}={value!r}")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", rank)) if local_rank is None else local_rank
    use_ddp = wrap == "ddp" and world > 1 and chosen is None

    model = error = None
    needed = min_batch or 1
    try:
        if backend is None:
            backend = make_backend("cuda" if torch.cuda.is_available() else "cpu")  # cuda: this rank's GPU
        model = workload.model if isinstance(workload.model, torch.nn.Module) else workload.model()
        if not isinstance(model, torch.nn.Module):
            raise AutobatchError(f"the model factory must return a torch.nn.Module, but it returned {type(model).__name__}")
        needed = min_batch if min_batch is not None else min_batch_for(model)
    except Exception as exc:
        error = exc
    comm = _Comm(_comm_device(backend), DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s)
    _agree_on_errors(comm, error, "setting up")  # past this line every rank has a backend and a model
    if chosen is not None:
        chosen = with_unit(chosen, model)  # the block FSDP wraps, named in the report and the configs

    # Training all-reduces gradient buckets; the trials (under no_sync) never do. The first such
    # collective sets up NCCL's communicator, whose buffers take memory outside the allocator:
    # run one now, then read the capacity, so the probe leaves room for them.
    _warm_up(comm, model)
    backend.remeasure()
    # The search must see the same capacity everywhere: the smallest one.
    agreed = torch.tensor([-float(backend.capacity()), float(needed)], dtype=torch.float64, device=comm.device)
    capacity, min_batch = _collective(
        comm, "agreeing on capacity", lambda: dist.all_reduce(agreed, op=dist.ReduceOp.MAX, async_op=True),
        lambda: (int(-agreed[0].item()), int(agreed[1].item())))
    if max_batch is not None and max_batch < min_batch:
        raise AutobatchError(f"max_batch ({max_batch}) must be at least min_batch ({min_batch})")
    headroom_bytes = resolve_headroom(headroom, capacity)
    local_trials: list[list[Trial]] = [[] for _ in range(world)]
    breakdowns: dict[int, Any] = {}
    configs: dict[int, dict[str, Any]] = {}

    def run(batch: int, net: torch.nn.Module) -> Trial:
        mine = failure = None
        try:
            if chosen is None:
                mine = run_trial(workload, net, backend, batch)
            else:  # a fresh wrapped copy of the (CPU) model per trial, on this process group
                done = run_sharded_trial(workload, model, chosen, backend, batch, deepspeed_config=deepspeed_config)
                mine, breakdowns[batch], configs[batch] = done.trial, done.breakdown, done.config
        except Exception as exc:  # run_trial turned OOM into a trial already
            failure = exc
        shared = _share_trial(comm, mine)
        if any(t is None for t in shared):
            _agree_on_errors(comm, failure, f"running the trial at batch {batch}")
        trials = [replace(t, batch=batch) for t in shared if t is not None]
        for r, t in enumerate(trials):
            local_trials[r].append(t)
        trial = _agreed(batch, trials)
        if on_trial is not None:
            on_trial(trial)
        return trial

    owned = not isinstance(workload.model, torch.nn.Module)
    with ExitStack() as stack:
        # Moving the weights, and DDP's buckets, can run out of memory on one rank while the others
        # would wait for it in DDP's collectives: agree on that too.
        net = error = None
        if chosen is None:  # a sharded trial wraps its own copy; the model stays where it is
            try:
                net = stack.enter_context(
                    borrowed_model(model, backend.device, grad_checkpointing=workload.grad_checkpointing))
            except Exception as exc:
                error = weights_error(exc, backend, "the model's weights")
            _agree_on_errors(comm, error, "moving the model to its device")
        if use_ddp:
            try:
                net = stack.enter_context(ddp_for_trials(net, backend))
            except Exception as exc:  # out of memory for the buckets alone, or one of DDP's checks
                error = weights_error(exc, backend, "the model's weights and DDP's gradient buckets")
            _agree_on_errors(comm, error, "wrapping the model in DistributedDataParallel")
        outcome = search_max(lambda b: run(b, net), capacity, min_batch=min_batch, max_batch=max_batch)
        net = None  # the wrapper's gradient buckets die with the last reference
    if owned:
        del model
    backend.release()

    me = (local_rank, socket.gethostname(), backend.info().to_dict())
    everyone: list[Any] = [None] * world
    _collective(comm, "gathering the rank reports", lambda: dist.all_gather_object(everyone, me))
    reports = tuple(
        _rank_report(r, lr, host, DeviceInfo(**info), local_trials[r]) for r, (lr, host, info) in enumerate(everyone)
    )
    if outcome.max_batch == 0:
        failed = ", ".join(str(r.rank) for r in reports if not r.trials[0].fits)
        raise NoBatchFitsError(
            f"even a batch of {min_batch} runs out of memory on rank(s) {failed} "
            f"(smallest capacity {format_bytes(capacity)}, reached {format_bytes(outcome.trials[0].reserved_bytes)}); "
            "use a shorter sequence, bf16, gradient checkpointing, a smaller model or larger devices"
        )
    failed_at = min((t.batch for t in outcome.trials if not t.fits), default=None)
    limiting = () if outcome.limited_by == "max_batch" or failed_at is None else tuple(
        r.rank for r in reports if any(t.batch == failed_at and not t.fits for t in r.trials)
    )
    summary = summarise(outcome.trials, outcome.max_batch, capacity - headroom_bytes)
    return DistributedProbeResult(
        max_batch=outcome.max_batch,
        safe_batch=summary.safe_batch,
        limited_by=outcome.limited_by,
        min_batch=min_batch,
        world_size=world,
        trials=outcome.trials,
        ranks=reports,
        limiting_ranks=limiting,
        capacity_bytes=capacity,
        headroom_bytes=headroom_bytes,
        bytes_per_sample=summary.bytes_per_sample,
        fixed_bytes=summary.fixed_bytes,
        safe_peak_bytes=summary.safe_peak_bytes,
        safe_peak_measured=summary.safe_peak_measured,
        wrapped="ddp" if use_ddp else None if chosen is None else chosen.label,
        workload=workload.name,
        extra={} if chosen is None else {"sharding": sharding_report(
            chosen, world, breakdowns.get(outcome.max_batch), configs.get(outcome.max_batch), simulated=False)},
    )

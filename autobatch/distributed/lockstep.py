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

import gc
import socket
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from ..errors import AutobatchError, NoBatchFitsError
from ..modelinfo import batchnorm_record, min_batch_for
from ..probing.backends import DeviceInfo, MemoryBackend
from ..probing.heap import frozen_heap
from ..probing.oom import is_oom_error
from ..probing.pending import stopped
from ..probing.preserve import borrowed_model
from ..probing.probe import (
    DEFAULT_HEADROOM,
    make_backend,
    phase_points,
    prior_report,
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
from .environment import is_launched, rank_env
from .fence import TrialFence, is_stopped_by_peer
from .launch import DEFAULT_TIMEOUT_S, rank_gpu
from .own_limits import own_limits
from .agreement import Comm, agree_on_errors, agreed_prior, agreed_trial, collective, comm_device, share_trial, warm_up
from .result import DistributedProbeResult, RankReport
from .sharded_trial import off_the_gpu, run_sharded_trial
from .sharding import with_unit
from .simulated_world import sharding_report

__all__ = ["probe_distributed"]

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
    prior: Callable[[int], float] | None = None,
    each_rank: bool = False,
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
        prior: the predicted peak at any batch that leads the search, as in
            :func:`~autobatch.probing.search.search_max` (e.g. ``try_trace_prior(workload)``, built
            before the model moves); used only if every rank has one, and every rank reads the
            largest value any rank predicts (:func:`~autobatch.distributed.agreement.agreed_prior`).
        each_rank: after the agreed search, each rank searches on to its own largest batch
            (:func:`~autobatch.distributed.own_limits.own_limits`); the result's ``own_limits``
            gives every rank's, for a plan per rank (:func:`~autobatch.solve_uneven`).

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
    local_rank = (rank_env().local_rank if is_launched() else rank) if local_rank is None else local_rank
    use_ddp = wrap == "ddp" and world > 1 and chosen is None

    model = error = None
    needed = min_batch or 1
    batchnorm: dict[str, list[str]] = {}
    try:
        if backend is None:
            backend = make_backend(f"cuda:{rank_gpu()}" if torch.cuda.is_available() else "cpu")  # this rank's GPU
        model = workload.model if isinstance(workload.model, torch.nn.Module) else workload.model()
        if not isinstance(model, torch.nn.Module):
            raise AutobatchError(f"the model factory must return a torch.nn.Module, but it returned {type(model).__name__}")
        needed = min_batch if min_batch is not None else min_batch_for(model)
        batchnorm = batchnorm_record(model)
        if chosen is not None:  # every rank refuses alike, before any collective could wait on it
            from .simulated_world import offload_on_the_host

            refused = offload_on_the_host(chosen, backend, workload.name, world)
            if refused is not None:
                raise refused
    except Exception as exc:
        error = exc
    comm = Comm(comm_device(backend), DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s)
    agree_on_errors(comm, error, "setting up")  # past this line every rank has a backend and a model
    TrialFence.new_probe()  # every rank counts this probe's trials from here, in lockstep
    if chosen is not None:
        chosen = with_unit(chosen, model)  # the block FSDP wraps, named in the report and the configs

    # Until the search ends, the collections (the capacity's, each trial's) walk only what the probe made.
    with frozen_heap():
        # Training all-reduces gradient buckets; the trials (under no_sync) never do. The first such
        # collective sets up NCCL's communicator, whose buffers take memory outside the allocator:
        # run one now, then read the capacity, so the probe leaves room for them.
        warm_up(comm, model)
        backend.remeasure()
        # The search must see the same capacity everywhere: the smallest one.
        agreed = torch.tensor([-float(backend.capacity()), float(needed)], dtype=torch.float64, device=comm.device)
        capacity, min_batch = collective(
            comm, "agreeing on capacity", lambda: dist.all_reduce(agreed, op=dist.ReduceOp.MAX, async_op=True),
            lambda: (int(-agreed[0].item()), int(agreed[1].item())))
        if max_batch is not None and max_batch < min_batch:
            raise AutobatchError(f"max_batch ({max_batch}) must be at least min_batch ({min_batch})")
        headroom_bytes = resolve_headroom(headroom, capacity)
        local_trials: list[list[Trial]] = [[] for _ in range(world)]
        breakdowns: dict[int, Any] = {}
        configs: dict[int, dict[str, Any]] = {}

        def mine_at(batch: int, net: torch.nn.Module | None) -> Any:
            # Half the agreement's wait: a rank held in a collective the fence could not break
            # (see fence.py) gives up in time to meet the others in the agreement.
            return _rank_trial(workload, net if chosen is None else model, backend, batch, chosen,
                               deepspeed_config, comm.timeout_s / 2)

        def run(batch: int, net: torch.nn.Module) -> Trial:
            mine = failure = None
            try:
                mine = mine_at(batch, net)
                if chosen is not None:
                    mine, breakdowns[batch], configs[batch] = mine.trial, mine.breakdown, mine.config
            except Exception as exc:  # run_trial turned OOM into a trial already
                failure = exc
            shared = share_trial(comm, mine)
            if any(t is None for t in shared):
                agree_on_errors(comm, failure, f"running the trial at batch {batch}")
            trials = [replace(t, batch=batch) for t in shared if t is not None]
            for r, t in enumerate(trials):
                local_trials[r].append(t)
            trial = agreed_trial(batch, trials)
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
                agree_on_errors(comm, error, "moving the model to its device")
            if use_ddp:
                # DDP's constructor broadcasts the weights: a rank out of memory there must not leave the
                # others in the broadcast, so DDP runs on a fenced group (see fence.py).
                fence = stack.enter_context(TrialFence(timeout_s=comm.timeout_s / 2))
                net, error = _wrap_ddp(stack, net, backend, fence)
                if error is not None:
                    net = None
                    gc.collect()
                    fence.take_down()  # the ranks still in DDP's broadcast are freed
                    if is_stopped_by_peer(str(error)):
                        error = None  # the rank that ran out of memory reports it
                agree_on_errors(comm, error, "wrapping the model in DistributedDataParallel")
            if chosen is not None:  # each sharded trial wraps its own copy: the model waits in host memory
                stack.enter_context(off_the_gpu(model))
            with stopped(prior):  # a trace on its thread (asked in lockstep, it ran when first asked) ends here
                outcome = search_max(lambda b: run(b, net), capacity, min_batch=min_batch, max_batch=max_batch,
                                     prior=agreed_prior(comm, prior))
                own = None if not each_rank or outcome.max_batch == 0 else own_limits(
                    comm, lambda b: mine_at(b, net) if chosen is None else mine_at(b, net).trial,
                    local_trials[rank], capacity=backend.capacity(), headroom=headroom, min_batch=min_batch,
                    max_batch=max_batch, lockstep=chosen is not None, prior=prior,
                    timed=backend.device.type == "cuda")
            net = None  # the wrapper's gradient buckets die with the last reference
    if owned:
        del model
    backend.release()  # a full collection again: whatever the probe left, the model included

    me = (local_rank, socket.gethostname(), backend.info().to_dict())
    everyone: list[Any] = [None] * world
    collective(comm, "gathering the rank reports", lambda: dist.all_gather_object(everyone, me))
    reports = tuple(
        _rank_report(r, lr, host, DeviceInfo(**info), local_trials[r]) for r, (lr, host, info) in enumerate(everyone)
    )
    if outcome.max_batch == 0:
        failed = ", ".join(str(r.rank) for r in reports
                       if not r.trials[0].fits and not is_stopped_by_peer(r.trials[0].error))
        raise NoBatchFitsError(
            f"even a batch of {min_batch} runs out of memory on rank(s) {failed} "
            f"(smallest capacity {format_bytes(capacity)}, reached {format_bytes(outcome.trials[0].reserved_bytes)}); "
            "use a shorter sequence, bf16, gradient checkpointing, a smaller model or larger devices"
        )
    failed_at = min((t.batch for t in outcome.trials if not t.fits), default=None)
    limiting = () if outcome.limited_by == "max_batch" or failed_at is None else tuple(
        r.rank for r in reports
        if any(t.batch == failed_at and not t.fits and not is_stopped_by_peer(t.error) for t in r.trials)
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
        own_limits=own,
        workload=workload.name,
        extra={**prior_report(prior), **batchnorm, **({} if chosen is None else {"sharding": sharding_report(
            chosen, world, breakdowns.get(outcome.max_batch), configs.get(outcome.max_batch), simulated=False)})},
    )


def _rank_trial(workload: Workload, net: torch.nn.Module, backend: MemoryBackend, batch: int,
                chosen: Strategy | None, deepspeed_config: dict[str, Any] | None, timeout_s: float) -> Any:
    """This rank's trial at ``batch``: the (DDP) model's step (a :class:`Trial`), or a fresh wrapped copy
    of the (CPU) model on its own fenced process group (a ``ShardedTrial``, with its breakdown and config)."""
    if chosen is None:
        return run_trial(workload, net, backend, batch)
    with TrialFence(timeout_s=timeout_s) as fence:
        return run_sharded_trial(workload, net, chosen, backend, batch, deepspeed_config=deepspeed_config,
                                 fence=fence)


def _wrap_ddp(stack: ExitStack, model: torch.nn.Module, backend: MemoryBackend,
              fence: TrialFence) -> tuple[torch.nn.Module | None, Exception | None]:
    """DDP around ``model`` on the fence's group, entered on ``stack``; or this rank's error."""
    try:
        return stack.enter_context(ddp_for_trials(model, backend, group=fence.group)), None
    except Exception as exc:  # out of memory for the buckets alone, or one of DDP's checks
        if is_oom_error(exc):
            fence.out_of_memory()
        else:
            stopped = fence.peer_failure()
            if stopped is not None:
                return None, AutobatchError(stopped)
        return None, weights_error(exc, backend, "the model's weights and DDP's gradient buckets")

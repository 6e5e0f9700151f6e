"""``find_plan``: probe the largest per-device batch of a workload, then solve the plan for a target global batch."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from .errors import AutobatchError, NoBatchFitsError, option
from .estimating.background import TracedBeside, beside, between, spawned_between, traced_between, unpaused
from .estimating.prior import GuardedPrior, try_trace_prior
from .planning.plan import Plan
from .planning.solver import solve
from .probing.backends import MemoryBackend
from .probing.probe import DEFAULT_HEADROOM, NOTHING_FITS_FIX, ProbeResult, for_data_parallel, make_backend
from .probing.search import NoTrace
from .probing.trial import Trial
from .probing.workload import Workload
from .strategy import Strategy, parse_strategy
from .units import format_bytes

__all__ = ["Finding", "booked_as", "data_parallel_ranks", "trace_prior_for", "find_plan", "plan_from_probe", "plan_summary",
           "probe_worker", "probed_strategy", "local_gpu_count", "sharded_trace_prior", "sharded_prior_in_its_world",
           "launched_prior", "TURNED_OFF"]

log = logging.getLogger("autobatch.estimating.prior")  # the trace prior's one logger, wherever it is built


@dataclass(frozen=True)
class Finding:
    """One row of an answer: the probe (or estimate) and the plan built on its safe batch (``None``
    for an estimate without a target)."""

    probe: ProbeResult
    plan: Plan | None
    cached: bool = False
    ranks_report: str | None = None  # the per-rank table when every rank probed its own device
    strategy: Strategy | None = None  # how the model was wrapped for the trials (None: bare, or DDP under a launcher)

    @property
    def probed_zero(self) -> dict[str, Any] | None:
        """The ``zero_optimization`` values a ZeRO probe ran with (for the DeepSpeed file)."""
        return (self.probe.extra.get("sharding") or {}).get("deepspeed_zero_optimization")

    def to_dict(self) -> dict[str, Any]:
        """One value per figure: ``max_batch``/``safe_batch`` are the probe's, the plan's own
        limits (``max_micro`` is the safe batch it was allowed) live under ``plan``."""
        return {
            **plan_summary(self.plan),
            "max_batch": self.probe.max_batch,
            "safe_batch": self.probe.safe_batch,
            "plan": None if self.plan is None else self.plan.to_dict(),
            "probe": self.probe.to_dict(),
            "trials": [t.to_dict() for t in self.probe.trials],
            "trace_prior": self.probe.trace_record,  # whether the trace led the search, and why not
            "estimated": False,
            "cached": self.cached,
            **({"strategy": self.strategy.to_dict()} if self.strategy is not None else {}),
        }

    def __str__(self) -> str:
        return f"{self.probe}{' (cached)' if self.cached else ''}\nplan: {self.plan.describe()}"


def plan_summary(plan: Plan | None) -> dict[str, Any]:
    """The plan's numbers for the top level of a JSON answer, without its ``max_micro``: next to a
    probe's ``max_batch`` that name read as the largest batch that fits, which it is not (none
    without a plan)."""
    return {} if plan is None else {k: v for k, v in plan.to_dict().items() if k != "max_micro"}


def local_gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def plan_from_probe(
    result: ProbeResult,
    *,
    target: int | None = None,
    gpus_per_node: int = 1,
    nodes: int = 1,
    model_parallel: int = 1,
    multiple_of: int | None = None,
    base_lr: float | None = None,
    base_batch: int | None = None,
) -> Plan:
    """The plan for ``target`` with the probe's safe batch as the largest micro batch.

    Without a ``target`` the plan is the safe batch on every GPU with no accumulation. With more
    than one data-parallel rank, a probe of one bare device leaves room for DDP's gradient
    buckets first (:func:`~autobatch.probing.probe.for_data_parallel`).
    """
    if result.max_batch < result.min_batch:  # a length table's row where nothing fit: the probe's own error
        reached = max((t.reserved_bytes for t in result.trials), default=None)
        raise NoBatchFitsError(
            f"even a batch of {result.min_batch} runs out of memory on {result.device.name} (capacity "
            f"{format_bytes(result.capacity_bytes)}{'' if reached is None else ', reached ' + format_bytes(reached)}); "
            f"{NOTHING_FITS_FIX}")
    result = for_data_parallel(result, data_parallel_ranks(gpus_per_node, nodes, model_parallel))
    if result.safe_batch < result.min_batch:
        raise AutobatchError(
            f"no batch keeps the headroom ({result.headroom_bytes} bytes): even the smallest batch "
            f"({result.min_batch}) peaks above capacity minus headroom; lower {option('headroom')} "
            f"(max batch without it: {result.max_batch})"
        )
    if target is None:
        return Plan(result.safe_batch, 1, gpus_per_node=gpus_per_node, nodes=nodes, model_parallel=model_parallel,
                    max_micro=result.safe_batch, min_micro=result.min_batch,
                    reason="the safe batch on every GPU, no accumulation (no target given)")
    return solve(target, gpus_per_node, nodes, result.safe_batch, min_micro=result.min_batch,
                 multiple_of=multiple_of, model_parallel=model_parallel, base_lr=base_lr, base_batch=base_batch)


def find_plan(
    workload: Workload,
    *,
    target: int | None = None,
    gpus_per_node: int | None = None,
    nodes: int = 1,
    model_parallel: int = 1,
    backend: MemoryBackend | None = None,
    headroom: float | int | str = DEFAULT_HEADROOM,
    max_batch: int | None = None,
    min_micro: int | None = None,
    multiple_of: int | None = None,
    base_lr: float | None = None,
    base_batch: int | None = None,
    on_trial: Callable[[Trial], None] | None = None,
    use_cache: bool = False,
    cache_root: Path | None = None,
    strategy: Strategy | str | None = None,
    deepspeed_config: dict[str, Any] | None = None,
    use_trace_prior: bool = True,
    lead: Any = None,
) -> Finding:
    """Probe ``workload`` on ``backend`` and solve for ``target`` with the safe batch as the limit.

    ``gpus_per_node`` defaults to the GPUs visible here (1 on a CPU-only machine). With
    ``use_cache`` a probe already made for the same fingerprint is read from disk
    (:mod:`autobatch.cache`) instead of run again.

    With a ``strategy`` (``"ddp"``, ``"fsdp2"``, ``"fsdp1"``, ``"zero1"``, ``"zero2"``, ``"zero3"``)
    the trials train the model wrapped as that strategy will, as rank 0 of the data-parallel
    world (``gpus_per_node × nodes / model_parallel`` ranks) on torch's fake process group
    (:func:`autobatch.distributed.simulated_world.probe_sharded`): the answer is per rank, for
    that many GPUs, from one device. Such probes are not cached. ``deepspeed_config`` is the
    user's DeepSpeed file, whose bucket sizes a ZeRO probe uses. An estimate's sharded search may be
    led by another strategy's traced trials (``lead``: an :class:`~autobatch.estimating.lead.RowLead`).

    With ``use_trace_prior`` (the default) an unwrapped probe's search is led by the fake-tensor
    trace of the same step (:func:`~autobatch.estimating.prior.try_trace_prior`), calibrated
    against the real trials: fewer trials, the same exact answer (it rests on trials that fit
    and fail). A sharded probe's trace is the step wrapped as ``strategy`` wraps it
    (:func:`sharded_trace_prior`): for a model built from its name, traced by a process of its own on
    the CPU the trials leave idle (:func:`~autobatch.estimating.background.spawned_between`), else
    run between the trials, never for longer than they have taken
    (:func:`~autobatch.estimating.background.traced_between`). A model the trace cannot follow is
    searched from its trials alone; ``False`` skips the trace (CLI: ``--no-trace-prior``).
    """
    from .tuning.cache import cached_probe

    backend = backend if backend is not None else make_backend()
    if gpus_per_node is None:
        gpus_per_node = max(1, local_gpu_count()) if backend.device.type == "cuda" else 1
    chosen = parse_strategy(strategy) if strategy is not None else None
    if chosen is not None:
        from .distributed.simulated_world import probe_sharded

        world = data_parallel_ranks(gpus_per_node, nodes, model_parallel)
        if getattr(backend, "fake_mode", None) is not None:  # an estimate: its trials are traces already
            from .estimating.estimate import IS_THE_TRACE

            prior: Any = NoTrace(IS_THE_TRACE) if lead is None else lead
            if lead is not None:
                seen = on_trial

                def on_trial(trial: Trial) -> None:
                    lead.saw(trial)
                    if seen is not None:
                        seen(trial)
        elif use_trace_prior:
            # A sharded step's trace (a wrapped fake copy) costs seconds a batch, more than a small model's
            # trials save: a model built from its name is traced by a process of its own, on the CPU the
            # trials leave idle; one passed in between the trials, never for longer than they have taken.
            in_its_world = partial(sharded_prior_in_its_world, strategy=chosen, world=world,
                                   deepspeed_config=deepspeed_config)
            prior = spawned_between(workload, min_batch=min_micro, allocator=booked_as(backend),
                                    device_type=backend.device.type, traced=in_its_world) \
                or traced_between(lambda: sharded_trace_prior(
                    workload, chosen, min_batch=min_micro, allocator=booked_as(backend),
                    deepspeed_config=deepspeed_config, device_type=backend.device.type))
        else:
            prior = NoTrace(TURNED_OFF)
        result = probe_sharded(workload, backend, chosen, world, max_batch=max_batch, min_batch=min_micro,
                               headroom=headroom, deepspeed_config=deepspeed_config, on_trial=on_trial, prior=prior)
        cached = False
    else:
        def make_prior() -> Callable[[int], float] | NoTrace | None:
            return trace_prior_for(workload, backend, min_batch=min_micro) if use_trace_prior else NoTrace(TURNED_OFF)

        result, cached = cached_probe(workload, backend, max_batch=max_batch, min_batch=min_micro,
                                      headroom=headroom, on_trial=on_trial, use_cache=use_cache, root=cache_root,
                                      make_prior=make_prior)
        # an unwrapped probe on one device: DDP's buckets are taken off for several ranks
        result = for_data_parallel(result, data_parallel_ranks(gpus_per_node, nodes, model_parallel))
    plan = plan_from_probe(result, target=target, gpus_per_node=gpus_per_node, nodes=nodes,
                           model_parallel=model_parallel, multiple_of=multiple_of, base_lr=base_lr,
                           base_batch=base_batch)
    return Finding(result, plan, cached=cached, strategy=probed_strategy(result, chosen))


def sharded_trace_prior(workload: Workload, strategy: Strategy, *, min_batch: int | None = None,
                        allocator: str = "exact", deepspeed_config: dict[str, Any] | None = None,
                        device_type: str = "cuda") -> Callable[[int], float] | None:
    """The sharded step traced on fake tensors as the search's prior, for :func:`probe_sharded`.

    A fake copy of the model is wrapped as ``strategy`` wraps it, on the probe's own fake
    process group (the traces run when the search first asks, inside it), and replayed at any
    batch as :func:`~autobatch.estimating.prior.trace_prior` replays a plain step. DDP's reducer
    reads its tensors' data, so ``ddp`` takes the plain step's trace (its buckets are a constant
    the calibration absorbs). ``None`` where the model cannot be copied onto fake tensors; a
    trace that fails later makes the prior NaN, and the trials alone answer. Mixed precision casts
    as ``device_type``'s autocast does.
    """
    from .distributed.sharded_trial import run_sharded_trial
    from .estimating.estimate import fake_model
    from .estimating.fake_backends import _mode_of, _new_fake_mode, fake_backend
    from .estimating.prior import guarded_prior, phase_peaks, replayed_prior
    from .modelinfo import min_batch_for

    if strategy.name == "ddp":
        return try_trace_prior(workload, min_batch=min_batch, allocator=allocator, device_type=device_type)
    try:
        with torch.random.fork_rng(devices=[]):
            template = fake_model(workload.model, _mode_of(workload.model) or _new_fake_mode())
    except Exception as exc:  # any failure only costs the prior; the probe says why
        log.debug("no trace prior for %s under %s (%s: %s)", workload.name, strategy.label, type(exc).__name__, exc)
        return GuardedPrior.failed(workload.name, exc)
    first = min_batch if min_batch is not None else min_batch_for(template)

    def trace(batch: int, record: Any) -> tuple[float, float]:
        backend = fake_backend(template, 1 << 62, log=record, recomputed=workload.grad_checkpointing,
                               cuda_autocast=device_type == "cuda")
        with unpaused():  # a trace between the trials pauses before or after the wrapped copy, never in it
            return phase_peaks(run_sharded_trial(workload, template, strategy, backend, batch,
                                                 deepspeed_config=deepspeed_config).trial)

    return guarded_prior(replayed_prior(trace, first, allocator=allocator, name=workload.name), workload.name)


@contextmanager
def sharded_prior_in_its_world(workload: Workload, *, strategy: Strategy, world: int,
                               deepspeed_config: dict[str, Any] | None, min_batch: int | None, allocator: str,
                               device_type: str) -> Iterator[Callable[[int], float] | None]:
    """:func:`sharded_trace_prior` on a fake process group of ``world`` ranks, open for the block: how
    the trace's own process (:mod:`autobatch.estimating.spawned_child`) traces a sharded probe's step,
    as the probe's traces run inside its own fake group."""
    from .distributed.fake_group import fake_process_group

    with fake_process_group(world):
        yield sharded_trace_prior(workload, strategy, min_batch=min_batch, allocator=allocator,
                                  deepspeed_config=deepspeed_config, device_type=device_type)


# Why the trials alone searched, as the result records it (extra["trace_prior"]["reason"]).
TURNED_OFF = "the trace was turned off (--no-trace-prior, trace_prior=False)"
SHARDED_UNDER_A_LAUNCHER = ("a sharded probe under a launcher searches from its trials alone (the sharded step is "
                            "traced on a fake process group, which the job's own group leaves no room for)")


def launched_prior(workload: Workload, backend: MemoryBackend, use_trace_prior: bool, strategy: Any,
                   min_batch: int | None) -> GuardedPrior | NoTrace | None:
    """The prior of one rank's lockstep probe: the trace of its unsharded step, or why there is none."""
    if not use_trace_prior:
        return NoTrace(TURNED_OFF)
    if strategy is not None:
        return NoTrace(SHARDED_UNDER_A_LAUNCHER)
    return trace_prior_for(workload, backend, min_batch=min_batch)


def data_parallel_ranks(gpus_per_node: int, nodes: int = 1, model_parallel: int = 1) -> int:
    """The data-parallel ranks of a job (at least one): its GPUs over the model-parallel degree.

    Example:
        >>> data_parallel_ranks(8, 2, model_parallel=4)
        4
    """
    return max(1, gpus_per_node * nodes // max(1, model_parallel))


def trace_prior_for(workload: Workload, backend: MemoryBackend, *,
                    min_batch: int | None = None) -> TracedBeside | GuardedPrior | None:
    """The fake-tensor trace as the prior of a probe on ``backend``, booked as ``backend`` books memory;
    on a GPU traced beside the trials (:mod:`~autobatch.estimating.background`), leading once ready.

    :func:`~autobatch.estimating.prior.try_trace_prior` with the allocator of :func:`booked_as`:
    ``None`` where the model cannot be copied onto fake tensors, and the trials alone search.
    On a simulated budget the trials run on the same CPU as the trace, so there it runs between
    them, never for longer than they have taken (:func:`~autobatch.estimating.background.between`).
    """
    if backend.device.type == "cuda":
        return beside(workload, min_batch=min_batch, allocator=booked_as(backend), device_type="cuda")
    return between(workload, min_batch=min_batch, allocator=booked_as(backend), device_type=backend.device.type)


def booked_as(backend: MemoryBackend) -> str:
    """How ``backend`` books memory, for the prior to replay the same way: ``"caching"`` on a CUDA
    device or the simulated caching-allocator model (a staircase), else ``"exact"`` tensor bytes."""
    return "caching" if backend.device.type == "cuda" or getattr(backend, "allocator", None) == "caching" else "exact"


def probed_strategy(result: ProbeResult, asked: Strategy | None) -> Strategy | None:
    """The strategy as the probe ran it: with the FSDP block class it wrapped when none was asked
    for, so the configs written from the result wrap the same way."""
    ran = (result.extra.get("sharding") or {}).get("strategy") or {}
    if asked is None or asked.unit is not None or not ran.get("unit"):
        return asked
    return Strategy(asked.name, asked.offload, ran["unit"])


def probe_worker(model: str, load: dict[str, Any], settings: dict[str, Any], options: dict[str, Any],
                 memory: str | None = None) -> tuple[ProbeResult, str]:
    """One rank of a ``find`` that started its own workers: probe this rank's device in lockstep.

    Module level and built from plain arguments, because workers receive it pickled (a
    workload's lambdas do not pickle). Returns the agreed result and the per-rank report.
    """
    from contextlib import nullcontext

    from .distributed.launch import probe_distributed
    from .estimating.spawned import named_workload, warmed

    options = dict(options)
    traced = options.pop("use_trace_prior", True)
    # its trace beside the trials builds it again in a process of its own, started as it is built here
    with warmed() if traced and options.get("strategy") is None else nullcontext():
        workload = named_workload(model, load, settings)
        device = "cpu" if memory is not None else "cuda"  # this rank's GPU (resolve_cuda_device)
        backend = make_backend(device, memory)
        prior = launched_prior(workload, backend, traced, options.get("strategy"), options.get("min_batch"))
        result = probe_distributed(workload, backend, prior=prior, **options)
    return result.to_probe_result(), str(result)

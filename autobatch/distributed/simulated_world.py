"""Probe a strategy for W ranks from one process: the real wrapper as rank 0 of W on the fake group.

Without a launcher, ``find --gpus W --strategy zero3`` cannot run W processes on one CPU (or
one GPU), and does not need to: every rank of FSDP and ZeRO holds the same shapes, and rank 0's
shard is never smaller than another's (the padding goes to the last ones). So one process joins
torch's fake process group as rank 0 of W (:func:`~autobatch.distributed.fake_group.fake_process_group`)
and runs the probe's search over real sharded trials
(:func:`~autobatch.distributed.sharded_trial.run_sharded_trial`) on its own backend: a simulated
budget, or the GPU it has. The answer is a :class:`~autobatch.probing.result.ProbeResult` whose
``extra`` says the strategy, the world size and where each rank's memory goes.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from ..errors import AutobatchError
from ..modelinfo import batchnorm_record, min_batch_for
from ..probing.backends import MemoryBackend
from ..probing.heap import frozen_heap
from ..probing.memory_curve import last_kept
from ..probing.probe import DEFAULT_HEADROOM, prior_report, resolve_headroom, result_from_search
from ..probing.result import ProbeResult
from ..probing.search import NoTrace, SearchOutcome, search_max
from ..probing.trial import Trial
from ..probing.workload import Workload
from ..strategy import Strategy, parse_strategy
from .fake_group import fake_process_group
from .sharded_trial import MemoryBreakdown, ShardedTrial, off_the_gpu
from .traced_trials import sharded_trials
from .sharding import host_apart, with_unit

__all__ = ["probe_sharded", "sharding_report", "offload_on_the_host"]

# Strategies under which no rank holds more than rank 0, so only rank 0 plays. DDP: every rank the
# same. FSDP2: every rank's padded shard, gathered unit and reduce-scatter output have the same size,
# and what is sized by the unpadded shard (its optimizer state, its gradient's view) is largest on
# rank 0, whose chunk (torch.chunk's first) is never smaller than another's. ZeRO-3: every rank's
# partition of a parameter is its padded size over the world (DeepSpeed's ``_aligned_size(p) //
# world``), and its flat groups, gradient partitions and buckets are made of those, so every rank
# allocates the same sizes (tests/test_worst_rank.py: real steps on every rank, fp32 and bf16).
# FSDP1: every rank's flat shard is the padded size; the views of it its optimizer keeps state for
# differ by rank, so ranks differ by a few hundred bytes either way (gpt2 on 3 to 8 ranks: at most
# 144 bytes above rank 0, of 1.26 GB), mostly at middle ranks, which the last rank's play never
# found: rank 0 plays alone here too (tests/test_worst_rank.py bounds the difference).
_RANK_0_HOLDS_MOST = ("ddp", "fsdp2", "zero3", "fsdp1")


def sharding_report(strategy: Strategy, world_size: int, breakdown: MemoryBreakdown | None,
                    config: dict[str, Any] | None = None, *, simulated: bool = True) -> dict[str, Any]:
    """What a sharded probe adds to a result's ``extra["sharding"]``."""
    report: dict[str, Any] = {"strategy": strategy.to_dict(), "world_size": world_size,
                              "simulated_world": simulated}
    if breakdown is not None:
        report["per_rank"] = breakdown.to_dict()
    zero = (config or {}).get("zero_optimization")
    if zero:
        report["deepspeed_zero_optimization"] = zero
    return report


def offload_on_the_host(strategy: Strategy, backend: MemoryBackend, name: str, world_size: int) -> AutobatchError | None:
    """The error for an offloading strategy probed with real steps on the CPU, where the host is the
    simulated device itself (a trace whose host is apart, on ``cpu:0``, tells the two apart); else None."""
    if strategy.offload is None or backend.device.type != "cpu" or host_apart(backend.device):
        return None
    asked = f"--strategy {strategy.name} --offload {strategy.offload}"
    configs = "--deepspeed ds.json" if strategy.is_deepspeed else "--accelerate accelerate.yaml"
    return AutobatchError(
        f"offload={strategy.offload!r} moves state to host memory, which on the CPU is the simulated device "
        "itself, so it cannot be probed here; probe it on a GPU, estimate it on fake tensors "
        f"(`autobatch estimate --model {name} --gpus {world_size} {asked}`), or probe without --offload "
        f"and write it into the configs with `autobatch solve --target GLOBAL_BATCH --gpus {world_size} {asked} "
        f"{configs}`")


def probe_sharded(
    workload: Workload,
    backend: MemoryBackend,
    strategy: Strategy | str,
    world_size: int,
    *,
    max_batch: int | None = None,
    min_batch: int | None = None,
    headroom: float | int | str = DEFAULT_HEADROOM,
    deepspeed_config: dict[str, Any] | None = None,
    on_trial: Callable[[Trial], None] | None = None,
    prior: Callable[[int], float] | None = None,
) -> ProbeResult:
    """The exact largest per-rank batch under ``strategy`` on ``world_size`` ranks, probed as rank 0.

    Args:
        workload: what to train; a module passed in is copied for every trial and never changed.
        backend: rank 0's device (e.g. ``SimulatedBackend("16GiB")`` for a 16 GiB GPU).
        strategy: ``"ddp"``, ``"fsdp2"``, ``"fsdp1"``, ``"zero1"``, ``"zero2"``, ``"zero3"`` or a
            :class:`~autobatch.strategy.Strategy`.
        world_size: the data-parallel ranks the strategy shards over.
        max_batch, min_batch, headroom, on_trial: as in :func:`~autobatch.probe`.
        deepspeed_config: the user's DeepSpeed config, whose bucket sizes are used where set.
        prior: the predicted peak at any batch that leads the search (see
            :func:`~autobatch.probing.search.search_max`); called inside this probe's fake process
            group, so it may trace the sharded step on fake tensors (``find`` does).

    Example:
        >>> import torch, autobatch
        >>> blocks = lambda: torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
        >>> work = autobatch.Workload(blocks, lambda b: torch.randn(b, 64))
        >>> result = probe_sharded(work, autobatch.SimulatedBackend("300KiB"), "fsdp2", 4)  # doctest: +SKIP
    """
    strategy = parse_strategy(strategy)
    refused = offload_on_the_host(strategy, backend, workload.name, world_size)
    if refused is not None:
        raise refused
    for name, value in (("max_batch", max_batch), ("min_batch", min_batch)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise AutobatchError(f"{name} must be a positive integer, but got {name}={value!r}")
    capacity = backend.capacity()
    headroom_bytes = resolve_headroom(headroom, capacity)
    template = workload.model if isinstance(workload.model, torch.nn.Module) else workload.model()
    if not isinstance(template, torch.nn.Module):
        raise AutobatchError(f"the model factory must return a torch.nn.Module, but it returned {type(template).__name__}")
    strategy = with_unit(strategy, template)  # the block FSDP wraps, named in the report and the configs
    if min_batch is None:
        min_batch = min_batch_for(template)
    if max_batch is not None and max_batch < min_batch:
        raise AutobatchError(f"max_batch ({max_batch}) must be at least min_batch ({min_batch})")
    breakdowns: dict[tuple[int, int], MemoryBreakdown | None] = {}
    configs: dict[int, dict[str, Any]] = {}

    def runner(rank: int, trial: Callable[[int], ShardedTrial]) -> Callable[[int], Trial]:
        def run(batch: int) -> Trial:
            done = trial(batch)
            breakdowns[rank, batch], configs[batch] = done.breakdown, done.config
            if on_trial is not None:
                on_trial(done.trial)
            return done.trial
        return run

    def trials() -> Any:  # on fake tensors, one wrapped copy serves the rank's every trial
        return sharded_trials(workload, template, strategy, backend, deepspeed_config)

    worst, played = 0, [0]
    with off_the_gpu(template):
        # The prior's traces, if any, run on the same group; each trial's collection walks only what the probe made.
        with frozen_heap(), fake_process_group(world_size), trials() as trial:
            known: tuple[Trial, ...] = ()
            if (prior is None or isinstance(prior, NoTrace) or hasattr(prior, "led_by")) \
                    and getattr(trial, "booking", None) is not None:
                # booked on fake tensors: the first two trials give every batch's requests, a curve that leads
                # (the second where another row's trials put the boundary, if they lead this row)
                known, prior = _booked_lead(runner(0, trial), trial, min_batch, max_batch, capacity,
                                            prior if hasattr(prior, "led_by") else None)
            outcome = search_max(runner(0, trial), capacity, min_batch=min_batch, max_batch=max_batch, prior=prior,
                                 known=known)
            outcome = replace(outcome, trials=known + outcome.trials)
            if known and known[0].batch > min_batch and outcome.max_batch > 0 and not any(
                    t.fits and t.reserved_bytes <= capacity - headroom_bytes for t in outcome.trials):
                # the first trial was past the smallest batch, and none kept the headroom: the smallest may
                outcome = replace(outcome, trials=outcome.trials + (runner(0, trial)(min_batch),))
        # Ranks hold different shards where the partitions are uneven (ZeRO-1/2 pad and split the flat
        # buffer by rank, FSDP1 pads the last shard): the last rank plays the answer too, and where it
        # runs out of memory there, its own search goes on below it. The answer is the smaller one.
        if world_size > 1 and strategy.name not in _RANK_0_HOLDS_MOST and outcome.max_batch >= min_batch:
            last = world_size - 1
            played.append(last)
            with frozen_heap(), fake_process_group(world_size, rank=last), trials() as trial:
                check = runner(last, trial)(outcome.max_batch)
                if not check.fits:
                    worst = last
                    outcome = (SearchOutcome(0, "memory", (check,)) if outcome.max_batch == min_batch else
                               search_max(runner(last, trial), capacity, min_batch=min_batch, max_batch=max_batch,
                                          fails_at=outcome.max_batch))
    backend.release()
    return result_from_search(
        outcome, backend, capacity=capacity, headroom_bytes=headroom_bytes, min_batch=min_batch,
        workload=workload.name, context=f"under {strategy.label} on {world_size} rank{'s' if world_size != 1 else ''}, ",
        fix=_advice(strategy), curve=prior if isinstance(prior, _BookedCurve) and worst == 0 else None,
        extra={"sharding": {**sharding_report(strategy, world_size, breakdowns.get((worst, outcome.max_batch)),
                                              configs.get(outcome.max_batch)),
                            "ranks_played": played, "limiting_rank": worst}, **prior_report(prior),
               **batchnorm_record(template)},
    )


class _BookedCurve:
    """The reserved peak a fresh run books at any batch, its requests sized on the line through the first
    two trials (:meth:`~.traced_trials.OneWrapper.curve`): the estimate's own trace, leading its search."""

    def __init__(self, curve: Callable[[int], float], batches: list[int], seconds: float):
        self.curve, self.batches, self.seconds = curve, batches, seconds
        self.cache: dict[int, float] = {}

    def __call__(self, batch: int) -> float:
        if batch not in self.cache:
            self.cache[batch] = self.curve(batch)
        return self.cache[batch]

    def report(self) -> dict[str, Any]:
        return {"led": True, "reason": None, "traced_batches": self.batches, "traced_once": False,
                "seconds": self.seconds, "failure": None}


def _booked_lead(run: Callable[[int], Trial], trials: Any, min_batch: int, max_batch: int | None, capacity: int,
                 row_lead: Any = None) -> tuple[tuple[Trial, ...], Callable[[int], float] | None]:
    """A first trial and a second, whose requests give every batch's (:class:`_BookedCurve`); none where the
    first fails or the cap allows no second.

    The first is at the batch after the smallest: at one sample PyTorch makes a request fewer (the copy of
    ``labels[..., 1:]``), so a first trial there would book every larger batch without it; where it fits,
    so does the smallest. The second is the next batch, or where another row's trials put this row's
    boundary (``row_lead``, moved onto the first trial); one more where the second had to be traced afresh."""
    started = time.perf_counter()
    first = min_batch + 1 if max_batch is None or max_batch > min_batch else min_batch
    known = (run(first),)
    if not known[0].fits:
        return (known + (run(min_batch),) if first > min_batch else known), None
    if row_lead is not None:
        row_lead.saw(known[0])
    for k in range(2):
        if max_batch is not None and max_batch <= known[-1].batch:
            return known, None
        batch = known[-1].batch + 1
        if k == 0 and row_lead is not None:
            batch = max(batch, _boundary(row_lead, capacity, batch, max_batch))
        known += (run(batch),)
        if not math.isnan(trials.curve(batch)):
            return known, _BookedCurve(trials.curve, [t.batch for t in known], time.perf_counter() - started)
        if not known[-1].fits:
            return known, None
    return known, None


def _boundary(curve: Callable[[int], float], capacity: int, low: int, cap: int | None) -> int:
    """The largest batch from ``low`` on (up to ``cap``) whose ``curve`` stays within ``capacity``, by doubling then bisection."""
    high = low
    while curve(high) <= capacity and (cap is None or high < cap) and high < 1 << 40:
        low, high = high, high * 2
    return last_kept(lambda b: curve(b) <= capacity, low, high if cap is None else min(high, cap + 1))


def _advice(strategy: Strategy) -> str:
    """What frees memory from here: more sharding where there is more to shard, then the usual."""
    if strategy.name == "ddp":
        more = "shard (fsdp2, zero3), "
    elif strategy.zero_stage == 3 or strategy.is_fsdp:
        more = ("offload (zero3 --offload optimizer or params), " if strategy.zero_stage == 3 and not strategy.offload
                else "") + "use more GPUs (smaller shards), "
    else:
        more = "shard more (zero3, fsdp2), use more GPUs (smaller shards), "
    return f"{more}bf16, gradient checkpointing or smaller inputs"

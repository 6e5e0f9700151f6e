"""Under a launcher (torchrun, ``accelerate launch``, the DeepSpeed launcher, ``srun``): every rank probes its own
device in lockstep, in the launcher's process group, and the plan is for the ranks it started.

A plan that accumulates is probed again with the gradients held (:mod:`.held`) in the same group: a second
rendezvous on the launcher's port hung the DeepSpeed launcher's ranks. Every rank holds the agreed plan, so all
ranks probe again or none does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from ..errors import RequestError, assigned, option
from ..pipeline import Finding, launched_prior, plan_from_probe, probed_strategy
from ..probing.probe import for_data_parallel, make_backend
from .held import HELD_NOTE, held_again
from .mixed import uneven_plan
from .report import Report
from .request import Request
from .rows import user_deepspeed_config, workload_of

__all__ = ["launched"]


def launched(request: Request, note: Callable[[str], None]) -> Report:
    """Under torchrun, ``accelerate launch``, …: every rank probes its own device, in lockstep; a plan that
    accumulates is probed again with the gradients held, in the same group (a second rendezvous on the
    launcher's port hung the DeepSpeed launcher's ranks). Every rank has the agreed plan, so all or none do."""
    from ..distributed.launch import process_group, rank_env, rank_gpu

    env = rank_env()
    _same_world(request, env)
    memory = request.memory_of(env.rank)  # simulated mixed GPUs: rank r takes the r-th budget
    here = f"cuda:{rank_gpu(env)}" if torch.cuda.device_count() else "cuda"  # this rank's GPU
    backend = make_backend(request.device or (here if memory is None else "cpu"), memory)
    with process_group("gloo" if backend.device.type == "cpu" else None, timeout_s=request.timeout):
        report = _launched_probe(request, env, backend)
        if held_again(request, report):
            note(HELD_NOTE.format(micro=report.plan.micro_batch, accum=report.plan.grad_accum))
            report = _launched_probe(replace(request, grads_held=True), env, backend)
    return report


def _launched_probe(request: Request, env: Any, backend: Any) -> Report:
    from ..distributed.launch import is_main_process
    from ..distributed.lockstep import probe_distributed

    strategies = request.strategies
    workload = workload_of(request)
    sharded = {} if strategies is None else {"strategy": strategies[0],
                                             "deepspeed_config": user_deepspeed_config(request.deepspeed)}
    # The trace leads an unsharded search on every rank, as without a launcher.
    prior = launched_prior(workload, backend, request.trace_prior, strategies and strategies[0], request.min_micro)
    result = probe_distributed(workload, backend, max_batch=request.max_micro, min_batch=request.min_micro,
                               headroom=request.headroom, timeout_s=request.timeout, prior=prior,
                               each_rank=request.uneven, **sharded)
    agreed = result.to_probe_result()
    planning = request.planning()
    if request.nodes == 1 and env.nodes > 1:
        planning["nodes"] = env.nodes
    gpus = request.gpus_per_node or env.local_world_size
    uniform = not request.uneven or request.target is None or request.target % env.world_size == 0
    plan = plan_from_probe(agreed, gpus_per_node=gpus, **planning) if uniform else None
    strategy = probed_strategy(agreed, None if strategies is None else strategies[0])
    uneven = None if not request.uneven else uneven_plan(
        request, result.own_limits, strategy=strategy, min_micro=agreed.min_batch,
        uniform_safe=for_data_parallel(agreed, env.world_size).safe_batch)
    finding = Finding(agreed, plan, ranks_report=str(result), strategy=strategy)
    return Report(request, plan, rows=(finding,), device=agreed.device, main_rank=is_main_process(), uneven=uneven)


def _same_world(request: Request, env: Any) -> None:
    """Under a launcher the plan is for the ranks it started: GPUs per node or nodes asked otherwise are
    refused before anything runs (they replaced the launcher's, silently, in every file written). An
    explicit one node is the default, which the launcher's count replaces."""
    asked = {name: value for name, value, theirs in (("gpus_per_node", request.gpus_per_node, env.local_world_size),
                                                     ("nodes", request.nodes, env.nodes))
             if value is not None and value != theirs and not (name == "nodes" and value == 1)}
    if asked:
        given = " and ".join(assigned(name, value) for name, value in asked.items())
        raise RequestError([
            f"under {env.launcher} the plan is for the ranks it started, {env.local_world_size} per node × {env.nodes} "
            f"node{'s' if env.nodes != 1 else ''}, but {given} asks for another world; drop "
            f"{' and '.join(option(name) for name in asked)}, or plan that world from this one's safe batch with "
            f"`autobatch solve --max-micro SAFE` and its own {option('gpus_per_node')} and {option('nodes')}"])

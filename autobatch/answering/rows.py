"""The rows of an answer: one per strategy (probed or traced as rank 0 of W), or one per length.

A strategy under which nothing fits is a row of its own (:class:`NoFit`) when several are
compared; one strategy alone raises its error. The length table is :func:`length_table`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..errors import AutobatchError, NoBatchFitsError, option
from ..lengths import LengthTable, probe_lengths
from ..pipeline import Finding, data_parallel_ranks, find_plan
from ..probing.backends import MemoryBackend
from ..strategy import Strategy
from ..units import format_bytes
from .request import Request

__all__ = ["NoFit", "user_deepspeed_config", "strategy_rows", "estimate_strategy_rows", "length_table",
           "estimate_overheads", "estimate_workload", "workload_of"]


@dataclass(frozen=True)
class NoFit:
    """A compared strategy under which not even the smallest batch fits: a row of its own, not the end."""

    strategy: Strategy
    error: Exception
    world_size: int

    def to_dict(self) -> dict[str, Any]:
        return {"strategy": self.strategy.to_dict(), "world_size": self.world_size, "max_micro": 0, "error": str(self.error)}


def user_deepspeed_config(path: Any) -> dict[str, Any] | None:
    """The DeepSpeed file ``deepspeed`` names, when it exists already (its bucket sizes are probed)."""
    from ..configs.deepspeed import read_deepspeed_config

    return read_deepspeed_config(path) if path and Path(path).exists() else None


Setup = Callable[[Strategy], tuple[Any, MemoryBackend]]


def strategy_rows(request: Request, setup: Setup, *, on_trial: Callable[[Any], None] | None = None,
                  use_trace_prior: bool = True, led: bool = False) -> list[Finding | NoFit]:
    """One :class:`~autobatch.pipeline.Finding` per strategy, each probed as rank 0 of the data-parallel world.

    ``setup(strategy)`` returns the workload and backend for that strategy. When several are
    compared, one under which nothing fits becomes a :class:`NoFit` row; a single strategy
    raises its error. ``led`` (an estimate's traced rows): a row's search is led by the last row
    before it whose step computes alike (:mod:`~autobatch.estimating.lead`).
    """
    from ..estimating.lead import RowLead, leads

    strategies = request.strategies or ()
    user_config = user_deepspeed_config(request.deepspeed)
    gpus = request.gpus_per_node or 1
    found: list[Finding | NoFit] = []
    leader: Finding | None = None
    for chosen in strategies:
        workload, backend = setup(chosen)
        lead = None
        if led and leader is not None and leads(chosen.name):
            lead = RowLead(leader.probe.trials, leader.strategy.label if leader.strategy else "previous")
        try:
            found.append(find_plan(workload, gpus_per_node=gpus, backend=backend, max_batch=request.max_micro,
                                   min_micro=request.min_micro, headroom=request.headroom, strategy=chosen,
                                   deepspeed_config=user_config, on_trial=on_trial, use_trace_prior=use_trace_prior,
                                   lead=lead if lead is not None and lead.usable else None, **request.planning()))
            if leads(chosen.name):
                leader = found[-1]
        except NoBatchFitsError as exc:
            if len(strategies) == 1:
                raise
            found.append(NoFit(chosen, exc, data_parallel_ranks(gpus, request.nodes, request.model_parallel)))
    return found


def estimate_strategy_rows(request: Request, spec: Any, *, on_trial: Callable[[Any], None] | None = None) -> list[Finding | NoFit]:
    """Rank 0 of W's sharded steps against ``spec``'s usable memory less the allocator's overheads, one row per
    strategy.

    Every strategy trains on fake tensors (no memory, seconds at any size): FSDP and ZeRO as their
    wrappers run (ZeRO's offload to a host apart from the GPU), DDP as its gradient buckets (:func:`~autobatch.distributed.ddp.traced_buckets`;
    its reducer reads data a fake tensor has none of). A module passed in is copied onto fake
    tensors, never changed.
    """
    from ..estimating.estimate import fake_model, load_fake_model
    from ..estimating.overheads import beside_the_context
    from ..estimating.fake_backends import _new_fake_mode, fake_backend
    from ..estimating.fresh_log import FreshBooking

    # Each trial's requests booked in a fresh run's order through the caching allocator's model on what the
    # card leaves beside its context, after the workspaces (traced_trials.OneWrapper); with --fragmentation,
    # its multiplier and the workspaces come off the card instead.
    overheads = estimate_overheads(request)
    beside = beside_the_context(spec, overheads)
    booked = overheads.fragmentation is None
    usable = beside - overheads.workspace_bytes if booked else overheads.allocatable(beside)
    if usable <= 0:
        raise AutobatchError(
            f"{spec.name} keeps {format_bytes(beside)} beside its CUDA context, which must "
            f"exceed the libraries' workspaces ({request.workspace}); pass a larger {option('gpu_memory')} or a smaller {option('workspace')}")
    load = request.load_options(request.one_length)
    if isinstance(request.model, str):
        workload = load_fake_model(request.model, **load).to_workload(**request.settings())
    else:
        given = workload_of(request, load)
        workload = replace(given, model=fake_model(given.model, _new_fake_mode()))
    backends: dict[bool, Any] = {}

    def setup(chosen: Strategy) -> tuple[Any, Any]:
        # Offload: the GPU's tensors apart from the host's, where the engine moves the optimizer (and parameters)
        apart = chosen.offload is not None
        if apart not in backends:
            backends[apart] = fake_backend(workload.model, beside if booked else usable,
                                           recomputed=workload.grad_checkpointing, host_apart=apart)
            backends[apart].booking = FreshBooking(backends[apart], beside, overheads.workspace_bytes) if booked else None
        return workload, backends[apart]

    # The trials already run on fake tensors: a traced prior saves nothing. Booked, each row's first two
    # trials give its own curve (simulated_world._booked_lead); a row led by the one before puts its
    # second where the leader's trials put the boundary.
    return strategy_rows(request, setup, on_trial=on_trial, use_trace_prior=False, led=True)


def estimate_overheads(request: Request) -> Any:
    """What an estimate adds to a traced peak on a GPU: the request's fragmentation, workspaces and CUDA context."""
    from ..estimating.overheads import Overheads
    from ..units import parse_bytes

    context = None if request.cuda_context is None else parse_bytes(request.cuda_context, zero=True)
    return Overheads(fragmentation=request.fragmentation, workspace_bytes=parse_bytes(request.workspace, zero=True),
                     context_bytes=context)


def estimate_workload(request: Request) -> Any:
    """The request's model for an estimate: a named model built on fake tensors (no memory), else as given."""
    if not isinstance(request.model, str):
        return workload_of(request)
    from ..estimating.estimate import load_fake_model

    return load_fake_model(request.model, **request.load_options(request.one_length)).to_workload(**request.settings())


def workload_of(request: Request, load: dict[str, Any] | None = None) -> Any:
    """The request's model as a :class:`~autobatch.Workload` (a named model is built here)."""
    from ..estimating.spawned import named_workload
    from ..probing.workload import Workload, default_loss

    if isinstance(request.model, Workload):
        return replace(request.model, **request.settings())
    if isinstance(request.model, str):
        # Built so that a trace beside GPU trials may build it again in a process of its own.
        return named_workload(request.model, load or request.load_options(request.one_length), request.settings())
    return Workload(request.model, request.make_batch, loss_fn=request.loss_fn or default_loss, **request.settings())


def length_table(request: Request, backend: MemoryBackend | None, estimate_for: dict[str, Any] | None
                 ) -> tuple[LengthTable, Any]:
    """Probe (or, with ``estimate_for``, trace) every length of ``request``: one row each, and the workload.

    The longest length is checked against the model first; ``--eval`` alone on a model without
    lengths takes the model's own shape.
    """
    lengths = list(request.lengths) if request.lengths else None
    if isinstance(request.model, str):
        load = {**request.load_options(max(lengths) if lengths else None)}
        if estimate_for is not None:
            from ..estimating.estimate import load_fake_model

            source = load_fake_model(request.model, **load)
        else:
            from ..models import load_model

            source = load_model(request.model, **load)
        if lengths is None and source.make_batch_at is None:  # --eval alone, a model without lengths: its own shape
            base = source.to_workload(**request.settings())
            workload = replace(base, make_batch=lambda b, _seq_len: base.make_batch(b))
        else:
            if lengths is None and source.seq_len is None:
                raise AutobatchError(f"{request.model}'s make_batch takes a sequence length (b, seq_len); pass "
                                     f"{option('seq_len')}")
            lengths = lengths or [source.seq_len]
            workload = source.to_length_workload(lengths, **request.settings())
    else:
        workload = workload_of(request)
        if lengths is None:
            base = workload
            workload = replace(base, make_batch=lambda b, _seq_len: base.make_batch(b))
    table = probe_lengths(workload, lengths or [None], backend, evaluation=request.evaluation,
                          train_seq_len=request.train_seq_len, headroom=request.headroom, max_batch=request.max_micro,
                          min_batch=request.min_micro, **(estimate_for or {}))
    return table, workload

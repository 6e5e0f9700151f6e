"""Mixed GPUs: when a request may plan a batch per rank (``--uneven``), and the plan per rank from
every rank's own probe under a launcher, or from an estimate for a mixed ``--gpu`` list.

The uniform plan stays the default and is what the config files hold: DeepSpeed's JSON and HF's
TrainingArguments take one micro batch for every rank. The plan per rank goes to ``--json`` and to
:class:`~autobatch.training.UnevenBatchSampler`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..errors import AutobatchError, option
from ..planning.per_rank import RankLimit, UnevenPlan
from ..planning.uneven import solve_uneven

if TYPE_CHECKING:
    from .request import Request

__all__ = ["gpu_problems", "uneven_problems", "mixed_gpus", "shares_one_accum", "uneven_plan", "FALLBACK_NOTE",
           "estimate_mixed"]

FALLBACK_NOTE = ("DeepSpeed's JSON, accelerate's and HF's settings hold one micro batch for every rank, so the "
                 "files written carry the uniform plan ({uniform}); the plan per rank is in --json ('per_rank') "
                 "and for autobatch.training.UnevenBatchSampler")


#: The most GPUs a mixed ``--gpu`` list may name: its plan is one per rank (a count past it ran for minutes and
#: took the host's memory).
MIXED_RANKS = 1 << 20


def mixed_gpus(request: Request) -> tuple[tuple[Any, int], ...] | None:
    """The cards of an estimate for a mixed ``--gpu`` list, in rank order; ``None`` for one card."""
    from ..estimating.gpus import gpu_mix

    return gpu_mix(request.gpu) if request.gpu_memory is None else None


def gpu_problems(request: Request) -> list[str]:
    """One line where the GPU an estimate is for cannot be resolved (a plain name or a mixed list)."""
    from ..estimating.gpus import resolve_gpu

    if request.model is None or request.mode != "estimate":
        return []
    try:
        mix = mixed_gpus(request)
        if mix is None:
            resolve_gpu(request.gpu, request.gpu_memory)
            return []
    except AutobatchError as exc:
        return [str(exc)]
    problems = []
    world = sum(n for _, n in mix)
    if world > MIXED_RANKS:  # each rank is planned, one by one
        return [f"{option('gpu')} {request.gpu} names {world:,} GPUs, but a mixed list plans each rank and takes at most "
                f"{MIXED_RANKS:,}; name the counts of the job's cards (e.g. a100-80gb:512,v100-32gb:256)"]
    if request.gpus_per_node is not None and request.gpus_per_node * request.nodes != world:
        problems.append(f"{option('gpu')} {request.gpu} names {world} GPUs, but {option('gpus_per_node')} "
                        f"{request.gpus_per_node} × {option('nodes')} {request.nodes} is "
                        f"{request.gpus_per_node * request.nodes}; drop {option('gpus_per_node')}: the list counts them")
    elif world % request.nodes:
        problems.append(f"{option('gpu')} {request.gpu} names {world} GPUs, which {option('nodes')} {request.nodes} "
                        "does not divide; give the same number of GPUs on every node")
    strategies = request.strategies if request.strategy is not None else None
    if strategies is not None and len(strategies) > 1:
        problems.append(f"a mixed {option('gpu')} list is estimated for one strategy, but {option('strategy')} names "
                        f"{len(strategies)}; compare them on one card first")
    if request.table:  # each card is estimated at one length, for training: a table's rows would go unread
        several = request.lengths is not None and len(request.lengths) > 1
        asked = " and ".join(filter(None, (
            f"{option('seq_len')} {','.join(map(str, request.lengths))}" if several else None,
            option("evaluation") if request.evaluation else None)))
        fix = " and ".join(filter(None, (f"pass one {option('seq_len')} (the length you train at)" if several else None,
                                         f"drop {option('evaluation')}" if request.evaluation else None)))
        verb = "make" if several and request.evaluation else "makes"
        problems.append(f"a mixed {option('gpu')} list is estimated at one sequence length for training, but {asked} "
                        f"{verb} it a table; {fix}, or estimate the table on each card alone")
    return problems


def uneven_problems(request: Request) -> list[str]:
    """One line for each reason ``uneven`` cannot apply to ``request``."""
    if not request.uneven:
        return []
    flag = option("uneven")
    if request.model is None:
        return [f"{flag} plans each rank from its own probe or estimate, which needs {option('model')}"]
    problems = []
    if request.mode == "probe":
        from ..distributed.environment import rank_env

        if not request.launched:
            problems.append(f"{flag} plans a batch per rank from each rank's own probe, which needs a launcher "
                            f"to start the ranks (torchrun --nproc-per-node N, srun, …); without one every GPU is "
                            f"planned alike: drop {flag}")
        elif rank_env().world_size < 2:
            problems.append(f"{flag} balances several ranks, but the launcher started one; launch the job's ranks, "
                            f"or drop {flag}")
    elif request.mode == "estimate":
        try:
            mix = mixed_gpus(request)
        except AutobatchError:
            mix = ()  # said by gpu_problems
        if mix is None:
            problems.append(f"{flag} plans mixed GPUs, so {option('gpu')} must list them with their counts, e.g. "
                            f"{option('gpu')} a100-80gb:4,a100-40gb:4")
    world = _world(request)
    outputs = [option(name) for name in ("deepspeed", "accelerate", "hf") if getattr(request, name) is not None]
    if outputs and request.target is not None and world and request.target % world:
        problems.append(f"{', '.join(outputs)} hold one micro batch for every rank, so the uniform plan they carry "
                        f"needs a target the {world} ranks divide, but got {option('target')} {request.target}; "
                        f"drop {', '.join(outputs)} (the plan per rank is in --json), or pick such a target")
    if request.model_parallel != 1:
        problems.append(f"{flag} plans each data-parallel rank alone, but {option('model_parallel')} "
                        f"{request.model_parallel} ties ranks into groups that share a batch; drop one of them")
    if request.table:
        problems.append(f"{flag} plans one sequence length; pass one {option('seq_len')} and drop "
                        f"{option('evaluation')}")
    return problems


def _world(request: Request) -> int | None:
    """The ranks an uneven request plans: the launcher's, or the mixed list's GPUs."""
    if request.mode == "probe":
        from ..distributed.environment import rank_env

        return rank_env().world_size if request.launched else None
    try:
        mix = mixed_gpus(request)
    except AutobatchError:
        return None
    return None if mix is None else sum(n for _, n in mix)


def shares_one_accum(strategy: Any) -> bool:
    """FSDP and ZeRO run collectives in every micro-step: one accumulation for all ranks; DDP (or none), per rank."""
    return strategy is not None and getattr(strategy, "name", strategy) != "ddp"


def uneven_plan(request: Request, limits: tuple[RankLimit, ...], *, strategy: Any, min_micro: int,
                uniform_safe: int, speeds: str = "measured") -> UnevenPlan:
    """The plan per rank for the request's target on ``limits``."""
    return solve_uneven(request.target, limits, same_accum=shares_one_accum(strategy), min_micro=min_micro,
                        multiple_of=request.multiple_of, uniform_safe=uniform_safe, speeds=speeds)


def estimate_mixed(request: Request, note: Callable[[str], None]) -> Any:
    """An estimate for a mixed ``--gpu`` list: every card traced, the uniform plan at the smallest
    card's safe batch and, with ``uneven``, a plan per rank split by the cards' peak speeds."""
    from ..estimating.estimate import estimate
    from ..estimating.gpus import lacks_bf16, peak_tflops
    from ..pipeline import Finding
    from ..planning.solver import solve
    from .report import Report
    from .rows import estimate_overheads, estimate_strategy_rows, estimate_workload

    mix = mixed_gpus(request)
    world = sum(n for _, n in mix)
    nodes = request.nodes
    if not request.estimate:
        note(f"no CUDA GPU here, so these are estimates for {request.gpu} from a fake-tensor trace; run find "
             "under a launcher on the GPU machines for exact figures")
    # Each card once (a card may stand twice in the list); the model is built once for all of them.
    cards_once = list({spec.name: spec for spec, _ in mix}.values())
    for spec in cards_once:  # as for one card
        if lacks_bf16(spec, request.precision):
            note(f"{spec.name} has no bf16 ({spec.notes}): the estimate is of bf16 as asked, its ranks balanced "
                 "by the card's fp32 speed, but on this card train with fp16 or fp32 (--dtype fp16)")
    found: dict[str, Any] = {}
    wrapped: dict[str, Any] = {}  # each card's strategy as its row was traced (the FSDP block it wrapped)
    if request.strategies is not None:
        for spec in cards_once:
            rows = estimate_strategy_rows(request, spec)
            if not isinstance(rows[0], Finding):
                raise AutobatchError(f"nothing fits on {spec.name} under {request.strategies[0].label}: "
                                     f"{rows[0]}; drop that card from {option('gpu')}")
            found[spec.name], wrapped[spec.name] = rows[0].probe, rows[0].strategy
    else:
        workload, overheads = estimate_workload(request), estimate_overheads(request)
        for spec in cards_once:
            found[spec.name] = estimate(workload, spec, overheads=overheads, headroom=request.headroom,
                                        max_batch=request.max_micro, min_batch=request.min_micro, data_parallel=world)
    # Each card's speed in the format the job trains in: fp32 is not split by 16-bit tensor-core figures.
    speed = {spec.name: peak_tflops(spec.name, request.precision) for spec in cards_once}
    limits = tuple(RankLimit(r, found[spec.name].max_batch, max(1, found[spec.name].safe_batch),
                             (0.0, 1.0 / (speed[spec.name][0] or 100.0)))
                   for r, spec in enumerate(spec for spec, n in mix for _ in range(n)))
    card = min(cards_once, key=lambda spec: found[spec.name].safe_batch)
    smallest = found[card.name]
    plan = uneven = None
    if request.target is not None and (not request.uneven or request.target % world == 0):
        plan = solve(request.target, world // nodes, nodes, smallest.safe_batch, min_micro=smallest.min_batch,
                     multiple_of=request.multiple_of, base_lr=request.base_lr, base_batch=request.base_batch)
    if request.uneven:
        uneven = uneven_plan(request, limits, strategy=request.strategies[0] if request.strategies else None,
                             min_micro=smallest.min_batch, uniform_safe=smallest.safe_batch, speeds="peak")
    runs: list[list[Any]] = []  # the cards in rank order, a card named twice running once (a100-80gb:2,a100-80gb:2)
    for spec, n in mix:
        if runs and runs[-1][0].name == spec.name:
            runs[-1][1] += n
        else:
            runs.append([spec, n])
    cards = tuple({"gpu": spec.name, "count": n, "max_batch": found[spec.name].max_batch,
                   "safe_batch": found[spec.name].safe_batch, "peak_tflops": speed[spec.name][0],
                   "peak_tflops_in": speed[spec.name][1]}
                  for spec, n in runs)
    # The smallest card's row, with the strategy it was traced under: the configs shard as it did.
    return Report(request, plan, rows=(Finding(smallest, plan, strategy=wrapped.get(card.name)),), gpu=card,
                  uneven=uneven, cards=cards)

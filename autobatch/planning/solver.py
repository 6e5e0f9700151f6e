"""Solve micro batch × gradient accumulation × world size = target global batch, exactly.

The rule (field report 5): take the largest per-GPU micro batch that fits, then accumulate.
When step times per micro batch are known, pick the fastest optimizer step instead. Never floor:
DeepSpeed, given only ``train_batch_size``, computes ``224 // 3`` per GPU and trains a different
batch than asked; :func:`solve` raises :class:`NoExactPlanError` with the nearest real options.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping

from ..errors import AutobatchError
from .divisors import MAX_INT, AllowedMicros, divisors, fuller_targets
from .plan import LRAdvice, Plan, require_positive_int

__all__ = ["solve", "exact_plans", "check_request", "NoExactPlanError"]

# How many alternative world sizes an error lists on each side of the current one.
_WORLD_SIZES_LISTED = 12  # every working world size up to this many; past it, the nearest few each side
_WORLD_SIZES_EACH_SIDE = 3


class NoExactPlanError(AutobatchError):
    """No micro batch × accumulation × world size equals the target under the constraints.

    Attributes:
        target: The global batch asked for.
        world_size: The data-parallel world size it had to divide into.
        below: Largest achievable global batch below ``target`` on this world size (or None).
        above: Smallest achievable global batch above ``target`` on this world size.
        world_sizes: Data-parallel world sizes near ``world_size`` that reach ``target`` exactly.
    """

    def __init__(
        self,
        message: str,
        *,
        target: int,
        world_size: int,
        below: int | None,
        above: int,
        world_sizes: tuple[int, ...],
    ):
        self.target = target
        self.world_size = world_size
        self.below = below
        self.above = above
        self.world_sizes = world_sizes
        super().__init__(message)


def _validate(
    target: object,
    gpus_per_node: object,
    nodes: object,
    max_micro: object,
    min_micro: object,
    multiple_of: object,
    model_parallel: object,
) -> tuple[int, int, int, int | None, int, int | None, int]:
    target = require_positive_int("target", target, fix="pass the global batch size you want, e.g. 256")
    if target >= MAX_INT:
        # Divisors of a number past 2**64 could take longer than anyone waits; no batch is that big.
        raise AutobatchError(f"target must be below 2**64, but got target={target}; pass the global batch you train with")
    gpus_per_node = require_positive_int("gpus_per_node", gpus_per_node, fix="pass the number of GPUs on each node")
    nodes = require_positive_int("nodes", nodes, fix="pass the number of nodes, 1 for a single machine")
    min_micro = require_positive_int("min_micro", min_micro, fix="use 1, or 2 for models with BatchNorm")
    model_parallel = require_positive_int("model_parallel", model_parallel, fix="use 1 without tensor/pipeline parallelism")
    if max_micro is not None:
        max_micro = require_positive_int("max_micro", max_micro, fix="pass the largest per-GPU batch that fits in memory")
    if multiple_of is not None:
        multiple_of = require_positive_int("multiple_of", multiple_of, fix="leave it out for no constraint")
    if max_micro is not None and max_micro < min_micro:
        raise AutobatchError(
            f"max_micro must be at least min_micro, but got max_micro={max_micro} and min_micro={min_micro}; "
            "a model that needs min_micro samples per GPU must fit that many in memory"
        )
    step = multiple_of or 1
    smallest = -(-min_micro // step) * step
    if max_micro is not None and smallest > max_micro:
        raise AutobatchError(
            f"no micro batch between min_micro={min_micro} and max_micro={max_micro} is a multiple of "
            f"multiple_of={multiple_of}; raise max_micro to {smallest} or lower multiple_of"
        )
    gpus = gpus_per_node * nodes
    if gpus % model_parallel:
        raise AutobatchError(
            f"model_parallel must divide the GPU count, but got model_parallel={model_parallel} for {gpus} GPUs; "
            f"use a degree that divides {gpus}"
        )
    return target, gpus_per_node, nodes, max_micro, min_micro, multiple_of, model_parallel


def _validate_step_times(step_times: Mapping[int, float] | None) -> dict[int, float]:
    if step_times is None:
        return {}
    if not isinstance(step_times, Mapping):
        raise AutobatchError(
            f"step_times must map micro batch to seconds per micro-batch step, but got {type(step_times).__name__}; "
            "pass e.g. {4: 0.21, 8: 0.38}"
        )
    result = {}
    for micro, seconds in step_times.items():
        micro = require_positive_int("step_times key", micro, fix="keys are micro batch sizes")
        if isinstance(seconds, bool) or not isinstance(seconds, numbers.Real) or not math.isfinite(seconds) or seconds <= 0:
            raise AutobatchError(
                f"step_times values must be positive seconds, but got step_times[{micro}]={seconds!r}; "
                "measure one forward+backward at that micro batch"
            )
        result[micro] = float(seconds)
    return result


def _lr_advice(base_lr: object, base_batch: object, global_batch: int) -> LRAdvice | None:
    if base_lr is None and base_batch is None:
        return None
    if base_lr is None or base_batch is None:
        raise AutobatchError(
            f"base_lr and base_batch go together, but only {'base_lr' if base_batch is None else 'base_batch'} "
            "was given; pass the learning rate and the global batch it was tuned at"
        )
    if isinstance(base_lr, bool) or not isinstance(base_lr, numbers.Real) or not math.isfinite(base_lr) or base_lr <= 0:
        raise AutobatchError(f"base_lr must be a positive number, but got base_lr={base_lr!r}; pass e.g. 3e-4")
    base_batch = require_positive_int("base_batch", base_batch, fix="pass the global batch the learning rate was tuned at")
    return LRAdvice(base_lr=float(base_lr), base_batch=base_batch, global_batch=global_batch)


def _nearest_achievable(target: int, world: int, allowed: AllowedMicros) -> tuple[int | None, int]:
    """Largest achievable global batch below ``target`` and smallest above, on ``world`` ranks.

    A global batch ``world × k`` is achievable when some allowed micro batch divides ``k``. Only
    multiples of ``multiple_of`` can be, and any multiple of the smallest allowed micro is, so
    each search visits at most ``smallest / multiple_of`` values of ``k`` (or, when the allowed
    micro batches are few, takes the nearest multiple of each).
    """
    step, smallest = allowed.multiple_of, allowed.smallest
    low, high = (target - 1) // world, target // world + 1
    few = allowed._few()
    if few is not None:
        below_k = max((low // m * m for m in few if low >= m), default=0)
        above_k = min(-(-high // m) * m for m in few)
        return (world * below_k if below_k else None), world * above_k
    below = None
    k = low // step * step
    while k >= smallest:
        if allowed.divides_some(k):
            below = world * k
            break
        k -= step
    k = max(-(-high // step) * step, smallest)
    while not allowed.divides_some(k):
        k += step
    return below, world * k


def _working_world_sizes(target: int, world: int, allowed: AllowedMicros) -> tuple[tuple[int, ...], bool]:
    """Data-parallel world sizes that reach ``target`` exactly: all of them when they are few, else the
    nearest few on each side of ``world``; and whether that is all of them."""
    sizes = divisors(target)

    def nearest(candidates: list[int]) -> list[int]:
        found = []
        for w in candidates:
            if allowed.divides_some(target // w):
                found.append(w)
                if len(found) > _WORLD_SIZES_LISTED:
                    break
        return found

    lower = nearest([w for w in reversed(sizes) if w < world])
    upper = nearest([w for w in sizes if w > world])
    if len(lower) + len(upper) <= _WORLD_SIZES_LISTED:
        return tuple(lower[::-1] + upper), True
    return tuple(lower[:_WORLD_SIZES_EACH_SIDE][::-1] + upper[:_WORLD_SIZES_EACH_SIDE]), False


def _per_gpu(target: int, world: int) -> str:
    """``target / world``: its whole part in full and its fraction to four places, never rounded up to a
    whole number it is not (0.99999… is not 1).

    Example:
        >>> _per_gpu(63, 2), _per_gpu(1000000007, 8), _per_gpu(99999, 100000), _per_gpu(8, 10**11)
        ('31.5', '125000000.875', '0.9999…', '0.0000…')
    """
    whole, rest = divmod(target, world)
    if rest == 0:
        return str(whole)
    fraction = f"{rest / world:.4f}"
    if fraction == "1.0000":
        return f"{whole}.9999…"
    if fraction == "0.0000":  # above the whole part, by less than the places shown
        return f"{whole}.0000…"
    return f"{whole}{fraction[1:].rstrip('0')}"


def _no_plan(target: int, gpus_per_node: int, nodes: int, model_parallel: int, allowed: AllowedMicros) -> NoExactPlanError:
    world = gpus_per_node * nodes // model_parallel
    mp = f" ÷ {model_parallel} model-parallel" if model_parallel > 1 else ""
    ranks = f"world size {world} ({gpus_per_node} per node × {nodes} node{'s' if nodes != 1 else ''}{mp})"
    if target % world:
        cause = (
            f"global batch {target} is not divisible by the data-parallel {ranks}: "
            f"{target} / {world} = {_per_gpu(target, world)} per GPU, and DeepSpeed would floor that to "
            f"{target // world} and train {target // world * world} instead"
        )
    else:
        cause = (
            f"global batch {target} on {ranks} is {target // world} per GPU, "
            f"and no micro batch ({allowed.describe()}) divides {target // world}"
        )
    below, above = _nearest_achievable(target, world, allowed)
    sizes, every = _working_world_sizes(target, world, allowed)
    nearest = f"{below} below or {above} above" if below is not None else f"{above} above (none below)"
    label = "data-parallel world sizes" if model_parallel > 1 else "world sizes"
    size_text = (
        f"; {label} that reach {target} exactly: {', '.join(map(str, sizes))}{'' if every else ' (the nearest; more exist)'}"
        if sizes else ""
    )
    fixes = ["change the target to one of those batches"]
    if sizes:
        fixes.append("run on one of those world sizes")
    if target % world == 0:
        fixes.append("relax the micro-batch limits")
    message = (
        f"no exact plan: {cause}. Nearest achievable global batches on {world} rank{'s' if world != 1 else ''}: "
        f"{nearest}{size_text}. Fix: {', or '.join(fixes)}"
    )
    return NoExactPlanError(message, target=target, world_size=world, below=below, above=above, world_sizes=sizes)


def check_request(
    target: int | None = None,
    gpus_per_node: int = 1,
    nodes: int = 1,
    *,
    min_micro: int = 1,
    multiple_of: int | None = None,
    model_parallel: int = 1,
) -> None:
    """Raise now what :func:`solve` would raise after a probe, whatever micro batch the probe allows.

    Bad values, a model-parallel degree that does not divide the GPUs, or a target that no
    micro batch reaches on this world size are known before the first trial; a probe that ends
    in one of these errors is minutes lost on a GPU.

    Example:
        >>> check_request(224, gpus_per_node=3)
        Traceback (most recent call last):
        ...
        autobatch.planning.solver.NoExactPlanError: no exact plan: global batch 224 is not divisible ...
    """
    if target is None:
        _validate(1, gpus_per_node, nodes, None, min_micro, multiple_of, model_parallel)
    else:
        solve(target, gpus_per_node, nodes, None, min_micro=min_micro, multiple_of=multiple_of,
              model_parallel=model_parallel)


def exact_plans(
    target: int,
    gpus_per_node: int = 1,
    nodes: int = 1,
    max_micro: int | None = None,
    *,
    min_micro: int = 1,
    multiple_of: int | None = None,
    model_parallel: int = 1,
) -> list[Plan]:
    """Every plan that reaches ``target`` exactly, largest micro batch (fewest GA steps) first.

    Args: as for :func:`solve`. Returns an empty list when none exists (no error).

    Example:
        >>> [p.micro_batch for p in exact_plans(224, gpus_per_node=16, max_micro=9)]
        [7, 2, 1]
    """
    target, gpus_per_node, nodes, max_micro, min_micro, multiple_of, model_parallel = _validate(
        target, gpus_per_node, nodes, max_micro, min_micro, multiple_of, model_parallel
    )
    world = gpus_per_node * nodes // model_parallel
    if target % world:
        return []
    allowed = AllowedMicros(min_micro, max_micro, multiple_of)
    per_rank = target // world
    return [
        Plan(
            micro_batch=m,
            grad_accum=per_rank // m,
            gpus_per_node=gpus_per_node,
            nodes=nodes,
            model_parallel=model_parallel,
            max_micro=max_micro,
            min_micro=min_micro,
            multiple_of=multiple_of,
        )
        for m in reversed(allowed.micros_dividing(per_rank))
    ]


def solve(
    target: int,
    gpus_per_node: int = 1,
    nodes: int = 1,
    max_micro: int | None = None,
    *,
    min_micro: int = 1,
    multiple_of: int | None = None,
    model_parallel: int = 1,
    step_times: Mapping[int, float] | None = None,
    base_lr: float | None = None,
    base_batch: int | None = None,
) -> Plan:
    """Find micro batch × gradient accumulation so that, on this world size, the global batch is ``target``.

    Args:
        target: Global batch per optimizer step (samples across all data-parallel ranks).
        gpus_per_node: GPUs on each node.
        nodes: Number of nodes.
        max_micro: Largest per-GPU micro batch that fits in memory (None: no limit).
        min_micro: Smallest allowed micro batch; 2 for BatchNorm models (field report 4).
        multiple_of: Micro batch must be a multiple of this (e.g. 8 for tensor cores).
        model_parallel: Tensor × pipeline parallel degree; the data-parallel world size is
            ``gpus_per_node × nodes / model_parallel``.
        step_times: Seconds per micro-batch step (forward + backward) by micro batch. When given,
            the plan minimises ``grad_accum × step_times[micro]`` among micro batches with a known
            time; ties go to fewer accumulation steps.
        base_lr: Learning rate tuned at ``base_batch``; with it, the plan carries scaled advice.
        base_batch: Global batch ``base_lr`` was tuned at.

    Returns:
        The :class:`Plan`; ``plan.micro_batch × plan.grad_accum × plan.world_size == target``.

    Raises:
        NoExactPlanError: no plan reaches ``target`` exactly; lists the nearest alternatives.
        AutobatchError: an argument is invalid (e.g. ``target=0``).

    Example:
        >>> print(solve(224, gpus_per_node=16, nodes=1, max_micro=9))
        7 per GPU × 2 accumulation × 16 GPUs (16 per node × 1 node) = 224
    """
    target, gpus_per_node, nodes, max_micro, min_micro, multiple_of, model_parallel = _validate(
        target, gpus_per_node, nodes, max_micro, min_micro, multiple_of, model_parallel
    )
    times = _validate_step_times(step_times)
    lr_advice = _lr_advice(base_lr, base_batch, target)
    allowed = AllowedMicros(min_micro, max_micro, multiple_of)
    world = gpus_per_node * nodes // model_parallel
    micros = allowed.micros_dividing(target // world) if target % world == 0 else []
    if not micros:
        raise _no_plan(target, gpus_per_node, nodes, model_parallel, allowed)

    per_rank = target // world
    limits = f" ({allowed.describe()})" if allowed.describe() != "any size" else ""
    timed = [m for m in micros if m in times]
    step_time = None
    if timed:
        best_time = min(per_rank // m * times[m] for m in timed)
        # ties (within float noise) go to the largest micro batch = fewest accumulation steps
        micro = max(m for m in timed if math.isclose(per_rank // m * times[m], best_time, rel_tol=1e-9))
        step_time = per_rank // micro * times[micro]
        reason = (
            f"fastest predicted optimizer step among measured micro batches{limits}: "
            f"{per_rank // micro} × {times[micro]:.4g} s = {step_time:.4g} s"
        )
    else:
        micro = micros[-1]
        reason = f"largest micro batch{limits} that divides the {per_rank} samples per GPU (fewest accumulation steps)"
        reason += fuller_targets(per_rank, world, micro, allowed)
        if times:
            reason += "; no step time was given for any micro batch that divides it"
        if max_micro is None:
            reason += ("; no memory limit was given (--max-micro / max_micro), so nothing says this micro batch "
                       "fits: `autobatch find` measures the largest that does")

    return Plan(
        micro_batch=micro,
        grad_accum=per_rank // micro,
        gpus_per_node=gpus_per_node,
        nodes=nodes,
        model_parallel=model_parallel,
        max_micro=max_micro,
        min_micro=min_micro,
        multiple_of=multiple_of,
        reason=reason,
        step_time=step_time,
        lr_advice=lr_advice,
    )

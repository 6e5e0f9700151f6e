"""Mixed GPUs: a micro batch and accumulation per rank, ``Σ_r m_r × k_r = target`` exactly.

The uniform plan holds every rank to the smallest rank's batch. An uneven plan gives rank ``r``
its own micro batch ``m_r`` (at most its safe batch) and accumulation ``k_r``:

* **DDP** syncs gradients once per optimizer step (the last micro-step; the others run under
  ``no_sync``), so ranks agree only on that one synced backward: ``k_r`` may differ by rank.
* **FSDP and ZeRO** run collectives in every micro-step (FSDP gathers the parameters in each
  forward; DeepSpeed's engine takes one ``gradient_accumulation_steps`` for all ranks), so ``k``
  is the same on every rank and only ``m_r`` differs.

The samples are split so that the ranks finish a step together: a micro-step of ``m`` samples
on rank ``r`` takes ``a_r + s_r·m`` seconds (its trials' measured step times, a line per rank),
and the plan minimises the slowest rank's ``k_r × (a_r + s_r·m_r)``, then the micro-steps. It is
never slower than the uniform plan by the same measure: where the uniform plan is as fast and
takes no more micro-steps, it is the answer. Measured times are noisy: an uneven split must be
:data:`NOISE` (5 %) faster, or as fast within it in fewer micro-steps.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from ..errors import AutobatchError, option
from .divisors import divisors
from .per_rank import RankLimit, RankPlan, UnevenPlan
from .plan import Plan, require_positive_int
from .solver import NoExactPlanError, solve

__all__ = ["solve_uneven", "NOISE"]

_BISECTIONS = 60
_RETRIES = 400      # makespans tried past the bisection's before the uniform plan is the answer
_SCAN = 512         # values tried below a rank's share when the surplus is taken off it
NOISE = 0.05        # measured step times closer than this are taken as equal
_PAIRS = 64         # ranks up to which samples are moved between pairs for fewer micro-steps
_MOVE = 16          # the most samples one such move shifts


class _Rank:
    """A rank's limits as the solver reads them: allowed micro batches and the time line."""

    def __init__(self, limit: RankLimit, min_micro: int, multiple: int, line: tuple[float, float]):
        self.limit = limit
        self.a, self.s = line
        self.lo = -(-min_micro // multiple) * multiple
        self.hi = limit.safe_batch // multiple * multiple
        self.multiple = multiple

    def fits(self, m: int) -> bool:
        return self.lo <= m <= self.hi and m % self.multiple == 0

    def split(self, n: int) -> tuple[int, int] | None:
        """The fewest micro-steps ``k`` (and ``m = n / k``) that carry ``n`` samples here, at most twice
        the fewest any split needs: a share that only tiny micro batches divide (a prime) is not one
        this rank takes, since a GPU runs tiny batches at a fraction of its speed."""
        if self.hi < self.lo or n < self.lo:
            return None
        fewest = max(1, -(-n // self.hi))
        for k in range(fewest, min(2 * fewest, n // self.lo) + 1):
            if n % k == 0 and self.fits(n // k):
                return n // k, k
        return None

    def cost(self, n: int) -> float:
        split = self.split(n)
        return math.inf if split is None else split[1] * self.a + self.s * n

    def most(self, tau: float) -> int:
        """The most samples this rank carries within ``tau`` seconds (0 where not even the smallest)."""
        if self.hi < self.lo:
            return 0
        best = 0
        guess = max(1, int(tau / (self.a + self.s * self.hi)))
        for k in {1, *range(max(1, guess - 2), guess + 3)}:
            m = min(self.hi, int((tau / k - self.a) / self.s))
            m = m // self.multiple * self.multiple
            if m >= self.lo:
                best = max(best, k * m)
        return best

    def cap(self, tau: float) -> int:
        """The largest allowed micro batch whose micro-step takes at most ``tau`` (0 if none)."""
        m = min(self.hi, int((tau - self.a) / self.s)) // self.multiple * self.multiple
        return m if m >= self.lo else 0


def _makespan(feasible: Any, lo: float, hi: float) -> float:
    for _ in range(_BISECTIONS):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if feasible(mid) else (mid, hi)
    return hi


def _per_rank_accum(ranks: list[_Rank], target: int) -> tuple[list[int], float] | None:
    """DDP: samples per rank within the smallest makespan, each carried in its fewest micro-steps."""
    hi = max(r.s * (target + r.hi) + r.a * target for r in ranks)
    tau = _makespan(lambda t: sum(r.most(t) for r in ranks) >= target
                    and all(r.most(t) >= r.lo for r in ranks), 0.0, hi)
    for attempt in range(_RETRIES):
        t = tau * (1 + 0.002 * attempt)
        shares = [r.most(t) for r in ranks]
        surplus = sum(shares) - target
        if surplus < 0 or min(shares) < min(r.lo for r in ranks):
            continue
        for spread in (True, False):  # first a little off every rank, then whatever is left off any
            order = sorted(range(len(ranks)), key=lambda i: -ranks[i].cost(shares[i]))
            for place, i in enumerate(order):
                if surplus == 0:
                    break
                want = -(-surplus // (len(order) - place)) if spread else surplus
                shares[i], surplus = _take_off(ranks[i], shares[i], want, t, surplus)
        if surplus == 0 and all(ranks[i].cost(n) <= t for i, n in enumerate(shares)):
            makespan = max(r.cost(n) for r, n in zip(ranks, shares))
            return _fewer_steps(ranks, shares, makespan), makespan
    return None


def _fewer_steps(ranks: list[_Rank], shares: list[int], makespan: float) -> list[int]:
    """Move a few samples between pairs of ranks where that takes fewer micro-steps within ``makespan``."""
    if len(ranks) > _PAIRS:
        return shares
    steps = [r.split(n)[1] for r, n in zip(ranks, shares)]
    improved = True
    while improved:
        improved = False
        for i, j in ((i, j) for i in range(len(ranks)) for j in range(len(ranks)) if i != j):
            for delta in range(1, _MOVE + 1):
                a, b = shares[i] - delta, shares[j] + delta
                if ranks[i].cost(a) > makespan or ranks[j].cost(b) > makespan:
                    continue
                ka, kb = ranks[i].split(a)[1], ranks[j].split(b)[1]
                if ka + kb < steps[i] + steps[j]:
                    shares[i], shares[j], steps[i], steps[j] = a, b, ka, kb
                    improved = True
                    break
    return shares


def _take_off(rank: _Rank, share: int, want: int, tau: float, surplus: int) -> tuple[int, int]:
    """Take up to ``want`` samples off ``share``, landing on a count the rank carries within ``tau``."""
    for n in range(max(rank.lo, share - want), min(share, max(rank.lo, share - want) + _SCAN)):
        if rank.cost(n) <= tau:
            return n, surplus - (share - n)
    return share, surplus


def _same_accum(ranks: list[_Rank], target: int) -> tuple[list[int], int, float] | None:
    """FSDP, ZeRO: one ``k`` for all; per micro-step the ranks split ``target / k`` within the least time."""
    best: tuple[float, int, list[int]] | None = None
    for k in divisors(target):
        per_step = target // k
        if per_step < sum(r.lo for r in ranks) or per_step > sum(r.hi for r in ranks):
            continue
        hi = max(r.a + r.s * r.hi for r in ranks)
        tau = _makespan(lambda t: all(r.cap(t) for r in ranks) and sum(r.cap(t) for r in ranks) >= per_step,
                        0.0, hi * 1.000001)
        micros = [r.cap(tau) for r in ranks]
        surplus = sum(micros) - per_step
        for spread in (True, False):
            for place, i in enumerate(sorted(range(len(ranks)), key=lambda j: -ranks[j].a - ranks[j].s * micros[j])):
                if surplus <= 0:
                    break
                r = ranks[i]
                want = -(-surplus // (len(ranks) - place)) if spread else surplus
                cut = min(want, micros[i] - r.lo) // r.multiple * r.multiple
                micros[i] -= cut
                surplus -= cut
        if surplus != 0:
            continue
        seconds = k * max(r.a + r.s * m for r, m in zip(ranks, micros))
        if best is None or (seconds, k) < (best[0], best[1]):
            best = (seconds, k, micros)
    return None if best is None else (best[2], best[1], best[0])


def _no_faster(seconds: float, steps: int, uniform_seconds: float, uniform_steps: int, tolerance: float) -> bool:
    """The uniform plan is as good: the uneven split is not faster by more than ``tolerance`` (measured
    times are noisy), nor as fast within it with fewer micro-steps."""
    if seconds < uniform_seconds * (1 - tolerance):
        return False
    return not (seconds <= uniform_seconds * (1 + tolerance) and steps < uniform_steps)


def solve_uneven(
    target: int | None,
    limits: Sequence[RankLimit],
    *,
    same_accum: bool = False,
    min_micro: int = 1,
    multiple_of: int | None = None,
    uniform_safe: int | None = None,
    speeds: str = "measured",
) -> UnevenPlan:
    """The plan per rank for ``target`` on the ranks of ``limits`` (one per rank, in rank order).

    Args:
        target: the global batch per optimizer step; ``None``: each rank its safe batch, no accumulation.
        limits: each rank's safe batch and, where measured, its step-time line.
        same_accum: one accumulation for every rank (FSDP, ZeRO); else per rank (DDP).
        min_micro, multiple_of: limits on every micro batch, as for :func:`~autobatch.solve`.
        uniform_safe: the safe batch of the uniform plan it is compared with, where every rank
            was probed at one batch together (default the smallest rank's safe batch).
        speeds: ``"measured"``: ``step_seconds`` are seconds a rank's trials took; ``"peak"``: relative
            times from the cards' peak speeds (an estimate), not shown as seconds.

    Raises:
        NoExactPlanError: no split reaches ``target`` exactly within the ranks' safe batches.

    Example:
        >>> plan = solve_uneven(96, [RankLimit(0, 40, 32), RankLimit(1, 20, 16)])
        >>> [(r.micro_batch, r.grad_accum) for r in plan.ranks]
        [(24, 2), (16, 3)]
    """
    if target is not None:
        target = require_positive_int("target", target)
    min_micro = require_positive_int("min_micro", min_micro)
    multiple = 1 if multiple_of is None else require_positive_int("multiple_of", multiple_of)
    limits = list(limits)
    if not limits or [lim.rank for lim in limits] != list(range(len(limits))):
        raise AutobatchError(f"limits must give ranks 0..N-1 in order, but got ranks {[lim.rank for lim in limits]}")
    timed = all(lim.step_seconds is not None for lim in limits)
    known = [lim.step_seconds for lim in limits if lim.step_seconds is not None]
    fill = (statistics.median(a for a, _ in known), statistics.median(s for _, s in known)) if known else (0.0, 1.0)
    ranks = [_Rank(lim, min_micro, multiple, lim.step_seconds or fill) for lim in limits]
    world = len(ranks)

    if target is None:  # each rank its safe batch, once: the most samples per step without accumulation
        if any(r.hi < r.lo for r in ranks):
            raise AutobatchError(f"a rank's safe batch is below the smallest micro batch allowed (≥ {min_micro}"
                                 f"{f', a multiple of {multiple}' if multiple > 1 else ''}); lower {option('min_micro')}")
        low = min(r.hi for r in ranks) if uniform_safe is None else uniform_safe
        return UnevenPlan(
            tuple(RankPlan(lim.rank, r.hi, 1, lim.max_batch, lim.safe_batch,
                           (r.a + r.s * r.hi) / r.hi if lim.step_seconds is not None and speeds == "measured"
                           else None)
                  for lim, r in zip(limits, ranks)),
            same_accum, Plan(low, 1, gpus_per_node=world), max(r.a + r.s * r.hi for r in ranks),
            max(r.a + r.s * low for r in ranks), timed, "each rank's safe batch, no accumulation (no target given)",
            speeds)
    uniform = uniform_seconds = None
    try:
        smallest = min(lim.safe_batch for lim in limits) if uniform_safe is None else uniform_safe
        uniform = solve(target, world, 1, smallest, min_micro=min_micro,
                        multiple_of=multiple_of)
        uniform_seconds = max(uniform.grad_accum * r.a + r.s * uniform.micro_batch * uniform.grad_accum
                              for r in ranks)
    except NoExactPlanError:
        pass

    if same_accum:
        found = _same_accum(ranks, target)
        plans = None if found is None else [(m, found[1]) for m in found[0]]
        seconds = None if found is None else found[2]
    else:
        found_ddp = _per_rank_accum(ranks, target)
        plans = None if found_ddp is None else [r.split(n) for r, n in zip(ranks, found_ddp[0])]
        seconds = None if found_ddp is None else found_ddp[1]
    steps = None if plans is None else sum(k for _, k in plans)
    tolerance = NOISE if timed and speeds == "measured" else 1e-9
    if uniform is not None and (plans is None or _no_faster(seconds, steps, uniform_seconds, uniform.grad_accum * world,
                                                            tolerance)):
        margin = f" by more than the {tolerance:.0%} measured times vary" if tolerance > 1e-6 else ""
        reason = (f"the uniform plan: no uneven split finishes a step sooner{margin}, or as soon in fewer micro-steps"
                  if plans is not None else "the uniform plan: no uneven split reaches the target")
        plans, seconds = [(uniform.micro_batch, uniform.grad_accum)] * world, uniform_seconds
    elif plans is None:
        raise NoExactPlanError(
            f"no exact uneven plan: {target} samples per step cannot be split over {world} ranks with each rank's "
            f"micro batch within its safe batch ({', '.join(str(lim.safe_batch) for lim in limits)}) and "
            f"≥ {min_micro}{f', a multiple of {multiple}' if multiple > 1 else ''}; pick a target the ranks reach",
            target=target, world_size=world, below=None, above=target, world_sizes=())
    else:
        balance = ("at equal speed per sample (no step times)" if not timed else "balanced by measured step times"
                   if speeds == "measured" else "balanced by the cards' peak speeds (an estimate times nothing)")
        reason = (f"the slowest rank's step is as short as the ranks' safe batches allow, {balance}, "
                  f"then the fewest micro-steps{'; one accumulation for all ranks' if same_accum else ''}")
    rank_plans = tuple(
        RankPlan(rank=lim.rank, micro_batch=m, grad_accum=k, max_batch=lim.max_batch, safe_batch=lim.safe_batch,
                 seconds_per_sample=(r.a + r.s * m) / m if lim.step_seconds is not None and speeds == "measured"
                 else None)
        for lim, r, (m, k) in zip(limits, ranks, plans)
    )
    return UnevenPlan(rank_plans, same_accum, uniform, seconds, uniform_seconds, timed, reason, speeds)

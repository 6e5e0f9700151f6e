"""The values of a plan per rank: what each rank can do (:class:`RankLimit`, its step-time line from
:func:`step_line`), its part of the plan (:class:`RankPlan`) and the whole (:class:`UnevenPlan`), which
prints its arithmetic per rank. :func:`~autobatch.planning.uneven.solve_uneven` makes one.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import AutobatchError
from .plan import Plan, require_positive_int

__all__ = ["RankLimit", "RankPlan", "UnevenPlan", "step_line"]


@dataclass(frozen=True)
class RankLimit:
    """What one rank can do: its largest and safe micro batch, and how long a micro-step takes.

    ``step_seconds`` is ``(a, s)``: a micro-step of ``m`` samples takes ``a + s·m`` seconds
    (:func:`step_line` draws it through a rank's trials); ``None`` where nothing was timed.

    Example:
        >>> RankLimit(0, max_batch=40, safe_batch=36, step_seconds=(0.5, 0.25)).seconds(10)
        3.0
    """

    rank: int
    max_batch: int
    safe_batch: int
    step_seconds: tuple[float, float] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
            raise AutobatchError(f"rank must be an integer ≥ 0, but got rank={self.rank!r}")
        require_positive_int("max_batch", self.max_batch)
        require_positive_int("safe_batch", self.safe_batch)
        if self.safe_batch > self.max_batch:
            raise AutobatchError(f"rank {self.rank}: safe_batch ({self.safe_batch}) must be at most max_batch "
                                 f"({self.max_batch})")
        if self.step_seconds is not None:
            a, s = self.step_seconds
            if not (math.isfinite(a) and math.isfinite(s) and a >= 0 and s > 0):
                raise AutobatchError(f"rank {self.rank}: step_seconds must be (a ≥ 0, s > 0) seconds, "
                                     f"but got {self.step_seconds!r}")

    def seconds(self, micro: int) -> float:
        a, s = self.step_seconds or (0.0, 1.0)
        return a + s * micro

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "max_batch": self.max_batch, "safe_batch": self.safe_batch,
                "step_seconds": None if self.step_seconds is None else list(self.step_seconds)}


def step_line(points: Sequence[tuple[int, float]]) -> tuple[float, float] | None:
    """``(a, s)`` with ``seconds ≈ a + s·batch`` through measured ``(batch, seconds)`` points.

    Least squares over two or more batches (``a`` kept ≥ 0); one batch gives ``(0, t / b)``; none,
    ``None``.

    Example:
        >>> step_line([(2, 0.3), (4, 0.5), (8, 0.9)])
        (0.1, 0.1)
    """
    points = [(b, t) for b, t in points if b > 0 and t is not None and t > 0 and math.isfinite(t)]
    if not points:
        return None
    batches = {b for b, _ in points}
    if len(batches) < 2:
        return 0.0, statistics.fmean(t / b for b, t in points)
    mb = statistics.fmean(b for b, _ in points)
    mt = statistics.fmean(t for _, t in points)
    slope = sum((b - mb) * (t - mt) for b, t in points) / sum((b - mb) ** 2 for b, _ in points)
    a = mt - slope * mb
    if slope <= 0 or a < 0:  # noise: the per-sample time through the origin
        return 0.0, sum(t for _, t in points) / sum(b for b, _ in points)
    return round(a, 12), round(slope, 12)


@dataclass(frozen=True)
class RankPlan:
    """One rank's part of an :class:`UnevenPlan`: ``micro_batch × grad_accum`` samples per step."""

    rank: int
    micro_batch: int
    grad_accum: int
    max_batch: int
    safe_batch: int
    seconds_per_sample: float | None

    @property
    def samples(self) -> int:
        return self.micro_batch * self.grad_accum

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "micro_batch": self.micro_batch, "grad_accum": self.grad_accum,
                "samples": self.samples, "max_batch": self.max_batch, "safe_batch": self.safe_batch,
                "seconds_per_sample": self.seconds_per_sample}


@dataclass(frozen=True)
class UnevenPlan:
    """A plan per rank; ``global_batch`` is ``Σ micro_batch × grad_accum`` over ``ranks``.

    ``same_accum`` says every rank takes the same ``grad_accum`` (FSDP, ZeRO). ``step_seconds``
    and ``uniform_seconds`` are the slowest rank's predicted step under this plan and under
    ``uniform`` (every rank at the smallest safe batch), with the times the ranks were measured
    at (seconds per sample where none were); ``uniform`` is ``None`` where no uniform plan reaches
    the target.
    """

    ranks: tuple[RankPlan, ...]
    same_accum: bool
    uniform: Plan | None
    step_seconds: float
    uniform_seconds: float | None
    timed: bool
    reason: str = ""
    speeds: str = "measured"   # where the step times come from: "measured" seconds, or the cards' "peak" TFLOPS

    @property
    def global_batch(self) -> int:
        return sum(r.samples for r in self.ranks)

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def is_uniform(self) -> bool:
        return len({(r.micro_batch, r.grad_accum) for r in self.ranks}) == 1

    def for_rank(self, rank: int) -> RankPlan:
        """This rank's micro batch and accumulation."""
        if not 0 <= rank < len(self.ranks):
            raise AutobatchError(f"rank must be in 0..{len(self.ranks) - 1} for this plan of {len(self.ranks)} "
                                 f"ranks, but got {rank}")
        return self.ranks[rank]

    def describe(self) -> str:
        """The arithmetic per rank, the balance, and how it compares with the uniform plan."""
        sums = " + ".join(f"{r.micro_batch}×{r.grad_accum}" for r in self.ranks)
        if len(self.ranks) > 8:
            sums = f"{len(self.ranks)} ranks' micro batch × accumulation"
        lines = [f"uneven plan: {sums} = {self.global_batch} per step"
                 f" ({'the same accumulation on every rank' if self.same_accum else 'accumulation per rank'})"]
        for r in self.ranks:
            per = "" if r.seconds_per_sample is None else f", {r.seconds_per_sample:.4g} s/sample"
            lines.append(f"  rank {r.rank}: {r.micro_batch} × {r.grad_accum} = {r.samples} samples "
                         f"(max {r.max_batch}, safe {r.safe_batch}{per})")
        if self.uniform is not None and self.uniform_seconds is not None:
            lines.append(f"step: {self._time(self.step_seconds)} on the slowest rank; uniform plan "
                         f"({self.uniform.micro_batch} × {self.uniform.grad_accum} on every rank = "
                         f"{self.uniform.global_batch} per step): {self._time(self.uniform_seconds)}")
        else:
            lines.append(f"step: {self._time(self.step_seconds)} on the slowest rank; no uniform plan reaches "
                         f"{self.global_batch} on {len(self.ranks)} ranks")
        if self.reason:
            lines.append(f"chosen: {self.reason}")
        return "\n".join(lines)

    def _time(self, value: float) -> str:
        """A step's time as the plan knows it: seconds measured, relative to peak speeds, or in samples."""
        if not self.timed:
            return f"the time of {value:.0f} samples"
        return f"{value:.4g} s" if self.speeds == "measured" else f"{value:.4g} (relative)"

    def __str__(self) -> str:
        return self.describe()

    def to_dict(self) -> dict[str, Any]:
        return {
            "global_batch": self.global_batch,
            "world_size": self.world_size,
            "same_accum": self.same_accum,
            "per_rank": [r.to_dict() for r in self.ranks],
            "step_time": self.step_seconds,
            "uniform_step_time": self.uniform_seconds,
            "time_unit": "seconds" if self.timed and self.speeds == "measured" else "relative" if self.timed
            else "samples",
            "timed": self.timed,
            "speeds": self.speeds if self.timed else "equal",
            "uniform": None if self.uniform is None else self.uniform.to_dict(),
            "reason": self.reason,
            "arithmetic": self.describe(),
        }

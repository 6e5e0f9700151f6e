"""The agreed answer of every rank, and what each rank saw on its own."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from ..errors import AutobatchError
from ..planning.per_rank import RankLimit
from ..probing.backends import DeviceInfo
from ..probing.result import BatchResult, ProbeResult
from ..probing.trial import Trial
from ..units import format_bytes

__all__ = ["DistributedProbeResult", "RankFailedError", "RankReport"]


class RankFailedError(AutobatchError):
    """Another rank failed with an error that is not out-of-memory; this rank stopped with it."""

    def __init__(self, message: str, rank: int):
        self.rank = rank
        super().__init__(message)


@dataclass(frozen=True)
class RankReport:
    """One rank's device and what its own trials showed.

    ``largest_fit``/``smallest_failure`` are observed on this rank. Its own maximum is exact
    (``exact_max``) only when they are adjacent; otherwise ``predicted_max`` is the rank's own
    line (forward/backward and optimizer peaks against its own capacity), an estimate.
    """

    rank: int
    local_rank: int
    host: str
    device: DeviceInfo
    largest_fit: int
    smallest_failure: int | None
    predicted_max: int | None
    trials: tuple[Trial, ...]

    @property
    def exact_max(self) -> int | None:
        if self.smallest_failure is not None and self.smallest_failure == self.largest_fit + 1:
            return self.largest_fit
        return None

    def to_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "local_rank": self.local_rank,
            "host": self.host,
            "device": self.device.to_dict(),
            "largest_fit": self.largest_fit,
            "smallest_failure": self.smallest_failure,
            "exact_max": self.exact_max,
            "predicted_max": self.predicted_max,
            "trials": [t.to_dict() for t in self.trials],
        }


@dataclass(frozen=True, kw_only=True)
class DistributedProbeResult(BatchResult):
    """The answer of :func:`~autobatch.probe_distributed`, identical on every rank.

    ``max_batch`` is the largest per-rank batch that trained on every rank at once (each rank
    under DDP when ``wrapped == "ddp"``), ``max_batch + 1`` ran out of memory on the ranks in
    ``limiting_ranks``. ``trials`` are the agreed trials: a trial fits when it fit on every rank,
    its bytes are the largest any rank reached. ``capacity_bytes`` is the smallest capacity.
    """

    world_size: int
    ranks: tuple[RankReport, ...]
    limiting_ranks: tuple[int, ...]   # ranks that ran out of memory at max_batch + 1
    safe_peak_measured: bool
    wrapped: str | None               # "ddp" under DistributedDataParallel; a strategy's label when sharded
    own_limits: tuple[RankLimit, ...] | None = None  # each rank's own largest and safe batch (each_rank=True)

    def _details(self) -> dict[str, Any]:
        return {
            "safe_peak_measured": self.safe_peak_measured,
            "world_size": self.world_size,
            "wrapped": self.wrapped,
            "limiting_ranks": list(self.limiting_ranks),
            "ranks": [r.to_dict() for r in self.ranks],
            **({} if self.own_limits is None else {"own_limits": [lim.to_dict() for lim in self.own_limits]}),
        }

    def to_probe_result(self) -> ProbeResult:
        """The same answer as a single-device :class:`~autobatch.ProbeResult` (the solver's input).

        Its ``device`` is the (first) limiting rank's; the per-rank report rides in ``extra``.
        """
        limiting = self.limiting_ranks[0] if self.limiting_ranks else 0
        common = {f.name: getattr(self, f.name) for f in fields(BatchResult) if f.name != "extra"}
        return ProbeResult(
            **common, device=self.ranks[limiting].device, safe_peak_measured=self.safe_peak_measured,
            extra={**self.extra, "distributed": {k: v for k, v in self._details().items()
                                                 if k in ("world_size", "wrapped", "limiting_ranks", "ranks",
                                                          "own_limits")}},
        )

    def __str__(self) -> str:
        how = " under DDP" if self.wrapped == "ddp" else f" under {self.wrapped}" if self.wrapped else ""
        if self.limited_by == "max_batch":
            limit = self.limit_text()
        else:
            limit = "memory on rank " + ", ".join(map(str, self.limiting_ranks))
        lines = [
            f"{self.workload} on {self.world_size} rank(s){how}: max batch {self.max_batch} per rank "
            f"(limited by {limit}), agreed in {len(self.trials)} trials: "
            + ", ".join(f"{t.batch}{'✓' if t.fits else '✗'}" for t in self.trials),
            f"safe batch {self.safe_batch} per rank (peak {format_bytes(self.safe_peak_bytes)}"
            f"{'' if self.safe_peak_measured else ' predicted'}, headroom {format_bytes(self.headroom_bytes)} "
            f"of the smallest capacity {format_bytes(self.capacity_bytes)})",
            "rank  host          device                          total      free       others     fits  fails  own max",
        ]
        lines.insert(1, self.trace_line())  # this rank's trace: every rank traced the same batches
        for r in self.ranks:
            exact = r.exact_max if self.own_limits is None else self.own_limits[r.rank].max_batch
            own = f"{exact} exact" if exact is not None else (
                f"~{r.predicted_max} predicted" if r.predicted_max is not None else "unknown")
            mark = " <- limits the plan" if r.rank in self.limiting_ranks else ""
            lines.append(
                f"{r.rank:<5} {r.host[:12]:<13} {r.device.name[:31]:<31} {format_bytes(r.device.total_bytes):<10} "
                f"{format_bytes(r.device.free_bytes):<10} {format_bytes(r.device.used_by_others_bytes):<10} "
                f"{r.largest_fit:<5} {r.smallest_failure if r.smallest_failure is not None else '-':<6} {own}{mark}"
            )
        return "\n".join(lines)



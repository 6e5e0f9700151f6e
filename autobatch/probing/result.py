"""The answer of a probe: one base for every kind of result, so a field is added once.

:class:`BatchResult` holds what every answer has — the exact max, the safe batch, the trials
that prove them, the memory line — and prints and serialises it. :class:`ProbeResult` is a
probe on one real or simulated device; the estimate (:mod:`autobatch.estimating`) and the
agreed answer of every rank (:mod:`autobatch.distributed`) extend the same base.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..units import format_bytes
from .backends import DeviceInfo
from .search import HARD_MAX_BATCH
from .trial import Trial

__all__ = ["BatchResult", "ProbeResult", "not_led", "trace_record"]


def not_led(reason: str) -> dict[str, Any]:
    """The record of a search the fake-tensor trace did not lead, and why."""
    return {"led": False, "reason": reason, "traced_batches": [], "traced_once": False, "seconds": 0.0,
            "failure": None}


def trace_record(said: dict[str, Any]) -> dict[str, Any]:
    """A traced prior's report (``traced_batches``, ``seconds``, ``failure``) as the record a result keeps:
    it led the search unless its trace stopped, and then the failure is the reason."""
    if "led" in said:
        return said
    failure = said.get("failure")
    return {"led": failure is None, "reason": None if failure is None else f"the trace stopped: {failure}", **said}


@dataclass(frozen=True, kw_only=True)
class BatchResult:
    """What every answer holds.

    ``max_batch`` is the largest batch that fit (exact when ``max_batch + 1`` is in ``trials``
    and failed, unless ``limited_by == "max_batch"``). ``safe_batch`` is the largest batch whose
    peak, measured or predicted from the fitted line, stays under ``capacity_bytes -
    headroom_bytes``. ``bytes_per_sample``/``fixed_bytes`` are that line's slope and intercept.
    """

    max_batch: int
    safe_batch: int
    limited_by: str                  # "memory" or "max_batch"
    min_batch: int
    trials: tuple[Trial, ...]
    capacity_bytes: int
    headroom_bytes: int
    bytes_per_sample: float | None   # slope of the fitted line
    fixed_bytes: float | None        # its intercept: model, gradients, optimizer state, workspaces
    safe_peak_bytes: int | None      # measured when a trial ran at safe_batch, else predicted
    workload: str = "model"
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def max_trial(self) -> Trial | None:
        return next((t for t in self.trials if t.batch == self.max_batch and t.fits), None)

    def trials_text(self) -> str:
        """``4✓, 9✗, 7✓, 8✗``: every trial in the order it ran."""
        return ", ".join(f"{t.batch}{'✓' if t.fits else '✗'}" for t in self.trials)

    def retried_text(self) -> str:
        """Why the safe batch stops below batches that fit, where the first of them fit only after the
        allocator freed its cache and retried (:func:`~autobatch.probing.probe.summarise`): ``""`` elsewhere."""
        retried = min((t.batch for t in self.trials if t.fits and t.alloc_retries), default=None)
        if retried is None or retried != self.safe_batch + 1:
            return ""
        return (f"; {retried} fit only after the allocator freed its cached blocks and retried, a step from running "
                "out: no batch from it on is safe")

    def limit_text(self) -> str:
        # The cap has two names: max_batch= in Python, --max-micro on the command line.
        if self.limited_by != "max_batch":
            return "memory"
        if self.max_batch >= HARD_MAX_BATCH:
            return "the probe's own cap, as memory never ran out: pass --max-micro / max_batch= for a lower one"
        return "the --max-micro / max_batch= cap"

    def _details(self) -> dict[str, Any]:
        """The fields a subclass adds, for :meth:`to_dict`."""
        return {}

    def to_dict(self) -> dict[str, Any]:
        return {
            "workload": self.workload,
            "max_batch": self.max_batch,
            "safe_batch": self.safe_batch,
            "limited_by": self.limited_by,
            "min_batch": self.min_batch,
            "capacity_bytes": self.capacity_bytes,
            "headroom_bytes": self.headroom_bytes,
            "bytes_per_sample": self.bytes_per_sample,
            "fixed_bytes": self.fixed_bytes,
            "safe_peak_bytes": self.safe_peak_bytes,
            **self._details(),
            "trials": [t.to_dict() for t in self.trials],
            **self.extra,
            "trace_prior": self.trace_record,
        }

    @property
    def trace_record(self) -> dict[str, Any]:
        """Whether the fake-tensor trace led the search and, where not, why: ``extra["trace_prior"]``
        (``led``, ``reason``, ``traced_batches``, ``seconds``, ``failure``), never missing."""
        said = self.extra.get("trace_prior")
        if not isinstance(said, dict):
            return not_led("no record of the trace (a result stored before it was recorded)")
        return trace_record(said)  # a record stored before "led" was gets one now

    @property
    def trace_led(self) -> bool:
        """Whether the fake-tensor trace led the search to its end (no failure, no other prior)."""
        return bool(self.trace_record["led"])

    def trace_line(self) -> str:
        """One line: how the fake-tensor trace led the search, or why it did not; and why its one trace for
        every batch stopped, where it did (``not_traced_once``) and the traces at each batch did not fail."""
        said = self.trace_record
        why = said.get("not_traced_once")
        line = self._trace_line(said)
        return f"{line}; its one trace for every batch stopped: {why}" if why and not said.get("failure") else line

    @staticmethod
    def _trace_line(said: dict[str, Any]) -> str:
        traced = ", ".join(str(b) for b in said.get("traced_batches", []))
        seconds = f"in {said.get('seconds', 0):.1f} s"
        cost = (f"traced once for every batch {seconds}" if said.get("traced_once") else
                f"traced at batches {traced} {seconds}" if traced else "traced nothing")
        if said["led"]:
            beside = said.get("from_trial")
            how = ("beside the trials at the lowest CPU priority" if "waited" in said
                   else "between the trials" if said.get("between") else "beside the trials")
            when = f" from trial {beside + 1} on (traced {how}: {cost})" if beside is not None else f" ({cost})"
            return f"led by the fake-tensor trace{when}; the answer rests on the trials"
        if said.get("failure"):
            return f"the trace stopped ({said['failure']}; {cost}): the trials searched on alone"
        if said.get("led_by"):
            return (f"led by the {said['led_by']} row's traced trials (the same activations, another state); "
                    "the answer rests on this row's own")
        return f"the trials alone searched: {said['reason']}"

    def memory_line(self) -> str | None:
        """The line through the trials nearest the boundary, as fixed bytes and bytes per sample; where it
        crosses zero at a positive batch (memory grows faster than the batch: a contrastive loss's batch ×
        batch logits), the slope alone, since no fixed part reads off that line."""
        if not self.bytes_per_sample:
            return None
        per_sample = f"{format_bytes(self.bytes_per_sample)} per sample"
        if self.fixed_bytes is not None and self.fixed_bytes < 0:
            return f"memory grows faster than the batch: ≈ {per_sample} near batch {self.max_batch}"
        return f"memory ≈ {format_bytes(self.fixed_bytes)} + {per_sample}"


@dataclass(frozen=True, kw_only=True)
class ProbeResult(BatchResult):
    """The answer of :func:`~autobatch.probe`: trials that ran on ``device``."""

    device: DeviceInfo
    safe_peak_measured: bool
    gradient_bytes: int | None = None  # the trainable parameters' gradients: one DDP bucket's copy

    def _details(self) -> dict[str, Any]:
        return {"safe_peak_measured": self.safe_peak_measured, "gradient_bytes": self.gradient_bytes,
                "device": self.device.to_dict()}

    def _safe_peak_text(self) -> str:
        """The safe batch's peak as the trial table shows it: measured or predicted, and DDP's buckets on top."""
        how = "measured" if self.safe_peak_measured else "predicted"
        buckets = self.extra.get("ddp_buckets_bytes")
        if not buckets or self.safe_peak_bytes is None:
            return f"{format_bytes(self.safe_peak_bytes)}{'' if self.safe_peak_measured else ' predicted'}"
        return (f"{format_bytes(self.safe_peak_bytes)}: {format_bytes(self.safe_peak_bytes - buckets)} {how} + "
                f"{format_bytes(buckets)} for DDP's gradient buckets on each of several ranks")

    def __str__(self) -> str:
        lines = [
            f"{self.workload} on {self.device.name}: capacity {format_bytes(self.capacity_bytes)}",
            f"max batch {self.max_batch} (limited by {self.limit_text()}), found in {len(self.trials)} trials: "
            + self.trials_text(),
            f"safe batch {self.safe_batch} (peak {self._safe_peak_text()}, headroom {format_bytes(self.headroom_bytes)}"
            f"{self.retried_text()})",
        ]
        lines.insert(2, self.trace_line())
        if self.memory_line():
            lines.append(self.memory_line())
        return "\n".join(lines)

"""Another strategy's traced trials lead an estimate's search: the same activations, another state.

An estimate of several strategies traces each one's sharded step at every batch its search tries.
Under FSDP and ZeRO the step computes in the run's dtype, so what a sample adds (its activations)
is the same under each: llama-1b in bf16 as rank 0 of 8 adds 6,746,841,088 bytes a sample under
fsdp1, fsdp2, zero1, zero2 and zero3 alike, and only what is held whatever the batch (the shards,
the optimizer's state, the buckets) differs. So the curve one row's trials drew, moved onto the
next row's first trial, is that row's curve: its search tries the batch the curve puts at the
boundary and the one after it, where alone it would have needed a trial more to find the slope.
DDP trains fp32 weights under autocast, whose activations differ (7,426,318,336 bytes a sample
there): it neither leads nor is led. Every answer still rests on the row's own trials.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .estimate import IS_THE_TRACE

__all__ = ["RowLead", "leads"]


def leads(name: str) -> bool:
    """Whether a strategy's rows lead, and are led by, one another (those that compute in the run's dtype)."""
    return name != "ddp"


class RowLead:
    """A prior for one row's search: the peaks of ``trials`` (another row's, the same step under
    another strategy), joined by straight lines and extended by the nearest one's slope, moved by
    the difference at this row's first trial once it is seen (:meth:`saw`). Exact there, it is
    trusted as it stands, so its next batch is the boundary it draws.

    Example:
        >>> from autobatch.probing.trial import Trial
        >>> lead = RowLead([Trial(b, True, 100 + 7 * b, 100 + 7 * b) for b in (1, 5, 9)], "zero1")
        >>> lead(20)
        240.0
        >>> lead.saw(Trial(1, True, 408, 408)); lead(20)  # this row holds 301 bytes more
        541.0
    """

    def __init__(self, trials: Sequence[Any], source: str):
        points: dict[int, int] = {}
        for trial in trials:
            if trial.reserved_bytes > 0:
                points[trial.batch] = max(points.get(trial.batch, 0), trial.reserved_bytes)
        self.batches = sorted(points)
        self.peaks = [float(points[b]) for b in self.batches]
        for i in range(1, len(self.peaks)):  # never decreasing, as a prior must be
            self.peaks[i] = max(self.peaks[i], self.peaks[i - 1])
        self.shift: float | None = None
        # Not the trace as a prior (an estimate's trials are traces already): the record says which row led.
        self.reason, self.led_by = IS_THE_TRACE, source

    @property
    def usable(self) -> bool:
        """Two batches at least: a slope to extend."""
        return len(self.batches) >= 2

    def curve(self, batch: float) -> float:
        xs, ys = self.batches, self.peaks
        i = 1
        while i < len(xs) - 1 and batch > xs[i]:
            i += 1
        slope = (ys[i] - ys[i - 1]) / (xs[i] - xs[i - 1])
        return ys[i - 1] + slope * (batch - xs[i - 1])

    def saw(self, trial: Any) -> None:
        """One of this row's trials: the first moves the curve onto its peak (the state this strategy holds)."""
        if self.shift is None and trial.reserved_bytes > 0:
            self.shift = trial.reserved_bytes - self.curve(trial.batch)

    def __call__(self, batch: int) -> float:
        return (self.shift or 0.0) + self.curve(batch)

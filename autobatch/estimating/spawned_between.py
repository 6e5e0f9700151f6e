"""The sharded trace beside CPU trials in a process of its own: the core they leave idle, and the time they lend.

On a simulated budget the trials run on this machine's CPU, and a trace on a thread of their
process can only run *between* them (:class:`~autobatch.estimating.background.TracedBetween`):
every second it runs is a second the search waits. That bound costs little where trials are cheap
and their trace cheaper still, but a sharded probe's trace wraps a fake copy as the strategy
does (a second or more a traced batch) against trials that are mostly the wrapper's set-up (a
tiny model's ZeRO-1 trial: about a second at any batch); lent their time, the trace cost more than
the one trial it saved (17.5 s against 10.4 s, docs/benchmarks/wall_cpu.md of 2026-11-27).

So the sharded step of a model this process built from its name is traced by a child of its own,
as beside a GPU (:class:`~autobatch.estimating.spawned.SpawnedBeside`), on a fake process group
of the probe's world, at the lowest CPU priority (Linux's idle policy): started as ``find`` builds
the model (:func:`~autobatch.estimating.spawned.warmed`), it imports and builds on the core the
build leaves idle, traces on whatever the trials leave idle, and yields the CPU to them whenever
they want it. Where the trials keep every core busy (a large model's steps) it gets nearly none;
so the search lends it time as it lends a trace between the trials: before each trial it waits
until the child has had as much CPU as the trials have taken (:meth:`SpawnedBetween.lend`), never
in all longer than they took. Time it had for free counts, so it waits less than a trace between
the trials would, and mostly not at all. Once what it still needs at its pace (in its own CPU
seconds a traced batch) passes what it could save, the search stops lending it time and waiting
for it (:meth:`SpawnedBetween.give_up`), and it goes on, on the idle CPU alone, leading if it is
ready before the search ends.

Its CPU seconds are read from ``/proc`` (Linux); elsewhere only the seconds lent are counted, as
for a trace between the trials.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from .prior import NOT_READY
from .spawned import SpawnedBeside

__all__ = ["SpawnedBetween", "cpu_seconds", "NOT_PAID_BESIDE", "NOT_WAITED"]

# A trace beside CPU trials not done when they were.
NOT_PAID_BESIDE = ("the trials were cheaper than the trace: they ended the search in {trials:.2f} s, before the trace, "
                   "run beside them at the lowest priority and waited for {lent:.2f} s, was done")
# A trace beside CPU trials no longer waited for once what it still needed passed what it could save.
NOT_WAITED = ("the trace would have cost more than the trials it saves: {left:.2f} s more to trace at its pace, "
              "against about {trial:.2f} s for the next trial; not waited for after {lent:.2f} s")


def cpu_seconds(pid: int) -> float | None:
    """The CPU seconds (user and system) process ``pid`` has used, or ``None`` where ``/proc`` cannot say.

    Example:
        >>> cpu_seconds(os.getpid()) is None or cpu_seconds(os.getpid()) > 0
        True
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            text = stat.read()
        fields = text[text.rindex(b")") + 2:].split()  # from the third field on: the name may hold spaces
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
    except (OSError, ValueError, IndexError):
        return None


class SpawnedBetween(SpawnedBeside):
    """A prior traced by a child at the lowest priority beside CPU trials, lent their time where it
    had less: the contract of :class:`~autobatch.estimating.background.TracedBetween`."""

    def __init__(self, recipe: tuple[str, dict[str, Any], dict[str, Any]], *, min_batch: int | None,
                 allocator: str, device_type: str = "cpu", traced: Callable[..., Any] | None = None,
                 model: Any = None):
        super().__init__(recipe, min_batch=min_batch, allocator=allocator, device_type=device_type, traced=traced,
                         model=model)
        self.lent = 0.0  # seconds the search has waited for it
        self.trials_seconds = 0.0
        self.not_worth: str | None = None  # why the search stopped waiting for it, if it did

    def used(self) -> float:
        """The CPU seconds the child has had (its start included), at least the seconds it was lent."""
        cpu = cpu_seconds(self._process.pid)
        return self.lent if cpu is None else max(cpu, self.lent)

    def lend(self, trials_seconds: float) -> None:
        """Wait until the child has had ``trials_seconds`` of CPU, or is done: never longer, in all
        the search has waited for it, than ``trials_seconds``."""
        self.trials_seconds = trials_seconds
        if self.not_worth is None:
            self.finish_within(min(trials_seconds - self.lent, trials_seconds - self.used()))

    def finish_within(self, seconds: float) -> bool:
        if seconds <= 0:
            return self.ready()
        start = time.perf_counter()
        try:
            return super().finish_within(seconds)
        finally:
            self.lent += time.perf_counter() - start

    def give_up(self, left: float, trial: float) -> None:
        """Stop lending it time: ``left`` seconds more would cost more than the trials it saves (about
        ``trial`` seconds the next). It goes on on the idle CPU, and leads if it is ready in time."""
        self.not_worth = NOT_WAITED.format(left=left, trial=trial, lent=self.lent)

    def report(self) -> dict[str, Any]:
        said = {**super().report(), "between": True, "waited": round(self.lent, 3)}
        if said.get("reason") == NOT_READY:
            said["reason"] = self.not_worth or NOT_PAID_BESIDE.format(trials=self.trials_seconds, lent=self.lent)
        return said

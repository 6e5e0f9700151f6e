"""The trace beside the trials: a prior traced on the CPU while the device trains.

A trace runs on the CPU; a trial runs on the GPU. :func:`beside` starts the traces a prior needs
(:func:`~autobatch.estimating.prior.try_trace_prior`'s, at the batches its laws are fitted and
checked at) at once: for a model this process built from its name, in a process of its own
(:class:`~autobatch.estimating.spawned.SpawnedBeside`), which leaves the trials their interpreter;
else on a daemon thread (:class:`TracedBeside`), which holds it while it runs. The search
(:func:`autobatch.probing.search.search_max`) asks ``ready()`` before each trial and lets the
prior lead from the first trial after it is ready; it never waits for it. When the search ends,
``stop()`` cancels a trace still running (at its next torch call) and joins the thread, so nothing
the trace does outlives the probe: the random number generator's state it forks is put back
before the probe puts back the caller's.

Fake tensors, their dispatch modes and autocast's state are per thread, so the trace and the
trials do not see each other's tensors.

Where the trials run on the same CPU as the trace (a simulated budget), the two cannot overlap on
a thread: the trace holds the interpreter while it runs, and a trial waits for it at every torch
call (a tiny model's step went from 0.011 s to 0.68 s beside it). There :func:`between` runs the
trace *between* the trials instead, paused at its next torch call while one runs, and never for longer
in all than the trials have taken so far (:meth:`TracedBetween.lend`). A trace that costs more
than the trials it would save (a tiny model's, whose steps take hundredths of a second) is given
only the trials' own time, and the search ends without it; once it has traced a batch, it is given
up where what it still needs passes what it could save
(:data:`~autobatch.probing.pending.SAVES` trials, fewer the later it would lead); one that pays (a step of seconds) is
ready after the first trial or two and leads from then on. A sharded probe's trace
(:func:`autobatch.pipeline.sharded_trace_prior`) costs more (a wrapped fake copy, a second or more a
batch) against trials that are mostly the wrapper's set-up: for a model built from its name it
runs in a process of its own, on the CPU the trials leave idle (:func:`spawned_between`); else
between its trials, each traced batch whole once begun (:func:`unpaused`): its wrapped copy holds
the wrapper's global state.

Example:
    >>> import torch, autobatch
    >>> model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    >>> work = autobatch.Workload(model, lambda b: (torch.randn(b, 32), torch.randint(0, 4, (b,))))
    >>> prior = beside(work, device_type="cpu")
    >>> result = autobatch.probe(work, autobatch.SimulatedBackend("1MiB"), prior=prior)
    >>> sorted(result.trace_record) == ["failure", "from_trial", "led", "reason", "seconds", "traced_batches",
    ...                                  "traced_once"]
    True
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from ..probing.progress import paused
from ..probing.workload import Workload
from . import spawned
from .spawned import SpawnedBeside
from .spawned_between import SpawnedBetween
from .prior import (NOT_READY, GuardedPrior, beside_report, left_at_pace, traced_nothing, try_trace_prior,
                    warm_batches)

__all__ = ["TracedBeside", "TracedBetween", "beside", "between", "spawned_between", "traced_between", "unpaused",
           "NOT_READY", "NOT_PAID", "NOT_BEGUN", "NOT_WORTH", "FIRST_WINDOW"]

# A trace run between the trials for no longer than they took, and not done when they were.
NOT_PAID = ("the trials were cheaper than the trace: they ended the search in {trials:.2f} s, before the trace, "
            "run between them for as long, was done")
# A trace between the trials never begun: each window the trials lent was shorter than its start takes.
NOT_BEGUN = ("the trials were cheaper than the trace: they ended the search in {trials:.2f} s; the trace was not "
             "begun, since no window they lent it was as long as the {least:.2f} s its start takes")
# A trace run between the trials given up once what it still needed passed what it could save.
NOT_WORTH = ("the trace would have cost more than the trials it saves: {left:.2f} s more to trace at its pace, "
             "against about {trial:.2f} s for the next trial; given up after {used:.2f} s")


# The shortest window a trace between the trials is begun in (seconds). Its start cannot be paused:
# the symbolic trace's first symbol makes torch import what names a guard's source (torch.export and
# aot_autograd: 0.39 s on this CPU), and a trace begun in a window of a tenth of a second ran 0.3 s
# past it (tiny-gpt2's trials take 0.32 s in all: the trace took 0.65 s, and the search 0.9 s more).
FIRST_WINDOW = 0.5
_LOOK = 0.05  # seconds between looks at whether a trace lent time has traced its first batch


class _Cancelled(BaseException):
    """Raised inside a trace that was stopped: not an ``Exception``, so no handler on the way takes it
    for the trace's own failure."""


_held = threading.local()  # .depth: a trace inside sections that do not pause (see unpaused)


@contextmanager
def unpaused() -> Iterator[None]:
    """A section of a trace that runs whole once begun: a trace between the trials pauses at no
    torch call in it, only before or after. A wrapped copy holds the wrapper's global state
    (DeepSpeed's groups and patches) while it steps, which a trial run in a pause would share."""
    _held.depth = getattr(_held, "depth", 0) + 1
    try:
        yield
    finally:
        _held.depth -= 1


class _Cancel(TorchFunctionMode):
    """Stop the trace at its next torch call once ``event`` is set; with a ``gate``, wait at it
    while the gate is shut (saying so by ``paused``), outside :func:`unpaused` sections."""

    def __init__(self, event: threading.Event, gate: threading.Event | None = None,
                 paused: threading.Event | None = None):
        super().__init__()
        self.event, self.gate, self.paused = event, gate, paused

    def __torch_function__(self, func, types, args=(), kwargs=None):
        while self.gate is not None and not self.gate.is_set() and not getattr(_held, "depth", 0):
            self.paused.set()
            with paused():  # its progress says nothing while the trials run, and counts only its own time
                self.gate.wait()
        if self.event.is_set():
            raise _Cancelled
        return func(*args, **(kwargs or {}))


class TracedBeside:
    """A prior whose traces run on a thread: ``ready()`` says when it can lead; ``stop()`` ends it.

    Called before it is ready it waits for it (the search never does). ``from_trial`` is the
    number of trials run before it took the lead (the search sets it), ``None`` while it has not.
    """

    def __init__(self, prior: GuardedPrior, batches: Sequence[int]):
        self._prior = prior
        self._stop, self._done = threading.Event(), threading.Event()
        self.cancelled = False
        self.from_trial: int | None = None
        self.asked = False  # asked outright (a search in lockstep asks as every rank does), not taken when ready
        self._started = time.perf_counter()
        self._thread = threading.Thread(target=self._trace, args=(tuple(batches),), name="autobatch-trace",
                                        daemon=True)
        self._begin()

    def _begin(self) -> None:
        self._thread.start()

    def _mode(self) -> _Cancel:
        return _Cancel(self._stop)

    def _trace(self, batches: tuple[int, ...]) -> None:
        try:
            with self._mode():
                for batch in batches:
                    self._prior(batch)
        except _Cancelled:
            self.cancelled = True
        finally:
            self._done.set()

    def ready(self) -> bool:
        """Whether the traces are done and the prior can lead (not when its trace failed)."""
        return self._done.is_set() and not self.cancelled and self._prior.failure is None

    def stop(self) -> None:
        """Cancel a trace still running and wait for the thread to end."""
        self._stop.set()
        self._thread.join()

    def ran(self) -> float:
        """The seconds the trace has run so far."""
        return time.perf_counter() - self._started

    def remaining(self) -> float | None:
        """The seconds the trace still needs at its pace so far (its first, slowest, batch counted
        in), or ``None`` before one batch is traced, unless it goes batch by batch (:func:`~.prior.left_at_pace`)."""
        if self._done.is_set():
            return 0.0
        return left_at_pace(self.ran(), len(self._prior.traced_batches), self._prior.by_batch)

    def paced(self) -> tuple[bool, bool]:
        """What is known of its pace: whether it has traced a batch, and whether it goes batch by batch."""
        return bool(self._prior.traced_batches), self._prior.by_batch

    def finish_within(self, seconds: float) -> bool:
        """Wait up to ``seconds`` for the trace to end (the search does where the trial it would
        run next costs more than that); whether it can lead now."""
        self._done.wait(seconds)
        return self.ready()

    def __call__(self, batch: int) -> float:
        self.asked = True
        self._done.wait()
        return self._prior(batch)

    def report(self) -> dict[str, Any]:
        """The prior's report and ``from_trial``; a trace that never led says why (a failed one is
        said by :func:`~autobatch.probing.result.trace_record`, as for any prior)."""
        said = self._prior.report() or traced_nothing(round(self._prior.seconds, 3))
        return beside_report(said, self.from_trial, self.asked)


class TracedBetween(TracedBeside):
    """A prior traced on a thread that runs only between the trials, while the search lends it time.

    The search calls :meth:`lend` before each trial with the seconds its trials have taken so far;
    the trace then runs until its own seconds reach them (or it is done) and pauses at its next
    torch call. So it never costs more than the trials did: where they are cheap, it does not
    finish, and the search ends without it (``reason``: :data:`NOT_PAID`). Where what it still needs
    passes what it could save, the search gives it up (:meth:`give_up`; ``reason``: :data:`NOT_WORTH`).
    It is not begun in a window shorter than ``least`` (:data:`FIRST_WINDOW`): its start cannot be paused
    (``reason``: :data:`NOT_BEGUN`, where the search ended so).
    """

    def __init__(self, prior: GuardedPrior, batches: Sequence[int], spent: float = 0.0, least: float | None = None):
        self._gate, self._paused = threading.Event(), threading.Event()
        self.used = spent  # seconds the trace has run (its fake copy included)
        self.least = FIRST_WINDOW if least is None else least  # the shortest window it is begun in
        self.trials_seconds = 0.0
        self.not_worth: str | None = None  # why it was given up, if it was
        super().__init__(prior, batches)

    def _mode(self) -> _Cancel:
        return _Cancel(self._stop, self._gate, self._paused)

    def _begin(self) -> None:
        pass  # the thread starts when it is first lent time: a prior never lent any leaves none behind

    def lend(self, trials_seconds: float) -> bool:
        """Let the trace run until it has taken ``trials_seconds`` in all, or is done; one that had traced
        no batch pauses as soon as more of its pace is known (:meth:`paced`: its one trace for every
        batch did not answer, or it traced a batch), so that the search weighs it before lending the rest
        (CLIP's first traced batch came 1.3 s before the end of such a window, and the trace was given up
        at its end). Whether it paused so, with time left to lend."""
        self.trials_seconds = trials_seconds
        return self._run_for(trials_seconds - self.used, until_paced=not self._prior.traced_batches)

    def ran(self) -> float:
        return self.used

    def give_up(self, left: float, trial: float) -> None:
        """Stop the trace for good: ``left`` seconds more would cost more than the trials it saves
        (about ``trial`` seconds the next), said in the report."""
        self.not_worth = NOT_WORTH.format(left=left, trial=trial, used=self.used)
        self.stop()

    def finish_within(self, seconds: float) -> bool:
        self._run_for(seconds)
        return self.ready()

    def _run_for(self, budget: float | None, until_paced: bool = False) -> bool:
        """Let the trace run for up to ``budget`` seconds (``None``: to its end), then pause it; with
        ``until_paced``, sooner once more of its pace is known (:meth:`paced`, looked at every :data:`_LOOK`
        seconds), and say so (``True``).

        The caller's random number generator is put back after the window: the trace's own
        ``fork_rng`` may close in it, putting back a state from before the trials in between.
        """
        if self._done.is_set() or (budget is not None and budget <= 0):
            return False
        if self._thread.ident is None and budget is not None and budget < self.least:
            return False  # its start cannot be paused: not begun in a shorter window than that start takes
        state = torch.get_rng_state()
        start = time.perf_counter()
        self._paused.clear()
        self._gate.set()
        if self._thread.ident is None:
            self._thread.start()
        paced, known = False, self.paced()
        try:
            if not until_paced:
                self._done.wait(budget)
            while until_paced and not (paced := self.paced() != known):
                left = _LOOK if budget is None else min(_LOOK, start + budget - time.perf_counter())
                if left <= 0 or self._done.wait(left):
                    break
        finally:
            self._gate.clear()
            while not (self._done.is_set() or self._paused.wait(0.01)):
                pass  # the trace stops at its next torch call
            self.used += time.perf_counter() - start
            torch.set_rng_state(state)
        return paced and not self._done.is_set()

    def stop(self) -> None:
        self._stop.set()
        self._gate.set()  # a paused trace wakes to find the stop
        if self._thread.ident is not None:
            self._thread.join()

    def __call__(self, batch: int) -> float:
        self.asked = True
        if not self._done.is_set():  # asked before it was ready: it runs to its end now
            self._run_for(None)
        return self._prior(batch)

    def report(self) -> dict[str, Any]:
        said = super().report()
        said = {**said, "seconds": round(self.used, 3), "between": True}
        if said.get("reason") == NOT_READY:
            begun = self._thread.ident is not None
            said["reason"] = self.not_worth or (NOT_PAID if begun else NOT_BEGUN).format(
                trials=self.trials_seconds, least=self.least)
        return said


def beside(workload: Workload, *, min_batch: int | None = None, allocator: str = "exact",
           device_type: str = "cuda") -> SpawnedBeside | TracedBeside | GuardedPrior | None:
    """:func:`~autobatch.estimating.prior.try_trace_prior`, its traces started now: by a process of
    their own for a model this process built from its name
    (:class:`~autobatch.estimating.spawned.SpawnedBeside`), else on a thread.

    On a thread the fake copy of the model is made here, before the probe lends the model to the
    device; a model that cannot be copied gives the failed prior as it is (it answers NaN at once).
    """
    recipe = spawned.recipe_of(workload) if spawned.SPAWNS else None
    if recipe is not None:
        try:
            return SpawnedBeside(recipe, min_batch=min_batch, allocator=allocator, device_type=device_type,
                                 model=workload.model)
        except OSError:  # no interpreter to start (an embedded one): traced on a thread instead
            pass
    prior = try_trace_prior(workload, min_batch=min_batch, allocator=allocator, device_type=device_type)
    if prior is None or prior.failure is not None:
        return prior
    return TracedBeside(prior, warm_batches(prior.first))


def between(workload: Workload, *, min_batch: int | None = None, allocator: str = "exact",
            device_type: str = "cpu") -> TracedBetween | GuardedPrior | None:
    """:func:`~autobatch.estimating.prior.try_trace_prior`, its traces run between the trials
    (:class:`TracedBetween`): for trials on the CPU the trace shares. (A sharded step's trace, whose
    start and batches cost more than such trials, runs in a process of its own: :func:`spawned_between`.)

    Example:
        >>> import torch, autobatch
        >>> model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
        >>> work = autobatch.Workload(model, lambda b: (torch.randn(b, 32), torch.randint(0, 4, (b,))))
        >>> result = autobatch.probe(work, autobatch.SimulatedBackend("1MiB"), prior=between(work))
        >>> result.trace_record["led"], result.trace_record["between"]  # its trials took less than its trace
        (False, True)
    """
    return traced_between(lambda: try_trace_prior(workload, min_batch=min_batch, allocator=allocator,
                                                  device_type=device_type))


def spawned_between(workload: Workload, *, min_batch: int | None, allocator: str, device_type: str,
                    traced: Callable[..., Any] | None = None) -> SpawnedBetween | None:
    """The trace of a model this process built from its name, by a process of its own at the lowest
    priority (:class:`~autobatch.estimating.spawned_between.SpawnedBetween`): a sharded probe's
    (``traced``: what traces its step there, :func:`autobatch.pipeline.sharded_prior_in_its_world`), whose
    trials are mostly the wrapper's set-up, a second or so at any batch, and whose trace costs more
    than that a batch: lent their time, it cost more than it saved (docs/benchmarks/wall_cpu.md).
    ``None`` for a model passed in, or where no interpreter starts: the caller traces it here."""
    recipe = spawned.recipe_of(workload) if spawned.SPAWNS else None
    if recipe is None:
        return None
    try:
        return SpawnedBetween(recipe, min_batch=min_batch, allocator=allocator, device_type=device_type,
                              traced=traced, model=workload.model)
    except OSError:  # no interpreter to start (an embedded one)
        return None


def traced_between(make: Callable[[], GuardedPrior | None]) -> TracedBetween | GuardedPrior | None:
    """The prior ``make`` returns (a trace not yet run) run between the trials (:class:`TracedBetween`),
    the seconds making it took (its fake copy of the model) counted as the trace's; a failed prior or
    none as it is."""
    start = time.perf_counter()
    prior = make()
    if prior is None or prior.failure is not None:
        return prior
    return TracedBetween(prior, warm_batches(prior.first), spent=time.perf_counter() - start)

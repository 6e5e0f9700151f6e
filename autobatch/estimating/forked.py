"""The trace beside the trials in a forked process: on another core, not on the trials' interpreter.

On a GPU a trial is mostly the interpreter launching kernels, and a trace on a thread of the same
process holds that interpreter while it runs: every torch call of a trial lets the lock go and
waits for it back, so the trials slowed down for as long as the trace ran (on an H200 every
search led by it took 1 to 8.4 s longer than its trials alone: docs/benchmarks/wall_cuda.md).
:class:`ForkedBeside` runs the same traces in a child forked from the probe's process, which
holds its own copy of the fake model, its own interpreter and a core of its own, and answers the
prior over a pipe: the traces of :func:`~autobatch.estimating.prior.warm_batches` at once, then
any batch the search asks.

Forking copies the prior as it is, however its model and batches were made (a lambda, a closure,
a model built in the caller's script): nothing is pickled, nothing imported again. The child
touches no GPU (the trace runs on fake tensors on the CPU; CUDA refuses a forked process anyway,
and such a refusal is the trace's failure, said in the report), runs torch on one thread, leaves
the terminal to the probe (its progress is not shown) and ignores Ctrl-C, which the probe handles.
:meth:`ForkedBeside.stop` kills it where it stands: nothing it did outlives the probe, and neither
the caller's random number generator nor its model is touched by it.

Where a process cannot fork (Windows, macOS's spawn default), :data:`FORKS` is false, and where
the caller's model is already on a GPU (:func:`on_a_gpu`: its fake copy has the GPU's device, and
choosing a kernel for it may ask CUDA about the card), the trace runs on a thread
(:class:`~autobatch.estimating.background.TracedBeside`).

Example:
    >>> import torch, autobatch
    >>> from autobatch.estimating.prior import try_trace_prior, warm_batches
    >>> model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    >>> work = autobatch.Workload(model, lambda b: (torch.randn(b, 32), torch.randint(0, 4, (b,))))
    >>> prior = try_trace_prior(work)
    >>> forked = ForkedBeside(prior, warm_batches(prior.first))
    >>> forked(64) == try_trace_prior(work)(64)  # the same prior, traced in the child
    True
    >>> forked.stop(); forked.report()["traced_batches"]
    [2, 4, 16, 64]
"""

from __future__ import annotations

import itertools
import math
import multiprocessing
import signal
import sys
import threading
import time
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from .prior import WARM_TRACES, GuardedPrior

__all__ = ["ForkedBeside", "FORKS", "DIED", "on_a_gpu"]

FORKS = sys.platform.startswith("linux") and "fork" in multiprocessing.get_all_start_methods()
DIED = "the trace's process ended before it answered (exit code {code})"
_POLL = 0.5  # seconds between looks at whether a child still lives, while waiting for its answer


def on_a_gpu(model: Any) -> bool:
    """Whether ``model`` (a module, or a factory: not yet built) holds a tensor on a CUDA device."""
    if not isinstance(model, torch.nn.Module):
        return False
    return any(t.is_cuda for t in itertools.chain(model.parameters(), model.buffers()))


def _said(prior: GuardedPrior) -> dict[str, Any]:
    return {"traced_batches": prior.traced_batches, "seconds": round(prior.seconds, 3), "failure": prior.failure}


def _serve(prior: GuardedPrior, batches: tuple[int, ...], conn: Any) -> None:
    """In the child: trace on a thread of its own, as a trace beside the trials on a thread does.

    The forked process is a copy of the thread that forked it, with that thread's torch state
    (grad mode, autocast, the modes a caller entered); a new thread starts from torch's defaults.
    """
    from ..probing import progress

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # blocked across the fork: see ForkedBeside
    torch.set_num_threads(1)
    progress._listeners.clear()  # the probe's terminal is the probe's
    thread = threading.Thread(target=_answer, args=(prior, batches, conn), name="autobatch-trace")
    thread.start()
    thread.join()


def _answer(prior: GuardedPrior, batches: tuple[int, ...], conn: Any) -> None:
    """Trace ``batches`` (saying each as it ends), then answer the batches asked until told to stop."""
    for batch in batches:
        prior(batch)
        conn.send(("traced", _said(prior)))
        if prior.failure is not None:
            break
    conn.send(("ready", _said(prior)))
    while True:
        try:
            batch = conn.recv()
        except EOFError:
            return
        if batch is None:
            return
        value = prior(batch)
        conn.send(("value", value, _said(prior)))


class ForkedBeside:
    """A prior traced in a forked child while the trials run: ``ready()`` says when it can lead,
    ``stop()`` ends it; the same contract as :class:`~autobatch.estimating.background.TracedBeside`.

    Called before it is ready it waits for it (the search never does). ``from_trial`` is the
    number of trials run before it took the lead (the search sets it), ``None`` while it has not.
    """

    def __init__(self, prior: GuardedPrior, batches: Sequence[int]):
        self.name = prior.name
        self.from_trial: int | None = None
        self.asked = False
        self.cancelled = False
        self._said = _said(prior)
        self._copied = prior.seconds  # the fake copy, made here before the fork
        self._started = time.perf_counter()
        self._ended: float | None = None  # when the child stopped tracing for good
        self._done = False
        here, there = multiprocessing.Pipe()
        self._process = multiprocessing.get_context("fork").Process(
            target=_serve, args=(prior, tuple(batches), there), name="autobatch-trace", daemon=True)
        # Ctrl-C is held back while forking, so the child is born deaf to it (it ignores it before
        # it listens again) and the probe, here, still gets it once the fork is done.
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            with warnings.catch_warnings():  # a process with threads (CUDA's, a progress line's) forks only this one
                warnings.simplefilter("ignore", DeprecationWarning)
                self._process.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        there.close()
        self._conn = here

    # What the child has said.

    def _take(self, message: tuple) -> Any:
        kind, *rest = message
        self._said = rest[-1]
        if kind == "ready":
            self._done = True
        return rest[0] if kind == "value" else None

    def _drain(self) -> None:
        try:
            while not self._conn.closed and self._conn.poll():
                self._take(self._conn.recv())
        except (EOFError, OSError):
            self._died()

    def _died(self) -> None:
        """The child is gone without its answer: the prior fails, said as the trace's failure."""
        if self._said["failure"] is None and not self.cancelled:
            self._process.join(1.0)
            self._said = {**self._said, "failure": DIED.format(code=self._process.exitcode)}
        self._done = True
        self._conn.close()

    def _wait(self, seconds: float | None) -> Any:
        """Wait up to ``seconds`` (``None``: for good) for the child's next message and take it."""
        deadline = None if seconds is None else time.perf_counter() + seconds
        while not self._conn.closed:
            left = _POLL if deadline is None else min(_POLL, deadline - time.perf_counter())
            if left < 0:
                return None
            try:
                if self._conn.poll(left):
                    return self._take(self._conn.recv())
            except (EOFError, OSError):
                break
            if not self._process.is_alive():
                self._drain()  # what it said before it ended
                break
        self._died()
        return None

    # The contract of a prior traced beside the trials.

    def ready(self) -> bool:
        """Whether the traces are done and the prior can lead (not when its trace failed)."""
        self._drain()
        return self._done and not self.cancelled and self._said["failure"] is None

    def remaining(self) -> float | None:
        """The seconds the trace still needs at its pace so far, or ``None`` before one batch is traced."""
        self._drain()
        if self._done:
            return 0.0
        traced = len(self._said["traced_batches"])
        spent = time.perf_counter() - self._started
        return spent / traced * max(0, WARM_TRACES - traced) if traced else None

    def finish_within(self, seconds: float) -> bool:
        """Wait up to ``seconds`` for the trace to end; whether it can lead now."""
        deadline = time.perf_counter() + seconds
        while not self._done and time.perf_counter() < deadline:
            self._drain()
            if self._done:
                break
            self._wait(deadline - time.perf_counter())
        return self.ready()

    def __call__(self, batch: int) -> float:
        self.asked = True
        while not self._done:
            self._wait(None)
        if self._said["failure"] is not None or self._conn.closed:
            return math.nan
        try:
            self._conn.send(batch)
        except OSError:
            self._died()
            return math.nan
        while not self._conn.closed:
            value = self._wait(None)
            if value is not None:
                return value
        return math.nan

    def stop(self) -> None:
        """End the child where it stands (a trace still running is cancelled) and wait for it."""
        if self._process.pid is None:
            return
        self._drain()
        if not self._done:  # still tracing: killed where it stands
            self.cancelled = True
            self._ended = time.perf_counter()
            self._process.kill()
        elif not self._conn.closed:  # waiting for a batch: told to end
            try:
                self._conn.send(None)
            except OSError:
                pass
        if not self._conn.closed:
            self._conn.close()
        self._process.join(0.2)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()

    def report(self) -> dict[str, Any]:
        """What the child said of its traces; a trace that never led says why."""
        from .background import NOT_READY

        said = dict(self._said)
        if self.cancelled:  # stopped mid-trace: its seconds are the time it ran
            said["seconds"] = round(self._copied + (self._ended or time.perf_counter()) - self._started, 3)
        if said["failure"] is None and self.from_trial is None and not self.asked:
            return {"led": False, "reason": NOT_READY, "from_trial": None, **said}
        return {"from_trial": self.from_trial, **said}

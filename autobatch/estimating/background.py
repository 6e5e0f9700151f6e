"""The trace beside the trials: a prior traced on a thread while the device trains.

A trace runs on the CPU; a trial runs on the GPU. :func:`beside` starts the traces a prior needs
(:func:`~autobatch.estimating.prior.try_trace_prior`'s, at the batches its laws are fitted and
checked at) on a daemon thread at once and returns a :class:`TracedBeside`. The search
(:func:`autobatch.probing.search.search_max`) asks ``ready()`` before each trial and lets the
prior lead from the first trial after it is ready; it never waits for it. When the search ends,
``stop()`` cancels a trace still running (at its next torch call) and joins the thread, so nothing
the trace does outlives the probe: the random number generator's state it forks is put back
before the probe puts back the caller's.

Fake tensors, their dispatch modes and autocast's state are per thread, so the trace and the
trials do not see each other's tensors.

Example:
    >>> import torch, autobatch
    >>> model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    >>> work = autobatch.Workload(model, lambda b: (torch.randn(b, 32), torch.randint(0, 4, (b,))))
    >>> prior = beside(work, device_type="cpu")
    >>> result = autobatch.probe(work, autobatch.SimulatedBackend("1MiB"), prior=prior)
    >>> sorted(result.trace_record) == ["failure", "from_trial", "led", "reason", "seconds", "traced_batches"]
    True
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from torch.overrides import TorchFunctionMode

from ..probing.workload import Workload
from .prior import GuardedPrior, try_trace_prior, warm_batches

__all__ = ["TracedBeside", "beside", "NOT_READY"]

NOT_READY = "the trials ended the search before the trace beside them was ready"


class _Cancelled(BaseException):
    """Raised inside a trace that was stopped: not an ``Exception``, so no handler on the way takes it
    for the trace's own failure."""


class _Cancel(TorchFunctionMode):
    """Stop the trace at its next torch call once ``event`` is set."""

    def __init__(self, event: threading.Event):
        super().__init__()
        self.event = event

    def __torch_function__(self, func, types, args=(), kwargs=None):
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
        self._thread = threading.Thread(target=self._trace, args=(tuple(batches),), name="autobatch-trace",
                                        daemon=True)
        self._thread.start()

    def _trace(self, batches: tuple[int, ...]) -> None:
        try:
            with _Cancel(self._stop):
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

    def __call__(self, batch: int) -> float:
        self._done.wait()
        return self._prior(batch)

    def report(self) -> dict[str, Any]:
        """The prior's report and ``from_trial``; a trace that never led says why (a failed one is
        said by :func:`~autobatch.probing.result.trace_record`, as for any prior)."""
        said = self._prior.report() or {"traced_batches": [], "seconds": round(self._prior.seconds, 3), "failure": None}
        if said["failure"] is None and self.from_trial is None:
            return {"led": False, "reason": NOT_READY, "from_trial": None, **said}
        return {"from_trial": self.from_trial, **said}


def beside(workload: Workload, *, min_batch: int | None = None, allocator: str = "exact",
           device_type: str = "cuda") -> TracedBeside | GuardedPrior | None:
    """:func:`~autobatch.estimating.prior.try_trace_prior`, its traces started on a thread now.

    The fake copy of the model is made here, before the probe lends the model to the device; a
    model that cannot be copied gives the failed prior as it is (it answers NaN at once).
    """
    prior = try_trace_prior(workload, min_batch=min_batch, allocator=allocator, device_type=device_type)
    if prior is None or prior.failure is not None:
        return prior
    return TracedBeside(prior, warm_batches(prior.first))

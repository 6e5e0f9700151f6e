"""Sharded trials on fake tensors, all on one wrapped copy: the wrap and the first step once, then one step a trial.

A sharded trial on a device wraps a fresh copy of the model (:func:`~.sharded_trial.run_sharded_trial`),
because a rank that runs out of memory mid-step leaves FSDP and DeepSpeed in no state to go on. On
fake tensors (an estimate) nothing runs out of memory mid-step: each trial runs to its end and is
decided by its peak. So one copy, wrapped once, serves every batch. The first trial runs the
workload's steps as a fresh trial does; its first step makes the optimizer's state and whatever
the wrapper allocates on its first step. Each later trial runs the steady step alone, at its own
batch. What a step leaves (parameters, state, buffers) does not depend on the batch, so a later
trial's peak is the second step's peak of a fresh trial at that batch. ``tests/test_traced_trials.py``
checks every strategy against fresh trials, field by field.

Wrapping DeepSpeed is seconds, and each step of a large model on fake tensors is seconds: one wrap
and one step a trial, where a fresh trial takes a wrap and two steps.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch

from ..probing.backends import MemoryBackend
from ..probing.progress import working
from ..probing.trial import PhasePeaks
from ..probing.workload import Workload
from ..strategy import Strategy
from .sharded_trial import (ShardedTrial, _copy_model, assemble, quiet_wrappers, run_sharded_trial, train_steps,
                            wrap_copy)
from .sharding import Wrapped, local_bytes

__all__ = ["OneWrapper", "sharded_trials"]



class OneWrapper:
    """Trials of ``template`` under ``strategy`` on a fake backend, on one wrapped copy (see the module).

    ``booking``: the card to book each trial's requests on as its caching allocator would, in the order
    of a fresh run at the trial's batch (:class:`~autobatch.estimating.fresh_log.FreshBooking`, which the
    estimate's backend carries); ``None`` decides fit by the traced peak against the backend's capacity.
    """

    def __init__(self, workload: Workload, template: torch.nn.Module, strategy: Strategy, backend: MemoryBackend,
                 deepspeed_config: dict[str, Any] | None = None, booking: Any = None):
        self.workload, self.template, self.strategy = workload, template, strategy
        self.backend, self.deepspeed_config, self.booking = backend, deepspeed_config, booking
        self.wrapped: Wrapped | None = None
        self.before = self.after_wrap = 0
        self.held: dict[str, int] = {}
        self.log: Any = None    # the booking's log of requests, from the last wrap on
        self.fresh: Any = None  # the requests of the fresh trial on this copy (the reference)

    def __call__(self, batch_size: int) -> ShardedTrial:
        done, requests = self._trial(batch_size, fresh=self.wrapped is None)
        if self.booking is not None and requests is None:  # its requests cannot be told from the reference's
            self.close()
            done, requests = self._trial(batch_size, fresh=True)
        if requests is None:
            return done
        trial, breakdown = self.booking.on_the_card(done.trial, done.breakdown, requests)
        return replace(done, trial=trial, breakdown=breakdown)

    def _trial(self, batch_size: int, fresh: bool) -> tuple[ShardedTrial, list[tuple[int, int | None]] | None]:
        """The trial at ``batch_size``: on a new wrapped copy (all the workload's steps), else one step on
        this one; and, where booking, the requests a fresh run at that batch makes (``None``: not known)."""
        backend, workload = self.backend, self.workload
        capacity = backend.capacity()
        with quiet_wrappers(), torch.random.fork_rng(devices=[]):
            peaks = PhasePeaks(backend, phase_by="reserved")
            figures: dict[str, int] = {}
            times: list[float] = []
            with working(f"tracing {workload.name} under {self.strategy.label} at batch {batch_size} on fake tensors"):
                if fresh:
                    self._wrap(batch_size)
                figures.update(self.held)
                params = list(self.wrapped.module.parameters())  # type: ignore[union-attr]
                bounds: list[tuple[int, int]] = []
                with backend.track_deferred(params + list(self.wrapped.module.buffers())):  # type: ignore[union-attr]
                    del params
                    for _ in range(workload.steps if fresh else 1):  # a step at a time: each one's bounds in the log
                        start = self.log.mark() if self.log is not None else 0
                        resident = train_steps(workload, self.wrapped, backend, batch_size, 1, peaks,  # type: ignore[arg-type]
                                               figures, times, self.after_wrap, ["forward_backward"])
                        bounds.append((start, self.log.mark() if self.log is not None else 0))
        config = dict(self.wrapped.config)  # type: ignore[union-attr]
        if "train_micro_batch_size_per_gpu" in config:  # DeepSpeed's batch keys are the trial's, as a fresh trial's are
            config["train_batch_size"] = config["train_batch_size"] // config["train_micro_batch_size_per_gpu"] * batch_size
            config["train_micro_batch_size_per_gpu"] = batch_size
        # a fake step's seconds are not a GPU's: none recorded, as for a single-GPU trace
        done = assemble(batch_size, peaks, capacity, figures, [], resident, None, config, self.before)
        requests = None
        if self.log is not None:
            if fresh:
                self.fresh = self.booking.reference(self.log, bounds, batch_size)
                requests = self.fresh.requests()
            else:
                requests = self.fresh.at(*bounds[0], batch_size)
        return done, requests

    def curve(self, batch: int) -> float:
        """The reserved peak a fresh run at ``batch`` books on the card, through the first trials' requests
        (:meth:`~autobatch.estimating.fresh_log.FreshBooking.curve`); NaN where not booked or before a second trial."""
        return math.nan if self.booking is None else self.booking.curve(self.fresh, batch)

    def _wrap(self, batch_size: int) -> None:
        backend = self.backend
        model = _copy_model(self.template, self.workload.grad_checkpointing, backend.device)
        if self.booking is not None:  # every request from the wrap on, in order, with the op that made it
            self.log = self.booking.attach()
        self.wrapped, self.before = wrap_copy(model, self.workload, self.strategy, backend, batch_size,
                                              self.deepspeed_config)
        params = list(self.wrapped.module.parameters())
        with backend.track_deferred(params + list(self.wrapped.module.buffers())):
            self.after_wrap = backend.allocated_bytes()
        parameters = local_bytes(params, backend.device)
        self.held = {"parameters": parameters, "buffers": max(0, self.after_wrap - self.before - parameters)}

    def close(self) -> None:
        """Drop the wrapped copy (inside its process group, which its engine may refer to); stop logging."""
        if self.wrapped is not None:
            self.wrapped.close()
            self.wrapped = None
        gc.collect()
        if self.log is not None:  # the requests logged stay, for the curve the answer's safe batch is read off
            self.booking.detach()
            self.log = None
        self.backend.release()


@contextmanager
def sharded_trials(workload: Workload, template: torch.nn.Module, strategy: Strategy, backend: MemoryBackend,
                   deepspeed_config: dict[str, Any] | None = None) -> Iterator[Callable[[int], ShardedTrial]]:
    """A sharded trial at any batch, for use inside one rank's process group: on one wrapped copy
    where the backend traces on fake tensors (:class:`OneWrapper`), else a fresh copy each."""
    if getattr(backend, "fake_mode", None) is None:
        yield lambda batch: run_sharded_trial(workload, template, strategy, backend, batch,
                                              deepspeed_config=deepspeed_config)
        return
    trials = OneWrapper(workload, template, strategy, backend, deepspeed_config, getattr(backend, "booking", None))
    try:
        yield trials
    finally:
        trials.close()

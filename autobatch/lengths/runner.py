"""Trials for the length table on a device: the user's model lent once, trained at any length."""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import replace
from typing import Any

import torch

from ..errors import AutobatchError
from ..modelinfo import batchnorm_record, min_batch_for
from ..probing.backends import MemoryBackend
from ..probing.evaluation import run_eval_trial
from ..probing.heap import frozen_heap
from ..probing.preserve import borrowed_model
from ..probing.probe import MemorySummary, training_trial
from ..probing.result import ProbeResult, not_led
from ..probing.search import SearchOutcome
from ..probing.trial import Trial

# Why no trace led a length table's searches (its rows' extra["trace_prior"]["reason"]).
LED_BY_LENGTHS = "a length table's searches are led by the fit of the lengths probed before them"
from ..probing.workload import Workload

__all__ = ["DeviceLengthRunner"]

class DeviceLengthRunner:
    """Training and evaluation trials at ``(batch, seq_len)`` on ``backend``.

    The model (built once from a factory, or the user's, restored bit for bit by
    :func:`~autobatch.probing.preserve.borrowed_model`) is lent for the whole table; ``close()``
    gives it back. ``workload.make_batch(b, seq_len)`` builds a batch at any length.
    """

    estimated = False

    def __init__(self, workload: Workload, backend: MemoryBackend, *, min_batch: int | None = None):
        self.workload, self.backend = workload, backend
        self.capacity = backend.capacity()
        model = workload.model if isinstance(workload.model, torch.nn.Module) else workload.model()
        if not isinstance(model, torch.nn.Module):
            raise AutobatchError(f"the model factory must return a torch.nn.Module, but it returned {type(model).__name__}")
        self.min_batch = min_batch_for(model) if min_batch is None else min_batch
        self.batchnorm = batchnorm_record(model)
        self.device_name = backend.info().name
        self._stack = ExitStack()
        # Each trial's release() collects garbage: with the heap frozen it walks only what the table made.
        self._stack.enter_context(frozen_heap())
        try:
            self.model = self._stack.enter_context(
                borrowed_model(model, backend.device, grad_checkpointing=workload.grad_checkpointing))
        except BaseException:
            self._stack.close()  # the heap as it was, before the error goes on
            raise

    def _at(self, seq_len: int) -> Workload:
        make_batch = self.workload.make_batch
        return replace(self.workload, make_batch=lambda b: make_batch(b, seq_len))

    def train(self, batch: int, seq_len: int) -> Trial:
        return training_trial(self._at(seq_len), self.model, self.backend, batch)

    def evaluate(self, batch: int, seq_len: int) -> Trial:
        return run_eval_trial(self._at(seq_len), self.model, self.backend, batch)

    def result(self, mode: str, seq_len: int, outcome: SearchOutcome, summary: MemorySummary, min_batch: int,
               headroom_bytes: int) -> ProbeResult:
        return ProbeResult(
            max_batch=outcome.max_batch, safe_batch=summary.safe_batch, limited_by=outcome.limited_by,
            min_batch=min_batch, trials=outcome.trials, device=self.backend.info(), capacity_bytes=self.capacity,
            headroom_bytes=headroom_bytes, bytes_per_sample=summary.bytes_per_sample,
            fixed_bytes=summary.fixed_bytes, safe_peak_bytes=summary.safe_peak_bytes,
            safe_peak_measured=summary.safe_peak_measured, workload=self.workload.name,
            extra={"trace_prior": not_led(LED_BY_LENGTHS), **self.batchnorm},
        )

    def close(self) -> Any:
        self._stack.close()
        del self.model
        self.backend.release()

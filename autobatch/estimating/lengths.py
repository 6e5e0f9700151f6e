"""Trials for the length table on fake tensors: the estimate's trace, at any sequence length.

The table over lengths (:mod:`autobatch.lengths`) asks a runner for one trial at a batch and a
length; this runner traces it on fake tensors for a named GPU, as :func:`~.estimate.estimate`
does for one length, and books each step's requests through the caching allocator's model as it does, so
a row answers as the one-length estimate at its length and ``find --seq-len 256,512,…`` works without a GPU.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from ..modelinfo import batchnorm_record, min_batch_for
from ..probing.evaluation import run_eval_trial
from ..probing.probe import MemorySummary, summarise
from ..probing.result import not_led
from ..probing.search import SearchOutcome
from ..probing.trial import Trial
from ..probing.workload import Workload
from .estimate import (IS_THE_TRACE, Estimate, dtype_label, reads_to_the_safe_batch, trace_batches, trace_trial,
                       training_copy)
from .fake_backends import _FakeBackend, _mode_of, _new_fake_mode
from .gpus import GpuSpec, resolve_gpu
from .overheads import Overheads, beside_the_context, on_the_card
from .replay import AllocationLog

__all__ = ["FakeLengthRunner"]


class FakeLengthRunner:
    """Training and evaluation trials at ``(batch, seq_len)`` traced on fake tensors for ``gpu``.

    Args:
        workload: its ``make_batch(b, seq_len)`` builds a batch at any length.
        gpu, gpu_memory, overheads: as for :func:`~.estimate.estimate`.
        min_batch: default 2 for models with BatchNorm, else 1.
        data_parallel: the ranks DDP trains on; above one every trial holds its gradient buckets
            (as many bytes as the gradients), as :func:`~.estimate.estimate`'s do.
    """

    estimated = True

    def __init__(self, workload: Workload, gpu: str | GpuSpec | None = None, *, gpu_memory: int | str | None = None,
                 overheads: Overheads | None = None, min_batch: int | None = None, data_parallel: int = 1):
        self.started = time.perf_counter()
        self.spec = resolve_gpu(gpu, gpu_memory)
        self.overheads = overheads if overheads is not None else Overheads()
        self.capacity = beside_the_context(self.spec, self.overheads)
        self.workload = workload
        self.fake_mode = _mode_of(workload.model) or _new_fake_mode()
        self.model = training_copy(workload, self.fake_mode)
        self.min_batch = min_batch_for(self.model) if min_batch is None else min_batch
        self.buckets = sum(p.numel() * p.element_size() for p in self.model.parameters()
                           if p.requires_grad) if data_parallel > 1 else 0
        self.device_name = f"{self.spec.name} (estimated: fake-tensor trace, no GPU used)"
        self.traced: dict[tuple[str, int], list[Trial]] = {}
        self.curves: dict[int, Any] = {}  # seq_len → its BatchCurve, or None where torch could not trace one

    def _at(self, seq_len: int) -> Workload:
        make_batch = self.workload.make_batch
        return replace(self.workload, make_batch=lambda b: make_batch(b, seq_len))

    def _on_card(self, mode: str, seq_len: int, raw: Trial, requests: list[tuple[int, int | None]]) -> Trial:
        """``raw`` as the card holds it (:func:`~.overheads.on_the_card`), kept with the card's verdict."""
        trial = on_the_card(raw, requests, self.overheads, self.capacity, self.buckets)
        self.traced.setdefault((mode, seq_len), []).append(replace(raw, fits=trial.fits))
        return trial

    def _trace(self, mode: str, batch: int, seq_len: int, run: Callable[..., Trial]) -> Trial:
        # Booked through the caching allocator's model, as a one-length estimate is (the default), or by a multiplier.
        log = AllocationLog() if self.overheads.fragmentation is None else None
        backend = _FakeBackend(self.fake_mode, self.overheads.fused_attention, log=log,
                               recomputed=self.workload.grad_checkpointing)
        raw = replace(run(self._at(seq_len), self.model, backend, batch, log), seconds_per_step=None)
        return self._on_card(mode, seq_len, raw, log.requests() if log is not None else [])

    def train(self, batch: int, seq_len: int) -> Trial:
        # One trace with a symbolic batch answers every batch its curve allows at this length, as for one length.
        booked = self.overheads.fragmentation is None
        if seq_len not in self.curves:
            self.curves[seq_len] = trace_batches(self._at(seq_len), self.model, fake_mode=self.fake_mode,
                                                 fused_attention=self.overheads.fused_attention, primed=not booked)
        curve = self.curves[seq_len]
        if curve is not None and curve.answers(batch):
            return self._on_card("train", seq_len, curve.trial(batch), curve.requests(batch) if booked else [])
        return self._trace("train", batch, seq_len, lambda w, m, b, n, log: trace_trial(
            w, m, n, fake_mode=self.fake_mode, fused_attention=self.overheads.fused_attention, log=log))

    def evaluate(self, batch: int, seq_len: int) -> Trial:
        return self._trace("eval", batch, seq_len, lambda w, m, b, n, log: run_eval_trial(w, m, b, n))

    def result(self, mode: str, seq_len: int, outcome: SearchOutcome, summary: MemorySummary, min_batch: int,
               headroom_bytes: int) -> Estimate:
        curve = self.curves.get(seq_len) if mode == "train" else None
        if curve is not None and self.overheads.fragmentation is None and outcome.max_batch > 0:
            # every batch is a read off the booked curve: the safe one rests on adjacent reads, as for one length
            limit = self.capacity - headroom_bytes
            outcome = replace(outcome, trials=outcome.trials + reads_to_the_safe_batch(
                lambda b: self.train(b, seq_len), outcome.trials, limit, min_batch, outcome.max_batch, curve.answers))
            summary = summarise(outcome.trials, outcome.max_batch, limit)
        return Estimate(
            max_batch=outcome.max_batch, safe_batch=summary.safe_batch, limited_by=outcome.limited_by,
            min_batch=min_batch, gpu=self.spec, capacity_bytes=self.capacity, headroom_bytes=headroom_bytes,
            bytes_per_sample=summary.bytes_per_sample, fixed_bytes=summary.fixed_bytes,
            safe_peak_bytes=summary.safe_peak_bytes, overheads=self.overheads, trials=outcome.trials,
            traced=tuple(self.traced.get((mode, seq_len), ())), seconds=time.perf_counter() - self.started,
            workload=self.workload.name,
            dtype=dtype_label(self.workload.dtype),
            extra={"trace_prior": not_led(IS_THE_TRACE), **batchnorm_record(self.model),
                   **({"ddp_buckets_bytes": self.buckets} if self.buckets else {})},
        )

    def close(self) -> Any:
        return None

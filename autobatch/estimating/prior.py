"""The fake-tensor trace as a prior for the search: the whole memory curve, predicted on the CPU.

A real trial costs seconds to minutes and can run out of memory; a traced one costs the same
small time at any batch and touches no device. :func:`trace_prior` traces the workload's
training step (the estimate's :func:`~autobatch.estimating.estimate.trace_trial`) at batches 1, 4, 16, …
as the search asks for them, and joins them by straight lines. The search
(:func:`~autobatch.probing.search.search_max`) calibrates this curve against the real trials (offset,
scale, per-sample bytes), so what the trace cannot see — the CUDA context, the allocator's
cache, a kernel's workspace — costs at most a trial, not a wrong answer: the answer still rests
on real trials only.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..probing.workload import Workload
from .estimate import _enable_checkpointing, fake_model, trace_trial
from .fake_backends import _mode_of, _new_fake_mode

__all__ = ["trace_prior"]

_GRID = 4  # traced batches: 1, 4, 16, …


def trace_prior(workload: Workload) -> Callable[[int], float]:
    """The traced peak (bytes) at any batch, for ``search_max(..., prior=...)`` or ``probe(..., prior=...)``.

    Traces run lazily, at most one per power of four the search asks about, and are cached.
    The user's model is not touched (the trace uses a fake copy) and the random number
    generator's state is restored after each trace.

    Example:
        >>> import torch, autobatch
        >>> model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
        >>> work = autobatch.Workload(model, lambda b: (torch.randn(b, 32), torch.randint(0, 4, (b,))))
        >>> prior = trace_prior(work)
        >>> prior(256) > prior(16) >= prior(1) > 0
        True
    """
    state: dict[str, object] = {}
    peaks: dict[int, float] = {}

    def traced(batch: int) -> float:
        if batch not in peaks:
            with torch.random.fork_rng(devices=[]):
                if "model" not in state:
                    mode = _mode_of(workload.model) or _new_fake_mode()
                    model = fake_model(workload.model, mode)
                    if workload.grad_checkpointing:
                        with mode:
                            _enable_checkpointing(model)
                    model.train()
                    state.update(model=model, mode=mode)
                peaks[batch] = float(trace_trial(workload, state["model"], batch, fake_mode=state["mode"]).reserved_bytes)
        return peaks[batch]

    def prior(batch: int) -> float:
        batch, low = max(1, batch), 1
        while low * _GRID <= batch:
            low *= _GRID
        if low == batch:
            return traced(batch)
        high = low * _GRID
        y0, y1 = traced(low), traced(high)
        return y0 + (y1 - y0) * (batch - low) / (high - low)

    return prior

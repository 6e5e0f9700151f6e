"""One evaluation trial: forward passes under ``torch.no_grad()`` at one batch size, and their peak.

Evaluation keeps no activations for a backward pass and no optimizer state, so its largest
batch is larger than training's, but not by a fixed factor: logits and the widest transient
tensors set its peak. HF Trainer and Lightning run evaluation under ``torch.no_grad()`` with the
model in eval mode, and so does this trial.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from .backends import MemoryBackend
from .oom import is_oom_error, oom_message
from .trial import Trial, batch_on
from .workload import Workload, resolve_dtype

__all__ = ["run_eval_trial"]


def _forward(workload: Workload, model: torch.nn.Module, batch_size: int, device: torch.device) -> None:
    # A function of its own so the batch, outputs and loss die with its frame.
    batch = batch_on(workload, batch_size, device)
    dtype = resolve_dtype(workload.dtype)
    autocast = torch.autocast(device_type=device.type, dtype=dtype) if dtype is not None else nullcontext()
    with torch.no_grad(), autocast:
        workload.loss_fn(model, batch)


def run_eval_trial(workload: Workload, model: torch.nn.Module, backend: MemoryBackend, batch_size: int) -> Trial:
    """Evaluate ``model`` on ``workload.steps`` batches of ``batch_size`` under ``torch.no_grad()``.

    The model is put in eval mode for the trial and its modes restored after. As in
    :func:`~autobatch.probing.trial.run_trial`, an out-of-memory error becomes a trial that does
    not fit and any other exception propagates; the forward peak is ``forward_backward_bytes``.
    """
    resident = [p for p in model.parameters()] + [b for b in model.buffers()]
    modes = [(m, m.training) for m in model.modules()]
    error = resident_bytes = None
    backend.release()
    model.eval()
    try:
        with backend.track(resident):
            try:
                for _ in range(workload.steps):
                    _forward(workload, model, batch_size, backend.device)
                resident_bytes = backend.allocated_bytes()
            except Exception as exc:
                if not is_oom_error(exc):
                    raise
                error = oom_message(exc)
            peak = backend.peak()
    finally:
        for module, training in modes:
            module.training = training
    backend.release()
    return Trial(batch=batch_size, fits=error is None, peak_bytes=peak.allocated, reserved_bytes=peak.reserved,
                 forward_backward_bytes=peak.reserved, optimizer_bytes=0, resident_bytes=resident_bytes, error=error)

"""One trial: real training steps at one batch size, and what they cost."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from typing import Any

import torch

from .backends import MemoryBackend
from .memtrack import making_batch
from .oom import is_oom_error, oom_message
from .progress import working
from .samples import check_sample_count
from .workload import Workload, make_optimizer, resolve_dtype, step_loss, weights_dtype, weights_in

__all__ = ["Trial", "PhasePeaks", "run_trial", "forward_backward", "batch_on", "to_device", "drain_autograd"]


@dataclass(frozen=True)
class Trial:
    """The record of one trial. Bytes are absolute device figures (the model included).

    ``peak_bytes`` is the allocator's peak of live tensors, ``reserved_bytes`` what it held
    from the device (the figure that meets the capacity). The allocated peak is also kept per
    phase, because the two grow differently: ``forward_backward_bytes`` grows with the batch
    (activations), ``optimizer_bytes`` hardly (gradients and optimizer state), and at small
    batches the latter can set the whole peak. Per phase it is the allocated peak, not the
    reserved one: resetting the peaks between phases restarts the reserved peak from what the
    allocator still caches, so the optimizer phase's reserved figure would carry the forward
    and backward's cache. For a trial that ran out of memory the figures are those reached
    before it failed. ``resident_bytes`` is what stays allocated between steps (parameters and
    optimizer state), ``None`` when the trial failed. ``alloc_retries`` counts the requests the
    allocator served only after flushing its cache: such a trial fits, but only just.
    ``forward_bytes`` is what was allocated at the forward's end (the loss computed, the backward not
    begun), the most of any step: the resident memory and the activations the backward will use, which
    a flat gradient peak hides at small batches (0 where not measured: a user's own training function).
    """

    batch: int
    fits: bool
    peak_bytes: int
    reserved_bytes: int
    forward_backward_bytes: int = 0
    optimizer_bytes: int = 0
    resident_bytes: int | None = None
    seconds_per_step: float | None = None
    error: str | None = None
    alloc_retries: int = 0
    forward_bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def to_device(batch: Any, device: torch.device, floats: torch.dtype | None = None) -> Any:
    """Move every tensor in a (nested) batch to ``device``; floating-point ones also to ``floats`` where given.

    A view of a larger storage that stays where it is (``x[:b]`` of a dataset on the host, on a simulated
    budget) is copied, as a move to a GPU copies only its elements: the trial holds the batch, not the data
    (:func:`~autobatch.probing.memtrack.making_batch` left the view uncounted).
    """
    if isinstance(batch, torch.Tensor):
        moved = batch.to(device, dtype=floats) if floats is not None and batch.is_floating_point() else batch.to(device)
        if moved is batch and device.type == "cpu" and _views_more(batch):
            return batch.clone(memory_format=torch.preserve_format)
        return moved
    if isinstance(batch, Mapping):
        moved = {k: to_device(v, device, floats) for k, v in batch.items()}
        return moved if type(batch) is dict else type(batch)(moved)
    if isinstance(batch, (list, tuple)):
        items = [to_device(v, device, floats) for v in batch]
        return type(batch)(*items) if hasattr(batch, "_fields") else type(batch)(items)
    return batch


def _views_more(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a view of a storage larger than its own elements."""
    try:
        return tensor.untyped_storage().nbytes() > tensor.numel() * tensor.element_size()
    except (RuntimeError, NotImplementedError):  # sparse and other storage-less layouts
        return False


def batch_on(workload: Workload, batch_size: int, device: torch.device) -> Any:
    """``workload.make_batch(batch_size)`` on ``device``, refused when it does not hold ``batch_size`` samples.
    With pure low-precision weights its floating-point tensors take their dtype (Lightning's ``convert_input``)."""
    weights = weights_dtype(workload.dtype)
    # Made in that dtype where make_batch leaves it to torch's default: a batch made in fp32 and cast
    # would hold both copies at once on a simulated budget, where a GPU copies the host's in one go.
    with weights_in(weights), making_batch():
        batch = workload.make_batch(batch_size)
    check_sample_count(batch, batch_size, workload.make_batch)
    return to_device(batch, device, weights)


def forward_backward(workload: Workload, model: torch.nn.Module, batch_size: int, device: torch.device,
                     at_forward_end: Callable[[], None] | None = None) -> None:
    """One micro-batch's forward and backward at ``batch_size`` (gradients accumulate in ``model``);
    ``at_forward_end`` is called between the two (:meth:`PhasePeaks.forward_end`)."""
    # A function of its own so the batch, activations and loss die with its frame.
    batch = batch_on(workload, batch_size, device)
    dtype = resolve_dtype(workload.dtype)
    autocast = torch.autocast(device_type=device.type, dtype=dtype) if dtype is not None else nullcontext()
    with autocast:
        loss = step_loss(workload.loss_fn, model, batch)
    if at_forward_end is not None:
        at_forward_end()
    loss.backward()


def _optimizer_step(optimizer: torch.optim.Optimizer, grads_held: bool = False) -> None:
    optimizer.step()
    # Held: zeroed, not freed, so the next step's forward runs beside them (accumulation's micro-steps).
    optimizer.zero_grad(set_to_none=not grads_held)


def drain_autograd(device: torch.device) -> None:
    """Run an empty backward on ``device``: the engine drops the tasks of a backward that raised.

    A backward that ran out of memory leaves its remaining tasks, and the saved tensors they
    hold, in the engine's queue for the device until the next backward there; they would count
    against the next trial, which then fails where it fits.
    """
    torch.zeros((), device=device, requires_grad=True).backward()


class PhasePeaks:
    """Running maxima of the backend's peaks, overall and per phase (forward and backward; the optimizer step).

    ``phase_by`` is the figure a phase's peak takes: ``"allocated"`` (a plain trial) or
    ``"reserved"`` (a sharded one, which decides fit from the reserved peak at the step's end).
    """

    def __init__(self, backend: MemoryBackend, phase_by: str = "allocated"):
        self.backend, self.phase_by = backend, phase_by
        self.allocated = self.reserved = self.forward = 0
        self.phase = {"forward_backward": 0, "optimizer": 0}

    def forward_end(self) -> None:
        """Fold in what is allocated now, at a forward's end (:attr:`Trial.forward_bytes`)."""
        self.forward = max(self.forward, self.backend.allocated_bytes())

    def read(self, phase: str) -> int:
        """Fold in the backend's peak since the last read, as ``phase``'s, reset it, and return it (by ``phase_by``)."""
        peak = self.backend.peak()
        self.allocated = max(self.allocated, peak.allocated)
        self.reserved = max(self.reserved, peak.reserved)
        now = getattr(peak, self.phase_by)
        self.phase[phase] = max(self.phase[phase], now)
        self.backend.reset_peak()
        return now


def run_trial(workload: Workload, model: torch.nn.Module, backend: MemoryBackend, batch_size: int,
              steps: int | None = None) -> Trial:
    """Train ``model`` for ``workload.steps`` full steps (or ``steps``) at ``batch_size`` on ``backend``.

    An out-of-memory error (see :func:`autobatch.probing.oom.is_oom_error`) becomes a trial that does not
    fit; any other exception propagates untouched. Either way the trial's tensors are freed and
    the device is back at its baseline when this returns.
    """
    params = [p for p in model.parameters()]
    resident = params + [b for b in model.buffers()]
    times: list[float] = []
    resident_bytes = error = None
    backend.release()
    retries_before = backend.alloc_retries()
    traced = getattr(backend, "fake_mode", None) is not None
    doing = (f"tracing {workload.name} at batch {batch_size} on fake tensors" if traced
             else f"training {workload.name} at batch {batch_size} ({workload.steps} steps)")
    with working(doing), backend.track(resident):
        peaks = PhasePeaks(backend)
        optimizer = make_optimizer(workload.optimizer, [p for p in params if p.requires_grad])
        phase = "forward_backward"
        try:
            for _ in range(steps or workload.steps):
                backend.synchronize()
                start = time.perf_counter()
                phase = "forward_backward"
                forward_backward(workload, model, batch_size, backend.device, peaks.forward_end)
                peaks.read(phase)
                phase = "optimizer"
                _optimizer_step(optimizer, workload.grads_held)
                peaks.read(phase)
                times.append(time.perf_counter() - start)
            resident_bytes = backend.allocated_bytes()
        except Exception as exc:
            if not is_oom_error(exc):
                raise
            error = oom_message(exc)
            peaks.read(phase)
        finally:
            del optimizer
            model.zero_grad(set_to_none=True)
    if error is not None:
        drain_autograd(backend.device)
    backend.release()
    fits = error is None
    return Trial(
        batch=batch_size,
        fits=fits,
        peak_bytes=peaks.allocated,
        reserved_bytes=peaks.reserved,
        forward_backward_bytes=peaks.phase["forward_backward"],
        optimizer_bytes=peaks.phase["optimizer"],
        resident_bytes=resident_bytes,
        # The first step allocates optimizer state; the steady state is what training sees.
        seconds_per_step=statistics.median(times[1:] or times) if fits else None,
        error=error,
        alloc_retries=backend.alloc_retries() - retries_before,
        forward_bytes=peaks.forward if fits else 0,
    )

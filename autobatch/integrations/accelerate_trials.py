"""The accelerate drop-in's trials: the user's function, run until its ``steps``-th optimizer step.

A global optimizer hook (:class:`_StepCounter`) counts the steps, reads the peaks per phase and
stops the function with :class:`TrialStop` (a ``BaseException``: ``except Exception`` lets it
pass); modules passed as arguments come back bit for bit, and so do optimizers and learning-rate
schedulers (their state, on the host while the trial runs: a trial's steps would otherwise be in
the real run's Adam moments and step count). A function that returns before that ran its whole
call, and its result is kept by batch.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from ..probing.backends import CudaBackend, MemoryBackend
from ..probing.oom import is_oom_error, oom_message
from ..probing.preserve import borrowed_model
from ..probing.trial import Trial

__all__ = ["TrialStop", "run_trial_of", "default_backend", "clear_device", "stateful"]


def stateful(values: Any) -> list[Any]:
    """The optimizers and learning-rate schedulers among ``values``: what a trial's steps change."""
    kinds = (torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler)
    return [v for v in values if isinstance(v, kinds)]


@contextmanager
def _state_kept(obj: Any) -> Iterator[None]:
    """``obj``'s state as it was once the trial is over: a copy on the host meanwhile, loaded back after."""
    saved = torch.utils._pytree.tree_map(
        lambda v: v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else v, obj.state_dict())
    try:
        yield
    finally:
        obj.load_state_dict(saved)


class TrialStop(BaseException):
    """Raised from the optimizer hook when a trial has run its steps (a BaseException: ``except Exception`` lets it pass)."""


class _StepCounter:
    """Counts optimizer steps while installed and reads the peaks per phase; raises :class:`TrialStop` at the ``steps``-th.

    Forward and backward (up to the optimizer's step) and the step itself peak differently; the
    search draws a line per phase, as it does for :func:`autobatch.probe`'s trials.
    """

    def __init__(self, steps: int, backend: MemoryBackend | None):
        self.steps, self.done, self.backend = steps, 0, backend
        self.resident: int | None = None
        self.forward_backward = self.optimizer = self.allocated = 0

    def _read(self) -> int:
        peak = self.backend.peak()
        self.allocated = max(self.allocated, peak.allocated)
        self.backend.reset_peak()
        return peak.reserved

    def before(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.backend is not None:
            self.forward_backward = max(self.forward_backward, self._read())

    def __call__(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.backend is not None:
            self.optimizer = max(self.optimizer, self._read())
        self.done += 1
        if self.done >= self.steps:
            # What stays between steps (weights, optimizer state: not the gradients, which the
            # loop is about to clear) is where the search's chord starts, as in probe's trials.
            if self.backend is not None:
                grads = sum(p.grad.nbytes for g in optimizer.param_groups for p in g["params"] if p.grad is not None)
                self.resident = self.backend.allocated_bytes() - grads
            raise TrialStop(f"{self.done} optimizer steps ran")

    def finish(self) -> None:
        """After the trial: a failure's peak belongs to the phase it happened in."""
        if self.backend is not None:
            self.forward_backward = max(self.forward_backward, self._read())


def default_backend() -> MemoryBackend | None:
    return CudaBackend(f"cuda:{torch.cuda.current_device()}") if torch.cuda.is_available() else None


def clear_device() -> None:
    # A failed step's tensors die with its cleared frames; on a GPU, also hand the cache back.
    # (gc.collect costs up to a second in a large process, so only where there is a cache.)
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()


def run_trial_of(
    function: Callable[..., Any], batch: int, args: tuple[Any, ...], kwargs: dict[str, Any],
    backend: MemoryBackend | None, steps: int, modules: list[torch.nn.Module], finished: dict[int, Any],
    kept: tuple[Any, ...] | list[Any] = (),
) -> Trial:
    counter = _StepCounter(steps, backend)
    error = None
    start = time.perf_counter()
    with ExitStack() as stack:
        for module in modules:  # the user's modules come back bit for bit
            device = next((p.device for p in module.parameters()), torch.device("cpu"))
            stack.enter_context(borrowed_model(module, device))
        for obj in kept:  # and their optimizers and schedulers
            stack.enter_context(_state_kept(obj))
        if backend is not None:
            backend.release()
            stack.enter_context(backend.track([]))
        handles = (register_optimizer_step_pre_hook(counter.before), register_optimizer_step_post_hook(counter))
        try:
            finished[batch] = function(batch, *args, **kwargs)
        except TrialStop:
            pass
        except Exception as exc:
            if not is_oom_error(exc):
                raise
            error = oom_message(exc)
        finally:
            for handle in handles:
                handle.remove()
        counter.finish()
    clear_device()
    if backend is not None:
        backend.release()
    return Trial(
        batch=batch, fits=error is None, peak_bytes=counter.allocated,
        reserved_bytes=max(counter.forward_backward, counter.optimizer),
        forward_backward_bytes=counter.forward_backward, optimizer_bytes=counter.optimizer,
        resident_bytes=counter.resident if error is None else None,
        seconds_per_step=(time.perf_counter() - start) / max(1, counter.done) if error is None else None,
        error=error,
    )

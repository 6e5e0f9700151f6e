"""A drop-in for accelerate's ``find_executable_batch_size``: the exact largest batch, agreed by every rank.

accelerate's decorator runs the training function at ``starting_batch_size`` and, on each
out-of-memory error, again at ``0.9 ×`` the batch: it lands up to 10 % under the largest batch
that fits, pays one failed run per 10 %, and each rank shrinks on its own. This one keeps the
call shape (``@find_executable_batch_size(starting_batch_size=128)`` over ``def train(batch_size, …)``)
and:

1. runs the function at ``starting_batch_size`` (or the plan's micro batch for ``target``); when
   it completes, that is the answer, exactly as accelerate does (in a process group that batch is
   first a trial, below, that every rank agrees on: no rank may finish alone while another searches);
2. when that runs out of memory, searches below it with short *trials*: the function runs until
   its ``steps``-th optimizer step (a global optimizer hook then stops it), and the library's
   search (:func:`autobatch.search_max`, fed with the device's peak memory when a backend can
   measure it, and bounded by the batch that just failed) finds the exact largest batch that
   trains in a few of them; in a process group the ranks agree after every trial, so every rank
   runs the same batch sizes. A function with no optimizer step (evaluation, inference,
   generation) runs whole in each trial: the answer is the largest batch whose call completed;
3. runs the function for real at that batch, unless the trial at it already ran the whole call
   (then that result is returned, not run again); with ``target`` (and ``accelerator``) it sets
   the accelerator's gradient accumulation so that micro batch × accumulation × processes = target.

A second call with the same arguments runs once at the batch the first found, as accelerate's
decorator keeps the batch it came down to. Nothing fitting, and ``starting_batch_size=0``, raise
accelerate's ``RuntimeError("No executable batch size found, reached zero.")`` when the function
is called (:class:`NoExecutableBatchSizeError`); passing the batch size raises accelerate's
``TypeError``; any other error propagates as the same object.

Build the model and optimizer inside the function, as accelerate's own example does: each trial
then starts from fresh weights. Modules, optimizers and schedulers passed as arguments are restored
after each trial.
A later out-of-memory error in the real run (a rare long batch, evaluation) falls back to
``reduce_batch_size_fn`` (default ``0.9 ×``); :func:`guard` splits such a step instead of
restarting: an :class:`~autobatch.guard.OOMGuard` whose micro-batches go through
``accelerator.backward``. Ranks agree *after* each trial: a rank that runs out of memory
inside one of the function's own collectives still leaves the others waiting until the group's
timeout, as with accelerate's decorator.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from ..distributed.launch import DEFAULT_TIMEOUT_S
from ..distributed.agreement import Comm, agreed_trial, collective, comm_device, share_trial
from ..distributed.result import RankFailedError
from ..errors import AutobatchError, NoBatchFitsError
from ..guard import OOMGuard
from ..planning.plan import Plan, require_positive_int
from ..planning.solver import solve
from ..probing.backends import MemoryBackend
from ..probing.oom import is_oom_error, oom_message
from ..probing.heap import frozen_heap
from ..probing.search import SearchOutcome, search_max
from ..probing.trial import Trial
from ._common import log_main, world
from .accelerate_trials import TrialStop, clear_device, default_backend, run_trial_of, stateful

__all__ = ["find_executable_batch_size", "NoExecutableBatchSizeError", "TrialStop", "guard"]

log = logging.getLogger("autobatch.integrations.accelerate")


def find_executable_batch_size(
    function: Callable[..., Any] | None = None,
    starting_batch_size: int = 128,
    reduce_batch_size_fn: Callable[[], int] | None = None,
    *,
    backend: MemoryBackend | None = None,
    steps: int = 2,
    target: int | None = None,
    accelerator: Any = None,
    on_trial: Callable[[Trial], None] | None = None,
) -> Callable[..., Any]:
    """Decorate ``function(batch_size, *args, **kwargs)``; call it without the batch size.

    Args:
        function: the training function; its first parameter receives the batch size.
        starting_batch_size: the largest batch to run, tried first (as in accelerate).
        reduce_batch_size_fn: what a later out-of-memory error in the real run falls back to (no
            arguments, returns the next batch; default ``0.9 ×``). Unlike accelerate, which calls it
            on every out-of-memory error, the first one starts the search instead: it is the
            fallback for a run that fails after the search proved its batch (a rare long batch).
        backend: where trials measure peak memory (default the current CUDA device, none on the
            CPU: the search then bisects on fit / out-of-memory alone, still exactly).
        steps: optimizer steps a trial runs before it is stopped (2: the optimizer state exists
            from the first step and the second carries it).
        target: a global batch to keep: the batch passed is a micro batch that divides
            ``target / processes`` and the accelerator accumulates the rest.
        accelerator: the ``accelerate.Accelerator`` whose ``gradient_accumulation_steps`` is set
            for ``target`` (and whose process count is the world size).
        on_trial: called with each (agreed) trial.

    Attributes of the returned wrapper after a call: ``batch_sizes`` (every batch the function
    was called with, in order), ``trials`` (the search's trials), ``plan`` (with ``target``).

    Example:
        >>> @find_executable_batch_size(starting_batch_size=64)
        ... def train(batch_size):
        ...     return batch_size
        >>> train()
        64
    """
    if function is None:
        return functools.partial(
            find_executable_batch_size, starting_batch_size=starting_batch_size,
            reduce_batch_size_fn=reduce_batch_size_fn, backend=backend, steps=steps, target=target,
            accelerator=accelerator, on_trial=on_trial,
        )
    if isinstance(starting_batch_size, bool) or not isinstance(starting_batch_size, int):
        require_positive_int("starting_batch_size", starting_batch_size)  # a float or a string: said now
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise AutobatchError(f"steps must be a positive integer, but got steps={steps!r}")
    if target is not None:
        require_positive_int("target", target, fix="pass the global batch to keep, or leave target out")

    @functools.wraps(function)
    def decorator(*args: Any, **kwargs: Any) -> Any:
        params = list(inspect.signature(function).parameters)
        if len(params) < len(args) + 1:  # accelerate's guard against passing the batch size too
            arg_str = ", ".join(f"{a}={v}" for a, v in zip(params[1:], args[1:]))
            raise TypeError(
                f"Batch size was passed into `{function.__name__}` as the first argument when called."
                f"Remove this as the decorator already does so: `{function.__name__}({arg_str})`"
            )
        if starting_batch_size < 1:  # as accelerate: said when the function is called, as a RuntimeError
            raise NoExecutableBatchSizeError(f"starting_batch_size is {starting_batch_size}")
        device = backend if backend is not None else default_backend()
        comm = Comm(comm_device(device), DEFAULT_TIMEOUT_S) if world()[1] > 1 else None
        processes = accelerator.num_processes if accelerator is not None else world()[1]
        decorator.batch_sizes, decorator.trials, decorator.plan = [], (), None
        key = _call_key(args, kwargs)
        # A second call with the same arguments runs once at what the first one found, as accelerate does.
        searched = key in decorator.found
        cap = decorator.found.get(key, starting_batch_size)
        while True:
            batch = cap
            if target is not None:
                decorator.plan = _plan(target, processes, cap)
                batch = decorator.plan.micro_batch
                if accelerator is not None:
                    accelerator.gradient_accumulation_steps = decorator.plan.grad_accum
                log_main(log, "autobatch: %s", decorator.plan)  # every rank holds it
            decorator.batch_sizes.append(batch)
            clear_device()
            line = None
            if comm is not None and not searched:
                # In a process group no rank may run the whole function while another searches: the
                # starting batch is first a trial whose outcome every rank agrees on.
                finished: dict[int, Any] = {}
                first = _agreed_trial(function, batch, args, kwargs, device, steps, finished, comm)
                decorator.trials = (first,)
                if on_trial is not None:
                    on_trial(first)
                if batch in finished:
                    decorator.found[key] = batch
                    return finished[batch]
                if first.fits:
                    decorator.batch_sizes.append(batch)  # the real run, next
                else:
                    line = first.error or "out of memory"
            if line is None:
                try:
                    # Under the backend's accounting, so that a simulated budget limits the run too.
                    with device.track([]) if device is not None else nullcontext():
                        result = function(batch, *args, **kwargs)
                    decorator.found[key] = batch
                    return result
                except Exception as exc:
                    if not is_oom_error(exc):
                        raise
                    line = oom_message(exc, 200)
            clear_device()
            if not searched:
                searched = True
                log.warning("autobatch: batch %d ran out of memory (%s); searching below it with %d-step trials",
                            batch, line, steps)
                if batch <= 1:
                    raise NoExecutableBatchSizeError("even a batch of 1 runs out of memory")
                outcome, finished = _search(function, args, kwargs, device, batch, steps, on_trial,
                                            decorator.batch_sizes, comm)
                decorator.trials = (*decorator.trials, *outcome.trials)
                if outcome.max_batch == 0:
                    raise NoExecutableBatchSizeError(f"even a batch of 1 runs out of memory ({len(outcome.trials)} trials)")
                cap = outcome.max_batch
                decorator.found[key] = cap
                log_main(log, "autobatch: the largest batch that trains is %d (%d trials: %s)", cap, len(outcome.trials),
                         ", ".join(f"{t.batch}{'✓' if t.fits else '✗'}" for t in outcome.trials))
                if cap in finished and target is None:
                    # The trial at the answer ran the whole function (one with no optimizer step, or
                    # fewer than ``steps``): that call was the run, and its result is the answer's.
                    log_main(log, "autobatch: the function finished within its trial at batch %d", cap)
                    return finished[cap]
            else:
                cap = reduce_batch_size_fn() if reduce_batch_size_fn is not None else int(batch * 0.9)
                log.warning("autobatch: the run at batch %d ran out of memory later (%s); retrying at %d", batch, line, cap)
                if cap < 1:
                    raise NoExecutableBatchSizeError(f"the run at batch {batch} ran out of memory later, and "
                                                     "reduce_batch_size_fn reached zero")

    decorator.batch_sizes, decorator.trials, decorator.plan = [], (), None
    decorator.found = {}
    return decorator


class NoExecutableBatchSizeError(NoBatchFitsError, RuntimeError):
    """Nothing fits, worded as accelerate words it ("No executable batch size found, reached zero."),
    and a ``RuntimeError`` as accelerate raises it, so code written for accelerate catches it."""

    def __init__(self, why: str):
        super().__init__(f"No executable batch size found, reached zero. ({why}; use a shorter sequence, bf16, "
                         "gradient checkpointing, a smaller model or a larger device)")


def _call_key(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """The same arguments: the same objects, in the same places."""
    return (tuple(id(a) for a in args), tuple((k, id(v)) for k, v in sorted(kwargs.items())))


def guard(accelerator: Any, model: torch.nn.Module, loss_fn: Callable[[torch.nn.Module, Any], Any], **options: Any) -> OOMGuard:
    """An :class:`~autobatch.guard.OOMGuard` for a loop under ``accelerator``: ``guard.backward(batch)`` replaces
    the forward and ``accelerator.backward(loss)``.

    Each micro-batch's normalised loss goes through ``accelerator.backward`` (which divides by the
    accelerator's gradient accumulation and applies its grad scaler), and gradients of earlier
    batches of an ``accelerator.accumulate`` window are kept (``accumulate=True``). A batch that
    runs out of memory is split; the update stays the whole batch's, so a decorated function
    keeps its batch size instead of being restarted smaller. ``options`` go to ``OOMGuard``
    (``shift``, ``label_key``, ``max_splits``, …). DeepSpeed keeps the gradients inside its engine,
    out of the guard's reach: it is refused.

    Example::

        step = guard(accelerator, model, lambda m, b: token_cross_entropy(m(b["input_ids"]), b["labels"], shift=True), shift=True)
        for batch in loader:
            with accelerator.accumulate(model):
                step.backward(batch)
                optimizer.step()
                optimizer.zero_grad()
    """
    if getattr(accelerator, "distributed_type", None) == "DEEPSPEED":  # a str enum
        raise AutobatchError(
            "guard needs the gradients in the parameters' .grad, but DeepSpeed keeps them inside its engine; "
            "leave the guard out under DeepSpeed, or train with DDP/FSDP"
        )
    return OOMGuard(model, loss_fn, backward_fn=accelerator.backward, accumulate=True, **options)


def _plan(target: int, processes: int, cap: int) -> Plan:
    return solve(target, gpus_per_node=processes, max_micro=cap)


def _search(
    function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], backend: MemoryBackend | None,
    fails_at: int, steps: int, on_trial: Callable[[Trial], None] | None, called: list[int], comm: Comm | None = None,
) -> tuple[SearchOutcome, dict[int, Any]]:
    """The search's outcome below ``fails_at`` (the batch that just ran out of memory), and the
    result of every trial that ran the function to its end, by batch."""
    finished: dict[int, Any] = {}

    def run(batch: int) -> Trial:
        called.append(batch)
        trial = _agreed_trial(function, batch, args, kwargs, backend, steps, finished, comm)
        if on_trial is not None:
            on_trial(trial)
        return trial

    capacity = backend.capacity() if backend is not None else 1
    if comm is not None and backend is not None:  # the same search everywhere: on the smallest capacity
        smallest = torch.tensor([capacity], dtype=torch.float64, device=comm.device)
        capacity = int(collective(comm, "agreeing on capacity", lambda: dist.all_reduce(
            smallest, op=dist.ReduceOp.MIN, async_op=True), lambda: smallest.item()))
    with frozen_heap():  # each trial's collection on a GPU walks only what the trials made
        return search_max(run, capacity, max_batch=fails_at - 1, fails_at=fails_at), finished


def _agreed_trial(
    function: Callable[..., Any], batch: int, args: tuple[Any, ...], kwargs: dict[str, Any],
    backend: MemoryBackend | None, steps: int, finished: dict[int, Any], comm: Comm | None,
) -> Trial:
    """This rank's trial, or in a process group the trial every rank agrees on (collective).

    It fits only where it fit on every rank, with the largest bytes any rank measured
    (:func:`~autobatch.distributed.agreement.agreed_trial`), so every rank's search takes the same next
    step. A rank whose trial raised another error tells the others, which stop too.
    """
    modules = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.nn.Module)]
    try:
        trial = run_trial_of(function, batch, args, kwargs, backend, steps, modules, finished,
                             stateful((*args, *kwargs.values())))
    except Exception:
        if comm is not None:
            share_trial(comm, None)
        raise
    if comm is None:
        return trial
    shared = share_trial(comm, trial)
    failed = [rank for rank, t in enumerate(shared) if t is None]
    if failed:
        raise RankFailedError(f"rank {failed[0]} failed in its trial at batch {batch}; every rank stopped with it "
                              f"(the error is in rank {failed[0]}'s log)", rank=failed[0])
    return agreed_trial(batch, [replace(t, batch=batch) for t in shared])

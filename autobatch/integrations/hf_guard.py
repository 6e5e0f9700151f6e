"""The HF Trainer's own ``training_step`` under the guard: a batch that runs out of memory is split, same update.

:func:`guard_trainer` replaces ``trainer.training_step`` on one Trainer by a
:class:`GuardedTrainingStep`, which runs the Trainer's step on the whole batch and, when that runs
out of memory, on 2, 4, … pieces of it (:func:`autobatch.guard.split_until_it_fits`): each piece
goes through the Trainer's ``compute_loss`` and ``accelerator.backward``, so its loss scaling, grad
scaler and gradient accumulation stay the Trainer's. Imported by :mod:`autobatch.integrations.hf`,
which re-exports both names.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist

from ..errors import AutobatchError
from ..guard import GuardedStep, batch_length, set_aside_gradients, split_batch, split_until_it_fits
from ._common import world

__all__ = ["guard_trainer", "GuardedTrainingStep"]

log = logging.getLogger("autobatch.integrations.hf")


def _comm_device(model: torch.nn.Module) -> torch.device | None:
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return next((p.device for p in model.parameters()), None)


def guard_trainer(trainer: Any, *, max_splits: int | None = None) -> GuardedTrainingStep:
    """Run ``trainer.training_step`` under the guard: a batch that runs out of memory is split, same update.

    The Trainer's ``training_step`` is replaced on this instance by a :class:`GuardedTrainingStep`
    (returned: its ``history`` holds the steps that were split). One process per device (DDP
    across them is fine), not DeepSpeed (its engine holds the gradients). The pieces go through the
    Trainer's own backward, grad scaler included.

    Example::

        trainer = Trainer(model=model, args=fit_training_args(args, model, sample=ds[0]), train_dataset=ds)
        guard_trainer(trainer)
        trainer.train()
    """
    _check_guardable(trainer)
    step = GuardedTrainingStep(trainer, max_splits)
    trainer.training_step = step
    return step


def _check_guardable(trainer: Any) -> None:
    if getattr(trainer, "is_deepspeed_enabled", False):
        raise AutobatchError(
            "guard_trainer needs the gradients in the parameters' .grad, but DeepSpeed keeps them inside its engine; "
            "leave the guard out under DeepSpeed"
        )
    if trainer.args.n_gpu > 1:
        raise AutobatchError(
            f"guard_trainer splits steps per process, but this Trainer runs DataParallel over {trainer.args.n_gpu} GPUs "
            "in one; launch one process per GPU (torchrun, accelerate launch), or leave the guard out"
        )


class GuardedTrainingStep:
    """``Trainer.training_step`` with a retry that splits the batch (see :func:`guard_trainer`).

    Each piece runs the Trainer's own ``training_step``. When the Trainer scales the loss by
    ``num_items_in_batch`` (a model that takes loss kwargs, or a ``compute_loss_func``), every
    piece gets the whole batch's count, so the pieces' gradients add up to the whole batch's
    exactly. Otherwise each piece's loss (a mean over its batch) is weighted by its share of the
    samples, exact when the loss is a mean over samples. Gradients of earlier batches of the
    accumulation window are set aside while a step runs (one more set of gradients meanwhile).

    Under DDP every rank splits the same step alike (the ranks share the out-of-memory flag after
    each attempt), the pieces run under ``no_sync``, and where the Trainer would have let DDP
    average the gradients (a window's last micro-batch) the step averages them itself.
    """

    def __init__(self, trainer: Any, max_splits: int | None):
        self.trainer, self.original, self.max_splits = trainer, trainer.training_step, max_splits
        self.steps = 0
        self.history: list[GuardedStep] = []

    def __call__(self, model: torch.nn.Module, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        trainer = self.trainer
        params = [p for p in model.parameters() if p.requires_grad]
        n = batch_length(inputs)
        scaled = trainer.loss_is_scaled_for_ga
        if scaled is None:
            scaled = (trainer.model_accepts_loss_kwargs and num_items_in_batch is not None) or trainer.compute_loss_func is not None
        self.steps += 1
        losses: list[torch.Tensor] = []

        def attempt(pieces: int) -> None:
            losses.clear()
            for piece in split_batch(inputs, pieces) if pieces > 1 else [inputs]:
                if scaled or pieces == 1:
                    losses.append(self.original(model, piece, num_items_in_batch))
                    continue
                own, compute_loss, share = trainer.__dict__.get("compute_loss"), trainer.compute_loss, batch_length(piece) / n
                trainer.compute_loss = lambda *a, _f=compute_loss, _w=share, **k: _f(*a, **k) * _w
                try:
                    losses.append(self.original(model, piece, num_items_in_batch))
                finally:  # the Trainer's compute_loss again
                    if own is None:
                        del trainer.compute_loss
                    else:
                        trainer.compute_loss = own

        ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
        if world()[1] > 1 and not ddp:
            raise AutobatchError(f"guard_trainer splits steps under DDP only, but the Trainer wrapped the model in "
                                 f"{type(model).__name__}; leave the guard out")
        # The Trainer runs a window's last micro-batch outside no_sync: there DDP would average the gradients.
        sync = ddp and model.require_backward_grad_sync
        limit = n if self.max_splits is None else min(self.max_splits, n)
        with set_aside_gradients(params), model.no_sync() if ddp else nullcontext():
            pieces, attempts = split_until_it_fits(attempt, params, limit=limit, step=self.steps,
                                                   device=_comm_device(model))
        if sync:  # the window's gradients, set-aside ones included, averaged over the ranks as DDP does
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad)
                p.grad.div_(dist.get_world_size())
        if pieces > 1:
            self.history.append(GuardedStep(self.steps, n, pieces, attempts, n))
            log.warning("training step %d went through as %d micro-batches after %d attempt(s); the update equals "
                        "the whole batch's (%s)", self.steps, pieces, attempts,
                        "num_items_in_batch kept" if scaled else "pieces weighted by their samples")
        return sum(losses[1:], losses[0])

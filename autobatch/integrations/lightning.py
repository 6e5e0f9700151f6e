"""Lightning: a ``Callback`` that probes the module's own training step at fit start and sets batch and accumulation.

Lightning's ``BatchSizeFinder`` refuses distributed strategies, doubles and bisects by running the
fit loop itself, lands 5 % under the largest batch it saw fit, and restores the model from a
checkpoint it writes. :class:`AutoBatch` instead, at ``on_fit_start`` (after the strategy has set
the model up, before the first batch):

* probes the LightningModule's own ``training_step`` (its real loss) with the optimizer that
  ``configure_optimizers`` built (a fresh one of the same class and param-group settings, so the
  trainer's optimizer state is not touched), on every rank in lockstep under DDP;
* solves micro batch × ``accumulate_grad_batches`` × world size = ``target`` exactly (default:
  the global batch the trainer was already set up for);
* sets the ``batch_size`` attribute where Lightning's finder sets it (``lightning_setattr``: the
  model, its ``hparams``, the datamodule) and ``trainer.accumulate_grad_batches``;
* logs the plan on rank 0 and keeps it in ``callback.plan`` (and the probe in ``callback.result``).

Weights, buffers, gradients and the RNG come back bit for bit (:func:`autobatch.probing.preserve.borrowed_model`).
``self.log`` calls inside ``training_step`` are ignored while probing.

With ``guard=True`` the training steps of the fit then run under an :class:`~autobatch.guard.OOMGuard`:
a rare long batch that runs out of memory is split into micro-batches inside that one training
step, and the update is the one the whole batch would have made (see :class:`_GuardedSteps`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from ..errors import AutobatchError
from ..guard import GuardedStep, OOMGuard, batch_length, set_aside_gradients
from ..planning.plan import Plan, require_positive_int
from ..probing.backends import MemoryBackend
from ..probing.probe import DEFAULT_HEADROOM, make_backend
from ..probing.result import ProbeResult
from ..probing.workload import Workload
from ._common import batches_from_dataset, log_main, max_micro_of, plan_for, probe_eval_batch, probe_here, require

_pl = require("lightning.pytorch", "lightning", "autobatch.integrations.lightning")
from lightning.pytorch.utilities.parsing import (
    lightning_getattr,
    lightning_hasattr,
    lightning_setattr,
)
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

__all__ = ["AutoBatch", "MODES"]

MODES = ("keep", "max")

log = logging.getLogger("autobatch.integrations.lightning")

_DTYPES = {"bf16-mixed": "bf16", "16-mixed": "fp16"}


class _TrainingStep(torch.nn.Module):
    """The LightningModule's ``training_step`` as a module's forward: what the trials (and DDP) call."""

    def __init__(self, module: Any):
        super().__init__()
        self.module = module

    def forward(self, batch: Any) -> torch.Tensor:
        out = self.module.training_step(batch, 0)
        loss = out.get("loss") if isinstance(out, dict) else out
        if not isinstance(loss, torch.Tensor):
            raise AutobatchError(
                f"AutoBatch needs training_step to return the loss (a tensor or a dict with 'loss'), but it returned "
                f"{type(out).__name__}; return the loss, or pass make_batch=… and probe with autobatch.probe"
            )
        return loss


class _StageStep(torch.nn.Module):
    """A LightningModule's ``validation_step``/``test_step``/``predict_step`` as a module's forward."""

    def __init__(self, module: Any, step: str):
        super().__init__()
        self.module, self.step = module, step

    def forward(self, batch: Any) -> Any:
        return getattr(self.module, self.step)(batch, 0)


def _same_optimizer(optimizer: torch.optim.Optimizer) -> Callable[[Any], torch.optim.Optimizer]:
    """A factory for a fresh optimizer of the same class and param groups (the user's keeps its state)."""
    groups = [{k: v for k, v in group.items() if k != "params"} | {"params": list(group["params"])}
              for group in optimizer.param_groups]

    def make(_params: Any) -> torch.optim.Optimizer:
        return type(optimizer)([dict(group) for group in groups])

    return make


class AutoBatch(_pl.Callback):
    """Probe at fit start, then set the batch size and gradient accumulation for ``target``.

    Args:
        target: the global batch (per-rank batch × accumulation × ranks); default the one the
            trainer was set up for (``batch_size × accumulate_grad_batches × world size``).
        batch_arg_name: the attribute that holds the DataLoader's batch size (as in ``BatchSizeFinder``).
        backend: this rank's memory backend; default the module's CUDA device, or a simulated
            ``memory`` budget on the CPU.
        memory: a simulated budget (``"2GiB"``) for CPU runs and tests.
        headroom: memory kept free: the plan's micro batch is at most the probe's ``safe_batch``.
        max_micro: a cap on the per-rank batch (``--max-micro``; ``max_batch=`` is its old name).
        make_batch: ``make_batch(b)`` for the probe; default ``b`` samples of the train
            dataloader's dataset collated by its ``collate_fn`` (give the longest samples here when
            lengths vary).
        guard: run every training step of the fit under an :class:`~autobatch.guard.OOMGuard`: a
            batch that runs out of memory is split into micro-batches and the step's gradients are
            the whole batch's. ``training_step`` must return the *mean over the batch's samples*
            (the pieces are weighted by their sample counts). One device or ``ddp``, automatic
            optimization, no fp16 grad scaler. The splits are kept in ``callback.guard.history``.
        max_splits: with ``guard``, the most micro-batches one batch may be cut into.
        mode: ``"keep"`` (default) keeps the global batch: the micro batch that fits, and the
            accumulation that makes up the rest; ``"max"`` sets the largest safe batch and leaves
            ``accumulate_grad_batches`` as it is, as ``BatchSizeFinder`` does.
        steps_per_trial: optimizer steps per trial (as ``BatchSizeFinder``'s; 2 is the least that
            holds the optimizer's state, and enough: the search is exact without more).

    ``trainer.validate``/``test``/``predict`` set the stage's own batch: the exact largest one under
    ``torch.no_grad()``, in ``callback.eval_batch``. ``BatchSizeFinder``'s ``init_val`` and
    ``max_trials`` have no counterpart: the search starts at the smallest batch to prove a fit and
    ends when the largest fits and the next fails, in a few trials (see docs/integrations.md).

    Example::

        trainer = Trainer(callbacks=[AutoBatch(target=512)], ...)
        trainer.fit(model, datamodule)        # prints: 128 per GPU × 4 accumulation × 1 GPU … = 512
    """

    def __init__(
        self,
        target: int | None = None,
        *,
        batch_arg_name: str = "batch_size",
        backend: MemoryBackend | None = None,
        memory: int | str | None = None,
        headroom: float | int | str = DEFAULT_HEADROOM,
        max_micro: int | None = None,
        make_batch: Callable[[int], Any] | None = None,
        guard: bool = False,
        max_splits: int | None = None,
        mode: str = "keep",
        steps_per_trial: int = 2,
        max_batch: int | None = None,
    ):
        max_micro = max_micro_of(max_micro, max_batch, "AutoBatch")
        if mode not in MODES:
            raise AutobatchError(f"mode must be one of {', '.join(MODES)}, but got {mode!r}; 'keep' keeps the global "
                                 "batch (the default), 'max' sets the largest batch that fits, as BatchSizeFinder does")
        if isinstance(steps_per_trial, bool) or not isinstance(steps_per_trial, int) or steps_per_trial < 2:
            raise AutobatchError(f"steps_per_trial must be an integer ≥ 2 (the optimizer's state appears at the first "
                                 f"step), but got {steps_per_trial!r}")
        self.mode, self.steps_per_trial = mode, steps_per_trial
        if target is not None:
            require_positive_int("target", target, fix="pass the global batch, or leave it out to keep the trainer's")
        self.target, self.batch_arg_name, self.backend, self.memory = target, batch_arg_name, backend, memory
        self.headroom, self.max_micro, self.make_batch = headroom, max_micro, make_batch
        self.use_guard, self.max_splits = bool(guard), max_splits
        self.plan: Plan | None = None
        self.result: ProbeResult | None = None
        self.eval_batch: int | None = None
        self.guard: OOMGuard | None = None
        self._steps: _GuardedSteps | None = None

    def setup(self, trainer: Any, pl_module: Any, stage: str | None = None) -> None:
        if not lightning_hasattr(pl_module, self.batch_arg_name):
            raise AutobatchError(
                f"AutoBatch sets the batch size in {self.batch_arg_name!r}, but neither the model, its hparams nor "
                "the datamodule has it; add self.batch_size and use it in train_dataloader(), or pass batch_arg_name=…"
            )
        if (hasattr(pl_module, self.batch_arg_name) and hasattr(pl_module, "hparams")
                and self.batch_arg_name in pl_module.hparams):  # Lightning's own warning, word for word
            rank_zero_warn(
                f"Field `model.{self.batch_arg_name}` and `model.hparams.{self.batch_arg_name}` are mutually"
                f" exclusive! `model.{self.batch_arg_name}` will be used as the initial batch size for scaling."
                " If this is not the intended behavior, please remove either one."
            )
        if stage not in (None, "fit"):
            return  # validate, test, predict: the evaluation batch, searched when their loop starts
        if not trainer.fit_loop._data_source.is_module():
            raise AutobatchError(
                "AutoBatch sets the batch size where train_dataloader() reads it, but the dataloaders were passed to "
                "fit() directly; build them in the LightningModule or a LightningDataModule (as BatchSizeFinder requires)"
            )
        if not pl_module.automatic_optimization:
            raise AutobatchError(
                "AutoBatch probes training_step with automatic optimization, but this module optimizes manually "
                "(automatic_optimization=False); probe with autobatch.probe and a Workload instead"
            )
        if self.use_guard and getattr(trainer.precision_plugin, "scaler", None) is not None:
            raise AutobatchError(
                f"AutoBatch(guard=True) runs the backward itself, past the fp16 grad scaler of precision="
                f"{trainer.precision!r}; train with bf16-mixed or 32, or leave guard out"
            )

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        world = trainer.world_size
        current = lightning_getattr(pl_module, self.batch_arg_name)
        target = self.target or int(current) * trainer.accumulate_grad_batches * world
        if not trainer.optimizers:
            raise AutobatchError("AutoBatch needs configure_optimizers to return an optimizer, but there is none")
        loader = None if self.make_batch else _train_dataloader(trainer)
        make_batch = self.make_batch or batches_from_dataset(loader.dataset, loader.collate_fn)
        workload = Workload(
            _TrainingStep(pl_module), make_batch, loss_fn=lambda step, batch: step(batch),
            optimizer=_same_optimizer(trainer.optimizers[0]), steps=self.steps_per_trial,
            dtype=_DTYPES.get(str(trainer.precision)), name=type(pl_module).__name__,
        )
        backend = self.backend or make_backend(pl_module.device, self.memory)
        quiet = {"log": lambda *a, **k: None, "log_dict": lambda *a, **k: None}
        pl_module.__dict__.update(quiet)  # self.log needs the fit loop's results, which do not exist yet
        try:
            self.result = probe_here(workload, backend, max_batch=self.max_micro, headroom=self.headroom)
        finally:
            for name in quiet:
                pl_module.__dict__.pop(name, None)
        if self.mode == "max":  # as BatchSizeFinder: the largest batch (the safe one), accumulation as it was
            micro = self.result.safe_batch
            self.plan = plan_for(self.result, micro * trainer.accumulate_grad_batches * world, world)
        else:
            self.plan = plan_for(self.result, target, world)
        lightning_setattr(pl_module, self.batch_arg_name, self.plan.micro_batch)
        trainer.accumulate_grad_batches = self.plan.grad_accum
        trainer.fit_loop._combined_loader = None  # a loader built before now had the old batch size
        log_main(log, "AutoBatch: max batch %d per rank (safe %d) in %d trials; %s = %d; %s=%d, accumulate_grad_batches=%d",
                 self.result.max_batch, self.result.safe_batch, len(self.result.trials),
                 f"{self.plan.micro_batch} batch size * {self.plan.grad_accum} accumulate_grad_batches * {world} ranks",
                 self.plan.global_batch, self.batch_arg_name, self.plan.micro_batch, self.plan.grad_accum)
        if self.use_guard:
            self._steps = _GuardedSteps(trainer, pl_module, self.max_splits)
            self.guard = self._steps.guard

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        if not trainer.sanity_checking and trainer.state.fn == "validate":  # not the validation inside fit
            self._scale_evaluation(trainer, pl_module, "validation_step")

    def on_test_start(self, trainer: Any, pl_module: Any) -> None:
        self._scale_evaluation(trainer, pl_module, "test_step")

    def on_predict_start(self, trainer: Any, pl_module: Any) -> None:
        self._scale_evaluation(trainer, pl_module, "predict_step")

    def _scale_evaluation(self, trainer: Any, pl_module: Any, step: str) -> None:
        """``validate``/``test``/``predict``: the exact largest batch of the stage's step under
        ``torch.no_grad()`` (no gradients, no optimizer), set where the dataloader reads it."""
        loop = trainer._active_loop
        loop.setup_data()
        loaders = loop._combined_loader.flattened
        if len(loaders) != 1:
            raise AutobatchError(f"AutoBatch sets one batch size for {step}, but the stage has {len(loaders)} "
                                 "dataloaders; scale one at a time (as BatchSizeFinder requires)")
        make_batch = self.make_batch or batches_from_dataset(loaders[0].dataset, loaders[0].collate_fn)
        backend = self.backend or make_backend(pl_module.device, self.memory)
        quiet = {"log": lambda *a, **k: None, "log_dict": lambda *a, **k: None}
        pl_module.__dict__.update(quiet)
        try:
            self.eval_batch = probe_eval_batch(_StageStep(pl_module, step), make_batch, backend,
                                               dtype=_DTYPES.get(str(trainer.precision)), max_batch=self.max_micro,
                                               loss_fn=lambda module, batch: module(batch))
        finally:
            for name in quiet:
                pl_module.__dict__.pop(name, None)
        lightning_setattr(pl_module, self.batch_arg_name, self.eval_batch)
        loop._combined_loader = None  # built again at the new batch size, and fetched from anew: the
        loop.setup_data()             # loop reads its fetcher after this hook (as BatchSizeFinder's runs rely on)
        loop.reset()
        log_main(log, "AutoBatch: %s runs at batch %d (the largest under torch.no_grad())", step, self.eval_batch)

    def teardown(self, trainer: Any, pl_module: Any, stage: str | None = None) -> None:
        if self._steps is not None:  # the module's own methods again, after fit
            self._steps.remove()
            self._steps = None


class _GuardedSteps:
    """``training_step`` and ``backward`` of a LightningModule, guarded, for the length of a fit.

    Lightning's automatic optimization calls ``training_step``, then (first batch of an
    accumulation window) ``optimizer.zero_grad``, then ``backward`` on the returned loss divided
    by ``accumulate_grad_batches``. The guarded ``training_step`` runs the forward *and* backward
    of the batch under an :class:`OOMGuard` (the original ``training_step`` per piece, its loss
    weighted by the piece's share of the samples and divided by the accumulation), keeps those
    gradients apart, and returns the batch's loss detached; the guarded ``backward`` adds the kept
    gradients where Lightning would have run its backward. Gradients of the window's earlier
    batches are set aside during the step; on a window's first batch the previous step's stale
    gradients are dropped at once (Lightning's ``zero_grad`` would drop them before its backward).
    Installed as instance attributes, removed at ``teardown``. On a split step, ``self.log`` in
    ``training_step`` runs once per piece.

    Under DDP the guarded ``training_step`` runs inside DDP's forward, so DDP is kept from syncing
    (``require_backward_grad_sync = False``, as inside ``no_sync``) for the fit: the guard's
    attempts agree across ranks (every rank splits the same step), and the guarded ``backward``
    of a window's last batch averages the gradients over the ranks, as DDP would have.
    """

    def __init__(self, trainer: Any, module: Any, max_splits: int | None):
        self.trainer, self.module = trainer, module
        wrapper = trainer.strategy.model
        self.ddp = wrapper if isinstance(wrapper, torch.nn.parallel.DistributedDataParallel) else None
        if trainer.world_size > 1 and self.ddp is None:
            raise AutobatchError(
                f"AutoBatch(guard=True) splits steps under DDP, but the strategy wrapped the model in "
                f"{type(wrapper).__name__}; use strategy='ddp', or leave guard out"
            )
        if self.ddp is not None:  # DDP would sync inside the guard's backward; the guard averages after the window
            self.ddp.require_backward_grad_sync = False
        self.original_step, self.original_backward = module.training_step, module.backward
        self.guard = OOMGuard(module, self._losses, labels=lambda batch: torch.ones(batch_length(batch), dtype=torch.bool),
                              max_splits=max_splits)
        self.pending: list[torch.Tensor | None] | None = None
        self._args: tuple[Any, ...] = ()
        self._outputs: list[tuple[int, Any]] = []
        module.__dict__.update(training_step=self.training_step, backward=self.backward)

    def remove(self) -> None:
        for name in ("training_step", "backward"):
            self.module.__dict__.pop(name, None)
        if self.ddp is not None:
            self.ddp.require_backward_grad_sync = True

    def _losses(self, module: Any, piece: Any) -> torch.Tensor:
        out = self.original_step(piece, *self._args)
        loss = out.get("loss") if isinstance(out, dict) else out
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise AutobatchError(
                "AutoBatch(guard=True) weighs each piece's loss by its samples, so training_step must return the mean "
                f"loss (a 0-d tensor, or a dict with 'loss'), but it returned {type(out).__name__}; leave guard out"
            )
        n = batch_length(piece)
        self._outputs.append((n, out))
        return (loss / self.trainer.accumulate_grad_batches).expand(n)  # OOMGuard sums these, / the batch's samples

    def training_step(self, batch: Any, batch_idx: int, *args: Any, **kwargs: Any) -> Any:
        if kwargs:
            raise AutobatchError("AutoBatch(guard=True) passes training_step its batch and batch_idx only")
        params = [p for p in self.module.parameters() if p.requires_grad]
        if batch_idx % self.trainer.accumulate_grad_batches == 0:
            for p in params:
                p.grad = None
        self._args, self._outputs = (batch_idx, *args), []
        with set_aside_gradients(params):
            done: GuardedStep = self.guard.backward(batch)  # a list of tensors ([x, y]) is one batch
            self.pending = [p.grad for p in params]
            for p in params:
                p.grad = None
        kept = self._outputs[-done.pieces:]  # the attempt that went through
        loss = sum(n * _loss_of(out).detach() for n, out in kept) / done.samples
        last = kept[-1][1]
        return {**last, "loss": loss} if isinstance(last, dict) else loss

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        if self.pending is None:
            return self.original_backward(loss, *args, **kwargs)
        params = [p for p in self.module.parameters() if p.requires_grad]
        for p, g in zip(params, self.pending):
            if g is not None:
                p.grad = g if p.grad is None else p.grad.add_(g)
        self.pending = None
        if self.ddp is not None and not self.trainer.fit_loop._should_accumulate():
            for p in params:  # the window's gradients, averaged over the ranks where DDP would have
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                torch.distributed.all_reduce(p.grad)
                p.grad.div_(self.trainer.world_size)


def _loss_of(out: Any) -> torch.Tensor:
    return out.get("loss") if isinstance(out, dict) else out


def _train_dataloader(trainer: Any) -> Any:
    from lightning.pytorch.trainer.connectors.data_connector import _request_dataloader

    source = trainer.fit_loop._data_source
    if not source.is_defined():
        raise AutobatchError(
            "AutoBatch builds probe batches from the train dataloader, but fit() got none; pass a datamodule or "
            "train_dataloaders, or make_batch=…"
        )
    return _request_dataloader(source)

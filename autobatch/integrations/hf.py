"""HF Trainer: probed ``TrainingArguments`` that keep the global batch, and a ``TrainerCallback`` form.

The Trainer's own ``auto_find_batch_size`` only shrinks (from the batch given, halving on each
out-of-memory error), restarts the training loop silently, leaves ``gradient_accumulation_steps``
alone (so the global batch changes) and does not cover ZeRO-3. :func:`fit_training_args` instead
probes the model's real training step (the Trainer's optimizer class and settings, its bf16/fp16
autocast, its gradient checkpointing), then returns new ``TrainingArguments`` whose
``per_device_train_batch_size × gradient_accumulation_steps × world size`` equals the old global
batch (or ``target``), with ``per_device_eval_batch_size`` from a forward-only probe and the
DeepSpeed config's explicit batch values rewritten to match (``"auto"`` values stay ``"auto"``
and the Trainer fills them from the new arguments). The arguments passed in are not changed,
nor is a DeepSpeed JSON file: a changed config is passed on as a dict.

:func:`guard_trainer` (or ``AutoBatchCallback(guard=True)``) runs the Trainer's own
``training_step`` under the guard's retry loop (:func:`autobatch.guard.split_until_it_fits`): a
batch that runs out of memory is split and each piece goes through the Trainer's step (its
``compute_loss``, its ``accelerator.backward``), so the update stays the whole batch's.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import gc
import json
import logging
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..errors import AutobatchError
from ..planning.plan import Plan, require_positive_int
from ..planning.solver import solve
from ..probing.backends import MemoryBackend
from ..probing.oom import is_oom_error, oom_message
from ..probing.probe import DEFAULT_HEADROOM, make_backend
from ..probing.result import ProbeResult
from ..probing.workload import Workload, default_loss
from ._common import batches_from_dataset, log_main, max_micro_of, plan_for, probe_eval_batch, probe_here, require, world
from .hf_guard import GuardedTrainingStep, _check_guardable, guard_trainer

_transformers = require("transformers", "hf", "autobatch.integrations.hf")

__all__ = ["fit_training_args", "AutoBatchCallback", "deepspeed_batch_config", "probe_eval_batch", "guard_trainer",
           "GuardedTrainingStep"]

log = logging.getLogger("autobatch.integrations.hf")

_DS_KEYS = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")


def _make_batch(sample: Any, data_collator: Callable[[list[Any]], Any] | None, train_dataset: Any) -> Callable[[int], Any]:
    collate = data_collator or _transformers.default_data_collator
    if sample is not None:
        return lambda b: collate([sample] * b)
    if train_dataset is not None:
        return batches_from_dataset(train_dataset, collate)
    raise AutobatchError(
        "fit_training_args needs a sample (one training example at the longest length you train on), a "
        "train_dataset, or make_batch=… to build probe batches"
    )


def deepspeed_batch_config(config: Any, plan: Plan) -> dict[str, Any] | None:
    """A copy of a DeepSpeed config (dict or JSON path) whose explicit batch values match ``plan``.

    ``"auto"`` values are left for the Trainer to fill from the arguments; ``None`` when nothing
    needed changing (pass the original on).

    Example:
        >>> deepspeed_batch_config({"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": "auto"}, Plan(4, 2))
        {'train_micro_batch_size_per_gpu': 4, 'gradient_accumulation_steps': 'auto'}
    """
    if isinstance(config, (str, os.PathLike)):
        with open(config, encoding="utf-8") as f:
            config = json.load(f)
    if not isinstance(config, dict):
        return None
    values = dict(zip(_DS_KEYS, (plan.micro_batch, plan.grad_accum, plan.global_batch)))
    changed = copy.deepcopy(config)
    for key, value in values.items():
        if key in changed and changed[key] != "auto":
            changed[key] = value
    return changed if changed != config else None


def fit_training_args(args: Any, model: torch.nn.Module, **options: Any) -> Any:
    """New ``TrainingArguments``: probed per-device batches, accumulation for the same global batch.

    Args:
        args: the ``TrainingArguments`` you would train with (not changed).
        model: the model (restored bit for bit after probing).
        sample: one training example (a dict of tensors/lists as the dataset yields it), at the
            longest length you train on; batches are ``data_collator([sample] * b)``.
        data_collator: the Trainer's collator; default ``transformers.default_data_collator``.
        train_dataset: used for batches when no sample is given (its first items, repeated).
        make_batch: ``make_batch(b)``, instead of the above.
        target: the global batch; default the one ``args`` already train with.
        backend, memory: where to probe: default the CUDA device; ``memory="2GiB"`` simulates a
            budget on the CPU.
        headroom: memory kept free: the micro batch is at most the probe's ``safe_batch``.
        max_micro: a cap on the per-device batch (``--max-micro``; ``max_batch=`` is its old name).
        loss_fn: ``loss_fn(model, batch)`` when the model's output holds no loss the Trainer would
            take (default: ``outputs["loss"]``, or the first item of a tuple, as the Trainer reads it).
        eval_batch: also probe ``per_device_eval_batch_size`` (forward only); else it is set to
            the training micro batch.

    Returns:
        A copy of ``args`` with ``per_device_train_batch_size``, ``gradient_accumulation_steps``,
        ``per_device_eval_batch_size`` (and a matching ``deepspeed`` dict when the config had
        explicit batch values). The plan and probe ride along as ``autobatch_plan`` and
        ``autobatch_probe`` attributes.

    Example::

        args = fit_training_args(args, model, sample=train_dataset[0])   # on a GPU
        Trainer(model=model, args=args, train_dataset=train_dataset).train()
    """
    changes, plan, result = _planned_changes(args, model, **options)
    new = dataclasses.replace(args, **changes)
    new.autobatch_plan, new.autobatch_probe = plan, result
    return new


def _planned_changes(
    args: Any,
    model: torch.nn.Module,
    *,
    sample: Any = None,
    data_collator: Callable[[list[Any]], Any] | None = None,
    train_dataset: Any = None,
    make_batch: Callable[[int], Any] | None = None,
    target: int | None = None,
    backend: MemoryBackend | None = None,
    memory: int | str | None = None,
    headroom: float | int | str = DEFAULT_HEADROOM,
    max_micro: int | None = None,
    eval_batch: bool = True,
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor] = default_loss,
    max_batch: int | None = None,
) -> tuple[dict[str, Any], Plan, ProbeResult]:
    """The changed argument values, the plan and the probe (see :func:`fit_training_args`)."""
    max_batch = max_micro_of(max_micro, max_batch, "fit_training_args")
    world = args.world_size
    if target is None:
        target = args.per_device_train_batch_size * args.gradient_accumulation_steps * world
    target = require_positive_int("target", target, fix="pass the global batch, or leave it out to keep args'")
    make = make_batch or _make_batch(sample, data_collator, train_dataset)
    cls, kwargs = _transformers.Trainer.get_optimizer_cls_and_kwargs(args, model)
    dtype = "bf16" if args.bf16 else "fp16" if args.fp16 else None
    checkpointing = bool(getattr(args, "gradient_checkpointing", False) or getattr(args, "activation_checkpointing", False))
    workload = Workload(model, make, loss_fn=loss_fn, optimizer=lambda params: cls(params, **kwargs), dtype=dtype,
                        grad_checkpointing=checkpointing, name=type(model).__name__)
    backend = backend or make_backend(_device_of(model, args), memory)
    with _as_the_trainer_sets(model, args):
        result = probe_here(workload, backend, max_batch=max_batch, headroom=headroom)
        plan = plan_for(result, target, world)
        evaluation = plan.micro_batch
        if eval_batch:  # each rank's own forward-only probe; every rank takes the smallest
            evaluation = _smallest_on_any_rank(
                probe_eval_batch(model, make, backend, dtype=dtype, max_batch=max_batch, loss_fn=loss_fn), backend)
    changes: dict[str, Any] = {
        "per_device_train_batch_size": plan.micro_batch,
        "gradient_accumulation_steps": plan.grad_accum,
        "per_device_eval_batch_size": evaluation,
    }
    if args.deepspeed:
        ds = deepspeed_batch_config(args.deepspeed, plan)
        if ds is not None:
            changes["deepspeed"] = ds
    log_main(log, "autobatch: max batch %d per device (safe %d) in %d trials; # %d per device * %d grad accum * %d "
             "devices = %d sequences per step; eval batch %d", result.max_batch, result.safe_batch, len(result.trials),
             plan.micro_batch, plan.grad_accum, world, plan.global_batch, evaluation)
    return changes, plan, result


@contextlib.contextmanager
def _as_the_trainer_sets(model: torch.nn.Module, args: Any) -> Iterator[None]:
    """The model's ``config.use_cache`` as the Trainer sets it from ``args.use_cache`` (off by default) while the
    probes run, then back: a model that caches keys and values keeps every layer's under ``no_grad``, so an
    evaluation probed with the cache on fits fewer than the Trainer's ``evaluate()`` does."""
    config = getattr(model, "config", None)
    wanted = getattr(args, "use_cache", None)
    if config is None or wanted is None or not hasattr(config, "use_cache"):
        yield
        return
    before = config.use_cache
    config.use_cache = wanted
    try:
        yield
    finally:
        config.use_cache = before


def _smallest_on_any_rank(value: int, backend: MemoryBackend) -> int:
    """``value``'s minimum over the ranks of an initialized group (collective); ``value`` alone without one."""
    if world()[1] == 1:
        return value
    device = backend.device if torch.distributed.get_backend() == "nccl" else torch.device("cpu")
    smallest = torch.tensor([value], dtype=torch.int64, device=device)
    torch.distributed.all_reduce(smallest, op=torch.distributed.ReduceOp.MIN)
    return int(smallest.item())


def _device_of(model: torch.nn.Module, args: Any) -> torch.device:
    device = next((p.device for p in model.parameters()), None)
    if device is not None and device.type == "cuda":
        return device
    return args.device if args.device.type == "cuda" else torch.device("cpu")


class AutoBatchCallback(_transformers.TrainerCallback):
    """The same, for a ``Trainer`` already built: ``AutoBatchCallback(target=…).attach(trainer)`` before ``train()``.

    The Trainer reads its batch size in ``__init__`` (before any callback event), so the probe runs
    in :meth:`attach`: it probes ``trainer.model`` with the Trainer's collator and dataset (or
    ``sample``), gives the Trainer the new arguments (``trainer.args``, its batch size, and the
    DeepSpeed plugin's config when DeepSpeed is on), and registers the callback, which logs the plan
    at ``on_train_begin`` and checks that the train dataloader uses it.

    Example::

        trainer = Trainer(model=model, args=args, train_dataset=ds, data_collator=collator)
        AutoBatchCallback(memory="4MiB").attach(trainer)   # on a GPU: AutoBatchCallback()
        trainer.train()

    ``guard=True`` also runs the Trainer's steps under :func:`guard_trainer` (``max_splits`` goes there).
    """

    def __init__(self, target: int | None = None, *, sample: Any = None, guard: bool = False,
                 max_splits: int | None = None, **options: Any):
        self.target, self.sample, self.options = target, sample, options
        self.use_guard, self.max_splits = bool(guard), max_splits
        self.plan: Plan | None = None
        self.result: ProbeResult | None = None
        self.guard: GuardedTrainingStep | None = None

    def attach(self, trainer: Any, resume_from_checkpoint: str | None = None) -> Any:
        """Probe and plan for ``trainer`` (or, resuming, take the batch the checkpoint trained with), then register.

        ``resume_from_checkpoint``: the checkpoint ``trainer.train`` will resume from: its
        ``train_batch_size`` is kept (no probe), with the accumulation that keeps the global
        batch, so a resumed run trains on as it did.
        """
        if self.use_guard:  # before any trial
            _check_guardable(trainer)
        if resume_from_checkpoint is not None:
            changes, self.plan = _resumed(trainer.args, resume_from_checkpoint, self.target)
            self.result = None
        else:
            changes, self.plan, self.result = _planned_changes(
                trainer.args, trainer.model, sample=self.sample, data_collator=trainer.data_collator,
                train_dataset=trainer.train_dataset, target=self.target, **self.options,
            )
        # In place: the Trainer's accelerator was built with these arguments; a copy would set up
        # its devices again and reset the accelerator's state under it.
        changes.pop("deepspeed", None)
        for key, value in changes.items():
            setattr(trainer.args, key, value)
        trainer._train_batch_size = trainer.args.train_batch_size
        if getattr(trainer, "is_deepspeed_enabled", False):
            from transformers.integrations.deepspeed import propagate_args_to_deepspeed

            # The plugin's config holds the old values (its "auto" were filled at init): write the
            # plan's, then let the Trainer check and fill the rest from the arguments, as it does
            # after its own auto_find_batch_size.
            config = trainer.accelerator.state.deepspeed_plugin.hf_ds_config.config
            config.update(dict(zip(_DS_KEYS, (self.plan.micro_batch, self.plan.grad_accum, self.plan.global_batch))))
            propagate_args_to_deepspeed(trainer.accelerator, trainer.args)
        if self.use_guard:
            self.guard = guard_trainer(trainer, max_splits=self.max_splits)
        _retry_smaller(trainer, self)
        trainer.add_callback(self)
        return trainer

    def on_train_begin(self, args: Any, state: Any, control: Any, train_dataloader: Any = None, **kwargs: Any) -> None:
        if self.plan is None:
            raise AutobatchError("AutoBatchCallback probes in attach(trainer); call it before trainer.train()")
        used = getattr(getattr(train_dataloader, "batch_sampler", None), "batch_size", None) or getattr(
            train_dataloader, "batch_size", None)
        if used is not None and used != self.plan.micro_batch:
            raise AutobatchError(
                f"the Trainer's train dataloader yields batches of {used}, but the plan is {self.plan.micro_batch}; "
                "attach the callback after building the Trainer and before train()"
            )
        if args.gradient_accumulation_steps != self.plan.grad_accum:
            raise AutobatchError(
                f"the Trainer accumulates {args.gradient_accumulation_steps} steps, but the plan is {self.plan.grad_accum}"
            )
        log_main(log, "autobatch: training with %s", self.plan)



def _resumed(args: Any, checkpoint: str, target: int | None) -> tuple[dict[str, Any], Plan]:
    """The batch a checkpoint trained with (its ``trainer_state.json``), planned for the same global batch."""
    state = _transformers.TrainerState.load_from_json(os.path.join(checkpoint, "trainer_state.json"))
    micro = state.train_batch_size
    if micro is None:
        raise AutobatchError(f"{checkpoint} records no train_batch_size; attach without resume_from_checkpoint to probe")
    world = args.world_size
    target = target or args.per_device_train_batch_size * args.gradient_accumulation_steps * world
    plan = solve(target, gpus_per_node=world, max_micro=micro, min_micro=micro)
    log_main(log, "autobatch: resuming %s with its batch: %s", checkpoint, plan)
    return {"per_device_train_batch_size": plan.micro_batch, "gradient_accumulation_steps": plan.grad_accum}, plan


def _retry_smaller(trainer: Any, callback: AutoBatchCallback) -> None:
    """Out of memory anywhere in a step (the forward, a callback at its end): train again from the
    start at the next smaller micro batch, with the accumulation that keeps the global batch, as
    the Trainer's ``auto_find_batch_size`` restarts its loop (which halves the batch and leaves
    the accumulation, so the global batch changes)."""
    inner = trainer._inner_training_loop

    @functools.wraps(inner)
    def retrying(*args: Any, **kwargs: Any) -> Any:
        while True:
            try:
                return inner(*args, **{**kwargs, "batch_size": callback.plan.micro_batch})
            except Exception as exc:
                if not is_oom_error(exc) or callback.plan.micro_batch <= 1:
                    raise
                before = callback.plan
                callback.plan = solve(before.global_batch, gpus_per_node=before.world_size,
                                      max_micro=before.micro_batch - 1)
                log_main(log, "autobatch: out of memory in a step at micro batch %d (%s); training again with %s",
                         before.micro_batch, oom_message(exc, 120), callback.plan)
                trainer.args.per_device_train_batch_size = callback.plan.micro_batch
                trainer.args.gradient_accumulation_steps = callback.plan.grad_accum
                trainer._train_batch_size = trainer.args.train_batch_size
                gc.collect()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()

    trainer._inner_training_loop = retrying

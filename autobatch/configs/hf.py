"""HF ``TrainingArguments`` values for a plan, as a dict and as command-line flags.

HF Trainer computes the global batch as ``per_device_train_batch_size × gradient_accumulation_steps
× data-parallel world size``; the world size comes from the launcher, not from these arguments.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

from ..strategy import Strategy

if TYPE_CHECKING:
    from ..planning.plan import Plan

__all__ = ["hf_training_args", "hf_flags"]


def hf_training_args(plan: Plan, deepspeed_config_file: str | os.PathLike[str] | None = None, *,
                     eval_batch: int | None = None, strategy: Strategy | None = None) -> dict[str, Any]:
    """Keyword arguments for ``transformers.TrainingArguments``.

    Args:
        plan: The plan.
        deepspeed_config_file: Adds ``deepspeed=<path>`` so Trainer uses the same DeepSpeed JSON.
        eval_batch: Adds ``per_device_eval_batch_size`` (the probed evaluation batch, ``--eval``).
        strategy: The strategy the micro batch was probed under. FSDP adds ``fsdp`` and
            ``fsdp_config`` (version, block class); ZeRO without a DeepSpeed file adds ``deepspeed``
            as a dict with its stage and offload (Trainer fills the ``"auto"`` values).

    Example:
        >>> from autobatch.planning.plan import Plan
        >>> hf_training_args(Plan(7, 2, gpus_per_node=16))
        {'per_device_train_batch_size': 7, 'gradient_accumulation_steps': 2}
    """
    args: dict[str, Any] = {
        "per_device_train_batch_size": plan.micro_batch,
        "gradient_accumulation_steps": plan.grad_accum,
    }
    if eval_batch is not None:
        args["per_device_eval_batch_size"] = eval_batch
    if deepspeed_config_file is not None:
        args["deepspeed"] = os.fspath(deepspeed_config_file)
    elif strategy is not None and strategy.is_deepspeed:
        from .deepspeed import zero_section

        args["deepspeed"] = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                             "train_batch_size": "auto", "zero_optimization": zero_section(strategy)}
    if strategy is not None and strategy.is_fsdp:
        fsdp_config: dict[str, Any] = {"version": 2 if strategy.name == "fsdp2" else 1}
        if strategy.unit:
            fsdp_config["transformer_layer_cls_to_wrap"] = [strategy.unit]
        args["fsdp"] = "full_shard auto_wrap"
        args["fsdp_config"] = fsdp_config
    return args


def hf_flags(plan: Plan, deepspeed_config_file: str | os.PathLike[str] | None = None,
             strategy: Strategy | None = None) -> list[str]:
    """The same values as ``HfArgumentParser`` command-line flags.

    Example:
        >>> from autobatch.planning.plan import Plan
        >>> hf_flags(Plan(7, 2, gpus_per_node=16))
        ['--per_device_train_batch_size', '7', '--gradient_accumulation_steps', '2']
    """
    flags: list[str] = []
    for key, value in hf_training_args(plan, deepspeed_config_file, strategy=strategy).items():
        flags += [f"--{key}", json.dumps(value) if isinstance(value, dict) else str(value)]
    return flags

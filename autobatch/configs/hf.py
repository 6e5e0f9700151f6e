"""HF ``TrainingArguments`` values for a plan, as a dict and as command-line flags.

HF Trainer computes the global batch as ``per_device_train_batch_size × gradient_accumulation_steps
× data-parallel world size``; the world size comes from the launcher, not from these arguments.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..planning.plan import Plan

__all__ = ["hf_training_args", "hf_flags"]


def hf_training_args(plan: Plan, deepspeed_config_file: str | os.PathLike[str] | None = None, *,
                     eval_batch: int | None = None) -> dict[str, Any]:
    """Keyword arguments for ``transformers.TrainingArguments``.

    Args:
        plan: The plan.
        deepspeed_config_file: Adds ``deepspeed=<path>`` so Trainer uses the same DeepSpeed JSON.
        eval_batch: Adds ``per_device_eval_batch_size`` (the probed evaluation batch, ``--eval``).

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
    return args


def hf_flags(plan: Plan, deepspeed_config_file: str | os.PathLike[str] | None = None) -> list[str]:
    """The same values as ``HfArgumentParser`` command-line flags.

    Example:
        >>> from autobatch.planning.plan import Plan
        >>> hf_flags(Plan(7, 2, gpus_per_node=16))
        ['--per_device_train_batch_size', '7', '--gradient_accumulation_steps', '2']
    """
    flags: list[str] = []
    for key, value in hf_training_args(plan, deepspeed_config_file).items():
        flags += [f"--{key}", str(value)]
    return flags

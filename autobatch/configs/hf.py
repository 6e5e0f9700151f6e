"""HF ``TrainingArguments`` values for a plan, as a dict and as command-line flags.

HF Trainer computes the global batch as ``per_device_train_batch_size × gradient_accumulation_steps
× data-parallel world size``; the world size comes from the launcher, not from these arguments.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

from ..strategy import SIZE_BASED_MIN_PARAMS, Strategy, as_strategy
from .trained import trained_with

if TYPE_CHECKING:
    from ..planning.plan import Plan

__all__ = ["hf_training_args", "hf_flags", "hf_fsdp"]


def hf_training_args(plan: Plan, deepspeed_config_file: str | os.PathLike[str] | None = None, *,
                     eval_batch: int | None = None, strategy: Strategy | str | None = None,
                     precision: str | None = None, grad_checkpointing: bool | None = None,
                     probed_zero: dict[str, Any] | None = None) -> dict[str, Any]:
    """Keyword arguments for ``transformers.TrainingArguments``.

    Args:
        plan: The plan.
        deepspeed_config_file: Adds ``deepspeed=<path>`` so Trainer uses the same DeepSpeed JSON.
        eval_batch: Adds ``per_device_eval_batch_size`` (the probed evaluation batch, ``--eval``).
        strategy: The strategy the micro batch was probed under. FSDP adds ``fsdp`` and
            ``fsdp_config`` (version, block class); ZeRO without a DeepSpeed file adds ``deepspeed``
            as a dict with its stage and offload (Trainer fills the ``"auto"`` batch values).
        precision, grad_checkpointing: what the micro batch was probed with (``"bf16"``/``"fp16"``
            autocast, gradient checkpointing): written too, since the batch fits only with them.
        probed_zero: the ``zero_optimization`` values a ZeRO probe ran with (its bucket sizes), written
            into that dict: without them DeepSpeed takes its own defaults (a 500,000,000-element
            gradient bucket, 954 MiB a GPU in fp16), which the probe did not hold.

    ``strategy``, ``precision``, ``grad_checkpointing`` and ``probed_zero`` not given are read from
    ``plan.trained_with`` (a plan from :func:`~autobatch.find` carries what its batch was found under).

    Example:
        >>> from autobatch.planning.plan import Plan
        >>> hf_training_args(Plan(7, 2, gpus_per_node=16))
        {'per_device_train_batch_size': 7, 'gradient_accumulation_steps': 2}
    """
    found = trained_with(plan, strategy=strategy, precision=precision, grad_checkpointing=grad_checkpointing,
                         probed_zero=probed_zero)
    strategy, precision, probed_zero = found.strategy, found.precision, found.probed_zero
    grad_checkpointing = found.grad_checkpointing
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
                             "train_batch_size": "auto", "zero_optimization": zero_section(strategy, None, probed_zero)}
    if strategy is not None and strategy.is_fsdp:
        args.update(hf_fsdp(strategy))
    if precision in ("bf16", "fp16"):
        args[precision] = True
    if grad_checkpointing:
        args["gradient_checkpointing"] = True
    return args


def hf_fsdp(strategy: Strategy | str) -> dict[str, Any]:
    """``fsdp`` and ``fsdp_config`` as the installed transformers reads them: ``fsdp=True`` with the
    sharding in ``fsdp_config`` (current releases, which deprecate ``"full_shard auto_wrap"``), or
    that string for releases that predate it. Units: the probed block class, else by size.

    Example:
        >>> hf_fsdp(Strategy("fsdp2", unit="GPT2Block"))["fsdp_config"]["transformer_layer_cls_to_wrap"]
        ['GPT2Block']
    """
    strategy = as_strategy(strategy)  # a name ("zero3") as well as a Strategy
    version = 2 if strategy.name == "fsdp2" else 1
    config: dict[str, Any] = {"version": version}
    if strategy.unit:
        config["transformer_layer_cls_to_wrap"] = [strategy.unit]
    else:  # a model with no blocks was probed wrapped by size
        config["min_num_params"] = SIZE_BASED_MIN_PARAMS
    if strategy.offload == "params":  # FSDP2's CPUOffloadPolicy, through accelerate's cpu_offload
        config["cpu_offload"] = True
    if not _legacy_fsdp_form():
        config["reshard_after_forward"] = True if version == 2 else "full_shard"
        return {"fsdp": True, "fsdp_config": config}
    return {"fsdp": "full_shard auto_wrap", "fsdp_config": config}


def _legacy_fsdp_form() -> bool:
    """Whether the installed transformers predates ``fsdp=True`` (it then reads only the string form)."""
    import importlib.util

    if importlib.util.find_spec("transformers") is None:
        return False  # written for the current form
    from transformers import TrainingArguments

    return not hasattr(TrainingArguments, "_apply_legacy_fsdp_to_config")


def hf_flags(plan: Plan, deepspeed_config_file: str | os.PathLike[str] | None = None,
             strategy: Strategy | str | None = None, **training: Any) -> list[str]:
    """The same values as ``HfArgumentParser`` command-line flags.

    Example:
        >>> from autobatch.planning.plan import Plan
        >>> hf_flags(Plan(7, 2, gpus_per_node=16))
        ['--per_device_train_batch_size', '7', '--gradient_accumulation_steps', '2']
    """
    strategy = as_strategy(strategy)  # a name ("zero3") as well as a Strategy
    flags: list[str] = []
    for key, value in hf_training_args(plan, deepspeed_config_file, strategy=strategy, **training).items():
        if value is True:  # a switch: HfArgumentParser reads `--fsdp` alone as True
            flags.append(f"--{key}")
            continue
        flags += [f"--{key}", json.dumps(value) if isinstance(value, dict) else str(value)]
    return flags

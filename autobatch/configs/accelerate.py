"""accelerate config YAML for a plan: processes, machines and the distributed type.

Where gradient accumulation goes depends on the mode, because accelerate's config format has
no top-level key for it (its loader rejects unknown keys):

- with DeepSpeed, the YAML points at the DeepSpeed JSON (``deepspeed_config_file``) and the
  accumulation lives in that JSON. accelerate refuses ``gradient_accumulation_steps`` (and
  ``mixed_precision``) next to ``deepspeed_config_file``, so they are not repeated here; it also
  requires a ``zero_optimization`` section in the JSON, which new autobatch DeepSpeed files have;
- without DeepSpeed, the script passes ``Accelerator(gradient_accumulation_steps=N)``, or the
  launch line sets ``ACCELERATE_GRADIENT_ACCUMULATION_STEPS=N`` (which ``Accelerator`` reads);
  the written YAML says so in a comment and :func:`~autobatch.configs.launch.accelerate_command`
  sets the variable.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from .files import read_config, write_config

if TYPE_CHECKING:
    from pathlib import Path

    from ..planning.plan import Plan

__all__ = [
    "GRAD_ACCUM_ENV",
    "REFUSED_WITH_DEEPSPEED_FILE",
    "accelerate_config",
    "accelerate_comment",
    "read_accelerate_config",
    "write_accelerate_config",
]

# Read by accelerate.Accelerator in preference to its gradient_accumulation_steps argument.
GRAD_ACCUM_ENV = "ACCELERATE_GRADIENT_ACCUMULATION_STEPS"
# Keys of the YAML's deepspeed_config section that accelerate refuses next to deepspeed_config_file
# (they belong in the DeepSpeed JSON); a top-level mixed_precision is refused there too.
REFUSED_WITH_DEEPSPEED_FILE = (
    "gradient_accumulation_steps",
    "gradient_clipping",
    "zero_stage",
    "offload_optimizer_device",
    "offload_param_device",
    "offload_param_nvme_path",
    "offload_optimizer_nvme_path",
    "zero3_save_16bit_model",
)


def accelerate_config(
    plan: Plan,
    deepspeed_config_file: str | os.PathLike[str] | None = None,
    *,
    mixed_precision: str = "no",
    main_process_ip: str | None = None,
    main_process_port: int = 29500,
) -> dict[str, Any]:
    """An accelerate ``ClusterConfig`` mapping for the plan (what ``accelerate config`` would write).

    Args:
        plan: The plan; ``num_processes`` is every GPU in the job (``gpus_per_node × nodes``).
        deepspeed_config_file: Use DeepSpeed with this JSON (write it with
            :func:`~autobatch.configs.deepspeed.write_deepspeed_config`).
        mixed_precision: ``"no"``, ``"fp16"`` or ``"bf16"``; not written with DeepSpeed, whose
            JSON decides precision (accelerate refuses both).
        main_process_ip: Address of node 0, for multi-node jobs.
        main_process_port: Port on node 0, for multi-node jobs.

    Example:
        >>> from autobatch.planning.plan import Plan
        >>> accelerate_config(Plan(7, 2, gpus_per_node=16))["distributed_type"]
        'MULTI_GPU'
    """
    if deepspeed_config_file is not None:
        distributed_type = "DEEPSPEED"
    elif plan.num_processes > 1:
        distributed_type = "MULTI_GPU"
    else:
        distributed_type = "NO"
    config: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "debug": False,
        "distributed_type": distributed_type,
        "downcast_bf16": "no",
        "machine_rank": 0,
        "main_training_function": "main",
        "num_machines": plan.nodes,
        "num_processes": plan.num_processes,
        "rdzv_backend": "static",
        "same_network": True,
        "use_cpu": False,
    }
    if deepspeed_config_file is None:
        config["mixed_precision"] = mixed_precision
    else:
        # accelerate refuses mixed_precision next to a DeepSpeed file: fp16/bf16 are set in the JSON
        config["deepspeed_config"] = {
            "deepspeed_config_file": os.fspath(deepspeed_config_file),
            "zero3_init_flag": False,
        }
    if plan.nodes > 1:
        if main_process_ip is not None:
            config["main_process_ip"] = main_process_ip
        config["main_process_port"] = main_process_port
    return config


def accelerate_comment(plan: Plan, deepspeed_config_file: str | os.PathLike[str] | None = None) -> str:
    """The header comment written above the YAML: the arithmetic and where accumulation lives."""
    lines = [f"written by autobatch: {plan}"]
    if deepspeed_config_file is not None:
        lines.append(f"batch sizes and gradient accumulation ({plan.grad_accum}) live in {os.fspath(deepspeed_config_file)}")
    else:
        lines.append(
            f"gradient accumulation is not an accelerate config key: use Accelerator(gradient_accumulation_steps="
            f"{plan.grad_accum}) or {GRAD_ACCUM_ENV}={plan.grad_accum}, and DataLoader(batch_size={plan.micro_batch})"
        )
    if plan.nodes > 1:
        lines.append("multi-node: on each node pass --machine_rank and --main_process_ip to accelerate launch")
    return "\n".join(lines)


def read_accelerate_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Load an accelerate config (YAML or JSON); one-line :class:`AutobatchError` on failure.

    Example:
        >>> read_accelerate_config("accelerate.yaml")["num_processes"]  # doctest: +SKIP
        16
    """
    return read_config(path)


def write_accelerate_config(
    plan: Plan, path: str | os.PathLike[str], deepspeed_config_file: str | os.PathLike[str] | None = None, **kwargs: Any
) -> Path:
    """Write :func:`accelerate_config` to ``path`` with :func:`accelerate_comment` on top.

    Example:
        >>> write_accelerate_config(plan, "accelerate.yaml", "ds_config.json")  # doctest: +SKIP
    """
    config = accelerate_config(plan, deepspeed_config_file, **kwargs)
    return write_config(path, config, comment=accelerate_comment(plan, deepspeed_config_file))

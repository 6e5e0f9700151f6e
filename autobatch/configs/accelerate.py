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

import copy
import os
from typing import TYPE_CHECKING, Any

from ..strategy import SIZE_BASED_MIN_PARAMS, Strategy, as_strategy
from .files import read_config, write_config
from .trained import trained_with

if TYPE_CHECKING:
    from pathlib import Path

    from ..planning.plan import Plan

__all__ = [
    "GRAD_ACCUM_ENV",
    "REFUSED_WITH_DEEPSPEED_FILE",
    "accelerate_config",
    "accelerate_comment",
    "describe_changes",
    "fsdp_plugin",
    "merge_accelerate_config",
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
    mixed_precision: str | None = None,
    main_process_ip: str | None = None,
    main_process_port: int = 29500,
    strategy: Strategy | str | None = None,
) -> dict[str, Any]:
    """An accelerate ``ClusterConfig`` mapping for the plan (what ``accelerate config`` would write).

    Args:
        plan: The plan; ``num_processes`` is every GPU in the job (``gpus_per_node × nodes``).
        deepspeed_config_file: Use DeepSpeed with this JSON (write it with
            :func:`~autobatch.configs.deepspeed.write_deepspeed_config`).
        mixed_precision: ``"no"``, ``"fp16"`` or ``"bf16"``; not written with DeepSpeed, whose
            JSON decides precision (accelerate refuses both). Not given: the autocast precision
            of ``plan.trained_with``, else ``"no"``.
        main_process_ip: Address of node 0, for multi-node jobs.
        main_process_port: Port on node 0, for multi-node jobs.
        strategy: The strategy the micro batch was probed under: FSDP writes accelerate's FSDP
            plugin (``fsdp_version`` 1 or 2, one unit per ``strategy.unit`` block); ZeRO without a
            DeepSpeed file writes the DeepSpeed plugin with its stage, offload and accumulation
            (with a file, the stage lives in the file). Not given: ``plan.trained_with``'s.

    Example:
        >>> from autobatch.planning.plan import Plan
        >>> accelerate_config(Plan(7, 2, gpus_per_node=16))["distributed_type"]
        'MULTI_GPU'
    """
    found = trained_with(plan, strategy=strategy)
    strategy = found.strategy
    if mixed_precision is None:  # autocast as the batch was found; pure bf16 weights are the model's own
        mixed_precision = found.precision if found.precision in ("bf16", "fp16") else "no"
    zero = strategy is not None and strategy.is_deepspeed
    fsdp = strategy is not None and strategy.is_fsdp
    if deepspeed_config_file is not None or zero:
        distributed_type = "DEEPSPEED"
    elif fsdp:
        distributed_type = "FSDP"
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
    if deepspeed_config_file is None and zero:
        assert strategy is not None  # narrowed by ``zero``
        config["deepspeed_config"] = {
            "gradient_accumulation_steps": plan.grad_accum,
            "offload_optimizer_device": "cpu" if strategy.offload else "none",
            "offload_param_device": "cpu" if strategy.offload == "params" else "none",
            "zero3_init_flag": strategy.zero_stage == 3,
            "zero_stage": strategy.zero_stage,
        }
        config["mixed_precision"] = mixed_precision
    elif deepspeed_config_file is None:
        config["mixed_precision"] = mixed_precision
        if fsdp:
            assert strategy is not None  # narrowed by ``fsdp``
            config["fsdp_config"] = fsdp_plugin(strategy)
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


def fsdp_plugin(strategy: Strategy | str) -> dict[str, Any]:
    """accelerate's ``fsdp_config`` section for an FSDP strategy: full sharding, one unit per block.

    Example:
        >>> fsdp_plugin(Strategy("fsdp2", unit="GPT2Block"))["fsdp_transformer_layer_cls_to_wrap"]
        'GPT2Block'
    """
    strategy = as_strategy(strategy)  # a name ("zero3") as well as a Strategy
    version = 2 if strategy.name == "fsdp2" else 1
    section: dict[str, Any] = {
        "fsdp_version": version,
        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP" if strategy.unit else "SIZE_BASED_WRAP",
        "fsdp_cpu_ram_efficient_loading": True,
        "fsdp_offload_params": strategy.offload == "params",
        "fsdp_state_dict_type": "SHARDED_STATE_DICT",
    }
    if strategy.unit:
        section["fsdp_transformer_layer_cls_to_wrap"] = strategy.unit
    else:  # a model with no blocks was probed wrapped by size (autobatch.distributed.sharding.fsdp_units)
        section["fsdp_min_num_params"] = SIZE_BASED_MIN_PARAMS
    if version == 2:
        section["fsdp_reshard_after_forward"] = True
    else:
        section.update(fsdp_reshard_after_forward="FULL_SHARD", fsdp_backward_prefetch="BACKWARD_PRE",
                       fsdp_forward_prefetch=False, fsdp_sync_module_states=True, fsdp_use_orig_params=True)
    return section


def accelerate_comment(plan: Plan, deepspeed_config_file: str | os.PathLike[str] | None = None,
                       strategy: Strategy | str | None = None, *, in_section: bool = False) -> str:
    """The header comment written above the YAML: the arithmetic and where accumulation lives (``in_section``:
    the DeepSpeed plugin's ``deepspeed_config`` holds it)."""
    strategy = as_strategy(strategy)  # a name ("zero3") as well as a Strategy
    lines = [f"written by autobatch: {plan}"]
    if strategy is not None:
        lines.append(f"micro batch probed under strategy {strategy.label} (shards {strategy.sharded})")
    if deepspeed_config_file is not None:
        lines.append(f"batch sizes and gradient accumulation ({plan.grad_accum}) live in {os.fspath(deepspeed_config_file)}")
    elif in_section or (strategy is not None and strategy.is_deepspeed):
        lines.append(f"gradient accumulation ({plan.grad_accum}) is in deepspeed_config; DataLoader(batch_size={plan.micro_batch})")
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


def merge_accelerate_config(
    plan: Plan, existing: dict[str, Any], deepspeed_config_file: str | os.PathLike[str] | None = None,
    precision: str | None = None,
) -> dict[str, Any]:
    """``existing`` with only what the plan decides changed; every other key is kept.

    The plan decides ``num_processes``, ``num_machines``, the distributed type where the plan
    needs another (several processes, or DeepSpeed) and, with DeepSpeed, the file the YAML points
    at. ``mixed_precision``, ``gpu_ids``, ``main_process_port`` and the rest stay as the user set
    them, except what accelerate refuses next to ``deepspeed_config_file`` (it belongs in the JSON).

    Example:
        >>> from autobatch.planning.plan import Plan
        >>> merged = merge_accelerate_config(Plan(7, 2, gpus_per_node=3), {"mixed_precision": "bf16", "num_processes": 8})
        >>> merged["mixed_precision"], merged["num_processes"], merged["distributed_type"]
        ('bf16', 3, 'MULTI_GPU')
    """
    config = copy.deepcopy(existing)
    config["num_processes"] = plan.num_processes
    config["num_machines"] = plan.nodes
    ids = config.get("gpu_ids")
    if isinstance(ids, (str, int)) and str(ids).strip().lower() != "all" \
            and len([i for i in str(ids).split(",") if i.strip()]) != plan.gpus_per_node:
        config["gpu_ids"] = "all"  # the GPUs it listed are not the plan's: they would contradict num_processes
    kind = config.get("distributed_type")
    if deepspeed_config_file is not None:
        config["distributed_type"] = "DEEPSPEED"
        section = config.get("deepspeed_config")
        section = dict(section) if isinstance(section, dict) else {}
        for key in REFUSED_WITH_DEEPSPEED_FILE:
            section.pop(key, None)
        section["deepspeed_config_file"] = os.fspath(deepspeed_config_file)
        config["deepspeed_config"] = section
        config.pop("mixed_precision", None)  # accelerate refuses it next to a DeepSpeed file
    else:
        if kind in (None, "NO") and plan.num_processes > 1:
            config["distributed_type"] = "MULTI_GPU"
        section = config.get("deepspeed_config")
        if kind == "DEEPSPEED" and isinstance(section, dict) and "gradient_accumulation_steps" in section:
            config["deepspeed_config"] = {**section, "gradient_accumulation_steps": plan.grad_accum}
        if precision in ("bf16", "fp16"):
            config["mixed_precision"] = precision  # the batch was probed with it: it fits only with it
    if plan.nodes > 1:
        config.setdefault("main_process_port", 29500)
    return config


def describe_changes(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """What a merge changed, key by key (one level into nested sections), for the user to read.

    Example:
        >>> describe_changes({"a": 1, "s": {"x": 1}}, {"a": 2, "s": {"x": 1, "y": 3}})
        ['a 1 → 2', 's.y added (3)']
    """
    lines: list[str] = []

    def walk(old: dict[str, Any], new: dict[str, Any], prefix: str) -> None:
        for key in new:
            name = f"{prefix}{key}"
            if key not in old:
                lines.append(f"{name} added ({new[key]!r})")
            elif isinstance(old[key], dict) and isinstance(new[key], dict):
                walk(old[key], new[key], f"{name}.")
            elif old[key] != new[key]:
                lines.append(f"{name} {old[key]!r} → {new[key]!r}")
        lines.extend(f"{prefix}{key} removed" for key in old if key not in new)

    walk(before, after, "")
    return lines


def write_accelerate_config(
    plan: Plan, path: str | os.PathLike[str], deepspeed_config_file: str | os.PathLike[str] | None = None, *,
    precision: str | None = None, **kwargs: Any
) -> Path:
    """Write :func:`accelerate_config` to ``path`` with :func:`accelerate_comment` on top.

    An existing file is merged instead (:func:`merge_accelerate_config`): only the keys the plan
    decides change, the user's others are kept. ``precision`` (``"bf16"``/``"fp16"``, what the
    batch was probed with) becomes ``mixed_precision`` where no DeepSpeed file decides it. It and
    ``strategy``, not given, are read from ``plan.trained_with``.

    Example:
        >>> write_accelerate_config(plan, "accelerate.yaml", "ds_config.json")  # doctest: +SKIP
    """
    found = trained_with(plan, strategy=kwargs.get("strategy"), precision=precision)
    precision = found.precision
    if found.strategy is not None:
        kwargs["strategy"] = found.strategy
    if precision in ("bf16", "fp16") and deepspeed_config_file is None:  # (the DeepSpeed JSON says it otherwise)
        kwargs.setdefault("mixed_precision", precision)
    config = accelerate_config(plan, deepspeed_config_file, **kwargs)
    if os.path.exists(path):
        existing = read_config(path)
        asked = {key: config[key] for key in kwargs if key in config and key != "mixed_precision"}  # set explicitly
        merged = merge_accelerate_config(plan, existing, deepspeed_config_file, precision)
        if kwargs.get("strategy") is not None:  # the probed strategy decides how training shards
            sharding = _sharding(existing, config)
            merged = {k: v for k, v in merged.items() if k not in _ENGINES or k in sharding}
            asked.update(sharding)
        config = {**merged, **asked}
    section = config.get("deepspeed_config")
    in_section = isinstance(section, dict) and "gradient_accumulation_steps" in section
    comment = accelerate_comment(plan, deepspeed_config_file, kwargs.get("strategy"), in_section=in_section)
    return write_config(path, config, comment=comment)


_ENGINES = ("fsdp_config", "deepspeed_config")  # one trains; the other's section is left from another plan


def _sharding(existing: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """The probed strategy's keys over an existing file's: its section (``fsdp_config``/``deepspeed_config``)
    keeps the user's other keys (gradient_clipping, zero3_save_16bit_model, …), a DeepSpeed file it named gives
    way to the plugin's own keys (accelerate takes one or the other), and the other engine's section goes."""
    sharding = {"distributed_type": config["distributed_type"]} if "distributed_type" in config else {}
    for key in _ENGINES:
        if key not in config:
            continue
        old = existing.get(key)
        old = {k: v for k, v in old.items() if k != "deepspeed_config_file"} if isinstance(old, dict) else {}
        sharding[key] = {**old, **config[key]} if "deepspeed_config_file" not in config[key] else config[key]
    return sharding

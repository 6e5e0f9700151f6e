"""The files a request writes, before the first trial: each its own, and each training as the probe will.

``find --deepspeed ds.json`` on an existing ZeRO-2 file merges the batch into it and keeps its stage,
so a batch found unsharded would be trained under ZeRO-2; one found in fp32 would be trained in the
bf16 the file enables. A file that shards, enables a precision or checkpoints activations where the
request says nothing of it is named here with the flags that probe as it trains. A strategy or
precision the request does give is written into the files (the batch was found so), so it is no
problem. An accelerate or HF file that trains from a DeepSpeed file needs that file written too: the
batch lives there.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..configs import read_config
from ..errors import AutobatchError, option
from ..strategy import Strategy, strategy_from_accelerate, strategy_from_deepspeed
from .hf import hf_strategy
from .views import ds_precision

__all__ = ["output_problems", "same_file_problems"]

_KINDS = ("deepspeed", "accelerate", "hf")  # the files a batch is merged into


def output_problems(outputs: Mapping[str, Any], strategies: tuple[Strategy, ...] | None, precision: str | None, *,
                    probed: bool, checkpointing: bool = False, simulated: bool = False) -> list[str]:
    """Every problem of the files a request writes (``outputs``: option name → path or ``None``), before the
    first trial: two options naming one file, a DeepSpeed file an accelerate or HF file trains from that is not
    written (unless the plan trains with FSDP or DDP instead, which replaces it), and (``probed``) a file that trains
    otherwise than the probe: one that shards where ``strategies`` is ``None`` (no strategy given), enables
    bf16/fp16 where ``precision`` is ``None`` (fp32), or checkpoints activations where the probe does not
    (``checkpointing``). ``simulated``: the probe runs on a CPU budget, which cannot hold an offload's host apart,
    so a file that offloads is to be estimated instead. Each existing file is read once."""
    existing = {kind: config for kind in _KINDS if (config := _existing(outputs.get(kind))) is not None}
    keeps_files = strategies is None or any(s.is_deepspeed for s in strategies)  # FSDP, ddp: the file's link goes
    return (same_file_problems(outputs) + (_named_deepspeed_problems(outputs, existing) if keeps_files else [])
            + (_trained_otherwise(outputs, existing, strategies, precision, checkpointing, simulated) if probed else []))


def same_file_problems(outputs: Mapping[str, Any]) -> list[str]:
    """One line for each two options of ``outputs`` (option name → path or ``None``) that name one file."""
    given = [(name, os.path.realpath(os.fspath(path))) for name, path in outputs.items() if path is not None]
    return [f"{option(other)} and {option(name)} name the same file ({os.fspath(outputs[name])!r}); give each its "
            "own path" for i, (name, path) in enumerate(given) for other, other_path in given[:i] if path == other_path]


def _existing(path: Any) -> dict[str, Any] | None:
    if path is None or not Path(path).is_file():
        return None
    try:
        config = read_config(path)
    except AutobatchError:
        return None  # unreadable: the writer says so, with its own line
    return config if isinstance(config, Mapping) else None


def _named_deepspeed(kind: str, config: Mapping[str, Any]) -> str | None:
    """The DeepSpeed file an accelerate (``deepspeed_config.deepspeed_config_file``) or HF (``deepspeed``)
    file trains from, or ``None``."""
    section = config.get("deepspeed_config") if kind == "accelerate" else config if kind == "hf" else None
    named = section.get("deepspeed_config_file" if kind == "accelerate" else "deepspeed") if isinstance(
        section, Mapping) else None
    return named if isinstance(named, str) and named.strip() else None


def _named_deepspeed_problems(outputs: Mapping[str, Any], existing: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """An existing accelerate or HF file that trains from a DeepSpeed file, where no ``deepspeed`` output is
    given: the batch lives in that file, so the plan written beside it would never reach the job."""
    if outputs.get("deepspeed") is not None:
        return []
    return [f"{outputs[kind]} trains from the DeepSpeed file {named}, which holds the batch, so a plan written "
            f"beside it would not reach the job; add {option('deepspeed')} {named}"
            for kind, config in existing.items() if (named := _named_deepspeed(kind, config)) is not None]


def _trains(kind: str, config: Mapping[str, Any]) -> tuple[Strategy | None, str | None, str, bool]:
    """The strategy, the precision (``"bf16"``/``"fp16"``; ``None``: fp32 or left to the launcher) and the
    keys that say so, and whether it checkpoints activations, as ``config`` trains."""
    if kind == "deepspeed":
        precision = next((p for p in ("bf16", "fp16") if ds_precision(config, p)), None)
        return strategy_from_deepspeed(config), precision, "zero_optimization.stage", False
    named = _named_deepspeed(kind, config)
    inner = _existing(named) if named is not None else None
    if kind == "accelerate":
        mixed = str(config.get("mixed_precision", "no")).lower()
        kind_key = {"FSDP": "fsdp_config", "DEEPSPEED": "deepspeed_config"}.get(str(config.get("distributed_type")).upper())
        key = f"{named}'s zero_optimization.stage" if inner is not None else kind_key or "distributed_type"
        fsdp = config.get("fsdp_config")
        checkpoints = isinstance(fsdp, Mapping) and str(fsdp.get("fsdp_activation_checkpointing")).lower() == "true"
        return strategy_from_accelerate(config, inner), mixed if mixed in ("bf16", "fp16") else None, key, checkpoints
    ds = config.get("deepspeed")
    ds = ds if isinstance(ds, Mapping) else inner
    found = hf_strategy(config)
    strategy = found[0] if found is not None else strategy_from_deepspeed(ds) if ds is not None else None
    precision = next((p for p in ("bf16", "fp16") if config.get(p) is True), None)
    return strategy, precision, "fsdp" if found is not None else "deepspeed", config.get("gradient_checkpointing") is True


def _trained_otherwise(outputs: Mapping[str, Any], existing: Mapping[str, Mapping[str, Any]],
                       strategies: tuple[Strategy, ...] | None, precision: str | None, checkpointing: bool,
                       simulated: bool) -> list[str]:
    """One line for each existing file that trains otherwise than the probe (see :func:`output_problems`)."""
    problems = []
    for kind, config in existing.items():
        if kind == "accelerate" and _named_deepspeed(kind, config) is not None and outputs.get("deepspeed"):
            continue  # it trains from the --deepspeed file, whose own line says it
        strategy, enabled, key, checkpoints = _trains(kind, config)
        trains, found, flags = [], [], []
        if strategies is None and strategy is not None and strategy.name != "ddp":
            trains.append(f"with {strategy.label} ({key})")
            found.append("unsharded")
            flags.append(f"{option('strategy')} {strategy.name}"
                         + (f" {option('offload')} {strategy.offload}" if strategy.offload else ""))
        if precision is None and enabled is not None:
            trains.append(f"in {enabled}")
            found.append("in fp32")
            flags.append(f"{option('dtype')} {enabled}")
        if checkpoints and not checkpointing:
            trains.append("with gradient checkpointing")
            found.append("without it")
            flags.append(option("grad_checkpointing"))
        if trains:
            tail = ""
            if strategies is None and simulated and strategy is not None and strategy.offload:
                tail = " and estimate it (`autobatch estimate`): a CPU budget cannot hold the offload's host apart"
            elif found == ["in fp32"]:
                tail = f", or turn {enabled} off in the file"
            problems.append(f"{outputs[kind]} trains {' '.join(trains)}, but its batch would be found "
                            f"{' '.join(found)}; add {' '.join(flags)}{tail}")
    return problems

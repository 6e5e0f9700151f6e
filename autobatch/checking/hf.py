"""The HF ``TrainingArguments`` a setup trains with (``check --hf args.json``).

What ``find --hf`` writes, read back: the micro batch and accumulation (the Trainer's own defaults,
8 and 1, where a key is absent), the DeepSpeed config it names (a path or a dict), how it shards
with ``fsdp``, and the two combinations the Trainer refuses: ``fp16`` with ``bf16``, and ``fsdp``
with ``deepspeed``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..strategy import FSDP_SHARDINGS, Strategy
from .problems import _Collector

__all__ = ["HF_MICRO", "HF_ACCUM", "hf_batch", "hf_deepspeed", "hf_refusals", "hf_strategy"]

HF_MICRO, HF_ACCUM = "per_device_train_batch_size", "gradient_accumulation_steps"
_DEFAULTS = {HF_MICRO: 8, HF_ACCUM: 1}  # TrainingArguments' own, where the file leaves a key out


def hf_batch(c: _Collector, label: str, args: Mapping[str, Any]) -> tuple[int | None, int | None]:
    """The micro batch and accumulation the Trainer takes from ``args`` (its defaults where absent)."""
    micro, accum = (c.positive_int(key, args.get(key, _DEFAULTS[key]), label) for key in (HF_MICRO, HF_ACCUM))
    return micro, accum


def _on(value: Any) -> bool:
    return value is True or (isinstance(value, str) and value.strip().lower() in ("true", "1", "yes"))


def _fsdp_options(args: Mapping[str, Any]) -> list[str] | None:
    """The ``fsdp`` options (``["full_shard", "auto_wrap"]``), ``[]`` for ``fsdp=True``, ``None`` when off."""
    fsdp = args.get("fsdp")
    if fsdp is None or fsdp is False or fsdp == "" or fsdp == []:
        return None
    if fsdp is True or _on(fsdp):
        return []
    words = fsdp.split() if isinstance(fsdp, str) else [str(w) for w in fsdp] if isinstance(fsdp, list) else []
    return [w.strip().lower() for w in words]


def hf_deepspeed(args: Mapping[str, Any]) -> str | Mapping[str, Any] | None:
    """The DeepSpeed config ``args`` names: a path, an inline dict, or ``None``."""
    value = args.get("deepspeed")
    return value if isinstance(value, (str, Mapping)) and value else None


def hf_refusals(c: _Collector, label: str, args: Mapping[str, Any]) -> None:
    """What ``TrainingArguments`` or the Trainer refuses at start-up, in their words."""
    if _on(args.get("fp16")) and _on(args.get("bf16")):
        c.add("hf-refuses", f"the Trainer trains in one of fp16 and bf16, but {label} sets both; TrainingArguments "
              "stops with 'At most one of fp16 and bf16 can be True, but not both'",
              "keep the one the micro batch was probed with (find --dtype bf16 --hf … writes bf16 alone)")
    if _fsdp_options(args) is not None and hf_deepspeed(args) is not None:
        c.add("hf-refuses", f"the Trainer shards with one of fsdp and deepspeed, but {label} sets both; it stops "
              "with 'Using --fsdp xxx together with --deepspeed is not possible, deactivate one of those flags'",
              "keep the one the micro batch was probed under (find --strategy … --hf … writes one)")


def hf_strategy(args: Mapping[str, Any]) -> tuple[Strategy, str] | None:
    """How ``args`` shards with FSDP: the strategy (``fsdp1``/``fsdp2`` by ``fsdp_config.version``) and
    its sharding, one of :data:`~autobatch.strategy.FSDP_SHARDINGS`; ``None`` without ``fsdp``.

    The sharding is an ``fsdp`` option (``"shard_grad_op auto_wrap"``) or, in the current form
    (``fsdp=True``), ``fsdp_config.reshard_after_forward``: a name under FSDP1, a bool under FSDP2
    (``false`` keeps the parameters gathered as ``SHARD_GRAD_OP`` does).

    Example:
        >>> hf_strategy({"fsdp": "shard_grad_op auto_wrap"})
        (Strategy(name='fsdp1', offload=None, unit=None), 'SHARD_GRAD_OP')
    """
    options = _fsdp_options(args)
    if options is None:
        return None
    config = args.get("fsdp_config")
    config = config if isinstance(config, Mapping) else {}
    name = "fsdp2" if str(config.get("version", 1)) == "2" else "fsdp1"
    offload = "params" if "offload" in options or _on(config.get("cpu_offload")) else None
    unit = config.get("transformer_layer_cls_to_wrap")
    unit = unit[0] if isinstance(unit, list) and len(unit) == 1 else unit if isinstance(unit, str) else None
    sharding = next((w.upper() for w in options if w.upper() in FSDP_SHARDINGS), None)
    if sharding is None:
        reshard = config.get("reshard_after_forward", True if name == "fsdp2" else "full_shard")
        if name == "fsdp2":
            sharding = "SHARD_GRAD_OP" if str(reshard).strip().lower() == "false" else "FULL_SHARD"
        else:
            sharding = str(reshard).strip().upper() if str(reshard).strip().upper() in FSDP_SHARDINGS else "FULL_SHARD"
    return Strategy(name, offload=offload, unit=unit), sharding

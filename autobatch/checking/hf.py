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
from .views import ds_precision

__all__ = ["HF_MICRO", "HF_ACCUM", "hf_batch", "hf_deepspeed", "hf_refusals", "hf_strategy", "hf_against_deepspeed",
           "hf_against_others"]

_FSDP_OPTIONS = ("full_shard", "shard_grad_op", "no_shard", "hybrid_shard", "hybrid_shard_zero2", "offload", "auto_wrap")

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


def _unknown_keys(args: Mapping[str, Any]) -> list[str] | None:
    """The keys ``TrainingArguments`` takes no argument for; ``None`` where transformers is not installed."""
    import dataclasses
    import importlib.util

    if importlib.util.find_spec("transformers") is None:
        return None
    from transformers import TrainingArguments

    known = {f.name for f in dataclasses.fields(TrainingArguments) if f.init}
    return [key for key in args if key not in known]


def hf_refusals(c: _Collector, label: str, args: Mapping[str, Any]) -> None:
    """What ``TrainingArguments`` or the Trainer refuses at start-up, in their words."""
    unknown = _unknown_keys(args)
    if unknown is None:
        c.note(f"transformers is not installed: the keys of {label} were not checked against TrainingArguments "
               "(pip install 'autobatch[hf]')")
    elif unknown:
        c.add("hf-refuses", f"TrainingArguments takes only its own keys, but {label} has {', '.join(map(repr, unknown))}; "
              "it stops with 'TypeError: … got an unexpected keyword argument'",
              "drop or rename them (per_gpu_train_batch_size is per_device_train_batch_size now)")
    options = _fsdp_options(args) or []
    for option in options:
        if option not in _FSDP_OPTIONS:
            c.add("hf-refuses", f"fsdp takes the options {', '.join(_FSDP_OPTIONS)}, but {label} has {option!r}; "
                  f"TrainingArguments stops with 'Unknown `fsdp` option: {option}'",
                  "write fsdp as find --strategy fsdp1|fsdp2 --hf … does")
    if _on(args.get("fp16")) and _on(args.get("bf16")):
        c.add("hf-refuses", f"the Trainer trains in one of fp16 and bf16, but {label} sets both; TrainingArguments "
              "stops with 'At most one of fp16 and bf16 can be True, but not both'",
              "keep the one the micro batch was probed with (find --dtype bf16 --hf … writes bf16 alone)")
    if _fsdp_options(args) is not None and hf_deepspeed(args) is not None:
        c.add("hf-refuses", f"the Trainer shards with one of fsdp and deepspeed, but {label} sets both; it stops "
              "with 'Using --fsdp xxx together with --deepspeed is not possible, deactivate one of those flags'",
              "keep the one the micro batch was probed under (find --strategy … --hf … writes one)")


def _default_fsdp_version() -> int:
    """The FSDP version the installed transformers takes where ``fsdp_config`` names none: 2 from
    transformers 5 on (``fsdp_config.get("version", 2)``), 1 before; 2 where it is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        major = version("transformers").split(".")[0]
    except PackageNotFoundError:
        return 2
    return 2 if not major.isdigit() or int(major) >= 5 else 1


def hf_strategy(args: Mapping[str, Any]) -> tuple[Strategy, str] | None:
    """How ``args`` shards with FSDP: the strategy (``fsdp1``/``fsdp2`` by ``fsdp_config.version``, else
    the installed transformers' default) and its sharding, one of
    :data:`~autobatch.strategy.FSDP_SHARDINGS`; ``None`` without ``fsdp``.

    The sharding is an ``fsdp`` option (``"shard_grad_op auto_wrap"``) or, in the current form
    (``fsdp=True``), ``fsdp_config.reshard_after_forward``: a name under FSDP1, a bool under FSDP2
    (``false`` keeps the parameters gathered as ``SHARD_GRAD_OP`` does).

    Example:
        >>> hf_strategy({"fsdp": "shard_grad_op auto_wrap", "fsdp_config": {"version": 1}})
        (Strategy(name='fsdp1', offload=None, unit=None), 'SHARD_GRAD_OP')
    """
    options = _fsdp_options(args)
    if options is None:
        return None
    config = args.get("fsdp_config")
    config = config if isinstance(config, Mapping) else {}
    name = "fsdp2" if str(config.get("version", _default_fsdp_version())) == "2" else "fsdp1"
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


def hf_against_deepspeed(c: _Collector, label: str, args: Mapping[str, Any], ds_label: str, ds: Mapping[str, Any]) -> None:
    """The DeepSpeed config's fp16 and bf16 against the Trainer's: a value set (not "auto") that
    differs stops the Trainer ('Please correct the following DeepSpeed config values that mismatch
    TrainingArguments values')."""
    for key in ("fp16", "bf16"):
        theirs = ds_precision(ds, key)
        if theirs is None:
            continue
        ours = _on(args.get(key)) or _on(args.get(f"{key}_full_eval"))
        if theirs != ours:
            c.add("hf-mismatch", f"the Trainer takes {key}.enabled from its arguments, but {ds_label} sets it "
                  f"{str(theirs).lower()} and {label} has {key}={str(ours).lower()}; it stops with 'Please correct the "
                  "following DeepSpeed config values that mismatch TrainingArguments values'",
                  f"set {key} alike in both, or \"enabled\": \"auto\" in {ds_label}", key=key)


def hf_against_others(c: _Collector, label: str, args: Mapping[str, Any], deepspeed: Any,
                      accelerate: tuple[str, Mapping[str, Any]] | None) -> None:
    """How the arguments shard against the DeepSpeed file and the accelerate config given beside them:
    the Trainer trains with what its arguments name, whatever the other files say."""
    fsdp, named = _fsdp_options(args) is not None, hf_deepspeed(args) is not None
    mine = "FSDP" if fsdp else "DeepSpeed" if named else "neither FSDP nor DeepSpeed"
    if deepspeed is not None and not named:
        c.add("hf-mismatch", f"the Trainer uses a DeepSpeed config only where its arguments name one, but {label} "
              f"names none (it trains with {mine}), so {deepspeed if isinstance(deepspeed, str) else 'the one given'} "
              "goes unused", f"set deepspeed in {label} to it, or drop it")
    if accelerate is not None and (fsdp or named):  # arguments that name neither take accelerate's plugin
        kind = str(accelerate[1].get("distributed_type", "")).upper()
        theirs = "FSDP" if kind == "FSDP" else "DeepSpeed" if kind == "DEEPSPEED" else None
        if theirs is not None and theirs != mine:
            c.add("hf-mismatch", f"{label} and {accelerate[0]} must shard one way, but {label} trains with {mine} and "
                  f"{accelerate[0]} with {theirs}", "write both from one plan: find --strategy … --hf … --accelerate …")

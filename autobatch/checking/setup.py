"""Check a proposed setup before launch: every batch-size problem at once, each with its fix.

A setup comes from numbers (target, micro batch, accumulation, GPUs per node, nodes) and/or
files (a DeepSpeed JSON, an accelerate YAML). :func:`check_setup` reads them the way the
libraries will, derives what they would derive, and collects every problem (it never stops at
the first), so one run tells the user everything to fix:

- per-device batch below 1 or fractional (field report 1: the ZeroDivisionError in metrics);
- global batch ≠ micro × accumulation × world size (DeepSpeed's start-up assertion), including
  what DeepSpeed derives by flooring when the file gives only some of the three keys;
- the DeepSpeed file or accelerate config disagreeing with the numbers given (field report 3);
- a BatchNorm model with one sample per GPU, or a global batch that does not split evenly
  across GPUs (field report 4).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..configs.deepspeed import (
    BATCH_KEYS,
    ZERO_OPTIMIZATION,
)
from ..modelinfo import per_gpu_statistics
from ..strategy import Strategy, fsdp_sharding, strategy_from_accelerate, strategy_from_deepspeed
from .hf import (
    HF_ACCUM,
    HF_MICRO,
    hf_against_deepspeed,
    hf_against_others,
    hf_batch,
    hf_deepspeed,
    hf_refusals,
    hf_strategy,
)
from .lengths import check_probed_length
from .problems import _AUTO, CheckResult, _Collector, _fix_for
from .strategies import Read, check_strategy
from .views import (
    _accelerate_deepspeed,
    _accelerate_topology,
    _Batch,
    _compare,
    _deepspeed_values,
    _deepspeed_auto_view,
    _deepspeed_open_view,
    _precision_view,
    _zero_stage_view,
    _deepspeed_view,
    _fill_auto,
    _flags_view,
)

if TYPE_CHECKING:
    import torch

__all__ = ["check_setup"]


def check_setup(
    *,
    target: int | None = None,
    micro_batch: int | None = None,
    grad_accum: int | None = None,
    gpus_per_node: int | None = None,
    nodes: int | None = None,
    model_parallel: int = 1,
    deepspeed: str | os.PathLike[str] | Mapping[str, Any] | None = None,
    accelerate: str | os.PathLike[str] | Mapping[str, Any] | None = None,
    hf: str | os.PathLike[str] | Mapping[str, Any] | None = None,
    model: torch.nn.Module | None = None,
    batchnorm: bool | None = None,
    seq_len: int | None = None,
    probed: Sequence[Mapping[str, Any]] | None = None,
    probed_strategy: str | Strategy | None = None,
    seq_len_stated: bool = True,
) -> CheckResult:
    """Find every batch-size problem in a proposed setup, before launch.

    Args:
        target: Global batch per optimizer step.
        micro_batch: Per-GPU batch (``per_device_train_batch_size``).
        grad_accum: Gradient accumulation steps.
        gpus_per_node: GPUs on each node (not the total). Defaults to the accelerate config's
            ``num_processes / num_machines``, else 1.
        nodes: Number of nodes. Defaults to the accelerate config's ``num_machines``, else 1.
        model_parallel: Tensor × pipeline parallel degree (the data-parallel world size is
            ``gpus_per_node × nodes / model_parallel``).
        deepspeed: DeepSpeed JSON path or mapping. Without it, the file named by the accelerate
            config's ``deepspeed_config_file`` is checked.
        accelerate: accelerate config YAML path or mapping.
        hf: HF ``TrainingArguments`` values (JSON or YAML path, or mapping), as ``find --hf`` writes
            them: its micro batch and accumulation (the Trainer's defaults where absent), the
            DeepSpeed config it names, how it shards, and what the Trainer refuses.
        model: The model; a BatchNorm layer requires at least 2 samples per GPU.
        batchnorm: Say the model has BatchNorm without passing it.
        seq_len: The longest sequence the setup trains on; with ``probed`` (the model's cached
            probes, ``[{"seq_len", "max_batch", "safe_batch", "device"}, …]``) a micro batch
            never probed at this length, or above its probed max, is a problem.
        seq_len_stated: False where ``seq_len`` is the model's own length rather than the user's: probes
            at other lengths only are then a note, not a problem.
        probed_strategy: The strategy the micro batch was probed under (``find --strategy``); a
            DeepSpeed stage or accelerate plugin that trains otherwise is a problem.

    Returns:
        A :class:`CheckResult`; ``result.ok`` is False when any problem was found. Unreadable or
        malformed files are problems in the result, not exceptions.

    Example:
        >>> result = check_setup(target=224, micro_batch=7, grad_accum=3, gpus_per_node=16)
        >>> [p.code for p in result.problems]
        ['batch-identity']
    """
    c = _Collector()
    given = _Batch(
        c.positive_int("target", target),
        c.positive_int("micro_batch", micro_batch, fix="set micro_batch to at least 1 sample per GPU"),
        c.positive_int("grad_accum", grad_accum),
    )
    flag_gpus = c.positive_int("gpus_per_node", gpus_per_node)
    flag_nodes = c.positive_int("nodes", nodes)
    mp = c.positive_int("model_parallel", model_parallel)
    check_probed_length(c, given.micro, seq_len, probed, seq_len_stated)

    layers: tuple[str, ...] = ("BatchNorm",) if batchnorm else ()
    if model is not None:
        from ..modelinfo import batchnorm_layers  # torch is imported only when a model is checked

        layers = tuple(dict.fromkeys(layers + batchnorm_layers(model)))
    bn = bool(layers)
    min_micro = 2 if bn else 1

    # --- topology: arguments first, then the accelerate config, then one GPU -------------------
    acc_loaded = c.load(accelerate, "accelerate config")
    acc_gpus = acc_nodes = None
    if acc_loaded is not None:
        acc_gpus, acc_nodes = _accelerate_topology(c, *acc_loaded)
    gpus = flag_gpus or acc_gpus
    node_count = flag_nodes or acc_nodes
    # an accelerate topology that does not add up gives no world to do the batch's arithmetic on
    unknown = gpus is None and any(p.code == "accelerate-topology" for p in c.problems)
    if gpus is None and gpus_per_node is None and not unknown:
        c.note("no GPU count given: assumed 1 GPU per node")
    gpus, node_count = gpus or 1, node_count or 1
    if acc_loaded is not None:
        label, acc = acc_loaded
        for name, ours, theirs in (("GPUs per node", flag_gpus, acc_gpus), ("nodes", flag_nodes, acc_nodes)):
            if ours is not None and theirs is not None and ours != theirs:
                c.add(
                    "accelerate-mismatch",
                    f"{label} must agree with the arguments, but it gives {theirs} {name} "
                    f"(num_processes={acc.get('num_processes')}, num_machines={acc.get('num_machines', 1)}) "
                    f"and the arguments give {ours}",
                    "set num_processes to the total GPU count and num_machines to the node count",
                    **{name: theirs},
                )

    world = None
    if mp is not None and not unknown:
        if (gpus * node_count) % mp:
            c.add(
                "model-parallel",
                f"the model-parallel degree must divide the GPU count, but {mp} does not divide {gpus * node_count} "
                f"({gpus} per node × {node_count} node{'s' if node_count != 1 else ''})",
                "use a tensor × pipeline degree that divides the number of GPUs",
                model_parallel=mp, gpus=gpus * node_count,
            )
        else:
            world = gpus * node_count // mp
    # --- DeepSpeed file: given, or named by the accelerate config -------------------------------
    ds_loaded = c.load(deepspeed, "DeepSpeed config")
    if acc_loaded is not None:
        acc_ds_file = (acc_loaded[1].get("deepspeed_config") or {}).get("deepspeed_config_file")
        if acc_ds_file and deepspeed is None:
            c.note(f"checked the DeepSpeed config {acc_ds_file} named in {acc_loaded[0]}")
            ds_loaded = c.load(acc_ds_file, "DeepSpeed config")
        elif acc_ds_file and not isinstance(deepspeed, Mapping) and os.path.realpath(acc_ds_file) != os.path.realpath(deepspeed):
            c.add(
                "accelerate-mismatch",
                f"{acc_loaded[0]} must name the DeepSpeed file being used, but it names {acc_ds_file} "
                f"and the DeepSpeed file given is {os.fspath(deepspeed)}",
                f"set deepspeed_config_file in {acc_loaded[0]} to {os.fspath(deepspeed)}",
            )
        _accelerate_deepspeed(c, *acc_loaded, *(ds_loaded or (None, None)))
    hf_loaded = c.load(hf, "HF TrainingArguments")
    if hf_loaded is not None:
        hf_refusals(c, *hf_loaded)
        named = hf_deepspeed(hf_loaded[1])
        if named is not None and ds_loaded is None:
            c.note(f"checked the DeepSpeed config {named if isinstance(named, str) else '(a dict)'} named in {hf_loaded[0]}")
            ds_loaded = c.load(named, "DeepSpeed config")
        elif isinstance(named, str) and isinstance(deepspeed, (str, os.PathLike)) \
                and os.path.realpath(named) != os.path.realpath(deepspeed):
            c.add("hf-mismatch", f"{hf_loaded[0]} must name the DeepSpeed file being used, but it names {named} "
                  f"and the DeepSpeed file given is {os.fspath(deepspeed)}",
                  f"set deepspeed in {hf_loaded[0]} to {os.fspath(deepspeed)}")
        hf_against_others(c, *hf_loaded, deepspeed, acc_loaded)
        if ds_loaded is not None:
            hf_against_deepspeed(c, *hf_loaded, *ds_loaded)

    if probed_strategy is not None:
        _check_strategy(c, probed_strategy, acc_loaded, ds_loaded, hf_loaded)

    if world is None:
        return CheckResult(tuple(c.problems), tuple(c.notes), *given.numbers(), None, gpus, node_count, mp)

    topo = (gpus, node_count, mp)
    slots = ("target", "micro", "accum")
    values = None
    if ds_loaded is not None:
        ds_label, ds = ds_loaded
        if ZERO_OPTIMIZATION not in ds and acc_loaded is None:
            c.note(
                f"{ds_label} has no {ZERO_OPTIMIZATION} section: plain deepspeed.initialize accepts that, "
                f'HF Trainer and accelerate refuse it (add "{ZERO_OPTIMIZATION}": {{"stage": 0}})'
            )
        _zero_stage_view(c, ds_label, ds)
        _precision_view(c, ds_label, ds)
        values = _deepspeed_values(c, ds_label, ds)
    determined = sum(n is not None for n in given.numbers()) >= 2 and (given.target, given.micro) != (None, None)
    hf_numbers: dict[str, int | None] = {}
    if hf_loaded is not None:  # the Trainer's arguments, which fill a DeepSpeed file's "auto" at launch
        hf_numbers = dict(zip(("micro", "accum"), hf_batch(c, *hf_loaded)))
        if not determined:
            default = " (the Trainer's default: the file leaves it out)"
            given = _taken(c, given, hf_loaded[0], {key: (hf_numbers[slot], "" if key in hf_loaded[1] else default)
                                                    for slot, key in (("micro", HF_MICRO), ("accum", HF_ACCUM))})
            determined = True
    open_gap = not determined and (given.target is not None or given.micro is not None)
    if values is not None and open_gap:
        # When the arguments alone would need an assumption (accumulation 1), the DeepSpeed file
        # fills the gap instead: `--target 512 --deepspeed ds.json` is checked with the file's
        # micro batch and accumulation. Arguments that determine all three are compared instead.
        given = _taken(c, given, ds_loaded[0], {key: (values[key], "") for key in BATCH_KEYS})  # type: ignore[index]
    acc_accum = None  # accelerate's DeepSpeed plugin holds the accumulation too
    if acc_loaded is not None:
        section = acc_loaded[1].get("deepspeed_config") or {}
        acc_accum = section.get("gradient_accumulation_steps") if isinstance(section, Mapping) else None
        acc_accum = None if acc_accum == _AUTO else c.positive_int("gradient_accumulation_steps", acc_accum,
                                                                    acc_loaded[0])
        if open_gap:  # as a DeepSpeed file's fills the gap
            given = _taken(c, given, acc_loaded[0], {"gradient_accumulation_steps": (acc_accum, "")})

    # Count problems before the flags view so the DeepSpeed view does not repeat its arithmetic.
    before = len(c.problems)
    flags = _flags_view(c, given, world, topo, min_micro)
    flags_problem = given.numbers() if len(c.problems) > before else None

    resolved = flags
    micros = {flags.micro}  # every per-GPU batch some launcher would use, for the BatchNorm rule
    if ds_loaded is not None and values is not None:
        ds_label = ds_loaded[0]
        explicit = {slot: v for slot, v in zip(slots, values.values()) if v != _AUTO}
        _compare(c, "deepspeed-mismatch", ds_label, explicit, flags, dict(zip(slots, BATCH_KEYS)))  # type: ignore[arg-type]
        if _fill_auto(c, ds_label, values, flags):
            ds_batch = _deepspeed_view(c, ds_label, values, world, topo, min_micro, flags_problem)
            if ds_batch is not None:
                micros.add(ds_batch.micro)
                if None in flags.numbers():
                    resolved = ds_batch
        elif flags_problem is None:  # the arguments' own problem already says what is wrong
            _deepspeed_auto_view(c, ds_label, values, world, topo, min_micro)
            _deepspeed_open_view(c, ds_label, values, given)
    if hf_numbers:
        _compare(c, "hf-mismatch", hf_loaded[0], hf_numbers, resolved, {"micro": HF_MICRO, "accum": HF_ACCUM})  # type: ignore[index]
    if acc_accum is not None:
        _compare(c, "accelerate-mismatch", acc_loaded[0], {"accum": acc_accum}, resolved,  # type: ignore[index]
                 {"accum": "deepspeed_config.gradient_accumulation_steps"})

    per_gpu = per_gpu_statistics(layers, world)
    if per_gpu and 1 in micros:
        c.add(
            "batchnorm",
            f"a model with {' and '.join(per_gpu)} needs at least 2 samples per GPU, but the micro batch is 1"
            + (f" in {ds_loaded[0]}" if ds_loaded is not None and flags.micro != 1 else "")
            + ": its statistics come from each GPU's own micro batch, so training fails where a channel holds one "
            "value ('Expected more than 1 value per channel when training') and elsewhere normalises each sample "
            "by itself",
            "use a micro batch of at least 2"
            + (f": {_fix_for(resolved.target, *topo, 2)}" if resolved.target is not None else "")
            + ", or torch.nn.SyncBatchNorm.convert_sync_batchnorm(model) on several GPUs",
            micro_batch=1,
        )
    if resolved.target is None and resolved.micro is None and ds_loaded is None and not c.problems:
        c.add(
            "missing-batch",
            "a setup needs a global batch or a micro batch to check, but neither was given",
            "pass the global batch and/or the micro batch (--target, --micro-batch; target=, micro_batch= from "
            "Python), or a DeepSpeed config",
        )

    return CheckResult(
        tuple(c.problems), tuple(c.notes), *resolved.numbers(), world, gpus, node_count, mp
    )


def _check_strategy(c: _Collector, probed: str | Strategy, acc_loaded: Any, ds_loaded: Any, hf_loaded: Any) -> None:
    """What each config says of how training shards, against the strategy the micro batch was probed under."""
    reads: list[Read] = []
    if ds_loaded is not None and (read := strategy_from_deepspeed(ds_loaded[1])) is not None:
        reads.append(Read(ds_loaded[0], read))
    # accelerate's DeepSpeed plugin says its stage itself (zero_stage); with a DeepSpeed file it is read above
    if acc_loaded is not None and (read := strategy_from_accelerate(acc_loaded[1])) is not None:
        label, config = acc_loaded
        sharding, key = fsdp_sharding(config) or ("FULL_SHARD", "")
        raw = (config.get("fsdp_config") or {}).get(key) if key else None
        said = f"{key}: {str(raw).lower() if isinstance(raw, bool) else raw}" + (
            f" ({sharding})" if str(raw) != sharding else "")
        reads.append(Read(label, read, sharding, said, f"fsdp_config.{key}",
                          "true" if read.name == "fsdp2" else "FULL_SHARD"))
    if hf_loaded is not None and (found := hf_strategy(hf_loaded[1])) is not None:
        (read, sharding), (label, args) = found, hf_loaded
        fsdp = args.get("fsdp")
        if isinstance(fsdp, str) and sharding.lower() in fsdp.lower().split():  # the older form: an fsdp option
            said, key, full = f"fsdp: {fsdp!r}", "fsdp", "'full_shard auto_wrap'"
        else:
            reshard = (args.get("fsdp_config") or {}).get("reshard_after_forward")
            said = f"fsdp_config.reshard_after_forward: {str(reshard).lower() if isinstance(reshard, bool) else reshard}"
            key, full = "fsdp_config.reshard_after_forward", "true" if read.name == "fsdp2" else "full_shard"
        reads.append(Read(label, read, sharding, f"{said} ({sharding})", key, full))
    check_strategy(c, probed, reads)


_SLOTS = {"train_batch_size": 0, "train_micro_batch_size_per_gpu": 1, "per_device_train_batch_size": 1,
          "gradient_accumulation_steps": 2}  # where each file's key goes in (target, micro, accum)


def _taken(c: _Collector, given: _Batch, label: str, found: Mapping[str, tuple[Any, str]]) -> _Batch:
    """``given`` with each number the arguments leave open taken from a file's ``found`` key (``{key:
    (value, why)}``: a whole number only, not "auto"), each said in a note."""
    numbers = list(given.numbers())
    for key, (value, why) in found.items():
        n = _SLOTS[key]
        if numbers[n] is None and isinstance(value, int) and not isinstance(value, bool):
            numbers[n] = value
            c.note(f"took {key}={value} from {label}{why}")
    return _Batch(*numbers)

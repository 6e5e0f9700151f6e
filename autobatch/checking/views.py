"""The views a check compares: the numbers given as flags, a DeepSpeed file, an accelerate config.

Each view derives the batch arithmetic the way its library will and records what disagrees.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..configs.accelerate import REFUSED_WITH_DEEPSPEED_FILE
from ..configs.deepspeed import (
    BATCH_KEYS,
    GRAD_ACCUM,
    MICRO_BATCH,
    TRAIN_BATCH_SIZE,
    ZERO_OPTIMIZATION,
    derive_batch_keys,
)

if TYPE_CHECKING:
    pass
from .problems import _AUTO, _Collector, _fix_for, _fix_pinned

__all__ = ["ds_precision"]


@dataclass
class _Batch:
    """Global batch, micro batch and accumulation from one source; ``derived`` names computed ones."""

    target: int | None = None
    micro: int | None = None
    accum: int | None = None
    derived: set[str] = field(default_factory=set)

    def numbers(self) -> tuple[int | None, int | None, int | None]:
        return self.target, self.micro, self.accum


def _flags_view(c: _Collector, given: _Batch, world: int, topo: tuple[int, int, int], min_micro: int) -> _Batch:
    """Resolve the numbers given as arguments; report what cannot be made exact."""
    target, micro, accum = given.numbers()
    fix = (lambda t: _fix_for(t, *topo, min_micro))  # noqa: E731 - small closure over the topology
    if target is None and micro is None:
        return given
    if target is None:
        # micro (and maybe accum) given: the total follows, as in every launcher
        if accum is None:
            c.note("no grad_accum given: assumed 1")
            accum = 1
        return _Batch(micro * accum * world, micro, accum, given.derived | {"target"})
    if micro is not None and accum is not None:
        if target != micro * accum * world:
            c.add(
                "batch-identity",
                f"target must equal micro_batch × grad_accum × world_size, but {target} != "
                f"{micro} × {accum} × {world} = {micro * accum * world}",
                fix(target),
                target=target, micro_batch=micro, grad_accum=accum, world_size=world,
            )
        return given
    if target % world:
        c.add(
            "not-divisible",
            f"the global batch must split evenly over the data-parallel GPUs, but target={target} over "
            f"world_size={world} is {target / world:.4g} per GPU"
            + (
                "; with BatchNorm a GPU left with 1 sample fails with 'Expected more than 1 value per channel'"
                if min_micro > 1 else ""
            ),
            fix(target),
            target=target, world_size=world,
        )
        return given
    per_rank = target // world
    if micro is None and accum is None:
        c.note("no micro batch or accumulation given: assumed accumulation 1, the default of DeepSpeed, accelerate "
               "and the HF Trainer")
        return _Batch(target, per_rank, 1, {"micro", "accum"})
    if micro is None:
        if per_rank % accum:
            below_one = per_rank < accum
            c.add(
                "per-device-batch",
                f"the per-device batch must be a whole number ≥ 1, but target / (world_size × grad_accum) = "
                f"{target} / ({world} × {accum}) = {target / (world * accum):.4g}"
                + ("; integer division makes it 0, no sample is processed and averaged metrics divide by zero"
                   if below_one else ""),
                fix(target),
                target=target, world_size=world, grad_accum=accum, per_device=target / (world * accum),
            )
            return given
        return _Batch(target, per_rank // accum, accum, {"micro"})
    if per_rank % micro:
        c.add(
            "batch-identity",
            f"target must equal micro_batch × grad_accum × world_size, but no whole grad_accum does: "
            f"{target} / ({micro} × {world}) = {target / (micro * world):.4g}",
            fix(target),
            target=target, micro_batch=micro, world_size=world,
        )
        return given
    return _Batch(target, micro, per_rank // micro, {"accum"})


def _deepspeed_values(c: _Collector, label: str, ds: dict[str, Any]) -> dict[str, int | str | None] | None:
    """The three batch keys as DeepSpeed reads them: int, ``"auto"`` or absent; ``None`` if any is invalid."""
    values: dict[str, int | str | None] = {}
    valid = True
    for key in BATCH_KEYS:
        raw = ds.get(key)
        if raw is None or raw == _AUTO:
            values[key] = raw
            continue
        number = c.positive_int(key, raw, label, fix=f"set {key} to a whole number ≥ 1 (or \"auto\" under HF Trainer/accelerate)")
        valid = valid and number is not None
        values[key] = number
    return values if valid else None


def _fill_auto(c: _Collector, label: str, values: dict[str, int | str | None], flags: _Batch) -> bool:
    """Replace ``"auto"`` with the numbers given, as HF Trainer and accelerate do; False if one stays open."""
    from_flags = dict(zip(BATCH_KEYS, flags.numbers()))
    complete = True
    for key, value in values.items():
        if value != _AUTO:
            continue
        if from_flags[key] is not None:
            values[key] = from_flags[key]
            c.note(f"{key} is \"auto\" in {label}: HF Trainer/accelerate fill it at launch; checked as {from_flags[key]}")
        else:
            complete = False
            c.note(
                f"{key} is \"auto\" in {label} and no argument gives it: HF Trainer/accelerate fill it at launch "
                "(plain deepspeed.initialize rejects \"auto\"); pass the numbers to check it"
            )
    return complete


def _zero_stage_view(c: _Collector, label: str, ds: dict[str, Any]) -> None:
    """``zero_optimization.stage`` as DeepSpeed accepts it: 0, 1, 2 or 3 (its ZeroStageEnum)."""
    section = ds.get(ZERO_OPTIMIZATION)
    if section is None:
        return
    if not isinstance(section, dict):
        c.add("deepspeed-zero-stage", f"{ZERO_OPTIMIZATION} in {label} must be a mapping, but got {section!r}",
              f'write "{ZERO_OPTIMIZATION}": {{"stage": 2}} (0, 1, 2 or 3)')
        return
    stage = section.get("stage", 0)
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        c.add("deepspeed-zero-stage", f"{ZERO_OPTIMIZATION}.stage in {label} must be 0, 1, 2 or 3, but got {stage!r}",
              "set the ZeRO stage you train with (autobatch solve --strategy zero2 --deepspeed … writes it)",
              stage=stage)


def ds_precision(ds: Mapping[str, Any], key: str) -> bool | None:
    """``fp16.enabled`` or ``bf16.enabled`` as DeepSpeed's config model reads it (a pydantic bool; ``bf16``
    else the older ``bfloat16``); ``None`` where the config leaves it unset or "auto" (the launcher's)."""
    section = ds.get(key) if key == "fp16" or key in ds else ds.get("bfloat16")
    value = section.get("enabled") if isinstance(section, Mapping) else None
    if value is None or value == _AUTO:
        return None
    return value is True or (isinstance(value, (int, str)) and not isinstance(value, bool)
                             and str(value).strip().lower() in ("1", "true", "yes", "on"))


def _precision_view(c: _Collector, label: str, ds: dict[str, Any]) -> None:
    """fp16 and bf16 both enabled: DeepSpeed asserts at start-up ('bfloat16 and fp16 modes cannot be
    simultaneously enabled')."""
    bf16_key = "bf16" if "bf16" in ds else "bfloat16"
    if ds_precision(ds, "fp16") and ds_precision(ds, "bf16"):
        c.add("deepspeed-precision",
              f"DeepSpeed trains in one of fp16 and bf16, but {label} enables both (fp16.enabled and "
              f"{bf16_key}.enabled); DeepSpeed stops at start-up: 'bfloat16 and fp16 modes cannot be simultaneously "
              "enabled'",
              "keep the one the micro batch was probed with (find --dtype bf16 writes bf16 on and fp16 off)")


def _deepspeed_open_view(c: _Collector, label: str, values: dict[str, int | str | None], flags: _Batch) -> None:
    """A file whose batch keys are all left to the launcher, with no numbers given: nothing is checked."""
    if any(isinstance(v, int) for v in values.values()) or any(n is not None for n in flags.numbers()):
        return
    c.add("deepspeed-unchecked",
          f"{label} leaves every batch key to the launcher (\"auto\" or absent) and no argument gives them, so "
          "nothing about the batch can be checked",
          "pass the numbers the launcher fills them with, e.g. --micro-batch 8 --grad-accum 2 --gpus 8")


def _deepspeed_auto_view(
    c: _Collector, label: str, values: dict[str, int | str | None], world: int, topo: tuple[int, int, int],
    min_micro: int,
) -> None:
    """Keys still "auto" are filled at launch: report when no whole numbers can fill them.

    With ``train_batch_size`` fixed, whatever the launcher puts in the open keys, DeepSpeed's
    identity needs it to be a multiple of world size × the terms the file fixes (224 on 3 GPUs
    never is), and a micro batch left open must come out at ``min_micro`` or more.
    """
    target = values[TRAIN_BATCH_SIZE]
    if not isinstance(target, int):
        return  # an open or absent global batch is computed from the others: always met
    micro, accum = values[MICRO_BATCH], values[GRAD_ACCUM]
    terms = [f"{key} ({value})" for key, value in ((MICRO_BATCH, micro), (GRAD_ACCUM, accum)) if isinstance(value, int)]
    step = world * (micro if isinstance(micro, int) else 1) * (accum if isinstance(accum, int) else 1)
    if target % step == 0 and (isinstance(micro, int) or target // step >= min_micro):
        return
    open_keys = [key for key, value in values.items() if value == _AUTO]
    rule = f"a multiple of {' × '.join(terms + [f'world_size ({world})'])} = {step}"
    if target % step == 0:
        rule = f"at least {min_micro} samples per GPU (BatchNorm), but {target} / {step} = {target // step}"
    else:
        rule += f", but {target} / {step} = {target / step:.4g}"
    c.add(
        "deepspeed-auto",
        f"{label} leaves {' and '.join(open_keys)} \"auto\" for the launcher to fill, but no whole numbers can: "
        f"{TRAIN_BATCH_SIZE}={target} must be {rule}",
        _fix_pinned(target, micro if isinstance(micro, int) else None, accum if isinstance(accum, int) else None,
                    topo, min_micro),
        train_batch_size=target, world_size=world, micro_batch=micro, grad_accum=accum,
    )


def _deepspeed_view(
    c: _Collector, label: str, values: dict[str, int | str | None], world: int, topo: tuple[int, int, int],
    min_micro: int, flags_problem: tuple[int | None, ...] | None,
) -> _Batch | None:
    """Mirror DeepSpeed's derivation and its start-up assertion for one config."""
    derived = derive_batch_keys(*(values[k] for k in BATCH_KEYS), world_size=world)  # type: ignore[arg-type]
    if derived is None:
        c.add(
            "deepspeed-assertion",
            f"DeepSpeed needs {TRAIN_BATCH_SIZE} or {MICRO_BATCH}, but {label} has neither",
            f"add the three batch keys from one plan (autobatch solve --deepspeed {label})",
        )
        return None
    target, micro, accum = derived.train_batch_size, derived.micro_batch, derived.grad_accum
    slot_of = dict(zip(BATCH_KEYS, ("target", "micro", "accum")))
    batch = _Batch(target, micro, accum, {slot_of[k] for k in derived.derived})
    derivation = f" (DeepSpeed derives {'; '.join(derived.steps)})" if derived.steps else ""
    if micro < 1 or accum < 1:
        c.add(
            "per-device-batch",
            f"DeepSpeed needs every batch term > 0, but {label} leads to {MICRO_BATCH}={micro}, "
            f"{GRAD_ACCUM}={accum} on world_size={world}{derivation}",
            _fix_for(target, *topo, min_micro),
            train_batch_size=target, micro_batch=micro, grad_accum=accum, world_size=world,
        )
    elif not derived.consistent and batch.numbers() != flags_problem:
        c.add(
            "deepspeed-assertion",
            f"DeepSpeed asserts {TRAIN_BATCH_SIZE} == {MICRO_BATCH} × {GRAD_ACCUM} × world_size, but {label} "
            f"gives {target} != {micro} × {accum} × {world} = {micro * accum * world}{derivation}",
            _implied_world(target, micro * accum, world, topo) + _fix_pinned(
                target, *(values[key] if isinstance(values[key], int) else None for key in (MICRO_BATCH, GRAD_ACCUM)),
                topo, min_micro),
            train_batch_size=target, micro_batch=micro, grad_accum=accum, world_size=world,
        )
    return batch


def _implied_world(target: int, per_rank: int, world: int, topo: tuple[int, int, int]) -> str:
    """When the file holds together on another number of ranks (the GPU count was not given): which."""
    if per_rank < 1 or target % per_rank or target // per_rank == world:
        return ""
    ranks = target // per_rank
    gpus = world * topo[2]  # every GPU of the job, as the arguments or the configs give them
    if ranks < world and world % ranks == 0:  # fewer data-parallel ranks than GPUs: model parallelism
        return (f"the file holds together on {ranks} data-parallel rank{'s' if ranks != 1 else ''}: if the {gpus} GPUs "
                f"train with a model-"
                f"parallel degree of {gpus // ranks}, pass --model-parallel {gpus // ranks}; otherwise ")
    mp = topo[2]
    return (f"the file holds together on {ranks} data-parallel rank{'s' if ranks != 1 else ''}: if that is the job, "
            f"pass the GPUs "
            f"(--gpus {ranks * mp}{f' with --model-parallel {mp}' if mp > 1 else ''}, or --gpus and --nodes); otherwise ")


def _compare(c: _Collector, code: str, label: str, theirs: dict[str, int | None], ours: _Batch, names: dict[str, str]) -> None:
    """One problem listing every key where a file disagrees with the numbers given or implied."""
    mine = {"target": ours.target, "micro": ours.micro, "accum": ours.accum}
    diffs = []
    for slot, their_value in theirs.items():
        our_value = mine[slot]
        if their_value is None or our_value is None or their_value == our_value:
            continue
        how = "implied" if slot in ours.derived else "given"
        diffs.append(f"{names[slot]}={their_value} but {our_value} {how} by the arguments")
    if diffs:
        c.add(
            code,
            f"{label} must agree with the batch arguments, but it has " + "; ".join(diffs),
            "write every file and flag from one plan (autobatch solve --target … --deepspeed … --accelerate …), "
            "or change the arguments to match",
            file=label,
        )


def _accelerate_topology(c: _Collector, label: str, acc: dict[str, Any]) -> tuple[int | None, int | None]:
    """``(gpus_per_node, nodes)`` from an accelerate config, reporting what does not add up."""
    processes = acc.get("num_processes")
    processes = None if processes in (None, -1) else c.positive_int("num_processes", processes, label)
    machines = c.positive_int("num_machines", acc.get("num_machines", 1), label)
    if processes is None or machines is None:
        return None, machines
    if processes % machines:
        c.add(
            "accelerate-topology",
            f"num_processes must be a multiple of num_machines (every machine runs the same number), but {label} "
            f"has num_processes={processes} and num_machines={machines}",
            "set num_processes to GPUs per node × num_machines",
            num_processes=processes, num_machines=machines,
        )
        return None, machines
    return processes // machines, machines


def _accelerate_deepspeed(c: _Collector, label: str, acc: dict[str, Any], ds_label: str | None, ds: dict[str, Any] | None) -> None:
    """accelerate's own refusals for DeepSpeed files, and a file that differs from the one given."""
    section = acc.get("deepspeed_config") or {}
    ds_file = section.get("deepspeed_config_file")
    if not ds_file:
        return
    refused = [k for k in REFUSED_WITH_DEEPSPEED_FILE if k in section]
    if acc.get("mixed_precision") is not None:
        refused.append("mixed_precision")
    if refused:
        c.add(
            "accelerate-refuses",
            f"accelerate refuses {', '.join(refused)} next to deepspeed_config_file, but {label} sets "
            f"{'it' if len(refused) == 1 else 'them'}",
            # in the DeepSpeed file being checked, which the file named is to be (a mismatch is said apart)
            f"remove {', '.join(refused)} from {label} and set {'it' if len(refused) == 1 else 'them'} in "
            f"{ds_label or ds_file}",
            keys=refused,
        )
    if ds is not None and ZERO_OPTIMIZATION not in ds:
        c.add(
            "accelerate-refuses",
            f"accelerate needs a {ZERO_OPTIMIZATION} section in the DeepSpeed file it is given, but {ds_label} has none",
            f'add "{ZERO_OPTIMIZATION}": {{"stage": 0}} (DeepSpeed\'s default) or the ZeRO stage you use',
        )

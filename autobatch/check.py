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
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .configs.accelerate import REFUSED_WITH_DEEPSPEED_FILE
from .configs.deepspeed import (
    BATCH_KEYS,
    GRAD_ACCUM,
    MICRO_BATCH,
    TRAIN_BATCH_SIZE,
    ZERO_OPTIMIZATION,
    derive_batch_keys,
)
from .configs.files import ConfigFileError, read_config
from .errors import AutobatchError, ConfigError
from .plan import Plan, require_positive_int
from .solver import NoExactPlanError, exact_plans, solve

if TYPE_CHECKING:
    import torch

__all__ = ["Problem", "CheckResult", "check_setup"]

_AUTO = "auto"
# How many (micro × accumulation) pairs a fix lists before eliding the rest.
_PAIRS_SHOWN = 6


@dataclass(frozen=True)
class Problem:
    """One thing that will go wrong, with the rule, the values and the fix.

    Attributes:
        code: Stable identifier for scripts, e.g. ``"per-device-batch"``, ``"deepspeed-mismatch"``.
        message: The rule and the values that break it.
        fix: What to change.
        values: The numbers involved, by name.
    """

    code: str
    message: str
    fix: str
    values: dict[str, Any] = field(default_factory=dict, hash=False)

    def __str__(self) -> str:
        return f"{self.message}. Fix: {self.fix}"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields."""
        return {"code": self.code, "message": self.message, "fix": self.fix, "values": dict(self.values)}


@dataclass(frozen=True)
class CheckResult:
    """Every problem found, notes on what was assumed or derived, and the numbers as resolved.

    The numbers are ``None`` where they could not be resolved. ``plan`` is the equivalent
    :class:`~autobatch.Plan` when the setup is consistent.
    """

    problems: tuple[Problem, ...] = ()
    notes: tuple[str, ...] = ()
    global_batch: int | None = None
    micro_batch: int | None = None
    grad_accum: int | None = None
    world_size: int | None = None
    gpus_per_node: int | None = None
    nodes: int | None = None
    model_parallel: int | None = 1

    @property
    def ok(self) -> bool:
        """True when no problem was found."""
        return not self.problems

    @property
    def plan(self) -> Plan | None:
        """The setup as a Plan, when it is consistent and fully resolved."""
        numbers = (self.micro_batch, self.grad_accum, self.gpus_per_node, self.nodes, self.model_parallel)
        if not self.ok or any(n is None for n in numbers) or self.global_batch is None:
            return None
        plan = Plan(*numbers[:2], gpus_per_node=self.gpus_per_node, nodes=self.nodes, model_parallel=self.model_parallel)
        return plan if plan.global_batch == self.global_batch else None

    def raise_for_problems(self) -> None:
        """Raise :class:`~autobatch.errors.ConfigError` listing every problem, if there are any."""
        if self.problems:
            raise ConfigError([str(p) for p in self.problems])

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready result: ``ok``, ``problems``, ``notes`` and the resolved numbers."""
        plan = self.plan
        return {
            "ok": self.ok,
            "problems": [p.to_dict() for p in self.problems],
            "notes": list(self.notes),
            "global_batch": self.global_batch,
            "micro_batch": self.micro_batch,
            "grad_accum": self.grad_accum,
            "world_size": self.world_size,
            "gpus_per_node": self.gpus_per_node,
            "nodes": self.nodes,
            "model_parallel": self.model_parallel,
            "arithmetic": None if plan is None else str(plan),
        }

    def report(self) -> str:
        """Human-readable report: the verdict, each problem with its fix, then notes."""
        plan = self.plan
        if self.ok:
            lines = [f"OK: {plan}" if plan is not None else "OK: no problem found"]
        else:
            count = len(self.problems)
            lines = [f"{count} problem{'s' if count != 1 else ''} found:"]
            lines += [f"  {i}. [{p.code}] {p}" for i, p in enumerate(self.problems, 1)]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.report()


class _Collector:
    """Gathers problems and notes; the check never stops at the first problem."""

    def __init__(self) -> None:
        self.problems: list[Problem] = []
        self.notes: list[str] = []

    def add(self, code: str, message: str, fix: str, **values: Any) -> None:
        problem = Problem(code, message, fix, values)
        if problem not in self.problems:
            self.problems.append(problem)

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    def positive_int(self, name: str, value: object, source: str = "", fix: str = "") -> int | None:
        """``value`` as an int; ``None`` (and a problem) when it is not a positive integer."""
        if value is None:
            return None
        try:
            return require_positive_int(name, value)
        except AutobatchError:
            where = f" in {source}" if source else ""
            self.add(
                "invalid-value",
                f"{name} must be a positive integer, but got {name}={value!r}{where}",
                fix or f"set {name} to a whole number ≥ 1",
                **{name: value},
            )
            return None

    def load(self, config: str | os.PathLike[str] | Mapping[str, Any] | None, kind: str) -> tuple[str, dict[str, Any]] | None:
        """``(label, mapping)`` for a path or mapping; a problem (and ``None``) when unreadable."""
        if config is None:
            return None
        if isinstance(config, Mapping):
            return f"the {kind}", dict(config)
        try:
            return os.fspath(config), read_config(config)
        except ConfigFileError as exc:
            self.add("unreadable-file", f"the {kind} file {exc.problem}", exc.fix, file=exc.path)
            return None


def _pairs_text(plans: list[Plan]) -> str:
    pairs = [f"{p.micro_batch} × {p.grad_accum}" for p in plans[:_PAIRS_SHOWN]]
    return ", ".join(pairs) + (", …" if len(plans) > _PAIRS_SHOWN else "")


def _fix_for(target: int, gpus: int, nodes: int, mp: int, min_micro: int) -> str:
    """Concrete ways to reach ``target`` on this topology, or the nearest alternatives when none exist."""
    plans = exact_plans(target, gpus, nodes, min_micro=min_micro, model_parallel=mp)
    if plans:
        return (
            f"for a global batch of {target} on {plans[0].world_size} GPUs use micro batch × accumulation = "
            f"{_pairs_text(plans)}"
        )
    try:
        solve(target, gpus, nodes, min_micro=min_micro, model_parallel=mp)
    except NoExactPlanError as exc:
        near = f"{exc.below} or {exc.above}" if exc.below is not None else str(exc.above)
        sizes = f", or a world size of {', '.join(map(str, exc.world_sizes))}" if exc.world_sizes else ""
        return f"use a global batch of {near} on {exc.world_size} GPUs{sizes}"
    return "re-run autobatch solve for this topology"  # unreachable: no plans means solve raises


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
        c.note("no micro_batch or grad_accum given: assumed grad_accum 1, as DeepSpeed does")
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
            _fix_for(target, *topo, min_micro),
            train_batch_size=target, micro_batch=micro, grad_accum=accum, world_size=world,
        )
    return batch


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
            f"remove {', '.join(refused)} from {label} and set {'it' if len(refused) == 1 else 'them'} in {ds_file}",
            keys=refused,
        )
    if ds is not None and ZERO_OPTIMIZATION not in ds:
        c.add(
            "accelerate-refuses",
            f"accelerate needs a {ZERO_OPTIMIZATION} section in the DeepSpeed file it is given, but {ds_label} has none",
            f'add "{ZERO_OPTIMIZATION}": {{"stage": 0}} (DeepSpeed\'s default) or the ZeRO stage you use',
        )


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
    model: torch.nn.Module | None = None,
    batchnorm: bool | None = None,
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
        model: The model; a BatchNorm layer requires at least 2 samples per GPU.
        batchnorm: Say the model has BatchNorm without passing it.

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

    bn = bool(batchnorm)
    if model is not None:
        from .modelinfo import has_batchnorm  # torch is imported only when a model is checked

        bn = bn or has_batchnorm(model)
    min_micro = 2 if bn else 1

    # --- topology: arguments first, then the accelerate config, then one GPU -------------------
    acc_loaded = c.load(accelerate, "accelerate config")
    acc_gpus = acc_nodes = None
    if acc_loaded is not None:
        acc_gpus, acc_nodes = _accelerate_topology(c, *acc_loaded)
    gpus = flag_gpus or acc_gpus
    node_count = flag_nodes or acc_nodes
    if gpus is None and gpus_per_node is None:
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
    if mp is not None:
        if (gpus * node_count) % mp:
            c.add(
                "model-parallel",
                f"model_parallel must divide the GPU count, but {mp} does not divide {gpus * node_count} "
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
        values = _deepspeed_values(c, ds_label, ds)
    determined = sum(n is not None for n in given.numbers()) >= 2 and (given.target, given.micro) != (None, None)
    if values is not None and not determined and (given.target is not None or given.micro is not None):
        # When the arguments alone would need an assumption (accumulation 1), the DeepSpeed file
        # fills the gap instead: `--target 512 --deepspeed ds.json` is checked with the file's
        # micro batch and accumulation. Arguments that determine all three are compared instead.
        numbers = list(given.numbers())
        for n, key in enumerate(BATCH_KEYS):
            if numbers[n] is None and isinstance(values[key], int):
                numbers[n] = values[key]
                c.note(f"took {key}={values[key]} from {ds_loaded[0]}")  # type: ignore[index]
        given = _Batch(*numbers)

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
    if acc_loaded is not None:
        section = acc_loaded[1].get("deepspeed_config") or {}
        accum = section.get("gradient_accumulation_steps")
        if accum is not None and accum != _AUTO:
            accum = c.positive_int("gradient_accumulation_steps", accum, acc_loaded[0])
            _compare(c, "accelerate-mismatch", acc_loaded[0], {"accum": accum}, resolved,
                     {"accum": "deepspeed_config.gradient_accumulation_steps"})

    if bn and 1 in micros:
        c.add(
            "batchnorm",
            "a model with BatchNorm needs at least 2 samples per GPU, but the micro batch is 1"
            + (f" in {ds_loaded[0]}" if ds_loaded is not None and flags.micro != 1 else "")
            + "; training fails with 'Expected more than 1 value per channel when training'",
            "use a micro batch of at least 2"
            + (f": {_fix_for(resolved.target, *topo, 2)}" if resolved.target is not None else ""),
            micro_batch=1,
        )
    if resolved.target is None and resolved.micro is None and ds_loaded is None and not c.problems:
        c.add(
            "missing-batch",
            "a setup needs a global batch or a micro batch to check, but neither was given",
            "pass target and/or micro_batch, or a DeepSpeed config",
        )

    return CheckResult(
        tuple(c.problems), tuple(c.notes), *resolved.numbers(), world, gpus, node_count, mp
    )

"""DeepSpeed JSON: the three batch keys, merged into an existing config without touching the rest.

DeepSpeed asserts ``train_batch_size == train_micro_batch_size_per_gpu × gradient_accumulation_steps
× world_size`` at start-up, where ``world_size`` is the data-parallel size. A :class:`~autobatch.Plan`
satisfies that identity by construction, so writing all three keys from one Plan always passes.

What happens to ``"auto"``
    HF Trainer and accelerate replace ``"auto"`` at launch with values computed from their own
    arguments (``per_device_train_batch_size``, ``gradient_accumulation_steps``, world size);
    plain ``deepspeed.initialize`` rejects ``"auto"``. By default autobatch writes the plan's
    numbers over ``"auto"``: the file is then correct on its own, and HF, which compares every
    concrete value with its ``TrainingArguments``, still accepts it as long as those arguments
    come from the same Plan (``plan.to_hf()``). With ``keep_auto=True`` keys that say ``"auto"``
    are left as they are, for setups where the launcher's own arguments are the source of truth.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import AutobatchError, option
from ..strategy import Strategy, as_strategy, not_deepspeed
from .files import read_config, write_config
from .trained import trained_with

if TYPE_CHECKING:
    from ..planning.plan import Plan

__all__ = [
    "TRAIN_BATCH_SIZE",
    "MICRO_BATCH",
    "GRAD_ACCUM",
    "BATCH_KEYS",
    "ZERO_OPTIMIZATION",
    "DerivedBatch",
    "derive_batch_keys",
    "deepspeed_config",
    "zero_section",
    "read_deepspeed_config",
    "write_deepspeed_config",
]

TRAIN_BATCH_SIZE = "train_batch_size"
MICRO_BATCH = "train_micro_batch_size_per_gpu"
GRAD_ACCUM = "gradient_accumulation_steps"
BATCH_KEYS = (TRAIN_BATCH_SIZE, MICRO_BATCH, GRAD_ACCUM)
ZERO_OPTIMIZATION = "zero_optimization"


def zero_section(strategy: Strategy | str, existing: dict[str, Any] | None = None,
                 probed: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``zero_optimization`` section that trains as ``strategy`` was probed.

    The stage and offload are the strategy's (a different stage in ``existing`` is replaced: the
    micro batch was measured under this one); every other key of ``existing`` is kept, and the
    bucket sizes the probe used (``probed``) are added where the file sets none.

    Example:
        >>> zero_section(Strategy("zero3", offload="optimizer"), {"stage": 2, "overlap_comm": True})
        {'stage': 3, 'overlap_comm': True, 'offload_optimizer': {'device': 'cpu', 'pin_memory': True}}
    """
    strategy = as_strategy(strategy)  # a name ("zero3") as well as a Strategy
    if strategy.zero_stage is None and strategy.name != "ddp":
        raise AutobatchError(f"{option('deepspeed')} writes {not_deepspeed([strategy.name])}")
    section = dict(existing or {})
    section["stage"] = strategy.zero_stage or 0
    for key, value in (probed or {}).items():
        if key not in ("stage",) and not key.startswith("offload_"):
            section.setdefault(key, value)
    if strategy.offload in ("optimizer", "params"):
        section["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    else:
        section.pop("offload_optimizer", None)
    if strategy.offload == "params":
        section["offload_param"] = {"device": "cpu", "pin_memory": True}
    else:
        section.pop("offload_param", None)
    return section


def deepspeed_config(plan: Plan, existing: dict[str, Any] | None = None, *, keep_auto: bool = False,
                     strategy: Strategy | str | None = None, probed_zero: dict[str, Any] | None = None,
                     precision: str | None = None) -> dict[str, Any]:
    """The plan's three batch keys, merged into an existing DeepSpeed config or as a new one.

    Args:
        plan: The plan to write.
        existing: A DeepSpeed config to update: only the three batch keys change, every other key
            (and the key order) is kept, and the argument itself is not modified. Without it the
            new config also holds ``"zero_optimization": {"stage": 0}`` (DeepSpeed's default),
            because HF Trainer and accelerate refuse a DeepSpeed config without that section.
        keep_auto: Leave keys whose value is ``"auto"`` untouched (see the module docstring).
        strategy: The strategy the micro batch was probed under: its ZeRO stage and offload are
            written (see :func:`zero_section`), so the file trains as the probe measured.
        probed_zero: The ``zero_optimization`` values the probe ran with (bucket sizes).
        precision: ``"bf16"`` or ``"fp16"``, what the micro batch was probed with (or what the
            accelerate config held, which accelerate refuses beside a DeepSpeed file): enabled, and
            the other one disabled where the config had it on.

    ``strategy``, ``probed_zero`` and ``precision`` not given are read from ``plan.trained_with``
    (a plan from :func:`~autobatch.find` carries what its batch was found under).

    Example:
        >>> from autobatch.planning.plan import Plan
        >>> deepspeed_config(Plan(7, 2, gpus_per_node=16), {"zero_optimization": {"stage": 2}})
        {'zero_optimization': {'stage': 2}, 'train_batch_size': 224, 'train_micro_batch_size_per_gpu': 7, 'gradient_accumulation_steps': 2}
        >>> deepspeed_config(Plan(7, 2, gpus_per_node=16))
        {'train_batch_size': 224, 'train_micro_batch_size_per_gpu': 7, 'gradient_accumulation_steps': 2, 'zero_optimization': {'stage': 0}}
    """
    found = trained_with(plan, strategy=strategy, probed_zero=probed_zero, precision=precision)
    if precision is None and _not_deepspeeds(found):
        engine, pure = found.precision[:4], found.precision.endswith("-true")
        raise AutobatchError(
            f"this plan's batch was found {found.strategy.name if found.strategy else 'unsharded'} with "
            f"{f'pure {engine} weights' if pure else f'fp32 weights under {engine} autocast'}, but DeepSpeed trains "
            f"{engine} in its own engine ({engine} weights and gradients beside an fp32 master copy); find it again "
            f"with {f'dtype={engine!r}, ' if pure else ''}strategy='zero1' (or zero2, zero3), or pass precision= to "
            "write one anyway")
    strategy, probed_zero, precision = found.strategy, found.probed_zero, found.precision
    config = copy.deepcopy(existing) if existing is not None else {}
    for key, value in zip(BATCH_KEYS, (plan.global_batch, plan.micro_batch, plan.grad_accum)):
        if keep_auto and config.get(key) == "auto":
            continue
        config[key] = value
    if precision in ("bf16", "fp16"):  # the batch was probed so: this precision on, the other off
        other = "fp16" if precision == "bf16" else "bf16"
        section = config.get(precision)
        config[precision] = {**(section if isinstance(section, dict) else {}), "enabled": True}
        if isinstance(config.get(other), dict) and config[other].get("enabled"):
            config[other] = {**config[other], "enabled": False}
    if strategy is not None:
        config[ZERO_OPTIMIZATION] = zero_section(strategy, config.get(ZERO_OPTIMIZATION), probed_zero)
    elif existing is None:
        # HF Trainer and accelerate refuse a DeepSpeed file without this section; stage 0 is
        # DeepSpeed's own default, so it changes nothing else. Existing configs are left alone.
        config[ZERO_OPTIMIZATION] = {"stage": 0}
    return config


def _not_deepspeeds(found: Any) -> bool:
    """A batch found in bf16/fp16 without DeepSpeed (unsharded or ddp: under autocast, or pure low-precision
    weights), which DeepSpeed's own engine does not train: low-precision weights and gradients beside an fp32
    master copy."""
    return (found.precision in ("bf16", "fp16", "bf16-true", "fp16-true")
            and (found.strategy is None or not found.strategy.is_deepspeed))


def read_deepspeed_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Load a DeepSpeed config (JSON, or hjson when installed); one-line :class:`AutobatchError` on failure.

    Example:
        >>> read_deepspeed_config("ds_config.json")["train_batch_size"]  # doctest: +SKIP
        224
    """
    return read_config(path)


def write_deepspeed_config(
    plan: Plan,
    path: str | os.PathLike[str],
    *,
    base: str | os.PathLike[str] | None = None,
    keep_auto: bool = False,
    for_accelerate: bool = False,
    strategy: Strategy | str | None = None,
    probed_zero: dict[str, Any] | None = None,
    precision: str | None = None,
) -> dict[str, Any]:
    """Write the plan into a DeepSpeed JSON file and return what was written.

    Args:
        plan: The plan to write.
        path: Output file. When it exists (and ``base`` is not given) it is updated in place:
            only the three batch keys change. A new file is written as :func:`deepspeed_config`
            makes a new config.
        base: Start from this config instead (e.g. a shared template), leaving it untouched.
        keep_auto: Leave ``"auto"`` values untouched (see the module docstring).
        for_accelerate: The file will be named in an accelerate config (or HF ``deepspeed=``):
            an existing config without a ``zero_optimization`` section also gets
            ``{"stage": 0}``, DeepSpeed's own default, because those libraries refuse one without.
        strategy, probed_zero, precision: The probed strategy, its ZeRO values and precision (see
            :func:`deepspeed_config`).

    A file read as hjson is written back as plain JSON, which keeps no comments: the file as it was is
    kept beside it first (``NAME.orig``, :func:`~autobatch.configs.files.keep_original`).

    Example:
        >>> write_deepspeed_config(plan, "ds_config.json")  # doctest: +SKIP
    """
    strategy = as_strategy(strategy)  # a name ("zero3") as well as a Strategy
    source = base if base is not None else (path if Path(path).exists() else None)
    existing = read_deepspeed_config(source) if source is not None else None
    config = deepspeed_config(plan, existing, keep_auto=keep_auto, strategy=strategy, probed_zero=probed_zero,
                              precision=precision)
    if for_accelerate:
        config.setdefault(ZERO_OPTIMIZATION, {"stage": 0})
    write_config(path, config)
    return config


@dataclass(frozen=True)
class DerivedBatch:
    """The three batch keys after DeepSpeed fills in the missing ones.

    Attributes:
        train_batch_size, micro_batch, grad_accum: The values DeepSpeed will use and then check.
        world_size: The data-parallel world size they were derived for.
        derived: The keys DeepSpeed computed rather than read.
        steps: The flooring divisions it did, written out (e.g. ``"… = 224 // 3 = 74"``).
    """

    train_batch_size: int
    micro_batch: int
    grad_accum: int
    world_size: int
    derived: frozenset[str]
    steps: tuple[str, ...]

    @property
    def consistent(self) -> bool:
        """Whether DeepSpeed's start-up assertion (every term > 0, and the identity) passes."""
        return (
            self.micro_batch > 0 and self.grad_accum > 0
            and self.train_batch_size == self.micro_batch * self.grad_accum * self.world_size
        )


def derive_batch_keys(
    train_batch_size: int | None, micro_batch: int | None, grad_accum: int | None, world_size: int
) -> DerivedBatch | None:
    """What DeepSpeed's config does with missing batch keys, flooring included.

    Mirrors ``_set_batch_related_parameters`` in DeepSpeed's ``runtime/config.py``: e.g. given
    only ``train_batch_size`` it sets accumulation 1 and ``micro = train_batch_size // world_size``,
    then asserts the identity, which fails when that floor lost samples. Returns ``None`` when
    neither ``train_batch_size`` nor ``micro_batch`` is given (DeepSpeed refuses that config).

    Example:
        >>> d = derive_batch_keys(224, None, None, world_size=3)
        >>> (d.micro_batch, d.grad_accum, d.consistent)
        (74, 1, False)
    """
    target, micro, accum, world = train_batch_size, micro_batch, grad_accum, world_size
    steps: list[str] = []
    derived: set[str] = set()
    if target is None and micro is None:
        return None
    if target is not None and micro is not None and accum is None:
        accum = target // micro // world
        steps.append(f"{GRAD_ACCUM} = {target} // {micro} // {world} = {accum}")
        derived.add(GRAD_ACCUM)
    elif target is not None and accum is not None and micro is None:
        micro = target // world // accum
        steps.append(f"{MICRO_BATCH} = {target} // {world} // {accum} = {micro}")
        derived.add(MICRO_BATCH)
    elif micro is not None and accum is not None and target is None:
        target = micro * accum * world
        derived.add(TRAIN_BATCH_SIZE)
    elif target is not None and micro is None:  # accum is None too
        accum, micro = 1, target // world
        steps.append(f"{GRAD_ACCUM} = 1 and {MICRO_BATCH} = {target} // {world} = {micro}")
        derived |= {MICRO_BATCH, GRAD_ACCUM}
    elif micro is not None and target is None:  # accum is None too
        accum, target = 1, micro * world
        derived |= {TRAIN_BATCH_SIZE, GRAD_ACCUM}
    assert target is not None and micro is not None and accum is not None  # every case above sets all three
    return DerivedBatch(target, micro, accum, world, frozenset(derived), tuple(steps))

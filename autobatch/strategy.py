"""How training spreads model states over the data-parallel ranks: the strategy, as a value.

``ddp`` replicates parameters, gradients and optimizer state on every rank. ``fsdp2``
(``fully_shard``) and ``fsdp1`` (``FullyShardedDataParallel``) shard all three, gathering one
unit (a transformer block) at a time. DeepSpeed's ZeRO stages shard progressively: ``zero1``
the optimizer state, ``zero2`` also the gradients, ``zero3`` also the parameters; ZeRO can
offload the optimizer state (``offload="optimizer"``) or the parameters too (``"params"``) to
host memory. FSDP2's ``CPUOffloadPolicy`` offloads the parameters with their gradients and the
optimizer step (``offload="params"``), as FSDP1's ``CPUOffload(offload_params=True)`` does.

A :class:`Strategy` is what the probe wraps the model with
(:mod:`autobatch.distributed.sharding`), what the config writers put into DeepSpeed, accelerate
and HF files, and what ``check`` reads back from them. This module knows names and rules only,
so every stage can use it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .errors import AutobatchError, option

__all__ = ["Strategy", "strategy_problems", "not_deepspeed", "STRATEGIES", "OFFLOADS", "SIZE_BASED_MIN_PARAMS", "parse_strategy", "parse_strategies", "as_strategy",
           "strategy_from_deepspeed", "strategy_from_accelerate", "fsdp_sharding", "FSDP_SHARDINGS"]

STRATEGIES = ("ddp", "fsdp2", "fsdp1", "zero1", "zero2", "zero3")
# FSDP units of a model with no blocks, by size: torch's size_based_auto_wrap_policy and accelerate's
# fsdp_min_num_params default. The probe wraps with it and the configs say it.
SIZE_BASED_MIN_PARAMS = 10**8
OFFLOADS = ("none", "optimizer", "params")
# The strategies each offload applies to, in words (for the errors that name them).
_TAKES = {"optimizer": "zero1, zero2 or zero3", "params": "zero3, fsdp2 or fsdp1"}
_SHARDED = {"ddp": "nothing", "fsdp2": "parameters, gradients, optimizer state",
            "fsdp1": "parameters, gradients, optimizer state", "zero1": "optimizer state",
            "zero2": "gradients, optimizer state", "zero3": "parameters, gradients, optimizer state"}


@dataclass(frozen=True)
class Strategy:
    """One way to train data-parallel.

    Args:
        name: one of :data:`STRATEGIES`.
        offload: ZeRO: ``"optimizer"`` (optimizer state in host memory) or ``"params"``
            (parameters too; ZeRO-3 only). FSDP: ``"params"``, FSDP2's ``CPUOffloadPolicy`` or FSDP1's
            ``CPUOffload`` (the sharded parameters, their gradients and the optimizer step on the host). ``None`` keeps
            everything on the device.
        unit: FSDP only: the class name of the module wrapped as one unit; ``None`` takes the
            model's transformer block (``_no_split_modules``) or the items of its largest layer list.

    Example:
        >>> Strategy("zero3", offload="optimizer").label
        'zero3+offload-optimizer'
        >>> Strategy("zero2").zero_stage, Strategy("fsdp2").zero_stage
        (2, None)
    """

    name: str = "ddp"
    offload: str | None = None
    unit: str | None = None

    def __post_init__(self) -> None:
        if self.name not in STRATEGIES:
            raise AutobatchError(
                f"strategy must be one of {', '.join(STRATEGIES)}, but got {self.name!r}")
        if self.offload is not None:
            if self.offload not in OFFLOADS[1:]:
                raise AutobatchError(
                    f"offload must be 'optimizer' or 'params', but got offload={self.offload!r}")
            if self.is_fsdp and self.offload != "params":
                raise AutobatchError(
                    f"FSDP's CPU offload ({'CPUOffloadPolicy' if self.name == 'fsdp2' else 'CPUOffload'}) moves the "
                    f"parameters with their gradients and the optimizer step to the host, but got "
                    f"offload={self.offload!r}; use offload='params'")
            if self.name == "ddp":
                raise AutobatchError(
                    f"offload moves sharded state to the host, but ddp shards nothing; use {_TAKES[self.offload]} "
                    "with --offload, or drop --offload")
            if self.offload == "params" and self.zero_stage != 3 and not self.is_fsdp:
                raise AutobatchError(
                    f"offload='params' needs ZeRO-3 (only stage 3 partitions parameters), but got {self.name}; "
                    "use zero3, or offload='optimizer'")
        if self.unit is not None and not self.is_fsdp:
            raise AutobatchError(
                f"the FSDP unit names the block FSDP wraps, but the strategy is {self.name}; drop {option('fsdp_unit')}")

    @property
    def zero_stage(self) -> int | None:
        return int(self.name[-1]) if self.name.startswith("zero") else None

    @property
    def is_fsdp(self) -> bool:
        return self.name.startswith("fsdp")

    @property
    def is_deepspeed(self) -> bool:
        return self.zero_stage is not None

    @property
    def shards_parameters(self) -> bool:
        return self.is_fsdp or self.zero_stage == 3

    @property
    def shards_gradients(self) -> bool:
        return self.is_fsdp or (self.zero_stage or 0) >= 2

    @property
    def shards_optimizer(self) -> bool:
        return self.name != "ddp"

    @property
    def sharded(self) -> str:
        """What it shards, in words."""
        return _SHARDED[self.name]

    @property
    def label(self) -> str:
        return self.name + (f"+offload-{self.offload}" if self.offload else "")

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "offload": self.offload, "unit": self.unit, "sharded": self.sharded}


def parse_strategy(name: str | Strategy, offload: str | None = None, unit: str | None = None) -> Strategy:
    """A :class:`Strategy` from its name (``"zero3"``; case and ``zero-3``/``fsdp`` spellings accepted).

    A label as :attr:`Strategy.label` writes it (``"zero3+offload-optimizer"``) reads back as that strategy.

    Example:
        >>> parse_strategy("ZeRO-3", offload="optimizer").label
        'zero3+offload-optimizer'
        >>> parse_strategy("zero2+offload-optimizer") == Strategy("zero2", offload="optimizer")
        True
    """
    if isinstance(name, Strategy):
        return name
    text = str(name).strip().lower()
    if "+offload-" in text and offload is None:
        text, _, offload = text.partition("+offload-")
    key = text.replace("-", "").replace("_", "")
    key = {"fsdp": "fsdp2", "fullyshard": "fsdp2", "stage1": "zero1", "stage2": "zero2", "stage3": "zero3"}.get(key, key)
    offload = None if offload in (None, "none", "") else offload
    return Strategy(key, offload=offload, unit=unit)


def _takes(name: str, offload: str) -> bool:
    """Whether ``name`` takes ``offload``, by the strategy's own rules (an unknown offload: yes, so
    that the strategy says why it is refused)."""
    try:
        Strategy(name, offload=offload)
    except AutobatchError:
        return offload not in OFFLOADS
    return True


def as_strategy(strategy: str | Strategy | None) -> Strategy | None:
    """``None``, or the :class:`Strategy` a name stands for (a Strategy as it is): what every config
    writer takes, so ``deepspeed_config(plan, strategy="zero3")`` reads as ``find(strategy="zero3")`` does.

    Example:
        >>> as_strategy("fsdp").name, as_strategy(None)
        ('fsdp2', None)
    """
    return None if strategy is None else parse_strategy(strategy)


def parse_strategies(text: str, offload: str | None = None, unit: str | None = None) -> list[Strategy]:
    """Comma-separated strategies (``"ddp,fsdp2,zero3"``), each once, in order.

    ``offload`` applies to each strategy of the list that takes it (``"optimizer"``: ZeRO;
    ``"params"``: ZeRO-3 and FSDP), the others are compared without it; ``unit`` to the FSDP ones.

    Example:
        >>> [s.name for s in parse_strategies("ddp, fsdp2,zero3")]
        ['ddp', 'fsdp2', 'zero3']
    """
    names = [part for part in (p.strip() for p in str(text).split(",")) if part]
    if not names:
        raise AutobatchError(f"strategy must name at least one of {', '.join(STRATEGIES)}, but got {text!r}")
    found: list[Strategy] = []
    for part in names:
        base = parse_strategy(part)
        takes = offload not in (None, "none") and _takes(base.name, offload)
        strategy = Strategy(base.name, offload=offload if takes else None, unit=unit if base.is_fsdp else None)
        if strategy not in found:
            found.append(strategy)
    if offload not in (None, "none") and not any(s.offload for s in found):
        if len(found) > 1:
            raise AutobatchError(f"offload={offload!r} applies to none of {', '.join(s.name for s in found)}; add "
                                 f"{_TAKES.get(offload, 'zero3')} to the strategies, or drop offload")
        parse_strategy(found[0].name, offload=offload)  # raises the one-line error
    if unit is not None and not any(s.is_fsdp for s in found):
        parse_strategy(found[0].name, unit=unit)  # likewise: a unit that no strategy of the list would wrap
    return found


def strategy_from_deepspeed(config: Mapping[str, Any]) -> Strategy | None:
    """The strategy a DeepSpeed config trains with; ``None`` when its stage is ``"auto"`` or unreadable.

    Stage 0 is plain data parallelism: ``ddp``.

    Example:
        >>> strategy_from_deepspeed({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}).label
        'zero3+offload-optimizer'
    """
    zero = config.get("zero_optimization") or {}
    if not isinstance(zero, Mapping):
        return None
    stage = zero.get("stage", 0)
    if not isinstance(stage, int) or isinstance(stage, bool) or not 0 <= stage <= 3:
        return None

    def offloaded(key: str) -> bool:
        section = zero.get(key)
        return isinstance(section, Mapping) and str(section.get("device", "none")).lower() not in ("none", "")

    if stage == 0:
        return Strategy("ddp")
    offload = "params" if stage == 3 and offloaded("offload_param") else ("optimizer" if offloaded("offload_optimizer") else None)
    return Strategy(f"zero{stage}", offload=offload)


def strategy_from_accelerate(config: Mapping[str, Any], deepspeed: Mapping[str, Any] | None = None) -> Strategy | None:
    """The strategy an accelerate config trains with, or ``None`` when it does not say.

    ``FSDP`` gives ``fsdp1`` or ``fsdp2`` by ``fsdp_config.fsdp_version``; ``DEEPSPEED`` the stage
    in ``deepspeed_config.zero_stage``, or in the DeepSpeed file it names (passed as ``deepspeed``).

    Example:
        >>> strategy_from_accelerate({"distributed_type": "FSDP", "fsdp_config": {"fsdp_version": 2}}).name
        'fsdp2'
    """
    kind = str(config.get("distributed_type", "")).upper()
    if kind == "FSDP":
        fsdp = config.get("fsdp_config") or {}
        version = fsdp.get("fsdp_version", 1) if isinstance(fsdp, Mapping) else 1
        unit = fsdp.get("fsdp_transformer_layer_cls_to_wrap") if isinstance(fsdp, Mapping) else None
        name = "fsdp2" if str(version) == "2" else "fsdp1"
        offloads = isinstance(fsdp, Mapping) and str(fsdp.get("fsdp_offload_params", False)).lower() == "true"
        return Strategy(name, offload="params" if offloads else None,
                        unit=unit if isinstance(unit, str) and unit else None)
    if kind == "DEEPSPEED":
        section = config.get("deepspeed_config") or {}
        stage = section.get("zero_stage") if isinstance(section, Mapping) else None
        if isinstance(stage, int) and not isinstance(stage, bool) and 0 <= stage <= 3:
            offload = None
            if isinstance(section, Mapping):
                if stage == 3 and str(section.get("offload_param_device", "none")).lower() != "none":
                    offload = "params"
                elif str(section.get("offload_optimizer_device", "none")).lower() != "none" and stage > 0:
                    offload = "optimizer"
            return Strategy("ddp") if stage == 0 else Strategy(f"zero{stage}", offload=offload)
        return strategy_from_deepspeed(deepspeed) if deepspeed is not None else None
    if kind == "MULTI_GPU":
        return Strategy("ddp")
    return None


# accelerate's names for FSDP1's ShardingStrategy, in the order of their values 1–5 (FSDP_SHARDING_STRATEGY).
FSDP_SHARDINGS = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2")


def fsdp_sharding(config: Mapping[str, Any]) -> tuple[str, str] | None:
    """How an accelerate FSDP config shards, as ``(sharding, key)``: one of :data:`FSDP_SHARDINGS`
    and the key that says it; ``None`` where it is not an FSDP config or the value is not one accelerate reads.

    FSDP1 reads ``fsdp_reshard_after_forward`` (a name or 1–5), or the older ``fsdp_sharding_strategy``;
    FSDP2 reads ``fsdp_reshard_after_forward`` as a bool, where ``false`` keeps the parameters gathered
    from forward to backward, as ``SHARD_GRAD_OP`` does. Unset, both shard fully, as autobatch probes.

    Example:
        >>> fsdp_sharding({"distributed_type": "FSDP", "fsdp_config": {"fsdp_sharding_strategy": 3}})
        ('NO_SHARD', 'fsdp_sharding_strategy')
        >>> fsdp_sharding({"distributed_type": "FSDP", "fsdp_config": {"fsdp_version": 2, "fsdp_reshard_after_forward": False}})
        ('SHARD_GRAD_OP', 'fsdp_reshard_after_forward')
    """
    section = config.get("fsdp_config")
    if str(config.get("distributed_type", "")).upper() != "FSDP":
        return None
    section = section if isinstance(section, Mapping) else {}
    if str(section.get("fsdp_version", 1)) == "2":
        value = section.get("fsdp_reshard_after_forward", True)
        flag = str(value).strip().lower()
        if flag not in ("true", "false"):
            return None
        return ("FULL_SHARD" if flag == "true" else "SHARD_GRAD_OP"), "fsdp_reshard_after_forward"
    for key in ("fsdp_reshard_after_forward", "fsdp_sharding_strategy"):
        if key in section:
            value = str(section[key]).strip().upper()
            if value.isdigit() and 1 <= int(value) <= len(FSDP_SHARDINGS):
                return FSDP_SHARDINGS[int(value) - 1], key
            return (value, key) if value in FSDP_SHARDINGS else None
    return "FULL_SHARD", "fsdp_reshard_after_forward"


def not_deepspeed(names: list[str]) -> str:
    """The rule a DeepSpeed file breaks when the plan is for ``names`` (FSDP), with its fix."""
    return (f"a DeepSpeed config, which trains with ZeRO (zero1, zero2, zero3) or plain data parallelism (ddp), but "
            f"the plan is for {', '.join(names)}; drop {option('deepspeed')}, or plan for a ZeRO strategy")


def strategy_problems(strategies: Any, *, grads_held: bool = False, dtype: str = "fp32", probed: bool = False,
                      deepspeed: Any = None, unsharded: bool = False) -> list[str]:
    """What no trial of ``strategies`` (``unsharded``: no strategy given) could answer, each as one line, before the
    first: gradients held where an engine keeps its own, pure low-precision weights under DeepSpeed, a DeepSpeed file
    for FSDP or for an autocast probe, and a ZeRO probe (``probed``) without deepspeed installed (the rows before it
    ran for nothing, then the command failed)."""
    import importlib.util

    problems = []
    if grads_held and any(s.name != "ddp" for s in strategies):
        problems.append(f"{option('grads_held')} holds an unsharded step's gradients into the next forward; FSDP "
                        f"and ZeRO keep theirs as their engines do: drop it, or compare with {option('strategy')} ddp")
    if dtype.lower().endswith("-true") and any(s.is_deepspeed for s in strategies):
        problems.append(f"{option('dtype')} {dtype} trains pure low-precision weights, but DeepSpeed keeps fp32 "
                        f"master weights beside them; use {option('dtype')} {dtype[:4]} with ZeRO")
    fsdp = [s.name for s in strategies if s.is_fsdp]
    if deepspeed is not None and fsdp:
        problems.append(f"{option('deepspeed')} writes {not_deepspeed(fsdp)}")
    low = {"bfloat16": "bf16", "float16": "fp16"}.get(dtype.lower().replace("torch.", ""), dtype.lower())
    plain = "an unsharded" if unsharded else "a ddp" if any(s.name == "ddp" for s in strategies) else None
    if deepspeed is not None and probed and low in ("bf16", "fp16", "bf16-true", "fp16-true") and plain:
        # DeepSpeed, and HF and accelerate writing its file, train bf16/fp16 in its own engine at every stage: bf16
        # weights and gradients beside an fp32 master copy (and fp32 gradients to step it), neither autocast's fp32
        # weights nor pure low-precision ones.
        engine, pure = low[:4], low.endswith("-true")
        probed_as = f"pure {engine} weights" if pure else "fp32 weights under autocast"
        as_deepspeed = (f"{option('dtype')} {engine} " if pure else "") + f"{option('strategy')} zero1"
        problems.append(f"{option('deepspeed')} with {option('dtype')} {dtype} trains in DeepSpeed's {engine} engine "
                        f"({engine} weights and gradients beside an fp32 master copy), but {plain} probe trains "
                        f"{probed_as}; probe as DeepSpeed trains with {as_deepspeed} (or zero2, zero3), or drop "
                        f"{option('deepspeed')}")
    if probed and any(s.is_deepspeed for s in strategies) and importlib.util.find_spec("deepspeed") is None:
        problems.append("probing a ZeRO strategy needs deepspeed, which is not installed; "
                        "pip install 'autobatch[deepspeed]'")
    return problems

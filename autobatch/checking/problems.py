"""What a check reports: each :class:`Problem` with its rule, values and fix, collected into a :class:`CheckResult`."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..configs.files import ConfigFileError, read_config
from ..errors import AutobatchError, ConfigError
from ..planning.plan import Plan, require_positive_int
from ..planning.divisors import MAX_INT
from ..planning.solver import NoExactPlanError, exact_plans, solve

if TYPE_CHECKING:
    pass

__all__ = ["Problem", "CheckResult"]


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
        where = f" in {source}" if source else ""
        if (source and isinstance(value, float) and value.is_integer() and value >= 1
                and name != "train_micro_batch_size_per_gpu"):  # a DataLoader refuses a float batch size
            self.note(f"{name} is {value!r} in {source}: DeepSpeed reads it as {int(value)}; write {int(value)}")
            value = int(value)
        try:
            number = require_positive_int(name, value)
        except AutobatchError:
            self.add(
                "invalid-value",
                f"{name} must be a positive integer, but got {name}={value!r}{where}",
                fix or f"set {name} to a whole number ≥ 1",
                **{name: value},
            )
            return None
        if number >= MAX_INT:  # no batch is that big, and its divisors could take longer than anyone waits
            self.add("invalid-value", f"{name} must be below 2**64, but got {name}={value!r}{where}",
                     fix or f"set {name} to the number you train with", **{name: value})
            return None
        return number

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
    if target >= MAX_INT:  # a product of valid numbers can still be past the bound
        return "use numbers whose product is below 2**64"
    plans = exact_plans(target, gpus, nodes, min_micro=min_micro, model_parallel=mp)
    if plans:
        ranks = plans[0].world_size
        where = (f"{ranks} GPU{'s' if ranks != 1 else ''}" if mp == 1 else
                 f"{ranks} data-parallel rank{'s' if ranks != 1 else ''} ({gpus * nodes} GPUs ÷ {mp} model-parallel)")
        return f"for a global batch of {target} on {where} use micro batch × accumulation = {_pairs_text(plans)}"
    try:
        solve(target, gpus, nodes, min_micro=min_micro, model_parallel=mp)
    except NoExactPlanError as exc:
        near = f"{exc.below} or {exc.above}" if exc.below is not None else str(exc.above)
        sizes = f", or a world size of {', '.join(map(str, exc.world_sizes))}" if exc.world_sizes else ""
        ranks = f"{exc.world_size} GPUs" if mp == 1 else f"{exc.world_size} data-parallel ranks"
        return f"use a global batch of {near} on {ranks}{sizes}"
    return "re-run autobatch solve for this topology"  # unreachable: no plans means solve raises


def _fix_pinned(target: int, micro: int | None, accum: int | None, topo: tuple[int, int, int], min_micro: int) -> str:
    """The fix for a file that sets its micro batch or its accumulation itself: global batches that are
    a multiple of what it sets per rank × the world size, the world sizes that take ``target`` as it
    stands, and, where the micro batch is set and others reach ``target``, those.
    With neither set, :func:`_fix_for`."""
    if micro is None and accum is None:
        return _fix_for(target, *topo, min_micro)
    gpus, nodes, mp = topo
    world = gpus * nodes // mp
    per_rank = (micro or 1) * (accum or 1)
    step = per_rank * (world if micro is not None else world * min_micro)  # a derived micro batch is ≥ min_micro
    pinned = " × ".join(str(n) for n in (micro, accum) if n is not None)
    if micro is None:
        pinned += " accumulation steps" + (f" × {min_micro} samples" if min_micro > 1 else "")
    if micro is not None and accum is not None:  # all three set: the identity leaves one global batch
        fix = f"use a global batch of {step} (= {pinned} × {world} GPUs)"
    else:
        below, above = target // step * step, (target // step + 1) * step
        near = f"{below} or {above}" if below >= step else f"{above}"
        fix = f"use a global batch of {near} (a multiple of {pinned} × {world} GPUs = {step})"
    if target % per_rank == 0:
        if micro is not None and accum is not None:  # both set: one world size multiplies them into target
            ranks = [target // per_rank] if target // per_rank != world else []
        else:
            ranks = [d for d in range(1, min(target // per_rank, 4096) + 1) if (target // per_rank) % d == 0
                     and d != world and (micro is not None or target // per_rank // d >= min_micro)]
        if ranks:
            shown = ", ".join(map(str, ranks[:8])) + (", …" if len(ranks) > 8 else "")
            fix += f", or {target} on a world size of {shown}"
    if micro is not None and exact_plans(target, gpus, nodes, min_micro=min_micro, model_parallel=mp):
        fix += f", or change the micro batch: {_fix_for(target, *topo, min_micro)}"
    return fix

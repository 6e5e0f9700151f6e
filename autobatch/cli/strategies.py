"""``--strategy`` for ``autobatch find``: probe each strategy as rank 0 of W, one row each, per-rank memory shown."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import AutobatchError
from ..strategy import Strategy, parse_strategies

__all__ = ["strategies_from_options", "find_strategies", "strategy_table", "print_strategy_rows", "NoFit"]


class NoFit:
    """A compared strategy under which not even the smallest batch fits: a row of its own, not the end."""

    def __init__(self, strategy: Strategy, error: Exception):
        self.strategy, self.error = strategy, error

    def to_dict(self) -> dict[str, Any]:
        return {"strategy": self.strategy.to_dict(), "max_micro": 0, "error": str(self.error)}


def strategies_from_options(strategy: str | None, offload: str | None, fsdp_unit: str | None) -> list[Strategy] | None:
    """The strategies asked for, validated before any trial; ``None`` when no ``--strategy`` was given."""
    if strategy is None:
        if offload is not None or fsdp_unit is not None:
            raise AutobatchError(
                "--offload and --fsdp-unit describe a sharded strategy, but no --strategy was given; "
                "add --strategy zero3 (or fsdp2, …)")
        return None
    return parse_strategies(strategy, offload=offload, unit=fsdp_unit)


def find_strategies(workload: Any, strategies: list[Strategy], backend: Any, *, gpus: int | None,
                    deepspeed: str | None, options: dict[str, Any], planning: dict[str, Any],
                    on_trial: Any = None) -> list[Any]:
    """One :class:`~autobatch.pipeline.Finding` per strategy, each probed as rank 0 of the data-parallel world.

    When several are compared, one under which nothing fits becomes a :class:`NoFit` row; a single
    strategy raises its error.
    """
    from ..configs.deepspeed import read_deepspeed_config
    from ..errors import NoBatchFitsError
    from ..pipeline import find_plan

    user_config = read_deepspeed_config(deepspeed) if deepspeed and Path(deepspeed).exists() else None
    found: list[Any] = []
    for chosen in strategies:
        try:
            found.append(find_plan(workload, gpus_per_node=gpus or 1, backend=backend, max_batch=options["max_batch"],
                                   min_micro=options["min_batch"], headroom=options["headroom"], strategy=chosen,
                                   deepspeed_config=user_config, on_trial=on_trial, **planning))
        except NoBatchFitsError as exc:
            if len(strategies) == 1:
                raise
            found.append(NoFit(chosen, exc))
    return found


def strategy_table(findings: list[Any]) -> Any:
    """Where each rank's memory goes, one row per strategy (measured in the trial at the max batch)."""
    from rich.table import Table

    from ..units import format_bytes

    table = Table(title="per rank, at the max batch", title_justify="left")
    for column in ("strategy", "ranks", "max", "safe", "parameters", "gradients", "optimizer", "buffers",
                   "activations", "peak", "shards"):
        table.add_column(column, justify="left" if column in ("strategy", "shards") else "right")
    for finding in findings:
        if isinstance(finding, NoFit):
            table.add_row(finding.strategy.label, "-", "0", "-", "-", "-", "-", "-", "-", "no batch fits",
                          finding.strategy.sharded)
            continue
        sharding = finding.probe.extra.get("sharding", {})
        rank = sharding.get("per_rank") or {}

        def size(key: str) -> str:
            return format_bytes(rank[key]) if key in rank else "-"

        table.add_row(
            finding.strategy.label, str(sharding.get("world_size", "-")), str(finding.probe.max_batch),
            str(finding.probe.safe_batch), size("parameters"), size("gradients"), size("optimizer_state"),
            size("buffers"), size("activations"), size("peak"), finding.strategy.sharded,
        )
    return table


def print_strategy_rows(findings: list[Any], device_line: str, *, as_json: bool) -> None:
    """Several strategies compared: one JSON object, or the device, the table and a line per strategy."""
    import json

    import typer

    from .output import console

    if as_json:
        typer.echo(json.dumps({"strategies": [f.to_dict() for f in findings]}, indent=2, ensure_ascii=False))
        return
    out = console()
    out.print(device_line, highlight=False, markup=False)
    out.print(strategy_table(findings))
    for f in findings:
        if isinstance(f, NoFit):
            out.print(f"{f.strategy.label}: {f.error}", highlight=False, markup=False)
        else:
            out.print(f"{f.strategy.label}: max batch {f.probe.max_batch} per rank, trials {f.probe.trials_text()}; "
                      f"plan: {f.plan.describe()}", highlight=False, markup=False)

"""``--strategy`` for ``autobatch find``: probe each strategy as rank 0 of W, one row each, per-rank memory shown."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import AutobatchError
from ..strategy import Strategy, parse_strategies

__all__ = ["strategies_from_options", "user_deepspeed_config", "find_strategies", "strategy_table", "print_strategy_rows", "NoFit",
           "estimate_strategies"]


class NoFit:
    """A compared strategy under which not even the smallest batch fits: a row of its own, not the end."""

    def __init__(self, strategy: Strategy, error: Exception, world_size: int):
        self.strategy, self.error, self.world_size = strategy, error, world_size

    def to_dict(self) -> dict[str, Any]:
        return {"strategy": self.strategy.to_dict(), "world_size": self.world_size, "max_micro": 0, "error": str(self.error)}


def strategies_from_options(strategy: str | None, offload: str | None, fsdp_unit: str | None) -> list[Strategy] | None:
    """The strategies asked for, validated before any trial; ``None`` when no ``--strategy`` was given."""
    if strategy is None:
        if offload is not None or fsdp_unit is not None:
            raise AutobatchError(
                "--offload and --fsdp-unit describe a sharded strategy, but no --strategy was given; "
                "add --strategy zero3 (or fsdp2, …)")
        return None
    return parse_strategies(strategy, offload=offload, unit=fsdp_unit)


def user_deepspeed_config(path: str | None) -> dict[str, Any] | None:
    """The DeepSpeed file ``--deepspeed`` names, when it exists already (its bucket sizes are probed)."""
    from ..configs.deepspeed import read_deepspeed_config

    return read_deepspeed_config(path) if path and Path(path).exists() else None


def find_strategies(workload: Any, strategies: list[Strategy], backend: Any, *, gpus: int | None,
                    deepspeed: str | None, options: dict[str, Any], planning: dict[str, Any],
                    on_trial: Any = None, setup: Any = None, use_trace_prior: bool = True) -> list[Any]:
    """One :class:`~autobatch.pipeline.Finding` per strategy, each probed as rank 0 of the data-parallel world.

    When several are compared, one under which nothing fits becomes a :class:`NoFit` row; a single
    strategy raises its error. ``setup(strategy)``, when given, returns the workload and backend
    for that strategy instead of ``workload`` and ``backend``. ``use_trace_prior`` leads each
    search with the sharded step traced on fake tensors.
    """
    from ..errors import NoBatchFitsError
    from ..pipeline import data_parallel_ranks, find_plan

    user_config = user_deepspeed_config(deepspeed)
    found: list[Any] = []
    for chosen in strategies:
        if setup is not None:
            workload, backend = setup(chosen)
        try:
            found.append(find_plan(workload, gpus_per_node=gpus or 1, backend=backend, max_batch=options["max_batch"],
                                   min_micro=options["min_batch"], headroom=options["headroom"], strategy=chosen,
                                   deepspeed_config=user_config, on_trial=on_trial, use_trace_prior=use_trace_prior,
                                   **planning))
        except NoBatchFitsError as exc:
            if len(strategies) == 1:
                raise
            world = data_parallel_ranks(gpus or 1, planning.get("nodes", 1), planning.get("model_parallel", 1))
            found.append(NoFit(chosen, exc, world))  # the ranks the probe answered for, as find_plan counts them
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
            table.add_row(finding.strategy.label, str(finding.world_size), "0", "-", "-", "-", "-", "-", "-", "no batch fits",
                          finding.strategy.sharded)
            continue
        sharding = finding.probe.extra.get("sharding", {})
        rank = sharding.get("per_rank") or {}

        def size(key: str) -> str:
            return format_bytes(rank[key]) if key in rank else "-"

        capped = " (cap)" if finding.probe.limited_by == "max_batch" else ""  # the cap stopped the search, not memory
        table.add_row(
            finding.strategy.label, str(sharding.get("world_size", "-")), f"{finding.probe.max_batch}{capped}",
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
            led = " (led by the fake-tensor trace)" if f.probe.trace_led else ""
            out.print(f"{f.strategy.label}: max batch {f.probe.max_batch} per rank (limited by {f.probe.limit_text()}), "
                      f"trials {f.probe.trials_text()}{led}; "
                      f"plan: {f.plan.describe()}", highlight=False, markup=False)


def estimate_strategies(model: str, spec: Any, strategies: list[Strategy], *, load: dict[str, Any],
                        settings: dict[str, Any], options: dict[str, Any], planning: dict[str, Any],
                        outputs: dict[str, Any], as_json: bool) -> None:
    """``estimate --strategy``: rank 0 of W's sharded steps against the GPU's usable memory, one row each.

    FSDP and ZeRO train on fake tensors (:func:`~autobatch.estimating.fake_backends.fake_backend`): no
    memory, seconds at any size. DDP's reducer reads its tensors' data, so ``ddp`` runs real steps
    on this machine's CPU (rank 0's share of its memory and time); the output says which. With one strategy and ``--target``, the plan is solved and the
    configs are written with it.
    """
    import json

    import torch
    import typer

    from ..configs import write_plan_configs
    from ..estimating.estimate import load_fake_model
    from ..estimating.fake_backends import fake_backend, gpu_attention_backend
    from ..models import load_model
    from ..units import format_bytes
    from ._app import outputs as written_so_far
    from .output import console, plan_lines, print_written

    usable = spec.usable_bytes
    gpus = planning.pop("gpus_per_node")
    how: dict[str, str] = {}

    def setup(chosen: Strategy) -> tuple[Any, Any]:
        if chosen.name != "ddp":
            workload = load_fake_model(model, **load).to_workload(**settings)
            template = workload.model if isinstance(workload.model, torch.nn.Module) else None
            backend = None if template is None else fake_backend(template, usable)
            if backend is not None:
                how[chosen.label] = "a fake-tensor trace"
                return workload, backend
        how[chosen.label] = "real steps on this CPU"
        typer.echo(f"note: {chosen.label} runs real steps on this CPU (its wrapper reads its tensors' data, so it "
                   "cannot be traced on fake tensors): minutes for a large model", err=True)
        return load_model(model, **load).to_workload(**settings), gpu_attention_backend(usable)

    # The trials already run on fake tensors (or DDP's real steps, as before): a traced prior saves nothing.
    findings = find_strategies(None, strategies, None, gpus=gpus, deepspeed=outputs["deepspeed"], options=options,
                               planning=planning, setup=setup, use_trace_prior=False)
    said = "; ".join(f"{label}: {way}" for label, way in how.items())
    world = gpus * planning["nodes"] // planning["model_parallel"]
    if len(findings) > 1:
        if as_json:
            typer.echo(json.dumps({"estimated": True, "gpu": spec.to_dict(),
                                   "strategies": [f.to_dict() for f in findings]}, indent=2, ensure_ascii=False))
            return
        print_strategy_rows(findings, f"estimated for {spec.name}, as rank 0 of {world} against its usable "
                                      f"{format_bytes(usable)} ({said}; no GPU used)", as_json=False)
        return
    finding = findings[0]
    written: dict[str, str] = {}
    changes: list[str] = []
    if planning["target"] is not None:
        written = write_plan_configs(finding.plan, deepspeed=outputs["deepspeed"], accelerate=outputs["accelerate"],
                                     hf=outputs["hf"], written=written_so_far(), changes=changes,
                                     strategy=finding.strategy, probed_zero=finding.probed_zero)
    if as_json:
        data = {**finding.to_dict(), "estimated": True, "gpu": spec.to_dict()}
        typer.echo(json.dumps({**data, **written, **({"changes": changes} if changes else {})}, indent=2,
                              ensure_ascii=False))
        return
    out = console()
    out.print(f"note: estimated for {spec.name}, as rank 0 of {world} against its usable {format_bytes(usable)} "
              f"({said}; no GPU used; no allocator overheads added)", highlight=False, markup=False)
    out.print(strategy_table([finding]))
    out.print(str(finding.probe), highlight=False, markup=False)
    out.print("plan (estimated): " + finding.plan.describe(), highlight=False, markup=False)
    for line in plan_lines(finding.plan, deepspeed=outputs["deepspeed"], accelerate=outputs["accelerate"],
                           script=outputs["script"], strategy=finding.strategy):
        out.print(line, highlight=False, markup=False)
    print_written(written)
    for line in changes:
        out.print(f"updated {line}", highlight=False, markup=False)

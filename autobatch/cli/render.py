"""A :class:`~autobatch.Report` as the commands print it: ``--json`` is its ``to_dict()``, the text is
drawn from it alone — the device, the trials, the per-rank table, the length table, the plan."""

from __future__ import annotations

import json
from typing import Any

import typer

from ..units import format_bytes
from .output import console, plan_lines, print_plan, print_written

__all__ = ["print_report", "strategy_table", "trial_table", "device_line", "cached_line"]


def print_report(report: Any, *, as_json: bool) -> None:
    """What every command that answers a request prints: one JSON object, or the text of its mode."""
    if not report.main_rank:
        return  # under a launcher only rank 0 prints
    if as_json:
        typer.echo(json.dumps(report.to_dict(), indent=2, ensure_ascii=False))
        return
    if report.mode == "solve":
        print_plan(report.plan, **_launch(report))
    elif report.lengths is not None:
        _print_lengths(report)
        return
    elif len(report.rows) > 1:
        _print_rows(report)
        return
    elif report.estimated:
        _print_estimate(report)
    else:
        _print_probe(report)
    _print_uneven(report)
    print_written(report.written)
    for line in report.changes:
        typer.echo(f"updated {line}")


def _launch(report: Any) -> dict[str, Any]:
    from .. import rank_env

    request = report.request
    return dict(deepspeed=request.deepspeed, accelerate=request.accelerate, script=request.script,
                strategy=report.strategy, probed_zero=report.probed_zero, launcher=rank_env().launcher,
                **report.training())


def device_line(info: Any, label: str = "device") -> str:
    others = "" if info.used_by_others_bytes is None else f", {format_bytes(info.used_by_others_bytes)} held by other processes"
    return (f"{label}: {info.name} on {info.host}: total {format_bytes(info.total_bytes)}, "
            f"free {format_bytes(info.free_bytes)}{others}, capacity for the probe {format_bytes(info.capacity_bytes)}")


def cached_line(probe: Any, trace_prior: bool) -> str:
    """What a cached answer is: probed earlier, nothing ran now, and whether the trace led that search."""
    how = "the fake-tensor trace led that search" if probe.trace_led else "its trials alone searched"
    again = " without the trace" if probe.trace_led and not trace_prior else ""
    when = probe.extra.get("probed_at")
    return f"cached: probed {'at ' + when if when else 'earlier'}, nothing ran now ({how}); --no-cache probes again{again}"


def trial_table(finding: Any) -> Any:
    from rich.table import Table

    title = "trials (cached: they ran when this was probed)" if finding.cached else "trials"
    table = Table(title=title, title_justify="left")
    for column in ("batch", "fits", "peak", "reserved", "fwd+bwd", "optimizer", "s/step"):
        table.add_column(column, justify="right")
    for t in finding.probe.trials:
        never = not t.fits and not t.optimizer_bytes  # out of memory before the optimizer step ran
        table.add_row(
            str(t.batch), "yes" if t.fits else "OOM", format_bytes(t.peak_bytes), format_bytes(t.reserved_bytes),
            format_bytes(t.forward_backward_bytes), "-" if never else format_bytes(t.optimizer_bytes),
            "-" if t.seconds_per_step is None else f"{t.seconds_per_step:.3f}",
        )
    return table


def strategy_table(rows: Any) -> Any:
    """Where each rank's memory goes at its peak, one row per strategy (the trial at the max batch):
    the terms add up to the peak, each counted once (see ``MemoryBreakdown``)."""
    from rich.table import Table

    table = Table(title="per rank, at the max batch's peak (the terms add up to it)", title_justify="left")
    for column in ("strategy", "ranks", "max", "safe", "parameters", "buffers", "optimizer", "gradients",
                   "activations", "other", "peak", "shards"):
        table.add_column(column, justify="left" if column in ("strategy", "shards") else "right")
    for row in rows:
        if not hasattr(row, "probe"):  # a compared strategy under which nothing fits
            table.add_row(row.strategy.label, str(row.world_size), "0", "-", "-", "-", "-", "-", "-", "-", "no batch fits",
                          row.strategy.sharded)
            continue
        sharding = row.probe.extra.get("sharding", {})
        rank = sharding.get("per_rank") or {}

        def size(key: str) -> str:
            return format_bytes(rank[key]) if key in rank else "-"

        capped = " (cap)" if row.probe.limited_by == "max_batch" else ""  # the cap stopped the search, not memory
        table.add_row(
            row.strategy.label, str(sharding.get("world_size", "-")), f"{row.probe.max_batch}{capped}",
            str(row.probe.safe_batch), size("parameters"), size("buffers"), size("optimizer_state"),
            size("gradients"), size("activations"), size("other"), size("peak"), row.strategy.sharded,
        )
    return table


def _estimated_for(report: Any) -> str:
    request, spec = report.request, report.gpu
    world = request.gpus_here() * request.nodes // request.model_parallel
    tail = (f"; each trial's requests, as a fresh run makes them, booked through the caching allocator's model "
            f"after {request.workspace} of workspaces" if request.fragmentation is None else
            f"; ×{report.fragmentation:g} fragmentation and {request.workspace} of workspaces taken off it")
    beside = report.beside_the_context  # the context --cuda-context sets, else the card's
    usable = (f"{format_bytes(beside)}, {format_bytes(spec.total_bytes)} less its "
              f"{format_bytes(spec.total_bytes - beside)} CUDA context")
    return (f"estimated for {spec.name}, as rank 0 of {world} against its usable {usable} (each strategy's step "
            f"traced on fake tensors; no GPU used{tail})")


def _print_rows(report: Any) -> None:
    """Several strategies compared: the device, the table and a line per strategy."""
    out = console()
    head = _estimated_for(report) if report.estimated else device_line(report.device)
    out.print(head, highlight=False, markup=False)
    out.print(strategy_table(report.rows))
    for row in report.rows:
        if not hasattr(row, "probe"):
            out.print(f"{row.strategy.label}: {row.error}", highlight=False, markup=False)
            continue
        led = " (led by the fake-tensor trace)" if row.probe.trace_led else f" ({row.probe.trace_line()})"
        out.print(f"{row.strategy.label}: max batch {row.probe.max_batch} per rank (limited by {row.probe.limit_text()}), "
                  f"trials {row.probe.trials_text()}{led}; plan: {row.plan.describe()}", highlight=False, markup=False)


def _print_estimate(report: Any) -> None:
    finding = report.finding
    out = console()
    if report.request.strategies is not None:
        out.print("note: " + _estimated_for(report), highlight=False, markup=False)
        out.print(strategy_table([finding]))
        out.print(str(finding.probe), highlight=False, markup=False)
    else:
        if report.request.estimate:  # find without a GPU said so on stderr already
            typer.echo(f"note: these are estimates for {report.gpu.name} from a fake-tensor trace (no GPU used); "
                       "probe on the GPU itself for exact figures")
        typer.echo(str(finding.probe))
    if report.plan is not None:
        label = "uniform plan (estimated): " if report.uneven is not None else "plan (estimated): "
        print_plan(report.plan, label=label, **_launch(report))


def _print_uneven(report: Any) -> None:
    """The cards of a mixed list, and the plan per rank with its arithmetic."""
    for card in report.cards:
        typer.echo(f"{card['count']} × {card['gpu']}: max batch {card['max_batch']}, safe {card['safe_batch']} "
                   f"(estimated; peak {card['peak_tflops']} TFLOPS in {card['peak_tflops_in']}, "
                   "the speed its ranks are balanced by)")
    if report.uneven is not None:
        typer.echo(report.uneven.describe())


def _print_probe(report: Any) -> None:
    finding = report.finding
    out = console()
    # under a launcher, the device of the rank with the least room, which the answer is for
    label = "smallest device of the ranks" if finding.ranks_report else "device"
    out.print(device_line(finding.probe.device, label), highlight=False)
    if finding.cached:  # before the trials it shows: they ran earlier, and how that search went
        out.print(cached_line(finding.probe, report.request.trace_prior), highlight=False, markup=False)
    if finding.ranks_report:
        out.print(finding.ranks_report, highlight=False)
    if finding.strategy is not None:
        out.print(strategy_table([finding]))
    out.print(trial_table(finding))
    if not finding.ranks_report:
        out.print(str(finding.probe), highlight=False)
    elif finding.probe.memory_line():  # the rest is the ranks' summary above, as they agreed
        out.print(finding.probe.memory_line(), highlight=False)
    if report.plan is None:  # a plan per rank only: no uniform plan reaches the target
        out.print(f"uniform plan: none reaches {report.request.target} on these ranks", highlight=False)
        return
    out.print("plan: " + report.plan.describe(), highlight=False)
    for line in plan_lines(report.plan, **_launch(report)):
        out.print(line, highlight=False, markup=False)


def _print_lengths(report: Any) -> None:
    table, plan, eval_batch = report.lengths, report.plan, report.eval_batch
    for line in table.lines():
        typer.echo(line)
    where = "" if table.train_seq_len is None else f" at seq_len {table.train_seq_len}"
    typer.echo(f"plan{where}{' (estimated)' if table.estimated else ''}: {plan.describe()}")
    if eval_batch is not None:
        typer.echo(f"evaluation{where}: per_device_eval_batch_size {eval_batch} "
                   f"(max {table.train_row.eval.max_batch}, forward under torch.no_grad())")
    lines = plan_lines(plan, **_launch(report))
    if eval_batch is not None:  # the HF line carries the evaluation batch too
        lines[0] += f" --per_device_eval_batch_size {eval_batch}"
    for line in lines:
        typer.echo(line)
    print_written(report.written)
    for line in report.changes:
        typer.echo(f"updated {line}")

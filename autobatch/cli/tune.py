"""``autobatch tune`` and ``autobatch cache``: the fastest exact plan, and the cache of probes."""

from __future__ import annotations

from typing import Any

import typer

from ._app import cache_app, command, fail
from .options import (
    DeviceName,
    Dtype,
    Headroom,
    MaxBatch,
    MinMicro,
    ModelSpec,
    MultipleOf,
    Nodes,
    OptimizerName,
    SeqLen,
    SimulatedMemory,
    headroom_value,
)

__all__ = ["tune_command", "cache_list_command", "cache_clear_command"]


@command("tune")
def tune_command(
    model: ModelSpec,
    target: int = typer.Option(..., "--target", help="Global batch per optimizer step."),
    trials: int = typer.Option(20, "--trials", help="Optuna trials in this run (a resumed study adds to its own)."),
    gpus: int = typer.Option(1, "--gpus", help="GPUs per node (not the total; world = --gpus × --nodes)."),
    nodes: Nodes = 1,
    checkpointing: str = typer.Option("auto", "--checkpointing", help="auto (both when the model supports it), both, on or off."),
    timed_steps: int = typer.Option(3, "--timed-steps", help="Timed micro steps per plan, after one warm-up step."),
    seq_len: SeqLen = None,
    dtype: Dtype = "fp32",
    optimizer: OptimizerName = "adamw",
    headroom: Headroom = "5%",
    max_batch: MaxBatch = None,
    min_micro: MinMicro = None,
    multiple_of: MultipleOf = None,
    device: DeviceName = None,
    memory: SimulatedMemory = None,
    seed: int = typer.Option(0, "--seed", help="Seed of the TPE sampler."),
    no_cache: bool = typer.Option(False, "--no-cache", help="Probe again instead of reading the cache (the study is kept)."),
    plot: str | None = typer.Option(None, "--plot", help="Write a PNG of memory and throughput here (needs the plot extra)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Time the exact plans for --target (micro x GA x checkpointing) and keep the fastest."""
    import json

    from ..models import load_model
    from ..probing.probe import make_backend
    from ..tuning.tune import tune

    settings = {"auto": None, "both": [False, True], "on": [True], "off": [False]}
    if checkpointing not in settings:
        fail(f"--checkpointing must be auto, both, on or off, but got {checkpointing!r}")
    if plot is not None:
        from ..tuning.plot import check_plot_path

        check_plot_path(plot)  # before the probes and timings, not after
    backend = make_backend(device or ("cpu" if memory is not None else None), memory)
    source = load_model(model, **({} if seq_len is None else {"seq_len": seq_len}))
    workload = source.to_workload(optimizer=optimizer, dtype=dtype)

    def progress(m: Any) -> None:
        rate = "-" if m.samples_per_second is None else f"{m.samples_per_second:,.1f} samples/s"
        typer.echo(f"trial {m.trial_number}: {m.candidate.label}: {rate} ({m.state.lower()})", err=True)

    result = tune(workload, target, backend, n_trials=trials, gpus_per_node=gpus, nodes=nodes,
                  timed_steps=timed_steps, checkpointing=settings[checkpointing], headroom=headroom_value(headroom),
                  max_batch=max_batch, min_micro=min_micro, multiple_of=multiple_of, seed=seed,
                  use_cache=not no_cache, on_trial=progress)
    if plot is not None:
        from ..tuning.plot import plot_tune

        plot_tune(result, plot)
    if as_json:
        typer.echo(json.dumps({**result.to_dict(), **({"plot": plot} if plot else {})}, indent=2))
        return
    typer.echo(str(result))
    typer.echo("plan: " + result.best.candidate.plan.describe())
    if plot is not None:
        typer.echo(f"wrote {plot} (plot)")


@command("list", group=cache_app)
def cache_list_command(as_json: bool = typer.Option(False, "--json", help="Print one JSON object.")) -> None:
    """List cached probe results, newest first, and the tuning studies."""
    import json

    from ..tuning.cache import cache_dir, list_entries
    from ..tuning.tune import list_studies

    entries = list_entries()
    studies = list_studies()
    if as_json:
        typer.echo(json.dumps({
            "cache_dir": str(cache_dir()),
            "entries": [{**e.__dict__, "path": str(e.path)} for e in entries],
            "studies": studies,
        }, indent=2))
        return
    typer.echo(f"cache: {cache_dir()}")
    typer.echo(f"{len(entries)} cached probe{'s' if len(entries) != 1 else ''}")
    for entry in entries:
        typer.echo(f"  {entry}")
    for study in studies:
        typer.echo(f"  study {study['name']}: {study['trials']} trials")


@command("clear", group=cache_app)
def cache_clear_command() -> None:
    """Delete every cached probe result and the tuning studies."""
    from ..tuning.cache import cache_dir, clear

    removed = clear()
    typer.echo(f"removed {removed} file{'s' if removed != 1 else ''} from {cache_dir()}")

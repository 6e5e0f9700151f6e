"""``autobatch tune`` and ``autobatch cache``: the fastest exact plan, and the cache of probes."""

from __future__ import annotations

from typing import Any

import typer

from ._app import cache_app, command
from .options import (
    AsJson,
    DeviceName,
    Dtype,
    GpusPerNode,
    Headroom,
    InputShape,
    MaxMicro,
    MinMicro,
    ModelSpec,
    MultipleOf,
    Nodes,
    NumClasses,
    OptimizerName,
    SeqLen,
    SimulatedMemory,
    Target,
    TrustRemoteCode,
    check_micro_range,
    headroom_value,
    model_load_options,
    size_value,
)

__all__ = ["tune_command", "cache_list_command", "cache_clear_command"]


@command("tune", examples=[
    "autobatch tune --model gpt2 --target 224 --gpus 8",
    "autobatch tune --model tiny-mlp --target 16 --trials 3 --device cpu --memory 2MiB --max-micro 16",
])
def tune_command(
    model: ModelSpec,
    target: Target,
    trials: int = typer.Option(20, "--trials", min=1, help="Optuna trials in this run (a resumed study adds to its own)."),
    gpus: GpusPerNode = 1,
    nodes: Nodes = 1,
    grad_checkpointing: bool | None = typer.Option(
        None, "--grad-checkpointing/--no-grad-checkpointing", rich_help_panel="Model",
        show_default="both, where the model supports it", help="Time plans with gradient checkpointing on, or off.",
    ),
    timed_steps: int = typer.Option(3, "--timed-steps", min=1, help="Timed micro steps per plan, after one warm-up step."),
    seq_len: SeqLen = None,
    input_shape: InputShape = None,
    num_classes: NumClasses = 10,
    trust_remote_code: TrustRemoteCode = False,
    dtype: Dtype = "fp32",
    optimizer: OptimizerName = "adamw",
    headroom: Headroom = "5%",
    max_micro: MaxMicro = None,
    min_micro: MinMicro = None,
    multiple_of: MultipleOf = None,
    device: DeviceName = None,
    memory: SimulatedMemory = None,
    seed: int = typer.Option(0, "--seed", help="Seed of the TPE sampler."),
    no_cache: bool = typer.Option(False, "--no-cache", help="Probe again instead of reading the cache (the study is kept)."),
    plot: str | None = typer.Option(None, "--plot", rich_help_panel="Output",
                                    help="Write a PNG of memory and throughput here (needs the plot extra)."),
    as_json: AsJson = False,
) -> None:
    """Time the exact plans for --target (micro × GA × checkpointing) and keep the fastest."""
    import json

    from ..models import load_model
    from ..probing.probe import make_backend
    from ..tuning.tune import tune

    room = headroom_value(headroom)
    check_micro_range(min_micro, max_micro)
    if memory is not None:
        size_value(memory, "--memory")
    if plot is not None:
        from ..tuning.plot import check_plot_path

        check_plot_path(plot)  # before the probes and timings, not after
    backend = make_backend(device or ("cpu" if memory is not None else None), memory)
    source = load_model(model, **model_load_options(seq_len, input_shape, num_classes, trust_remote_code))
    workload = source.to_workload(optimizer=optimizer, dtype=dtype)

    def progress(m: Any) -> None:
        rate = "-" if m.samples_per_second is None else f"{m.samples_per_second:,.1f} samples/s"
        typer.echo(f"trial {m.trial_number}: {m.candidate.label}: {rate} ({m.state.lower()})", err=True)

    result = tune(workload, target, backend, n_trials=trials, gpus_per_node=gpus, nodes=nodes,
                  timed_steps=timed_steps, checkpointing=None if grad_checkpointing is None else [grad_checkpointing],
                  headroom=room, max_batch=max_micro, min_micro=min_micro, multiple_of=multiple_of, seed=seed,
                  use_cache=not no_cache, on_trial=progress)
    if plot is not None:
        from ..tuning.plot import plot_tune

        plot_tune(result, plot)
    if as_json:
        typer.echo(json.dumps({**result.to_dict(), **({"plot": plot} if plot else {})}, indent=2, ensure_ascii=False))
        return
    typer.echo(str(result))
    typer.echo("plan: " + result.best.candidate.plan.describe())
    if plot is not None:
        typer.echo(f"wrote {plot} (plot)")


@command("list", on=cache_app, examples=["autobatch cache list --json"])
def cache_list_command(as_json: AsJson = False) -> None:
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


@command("clear", on=cache_app, examples=["autobatch cache clear"])
def cache_clear_command() -> None:
    """Delete every cached probe result and the tuning studies."""
    from ..tuning.cache import cache_dir, clear

    removed = clear()
    typer.echo(f"removed {removed} file{'s' if removed != 1 else ''} from {cache_dir()}")

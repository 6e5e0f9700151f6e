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
    request_from,
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
    seed: int = typer.Option(0, "--seed", min=0, max=2**32 - 1, help="Seed of the TPE sampler (0 to 2**32 - 1)."),
    no_cache: bool = typer.Option(False, "--no-cache", help="Probe again instead of reading the cache (the study is kept)."),
    plot: str | None = typer.Option(None, "--plot", rich_help_panel="Output",
                                    help="Write a PNG of memory and throughput here (needs the plot extra)."),
    as_json: AsJson = False,
) -> None:
    """Time the exact plans for --target (micro × GA × checkpointing) and keep the fastest."""
    request = request_from({k: v for k, v in locals().items() if k not in ("trials", "timed_steps", "seed")},
                           grad_checkpointing=False, estimate=False)  # first: the flags alone
    import json

    from .. import tune_plans

    def progress(m: Any) -> None:
        rate = "-" if m.samples_per_second is None else f"{m.samples_per_second:,.1f} samples/s"
        typer.echo(f"trial {m.trial_number}: {m.candidate.label}: {rate} ({m.state.lower()})", err=True)

    result = tune_plans(request, trials=trials, timed_steps=timed_steps, seed=seed, on_trial=progress,
                        checkpointing=None if grad_checkpointing is None else [grad_checkpointing])
    if as_json:
        typer.echo(json.dumps(result.to_dict(), indent=2, ensure_ascii=False))
        return
    typer.echo(str(result))
    typer.echo("plan: " + result.best.candidate.plan.describe())
    if result.plot is not None:
        typer.echo(f"wrote {result.plot} (plot)")


@command("list", on=cache_app, examples=["autobatch cache list --json"])
def cache_list_command(as_json: AsJson = False) -> None:
    """List cached probe results, newest first, and the tuning studies."""
    import json

    from .. import cache_listing

    listing = cache_listing()
    typer.echo(json.dumps(listing.to_dict(), indent=2) if as_json else "\n".join(listing.lines()))


@command("clear", on=cache_app, examples=["autobatch cache clear"])
def cache_clear_command() -> None:
    """Delete every cached probe result and the tuning studies."""
    from .. import clear_cache

    removed, folder = clear_cache()
    typer.echo(f"removed {removed} file{'s' if removed != 1 else ''} from {folder}")

"""``autobatch solve`` and ``autobatch check``: plan a global batch, check a setup."""

from __future__ import annotations

import typer

from ..configs import accelerate_command, hf_flags, lightning_settings, torchrun_command
from ._app import command, outputs
from .options import ModelParallel, MultipleOf, Nodes

# --gpus is GPUs per node in both commands (the world size is --gpus × --nodes).

__all__ = ["solve_command", "check_command"]


@command("solve")
def solve_command(
    target: int = typer.Option(..., "--target", help="Global batch per optimizer step."),
    gpus: int = typer.Option(1, "--gpus", help="GPUs per node (not the total; world = --gpus × --nodes)."),
    nodes: Nodes = 1,
    max_micro: int | None = typer.Option(None, "--max-micro", help="Largest per-GPU batch that fits in memory."),
    min_micro: int = typer.Option(1, "--min-micro", help="Smallest per-GPU batch; 2 for BatchNorm models."),
    multiple_of: MultipleOf = None,
    model_parallel: ModelParallel = 1,
    base_lr: float | None = typer.Option(None, "--base-lr", help="Learning rate tuned at --base-batch."),
    base_batch: int | None = typer.Option(None, "--base-batch", help="Global batch --base-lr was tuned at."),
    deepspeed: str | None = typer.Option(
        None, "--deepspeed", help="Write the batch keys into this DeepSpeed JSON (other keys are kept)."
    ),
    accelerate: str | None = typer.Option(None, "--accelerate", help="Write an accelerate config YAML here."),
    keep_auto: bool = typer.Option(False, "--keep-auto", help='Leave "auto" values in the DeepSpeed JSON.'),
    script: str = typer.Option("train.py", "--script", help="Training script shown in the launch lines."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Micro batch × gradient accumulation × GPUs = --target exactly; write the configs."""
    import json

    from ..configs import write_plan_configs
    from ..planning.solver import solve

    plan = solve(
        target, gpus, nodes, max_micro, min_micro=min_micro, multiple_of=multiple_of,
        model_parallel=model_parallel, base_lr=base_lr, base_batch=base_batch,
    )
    changes: list[str] = []
    written = write_plan_configs(plan, deepspeed=deepspeed, accelerate=accelerate, keep_auto=keep_auto,
                                 written=outputs(), changes=changes)
    if as_json:
        typer.echo(json.dumps({**plan.to_dict(), **written, **({"changes": changes} if changes else {})},
                              indent=2, ensure_ascii=False))
        return
    hf = hf_flags(plan, deepspeed)
    lightning = lightning_settings(plan)
    trainer = ", ".join(f"{k}={v}" for k, v in lightning["trainer"].items())
    typer.echo(plan.describe())
    typer.echo(f"HF TrainingArguments: {' '.join(hf)}")
    typer.echo(f"Lightning: Trainer({trainer}), DataLoader(batch_size={lightning['dataloader']['batch_size']})")
    typer.echo(f"torchrun: {torchrun_command(plan, script)}")
    if accelerate is not None:
        typer.echo(f"accelerate: {accelerate_command(plan, script, config_file=accelerate, deepspeed_config_file=deepspeed)}")
    for kind, path in written.items():
        typer.echo(f"wrote {path} ({kind.replace('_', ' ')})")
    for line in changes:
        typer.echo(f"updated {line}")


@command("check")
def check_command(
    target: int | None = typer.Option(None, "--target", help="Global batch per optimizer step."),
    micro_batch: int | None = typer.Option(None, "--micro-batch", help="Per-GPU batch (per_device_train_batch_size)."),
    grad_accum: int | None = typer.Option(None, "--grad-accum", help="Gradient accumulation steps."),
    gpus: int | None = typer.Option(
        None, "--gpus", help="GPUs per node (not the total; world = --gpus × --nodes). Default: from --accelerate, else 1."
    ),
    nodes: int | None = typer.Option(None, "--nodes", help="Number of nodes. Default: from --accelerate, else 1."),
    model_parallel: ModelParallel = 1,
    deepspeed: str | None = typer.Option(None, "--deepspeed", help="DeepSpeed JSON to check."),
    accelerate: str | None = typer.Option(None, "--accelerate", help="accelerate config YAML to check."),
    batchnorm: bool = typer.Option(False, "--batchnorm", help="The model has BatchNorm (needs ≥ 2 samples per GPU)."),
    model: str | None = typer.Option(None, "--model", help="Check this model for BatchNorm (a name from `autobatch models`, hf:DIR, file.py:fn)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Report every batch-size problem in a setup before launch, each with its fix. Exit 1 if any."""
    import json

    from ..checking.setup import check_setup

    module = None
    if model is not None:
        import torch

        from ..models import load_model

        with torch.device("meta"):  # only the layers matter here: no memory, no weights
            module = load_model(model).model
    result = check_setup(
        target=target, micro_batch=micro_batch, grad_accum=grad_accum, gpus_per_node=gpus, nodes=nodes,
        model_parallel=model_parallel, deepspeed=deepspeed, accelerate=accelerate, batchnorm=batchnorm,
        model=module,
    )
    typer.echo(json.dumps(result.to_dict(), indent=2, ensure_ascii=False) if as_json else result.report())
    if not result.ok:
        raise typer.Exit(1)

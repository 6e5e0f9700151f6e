"""``autobatch solve`` and ``autobatch check``: plan a global batch, check a setup."""

from __future__ import annotations

import typer

from ._app import command, outputs
from .options import (
    AccelerateOut,
    AsJson,
    DeepSpeedOut,
    FsdpUnitOption,
    GpusPerNode,
    HfOut,
    InputShape,
    ModelParallel,
    MultipleOf,
    Nodes,
    NumClasses,
    OffloadOption,
    Script,
    SeqLen,
    Target,
    TrustRemoteCode,
)
from .options import request_from
from .render import print_report

# --gpus is GPUs per node in both commands (the world size is --gpus × --nodes).

__all__ = ["solve_command", "check_command"]


@command("solve", examples=[
    "autobatch solve --target 224 --gpus 16 --max-micro 9",
    "autobatch solve --target 256 --gpus 8 --nodes 2 --max-micro 12 --deepspeed ds.json --hf args.json",
    "autobatch solve --target 64 --gpus 8 --max-micro 4 --strategy zero3 --deepspeed ds.json",
    "autobatch solve --target 224 --gpus 16 --micro-batch 7",
])
def solve_command(
    target: Target,
    gpus: GpusPerNode = 1,
    nodes: Nodes = 1,
    max_micro: int | None = typer.Option(None, "--max-micro", min=1, rich_help_panel="Plan",
                                         help="Largest per-GPU batch allowed (what `autobatch find` measured)."),
    min_micro: int | None = typer.Option(None, "--min-micro", min=1, rich_help_panel="Plan", show_default="1",
                                         help="Smallest per-GPU batch (2 for a model with BatchNorm)."),
    micro_batch: int | None = typer.Option(None, "--micro-batch", min=1, rich_help_panel="Plan",
                                           help="Fix the per-GPU batch (instead of --max-micro/--min-micro); "
                                                "the accumulation follows, or no exact plan is said."),
    multiple_of: MultipleOf = None,
    model_parallel: ModelParallel = 1,
    base_lr: float | None = typer.Option(None, "--base-lr", help="Learning rate tuned at --base-batch."),
    base_batch: int | None = typer.Option(None, "--base-batch", min=1, help="Global batch --base-lr was tuned at."),
    deepspeed: DeepSpeedOut = None,
    accelerate: AccelerateOut = None,
    hf: HfOut = None,
    keep_auto: bool = typer.Option(False, "--keep-auto", rich_help_panel="Output",
                                   help='Leave "auto" values in the DeepSpeed JSON.'),
    script: Script = "train.py",
    strategy: str | None = typer.Option(
        None, "--strategy", rich_help_panel="Plan",
        help="How training shards: ddp, fsdp2, fsdp1, zero1, zero2 or zero3; the configs written carry it.",
    ),
    offload: OffloadOption = None,
    fsdp_unit: FsdpUnitOption = None,
    as_json: AsJson = False,
) -> None:
    """Micro batch × gradient accumulation × GPUs = --target exactly; write the configs.

    Without --max-micro any per-GPU batch is allowed; `autobatch find` measures it. With
    --strategy the configs train that way (DeepSpeed stage and offload, accelerate's FSDP or
    DeepSpeed plugin, HF fsdp/deepspeed); probe it with `find --strategy` for the micro batch."""
    request = request_from(locals())  # first: the flags alone
    from .. import answer

    print_report(answer(request, written=outputs(), on_note=lambda text: typer.echo(f"note: {text}", err=True)),
                 as_json=as_json)


@command("check", examples=[
    "autobatch check --target 224 --gpus 16 --micro-batch 7 --grad-accum 2",
    "autobatch check --deepspeed ds.json --accelerate accelerate.yaml --model tiny-cnn",
    "autobatch check --hf args.json --gpus 8 --strategy zero2",
])
def check_command(
    target: int | None = typer.Option(None, "--target", min=1, rich_help_panel="Plan", help="Global batch per optimizer step."),
    micro_batch: int | None = typer.Option(None, "--micro-batch", min=1, rich_help_panel="Plan",
                                           help="Per-GPU batch (per_device_train_batch_size)."),
    grad_accum: int | None = typer.Option(None, "--grad-accum", min=1, rich_help_panel="Plan",
                                          help="Gradient accumulation steps."),
    gpus: int | None = typer.Option(None, "--gpus", min=1, rich_help_panel="Plan", show_default="from --accelerate, else 1",
                                    help="GPUs per node (not the total: world size = --gpus × --nodes)."),
    nodes: int | None = typer.Option(None, "--nodes", min=1, rich_help_panel="Plan", show_default="from --accelerate, else 1",
                                     help="Number of nodes."),
    model_parallel: ModelParallel = 1,
    deepspeed: str | None = typer.Option(None, "--deepspeed", help="DeepSpeed JSON to check."),
    accelerate: str | None = typer.Option(None, "--accelerate", help="accelerate config YAML to check."),
    hf: str | None = typer.Option(None, "--hf", help="HF TrainingArguments values (JSON or YAML, as find --hf writes "
                                  "them) to check, with the DeepSpeed config they name."),
    batchnorm: bool = typer.Option(False, "--batchnorm", help="The model has BatchNorm (needs ≥ 2 samples per GPU)."),
    model: str | None = typer.Option(
        None, "--model", rich_help_panel="Model",
        help="Look for BatchNorm in this model: a built-in name, hf:NAME_OR_DIR, file.py:fn or module:fn (which "
             "import and run that code: pass only code you trust). Only its layers are built, on the meta device.",
    ),
    seq_len: SeqLen = None,
    input_shape: InputShape = None,
    num_classes: NumClasses = 10,
    trust_remote_code: TrustRemoteCode = False,
    strategy: str | None = typer.Option(
        None, "--strategy", rich_help_panel="Plan",
        help="The strategy the micro batch was probed under (find --strategy); checked against the configs' stage.",
    ),
    offload: OffloadOption = None,
    as_json: AsJson = False,
) -> None:
    """Report every batch-size problem in a setup before launch, each with its fix. Exit 1 if any.

    --input-shape and --num-classes are accepted so the model flags of `find` can be passed as they
    are; only the layers matter here, so no input is built. --model says when the micro batch was
    never probed at --seq-len, or is above the batch probed there (from the probes `find` cached for
    the model); without --seq-len, at the length `find` takes for the model."""
    import json

    from .. import check

    result = check(target=target, micro_batch=micro_batch, grad_accum=grad_accum, gpus_per_node=gpus, nodes=nodes,
                   model_parallel=model_parallel, deepspeed=deepspeed, accelerate=accelerate, hf=hf, batchnorm=batchnorm,
                   model=model, seq_len=seq_len, trust_remote_code=trust_remote_code, strategy=strategy,
                   offload=offload)
    typer.echo(json.dumps(result.to_dict(), indent=2, ensure_ascii=False) if as_json else result.report())
    if not result.ok:
        raise typer.Exit(1)

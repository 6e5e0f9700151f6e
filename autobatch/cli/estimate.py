"""``autobatch estimate``, ``gpus`` and ``models``: answers without a GPU, and what is built in."""

from __future__ import annotations

import typer

from ._app import command
from .find import answer_and_print
from .options import (
    AccelerateOut,
    AsJson,
    Attention,
    CudaContext,
    DeepSpeedOut,
    Dtype,
    Evaluation,
    Fragmentation,
    FsdpUnitOption,
    GpuMemory,
    GpuName,
    GpusPerNode,
    GradCheckpointing,
    GradsHeld,
    Headroom,
    HfOut,
    InputShape,
    MaxMicro,
    MinMicro,
    ModelParallel,
    ModelSpec,
    MultipleOf,
    Nodes,
    NumClasses,
    OffloadOption,
    OptimizerName,
    Script,
    SeqLens,
    StrategyOption,
    TrainSeqLen,
    TrustRemoteCode,
    Uneven,
    Workspace,
    request_from,
)
from .output import console

__all__ = ["estimate_command", "gpus_command", "models_command"]


@command("estimate", examples=[
    "autobatch estimate --model gpt2 --gpu h100-80gb --target 224 --gpus 8",
    "autobatch estimate --model llama-1b --gpu-memory 40GiB --seq-len 2048 --dtype bf16",
    "autobatch estimate --model gpt2 --gpu a100-80gb:4,a100-40gb:4 --target 512 --uneven",
    "autobatch estimate --model bert-base --gpu v100-16gb --attention eager --cuda-context 1.3GiB",
    "autobatch estimate --model llama-7b --gpu a100-40gb --gpus 8 --strategy zero3 --offload optimizer --dtype bf16",
    "autobatch estimate --model gpt2 --gpu rtx-4090 --gpus 2 --strategy fsdp2 --offload params",
])
def estimate_command(
    model: ModelSpec, gpu: GpuName = None, gpu_memory: GpuMemory = None,
    target: int | None = typer.Option(None, "--target", min=1, rich_help_panel="Plan",
                                      help="Global batch per optimizer step: plan it with the estimated safe batch."),
    gpus: GpusPerNode = None, nodes: Nodes = 1, model_parallel: ModelParallel = 1, multiple_of: MultipleOf = None,
    seq_len: SeqLens = None, evaluation: Evaluation = False, train_seq_len: TrainSeqLen = None,
    input_shape: InputShape = None, num_classes: NumClasses = 10, trust_remote_code: TrustRemoteCode = False,
    attention: Attention = None, dtype: Dtype = "fp32", optimizer: OptimizerName = "adamw",
    grad_checkpointing: GradCheckpointing = False, grads_held: GradsHeld = False,
    headroom: Headroom = "5%", max_micro: MaxMicro = None, min_micro: MinMicro = None,
    fragmentation: Fragmentation = None, workspace: Workspace = "64MiB", cuda_context: CudaContext = None,
    deepspeed: DeepSpeedOut = None,
    accelerate: AccelerateOut = None, hf: HfOut = None, script: Script = "train.py",
    strategy: StrategyOption = None, offload: OffloadOption = None, fsdp_unit: FsdpUnitOption = None,
    uneven: Uneven = False, as_json: AsJson = False,
) -> None:
    """Estimate the per-GPU batch for a named GPU from any machine: fake-tensor trace, no GPU used.

    The JSON carries "estimated": true. With --strategy: the sharded step as rank 0 of --gpus × --nodes ranks (torch's fake process group) against the GPU's usable memory; FSDP and ZeRO are traced on fake tensors (no memory used), ZeRO's and FSDP's --offload with the host's tensors counted apart from the GPU's; ddp as its gradient buckets."""  # noqa: E501 - one paragraph in --help
    answer_and_print(request_from(locals(), estimate=True), as_json=as_json)


@command("gpus", examples=["autobatch gpus", "autobatch estimate --model gpt2 --gpu-memory 40GiB"])
def gpus_command(as_json: AsJson = False) -> None:
    """List the GPUs `autobatch estimate --gpu` (and `find --gpu`) knows, with total and usable memory."""
    import json

    from .. import DEFAULT_GPU, GPUS
    from ..units import format_bytes

    if as_json:
        typer.echo(json.dumps({"default": DEFAULT_GPU, "gpus": [g.to_dict() for g in GPUS.values()]}, indent=2))
        return
    from rich.table import Table

    table = Table(title="GPUs (--gpu NAME)", title_justify="left")
    for column, justify in (("name", "left"), ("total", "right"), ("CUDA context", "right"), ("usable", "right"),
                            ("vendor", "left"), ("notes", "left")):
        table.add_column(column, justify=justify)
    for spec in GPUS.values():
        table.add_row(spec.name, format_bytes(spec.total_bytes), format_bytes(spec.context_bytes),
                      format_bytes(spec.usable_bytes), spec.vendor, spec.notes)
    console().print(table)
    typer.echo(f"default: {DEFAULT_GPU}; any other card: --gpu-memory 40GiB (usable = total − CUDA context)")


@command("models", examples=["autobatch models", "autobatch find --model tiny-gpt2 --device cpu --memory 8MiB"])
def models_command(as_json: AsJson = False) -> None:
    """List the built-in models (random weights, built from configs: nothing is downloaded)."""
    import json

    from rich.table import Table

    from .. import list_models

    rows = list_models()
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    table = Table(title="built-in models (or pass hf:NAME_OR_DIR, file.py:fn, module:fn)", title_justify="left")
    for column in ("name", "parameters", "seq len", "description"):
        table.add_column(column)
    for row in rows:
        table.add_row(row["name"], _count(row["parameters"]), str(row["seq_len"] or "-"), row["description"])
    console().print(table)


def _count(parameters: int) -> str:
    """A parameter count as people write it: 124.4M, 1.2B, 86.5K (a tiny model's were all 0.0M)."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if parameters >= size:
            return f"{parameters / size:,.1f}{unit}"
    return str(parameters)

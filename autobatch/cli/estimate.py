"""``autobatch estimate``, ``gpus`` and ``models``: answers without a GPU, and what is built in."""

from __future__ import annotations

import contextvars
import math

import typer

from ._app import command, fail, outputs
from .lengths import parse_seq_lens, run_length_table
from .options import (
    AccelerateOut,
    AsJson,
    DeepSpeedOut,
    Dtype,
    FsdpUnitOption,
    GpuMemory,
    GpuName,
    GpusPerNode,
    GradCheckpointing,
    Headroom,
    HfOut,
    InputShape,
    MaxMicro,
    MinMicro,
    ModelParallel,
    ModelSpec,
    MultipleOf,
    Nodes,
    Evaluation,
    NumClasses,
    OffloadOption,
    OptimizerName,
    Script,
    SeqLens,
    StrategyOption,
    TrainSeqLen,
    TrustRemoteCode,
    check_micro_range,
    headroom_value,
    model_load_options,
    size_value,
)
from .output import console, print_plan, print_written

__all__ = ["ESTIMATE_NOTED", "estimate_command", "gpus_command", "models_command"]

# `find` with no GPU to probe says itself (on stderr) that it estimates, then runs this command:
# set while it does, so the note is not printed twice.
ESTIMATE_NOTED: contextvars.ContextVar[bool] = contextvars.ContextVar("autobatch_estimate_noted", default=False)


@command("estimate", examples=[
    "autobatch estimate --model gpt2 --gpu h100-80gb --target 224 --gpus 8",
    "autobatch estimate --model llama-1b --gpu-memory 40GiB --seq-len 2048 --dtype bf16",
])
def estimate_command(
    model: ModelSpec,
    gpu: GpuName = None,
    gpu_memory: GpuMemory = None,
    target: int | None = typer.Option(None, "--target", min=1, rich_help_panel="Plan",
                                      help="Global batch per optimizer step: plan it with the estimated safe batch."),
    gpus: GpusPerNode = 1,
    nodes: Nodes = 1,
    model_parallel: ModelParallel = 1,
    multiple_of: MultipleOf = None,
    seq_len: SeqLens = None,
    evaluation: Evaluation = False,
    train_seq_len: TrainSeqLen = None,
    input_shape: InputShape = None,
    num_classes: NumClasses = 10,
    trust_remote_code: TrustRemoteCode = False,
    dtype: Dtype = "fp32",
    optimizer: OptimizerName = "adamw",
    grad_checkpointing: GradCheckpointing = False,
    headroom: Headroom = "5%",
    max_micro: MaxMicro = None,
    min_micro: MinMicro = None,
    fragmentation: float = typer.Option(1.05, "--fragmentation", help="Allocator reserved/allocated ratio assumed."),
    workspace: str = typer.Option("64MiB", "--workspace", help="cuBLAS/cuDNN workspaces assumed."),
    deepspeed: DeepSpeedOut = None,
    accelerate: AccelerateOut = None,
    hf: HfOut = None,
    script: Script = "train.py",
    strategy: StrategyOption = None,
    offload: OffloadOption = None,
    fsdp_unit: FsdpUnitOption = None,
    as_json: AsJson = False,
) -> None:
    """Estimate the per-GPU batch for a named GPU from any machine: fake-tensor trace, no GPU used.

    The JSON carries "estimated": true. With --strategy: the sharded step as rank 0 of --gpus ×
    --nodes ranks (torch's fake process group) against the GPU's usable memory; FSDP and ZeRO
    are traced on fake tensors (no memory used), ddp runs real steps on this machine's CPU."""
    import json

    from .strategies import strategies_from_options

    strategies = strategies_from_options(strategy, offload, fsdp_unit)
    from ..configs import check_plan_outputs, write_plan_configs
    from ..estimating.estimate import estimate, load_fake_model
    from ..estimating.gpus import resolve_gpu
    from ..estimating.overheads import Overheads
    from ..pipeline import plan_summary
    from ..planning.solver import check_request, solve

    if gpu is not None and gpu_memory is not None:
        fail(f"--gpu {gpu} and --gpu-memory {gpu_memory} both name the GPU to estimate for; pass one")
    room = headroom_value(headroom)
    check_micro_range(min_micro, max_micro)
    workspace_bytes = size_value(workspace, "--workspace")
    memory_bytes = None if gpu_memory is None else size_value(gpu_memory, "--gpu-memory")
    spec = resolve_gpu(gpu, memory_bytes)  # an unknown name fails here, before any model is built
    if (deepspeed or accelerate or hf) and target is None:
        fail("--deepspeed, --accelerate and --hf write a plan, which needs --target (the global batch); add --target N")
    check_request(target, gpus, nodes, min_micro=min_micro or 1, multiple_of=multiple_of, model_parallel=model_parallel)
    check_plan_outputs(deepspeed=deepspeed, accelerate=accelerate, hf=hf)
    if not math.isfinite(fragmentation) or fragmentation < 1:
        fail(f"--fragmentation is reserved ÷ allocated memory and must be a finite number ≥ 1, "
             f"but got {fragmentation}; use e.g. 1.05")
    overheads = Overheads(fragmentation=fragmentation, workspace_bytes=workspace_bytes)
    lengths = parse_seq_lens(seq_len)
    if strategies is not None:
        if (lengths and len(lengths) > 1) or evaluation:
            fail("--strategy estimates one sequence length for training; drop --eval and pass one --seq-len")
        from .strategies import estimate_strategies

        estimate_strategies(
            model, spec, strategies, load=model_load_options(lengths[0] if lengths else None, input_shape, num_classes,
                                                               trust_remote_code),
            settings=dict(optimizer=optimizer, dtype=dtype, grad_checkpointing=grad_checkpointing),
            options=dict(max_batch=max_micro, min_batch=min_micro, headroom=room),
            planning=dict(target=target, gpus_per_node=gpus, nodes=nodes, model_parallel=model_parallel,
                          multiple_of=multiple_of),
            outputs=dict(deepspeed=deepspeed, accelerate=accelerate, hf=hf, script=script), as_json=as_json)
        return
    if (lengths and len(lengths) > 1) or evaluation:
        run_length_table(
            model=model, lengths=lengths, evaluation=evaluation, train_seq_len=train_seq_len,
            estimate_for={"gpu": spec, "overheads": overheads}, device=None, memory=None,
            load=model_load_options(None, input_shape, num_classes, trust_remote_code),
            settings=dict(optimizer=optimizer, dtype=dtype, grad_checkpointing=grad_checkpointing),
            options=dict(max_batch=max_micro, min_batch=min_micro, headroom=room),
            planning=dict(target=target, gpus_per_node=gpus, nodes=nodes, model_parallel=model_parallel,
                          multiple_of=multiple_of),
            outputs=dict(deepspeed=deepspeed, accelerate=accelerate, hf=hf), as_json=as_json, use_cache=False,
        )
        return
    source = load_fake_model(model, **model_load_options(lengths[0] if lengths else None, input_shape, num_classes,
                                                         trust_remote_code))
    workload = source.to_workload(optimizer=optimizer, dtype=dtype, grad_checkpointing=grad_checkpointing)
    result = estimate(workload, spec, overheads=overheads, headroom=room, max_batch=max_micro, min_batch=min_micro,
                      data_parallel=gpus * nodes // max(1, model_parallel))
    plan = None
    written: dict[str, str] = {}
    changes: list[str] = []
    if target is not None:
        plan = solve(target, gpus, nodes, result.safe_batch, min_micro=result.min_batch, multiple_of=multiple_of,
                     model_parallel=model_parallel)
        written = write_plan_configs(plan, deepspeed=deepspeed, accelerate=accelerate, hf=hf, written=outputs(),
                                     changes=changes)
    if as_json:
        # The same top-level keys as `find --json` (max_batch, safe_batch, the plan's numbers, plan),
        # so scripts read either the same way.
        data = {**(plan_summary(plan) if plan is not None else {}), **result.to_dict()}
        if plan is not None:
            data["plan"] = plan.to_dict()
        typer.echo(json.dumps({**data, **written, **({"changes": changes} if changes else {})}, indent=2, ensure_ascii=False))
        return
    if not ESTIMATE_NOTED.get():
        typer.echo(f"note: these are estimates for {spec.name} from a fake-tensor trace (no GPU used); "
                   "probe on the GPU itself for exact figures")
    typer.echo(str(result))
    if plan is not None:
        print_plan(plan, label="plan (estimated): ", deepspeed=deepspeed, accelerate=accelerate, script=script)
    print_written(written)
    for line in changes:
        typer.echo(f"updated {line}")


@command("gpus", examples=["autobatch gpus", "autobatch estimate --model gpt2 --gpu-memory 40GiB"])
def gpus_command(as_json: AsJson = False) -> None:
    """List the GPUs `autobatch estimate --gpu` (and `find --gpu`) knows, with total and usable memory."""
    import json

    from ..estimating.gpus import DEFAULT_GPU, GPUS

    if as_json:
        typer.echo(json.dumps({"default": DEFAULT_GPU, "gpus": [g.to_dict() for g in GPUS.values()]}, indent=2))
        return
    for spec in GPUS.values():
        typer.echo(str(spec))
    typer.echo(f"default: {DEFAULT_GPU}; any other card: --gpu-memory 40GiB (usable = total − CUDA context)")


@command("models", examples=["autobatch models", "autobatch find --model tiny-gpt2 --device cpu --memory 8MiB"])
def models_command(as_json: AsJson = False) -> None:
    """List the built-in models (random weights, built from configs: nothing is downloaded)."""
    import json

    from rich.table import Table

    from ..models import list_models

    rows = list_models()
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    table = Table(title="built-in models (or pass hf:NAME_OR_DIR, file.py:fn, module:fn)", title_justify="left")
    for column in ("name", "parameters", "seq len", "description"):
        table.add_column(column)
    for row in rows:
        table.add_row(row["name"], f"{row['parameters'] / 1e6:,.1f}M", str(row["seq_len"] or "-"), row["description"])
    console().print(table)

"""``autobatch estimate``, ``gpus`` and ``models``: answers without a GPU, and what is built in."""

from __future__ import annotations

import typer

from ..configs import hf_flags
from ._app import command, fail, outputs
from .options import (
    Dtype,
    Headroom,
    MaxBatch,
    MinMicro,
    ModelParallel,
    ModelSpec,
    MultipleOf,
    Nodes,
    OptimizerName,
    SeqLen,
    headroom_value,
)

__all__ = ["estimate_command", "gpus_command", "models_command"]


@command("estimate")
def estimate_command(
    model: ModelSpec,
    gpu: str = typer.Option("a100-80gb", "--gpu", help="GPU to estimate for (see `autobatch gpus`); default a100-80gb."),
    gpu_memory: str | None = typer.Option(None, "--gpu-memory", help="Total memory of a GPU not in the catalogue, e.g. 40GiB."),
    target: int | None = typer.Option(None, "--target", help="Global batch per optimizer step: plan it with the estimated safe batch."),
    gpus: int = typer.Option(1, "--gpus", help="GPUs per node (not the total; world = --gpus × --nodes)."),
    nodes: Nodes = 1,
    model_parallel: ModelParallel = 1,
    multiple_of: MultipleOf = None,
    seq_len: SeqLen = None,
    dtype: Dtype = "fp32",
    optimizer: OptimizerName = "adamw",
    grad_checkpointing: bool = typer.Option(False, "--grad-checkpointing", help="Trace with gradient checkpointing on."),
    headroom: Headroom = "5%",
    max_batch: MaxBatch = None,
    min_micro: MinMicro = None,
    fragmentation: float = typer.Option(1.05, "--fragmentation", help="Allocator reserved/allocated ratio assumed."),
    workspace: str = typer.Option("64MiB", "--workspace", help="cuBLAS/cuDNN workspaces assumed."),
    deepspeed: str | None = typer.Option(None, "--deepspeed", help="With --target: write the batch keys into this DeepSpeed JSON."),
    accelerate: str | None = typer.Option(None, "--accelerate", help="With --target: write an accelerate config YAML here."),
    hf: str | None = typer.Option(None, "--hf", help="With --target: write HF TrainingArguments values (JSON) here."),
    as_json: bool = typer.Option(False, "--json", help='Print one JSON object (it carries "estimated": true).'),
) -> None:
    """Estimate the per-GPU batch for a named GPU from any machine: fake-tensor trace, no GPU used."""
    import json

    from ..configs import check_plan_outputs, write_plan_configs
    from ..estimating.estimate import estimate, load_fake_model
    from ..estimating.gpus import resolve_gpu
    from ..estimating.overheads import Overheads
    from ..pipeline import plan_summary
    from ..planning.solver import check_request, solve
    from ..units import parse_bytes

    spec = resolve_gpu(gpu, gpu_memory)  # an unknown name fails here, before any model is built
    if (deepspeed or accelerate or hf) and target is None:
        fail("--deepspeed, --accelerate and --hf write a plan, which needs --target (the global batch); add --target N")
    check_request(target, gpus, nodes, min_micro=min_micro or 1, multiple_of=multiple_of, model_parallel=model_parallel)
    check_plan_outputs(deepspeed=deepspeed, accelerate=accelerate, hf=hf)
    overheads = Overheads(fragmentation=fragmentation, workspace_bytes=parse_bytes(workspace))
    source = load_fake_model(model, seq_len=seq_len)
    workload = source.to_workload(optimizer=optimizer, dtype=dtype, grad_checkpointing=grad_checkpointing)
    result = estimate(workload, spec, overheads=overheads, headroom=headroom_value(headroom), max_batch=max_batch,
                      min_batch=min_micro)
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
        typer.echo(json.dumps({**data, **written, **({"changes": changes} if changes else {})}, indent=2))
        return
    typer.echo(f"note: these are estimates for {spec.name} from a fake-tensor trace (no GPU used); "
               "probe on the GPU itself for exact figures")
    typer.echo(str(result))
    if plan is not None:
        typer.echo("plan (estimated): " + plan.describe())
        typer.echo(f"HF TrainingArguments: {' '.join(hf_flags(plan, deepspeed))}")
    for kind, path in written.items():
        typer.echo(f"wrote {path} ({kind.replace('_', ' ')})")
    for line in changes:
        typer.echo(f"updated {line}")


@command("gpus")
def gpus_command(as_json: bool = typer.Option(False, "--json", help="Print one JSON object.")) -> None:
    """List the GPUs `autobatch estimate --gpu` knows, with total and usable memory."""
    import json

    from ..estimating.gpus import DEFAULT_GPU, GPUS

    if as_json:
        typer.echo(json.dumps({"default": DEFAULT_GPU, "gpus": [g.to_dict() for g in GPUS.values()]}, indent=2))
        return
    for spec in GPUS.values():
        typer.echo(str(spec))
    typer.echo(f"default: {DEFAULT_GPU}; any other card: --gpu-memory 40GiB (usable = total − CUDA context)")


@command("models")
def models_command(as_json: bool = typer.Option(False, "--json", help="Print one JSON object.")) -> None:
    """List the built-in models (random weights, built from configs: nothing is downloaded)."""
    import json

    from rich.console import Console
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
    Console().print(table)

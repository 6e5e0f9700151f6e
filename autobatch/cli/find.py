"""``autobatch find``: probe the largest per-GPU batch on every GPU, then plan the target."""

from __future__ import annotations

from typing import Any

import typer

from ..configs import hf_flags
from ._app import command, fail, outputs
from .options import (
    DeviceName,
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
    SimulatedMemory,
    headroom_value,
)


def _trial_table(finding: Any) -> Any:
    from rich.table import Table

    from ..units import format_bytes

    table = Table(title="trials", title_justify="left")
    for column in ("batch", "fits", "peak", "reserved", "fwd+bwd", "optimizer", "s/step"):
        table.add_column(column, justify="right")
    for t in finding.probe.trials:
        table.add_row(
            str(t.batch), "yes" if t.fits else "OOM", format_bytes(t.peak_bytes), format_bytes(t.reserved_bytes),
            format_bytes(t.forward_backward_bytes), format_bytes(t.optimizer_bytes),
            "-" if t.seconds_per_step is None else f"{t.seconds_per_step:.3f}",
        )
    return table


def _device_line(info: Any) -> str:
    from ..units import format_bytes

    others = "" if info.used_by_others_bytes is None else f", {format_bytes(info.used_by_others_bytes)} held by other processes"
    return (f"device: {info.name} on {info.host}: total {format_bytes(info.total_bytes)}, "
            f"free {format_bytes(info.free_bytes)}{others}, capacity for the probe {format_bytes(info.capacity_bytes)}")

__all__ = ["find_command"]


@command("find")
def find_command(
    model: ModelSpec,
    target: int | None = typer.Option(None, "--target", help="Global batch per optimizer step (default: the safe batch on every GPU)."),
    gpus: int | None = typer.Option(None, "--gpus", help="GPUs per node (default: the GPUs visible here; 1 on CPU)."),
    nodes: Nodes = 1,
    model_parallel: ModelParallel = 1,
    seq_len: SeqLen = None,
    dtype: Dtype = "fp32",
    optimizer: OptimizerName = "adamw",
    grad_checkpointing: bool = typer.Option(False, "--grad-checkpointing", help="Probe with gradient checkpointing on."),
    headroom: Headroom = "5%",
    max_batch: MaxBatch = None,
    min_micro: MinMicro = None,
    multiple_of: MultipleOf = None,
    device: DeviceName = None,
    memory: SimulatedMemory = None,
    input_shape: str | None = typer.Option(None, "--input-shape", help="Per-sample input shape for your own nn.Module, e.g. 3,224,224."),
    num_classes: int = typer.Option(10, "--num-classes", help="Classes for your own nn.Module's loss."),
    trust_remote_code: bool = typer.Option(False, "--trust-remote-code", help="Let an hf: model run its own code."),
    deepspeed: str | None = typer.Option(None, "--deepspeed", help="Write the batch keys into this DeepSpeed JSON (other keys kept)."),
    accelerate: str | None = typer.Option(None, "--accelerate", help="Write an accelerate config YAML here."),
    hf: str | None = typer.Option(None, "--hf", help="Write HF TrainingArguments values (JSON) here."),
    gpu: str = typer.Option("a100-80gb", "--gpu", help="With no CUDA GPU here and no --device: estimate for this GPU (default a100-80gb)."),
    no_cache: bool = typer.Option(False, "--no-cache", help="Probe again even when a result for this setup is cached."),
    plot: str | None = typer.Option(None, "--plot", help="Draw peak memory against batch into this PNG (needs the plot extra)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Probe the largest per-GPU batch with real training steps, then plan --target exactly.

    With no CUDA GPU and no --device, estimates for --gpu (default a100-80gb) from a fake-tensor trace."""
    import json

    import torch
    from rich.console import Console

    from ..configs import check_plan_outputs, write_plan_configs
    from ..models import load_model
    from ..pipeline import find_plan
    from ..planning.solver import check_request
    from ..probing.probe import make_backend

    check_plan_outputs(deepspeed=deepspeed, accelerate=accelerate, hf=hf)  # before any trial: a typo
    if device is None and memory is None and not torch.cuda.is_available():  # must not cost a probe
        # No GPU to probe: estimate for a named one (fake-tensor trace), saying so first.
        if plot is not None:
            fail("--plot draws the trials of a probe, and with no CUDA GPU here there is none (an estimate runs "
                 "instead); drop --plot, or run find on the GPU machine")
        typer.echo(f"note: no CUDA GPU here, so these are estimates for {gpu} from a fake-tensor trace (pick your card "
                   "with --gpu, see `autobatch gpus`); run find on the GPU machine for exact figures", err=True)
        from .estimate import estimate_command

        estimate_command(
            model=model, gpu=gpu, gpu_memory=None, target=target, gpus=gpus or 1, nodes=nodes,
            model_parallel=model_parallel, multiple_of=multiple_of, seq_len=seq_len, dtype=dtype,
            optimizer=optimizer, grad_checkpointing=grad_checkpointing, headroom=headroom, max_batch=max_batch,
            min_micro=min_micro, fragmentation=1.05, workspace="64MiB", deepspeed=deepspeed, accelerate=accelerate,
            hf=hf, as_json=as_json,
        )
        return
    if plot is not None:
        from ..tuning.plot import check_plot_path

        check_plot_path(plot)
    from ..distributed.launch import (
        is_launched,
        is_main_process,
        process_group,
        rank_env,
        spawn_local,
    )
    from ..pipeline import Finding, local_gpu_count, plan_from_probe, probe_worker

    load = dict(seq_len=seq_len, input_shape=input_shape, num_classes=num_classes, trust_remote_code=trust_remote_code)
    settings = dict(optimizer=optimizer, dtype=dtype, grad_checkpointing=grad_checkpointing)
    options = dict(max_batch=max_batch, min_batch=min_micro, headroom=headroom_value(headroom))
    planning = dict(target=target, nodes=nodes, model_parallel=model_parallel, multiple_of=multiple_of)
    console = Console(stderr=True)
    if gpus is not None:
        here = gpus
    elif is_launched():
        env = rank_env()
        here = env.local_world_size
    else:  # what the plan will take: the GPUs visible here, 1 on the CPU
        here = max(1, local_gpu_count()) if memory is None and (device or "cuda").startswith("cuda") else 1
    check_request(target, here, nodes, min_micro=min_micro or 1, multiple_of=multiple_of, model_parallel=model_parallel)
    if is_launched():
        # Under torchrun / accelerate launch: every rank probes its own device, in lockstep.
        from ..distributed.lockstep import probe_distributed

        env = rank_env()
        backend = make_backend(device or (f"cuda:{env.local_rank}" if memory is None else "cpu"), memory)
        with process_group("gloo" if backend.device.type == "cpu" else None):
            workload = load_model(model, **load).to_workload(**settings)
            result = probe_distributed(workload, backend, **options)
        if not is_main_process():
            return  # only rank 0 prints and writes files
        if nodes == 1 and env.world_size > env.local_world_size:
            planning["nodes"] = env.world_size // env.local_world_size
        agreed = result.to_probe_result()
        plan = plan_from_probe(agreed, gpus_per_node=gpus or env.local_world_size, **planning)
        finding = Finding(agreed, plan, ranks_report=str(result))
    elif device is None and memory is None and (gpu_count := local_gpu_count()) > 1:
        # Several GPUs and no launcher: start one worker per GPU ourselves (same lockstep path).
        console.print(f"probing {gpu_count} GPUs, one worker each…", highlight=False)
        agreed, report = spawn_local(probe_worker, (model, load, settings, options))
        plan = plan_from_probe(agreed, gpus_per_node=gpus or gpu_count, **planning)
        finding = Finding(agreed, plan, ranks_report=report)
    else:
        backend = make_backend(device or ("cpu" if memory is not None else None), memory)
        workload = load_model(model, **load).to_workload(**settings)
        with console.status("probing…") as status:
            def progress(trial: Any) -> None:
                status.update(f"probing… batch {trial.batch} {'fits' if trial.fits else 'is out of memory'}")

            finding = find_plan(workload, gpus_per_node=gpus, backend=backend, max_batch=max_batch,
                                min_micro=min_micro, headroom=headroom_value(headroom), on_trial=progress,
                                use_cache=not no_cache, **planning)
    plan = finding.plan
    changes: list[str] = []
    written = write_plan_configs(plan, deepspeed=deepspeed, accelerate=accelerate, hf=hf, written=outputs(),
                                 changes=changes)
    if plot is not None:
        from ..tuning.plot import plot_probe

        plot_probe(finding.probe, plot, chosen=plan.micro_batch)
        written["plot"] = plot
    if as_json:
        typer.echo(json.dumps({**finding.to_dict(), **written, **({"changes": changes} if changes else {})}, indent=2))
        return
    out = Console()
    out.print(_device_line(finding.probe.device), highlight=False)
    if finding.ranks_report:
        out.print(finding.ranks_report, highlight=False)
    out.print(_trial_table(finding))
    out.print(str(finding.probe) + (" (cached)" if finding.cached else ""), highlight=False)
    out.print("plan: " + plan.describe(), highlight=False)
    out.print(f"HF TrainingArguments: {' '.join(hf_flags(plan, deepspeed))}", highlight=False)
    for kind, path in written.items():
        out.print(f"wrote {path} ({kind.replace('_', ' ')})", highlight=False)
    for line in changes:
        out.print(f"updated {line}", highlight=False)

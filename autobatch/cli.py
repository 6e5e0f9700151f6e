"""The ``autobatch`` command: a thin typer layer over the library.

Each command parses flags, calls library functions and prints. Library errors
(:class:`~autobatch.errors.AutobatchError`) become one line on stderr and exit code 2; the
traceback is shown only with ``autobatch --debug …``.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from typing import Annotated, Any

import typer

from .errors import AutobatchError

__all__ = ["app", "main"]

app = typer.Typer(
    name="autobatch",
    help="Find the per-GPU batch that fits, and reach your global batch exactly.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
_state = {"debug": False}


# Options several commands share: one definition each, so their flags and help never drift.
ModelSpec = Annotated[str, typer.Option("--model", help='Built-in name (see `autobatch models`), hf:NAME_OR_DIR, file.py:fn or module:fn.')]
Nodes = Annotated[int, typer.Option("--nodes", help='Number of nodes.')]
ModelParallel = Annotated[int, typer.Option("--model-parallel", help='Tensor × pipeline parallel degree.')]
SeqLen = Annotated[int | None, typer.Option("--seq-len", help='Tokens per sample, the longest you train on.')]
Dtype = Annotated[str, typer.Option("--dtype", help='fp32, bf16 or fp16 (autocast).')]
OptimizerName = Annotated[str, typer.Option("--optimizer", help='adamw, adam, sgd, sgd-nomomentum or adafactor.')]
Headroom = Annotated[str, typer.Option("--headroom", help='Memory kept free for the safe batch: 5%, 0.05 or 2GiB.')]
MaxBatch = Annotated[int | None, typer.Option("--max-batch", help='Never try a per-GPU batch above this.')]
MinMicro = Annotated[int | None, typer.Option("--min-micro", help='Smallest per-GPU batch (default 2 with BatchNorm, else 1).')]
MultipleOf = Annotated[int | None, typer.Option("--multiple-of", help='Per-GPU batch must be a multiple of this.')]
DeviceName = Annotated[str | None, typer.Option("--device", help='cuda, cuda:N, or cpu (with --memory: simulated budget).')]
SimulatedMemory = Annotated[str | None, typer.Option("--memory", help='Simulated device memory for --device cpu, e.g. 2GiB.')]


@app.callback()
def _root(
    debug: bool = typer.Option(False, "--debug", help="Show the full traceback on errors (or AUTOBATCH_DEBUG=1)."),
) -> None:
    # Set on every invocation, so one --debug run does not leak into the next in the same process.
    _state["debug"] = debug or os.environ.get("AUTOBATCH_DEBUG", "") not in ("", "0")


def command(*args: Any, **kwargs: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``app.command`` that turns AutobatchError into one line and exit code 2."""

    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*a: Any, **kw: Any) -> Any:
            try:
                return fn(*a, **kw)
            except AutobatchError as exc:
                if _state["debug"]:
                    raise
                typer.echo(f"Error: {exc}", err=True)
                raise typer.Exit(2) from None

        return app.command(*args, **kwargs)(wrapper)

    return register


def fail(message: str) -> None:
    """Stop a command with one line (for checks done in the CLI layer itself)."""
    raise AutobatchError(message)


# --- commands -----------------------------------------------------------------------------
# Each command lives in its own section below; add new ones at the end of this file.


# --- verify-ga ------------------------------------------------------------------------------


@command("verify-ga")
def verify_ga_command(
    model: ModelSpec,
    micro_batch: int = typer.Option(..., "--micro-batch", help="Samples per micro-batch per rank."),
    grad_accum: int = typer.Option(..., "--grad-accum", help="Micro-batches accumulated per optimizer step."),
    world_size: int = typer.Option(1, "--world-size", help="Data-parallel ranks, simulated in this process."),
    seq_len: SeqLen = None,
    normalised: bool = typer.Option(
        False, "--normalised/--naive",
        help="Check autobatch's token-normalised loss, or (default) the naive mean per micro-batch / GA.",
    ),
    tolerance: float = typer.Option(1e-5, "--tolerance", help="Largest overall relative gradient error that passes."),
    seed: int = typer.Option(0, "--seed", help="Seed for the weights, the batch and every forward pass."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Does micro-batch x GA (x ranks) give the big batch's gradient? Exit 0 PASS, 1 FAIL, 3 FLAGGED."""
    import json

    from .verify_ga import verify_model

    result = verify_model(
        model, seq_len=seq_len, micro_batch=micro_batch, grad_accum=grad_accum, world_size=world_size,
        mode="normalised" if normalised else "naive", tolerance=tolerance, seed=seed,
    )
    # ensure_ascii=False: the cause reads "2.5× more", not "2.5\u00d7 more".
    typer.echo(json.dumps(result.to_dict(), indent=2, ensure_ascii=False) if as_json else str(result))
    if result.exit_code:
        raise typer.Exit(result.exit_code)


# --- solve / check --------------------------------------------------------------------------
# --gpus is GPUs per node in both commands (the world size is --gpus × --nodes).


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

    from .configs import write_plan_configs
    from .solver import solve

    plan = solve(
        target, gpus, nodes, max_micro, min_micro=min_micro, multiple_of=multiple_of,
        model_parallel=model_parallel, base_lr=base_lr, base_batch=base_batch,
    )
    written = write_plan_configs(plan, deepspeed=deepspeed, accelerate=accelerate, keep_auto=keep_auto)
    if as_json:
        typer.echo(json.dumps({**plan.to_dict(), **written}, indent=2, ensure_ascii=False))
        return
    hf = plan.hf_flags(deepspeed)
    lightning = plan.to_lightning()
    trainer = ", ".join(f"{k}={v}" for k, v in lightning["trainer"].items())
    typer.echo(plan.describe())
    typer.echo(f"HF TrainingArguments: {' '.join(hf)}")
    typer.echo(f"Lightning: Trainer({trainer}), DataLoader(batch_size={lightning['dataloader']['batch_size']})")
    typer.echo(f"torchrun: {plan.torchrun_command(script)}")
    if accelerate is not None:
        typer.echo(f"accelerate: {plan.accelerate_command(script, config_file=accelerate, deepspeed_config_file=deepspeed)}")
    for kind, path in written.items():
        typer.echo(f"wrote {path} ({kind.replace('_', ' ')})")


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

    from .check import check_setup

    module = None
    if model is not None:
        import torch

        from .models import load_model

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


# --- find / models ------------------------------------------------------------------------


def _headroom(text: str) -> float | str:
    try:
        return float(text)
    except ValueError:
        return text  # "5%" or "2GiB": resolved by the library, which explains a bad value


def _trial_table(finding: Any) -> Any:
    from rich.table import Table

    from .units import format_bytes

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
    from .units import format_bytes

    others = "" if info.used_by_others_bytes is None else f", {format_bytes(info.used_by_others_bytes)} held by other processes"
    return (f"device: {info.name} on {info.host}: total {format_bytes(info.total_bytes)}, "
            f"free {format_bytes(info.free_bytes)}{others}, capacity for the probe {format_bytes(info.capacity_bytes)}")


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

    from .configs import write_plan_configs
    from .find import find_plan
    from .models import load_model
    from .probe import make_backend

    if device is None and memory is None and not torch.cuda.is_available():
        # No GPU to probe: estimate for a named one (fake-tensor trace), saying so first.
        typer.echo(f"note: no CUDA GPU here, so these are estimates for {gpu} (--gpu; default a100-80gb); "
                   "for real training steps on the CPU pass --device cpu --memory 8GiB", err=True)
        estimate_command(
            model=model, gpu=gpu, gpu_memory=None, target=target, gpus=gpus or 1, nodes=nodes,
            model_parallel=model_parallel, multiple_of=multiple_of, seq_len=seq_len, dtype=dtype,
            optimizer=optimizer, grad_checkpointing=grad_checkpointing, headroom=headroom, max_batch=max_batch,
            min_micro=min_micro, fragmentation=1.05, workspace="64MiB", deepspeed=deepspeed, accelerate=accelerate,
            as_json=as_json,
        )
        return
    from .distributed import is_launched, is_main_process, process_group, rank_env, spawn_local
    from .find import Finding, local_gpu_count, plan_from_probe, probe_worker

    load = dict(seq_len=seq_len, input_shape=input_shape, num_classes=num_classes, trust_remote_code=trust_remote_code)
    settings = dict(optimizer=optimizer, dtype=dtype, grad_checkpointing=grad_checkpointing)
    options = dict(max_batch=max_batch, min_batch=min_micro, headroom=_headroom(headroom))
    planning = dict(target=target, nodes=nodes, model_parallel=model_parallel, multiple_of=multiple_of)
    console = Console(stderr=True)
    if is_launched():
        # Under torchrun / accelerate launch: every rank probes its own device, in lockstep.
        from .distributed import probe_distributed

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
                                min_micro=min_micro, headroom=_headroom(headroom), on_trial=progress,
                                use_cache=not no_cache, **planning)
    plan = finding.plan
    written = write_plan_configs(plan, deepspeed=deepspeed, accelerate=accelerate, hf=hf)
    if as_json:
        typer.echo(json.dumps({**finding.to_dict(), **written}, indent=2))
        return
    if plot is not None:
        from .plot import plot_probe

        plot_probe(finding.probe, plot, chosen=plan.micro_batch)
        written["plot"] = plot
    out = Console()
    out.print(_device_line(finding.probe.device), highlight=False)
    if finding.ranks_report:
        out.print(finding.ranks_report, highlight=False)
    out.print(_trial_table(finding))
    out.print(str(finding.probe) + (" (cached)" if finding.cached else ""), highlight=False)
    out.print("plan: " + plan.describe(), highlight=False)
    out.print(f"HF TrainingArguments: {' '.join(plan.hf_flags(deepspeed))}", highlight=False)
    for kind, path in written.items():
        out.print(f"wrote {path} ({kind.replace('_', ' ')})", highlight=False)


@command("models")
def models_command(as_json: bool = typer.Option(False, "--json", help="Print one JSON object.")) -> None:
    """List the built-in models (random weights, built from configs: nothing is downloaded)."""
    import json

    from rich.console import Console
    from rich.table import Table

    from .models import list_models

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


# --- estimate / gpus ------------------------------------------------------------------------
# Estimates trace the training step on fake tensors for a named GPU: no GPU is needed or used.


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
    as_json: bool = typer.Option(False, "--json", help='Print one JSON object (it carries "estimated": true).'),
) -> None:
    """Estimate the per-GPU batch for a named GPU from any machine: fake-tensor trace, no GPU used."""
    import json

    from .configs import write_plan_configs
    from .estimate import estimate, load_fake_model
    from .gpus import resolve_gpu
    from .overheads import Overheads
    from .solver import solve
    from .units import parse_bytes

    spec = resolve_gpu(gpu, gpu_memory)  # an unknown name fails here, before any model is built
    if (deepspeed or accelerate) and target is None:
        fail("--deepspeed and --accelerate write a plan, which needs --target (the global batch); add --target N")
    overheads = Overheads(fragmentation=fragmentation, workspace_bytes=parse_bytes(workspace))
    source = load_fake_model(model, seq_len=seq_len)
    workload = source.to_workload(optimizer=optimizer, dtype=dtype, grad_checkpointing=grad_checkpointing)
    result = estimate(workload, spec, overheads=overheads, headroom=_headroom(headroom), max_batch=max_batch,
                      min_batch=min_micro)
    plan = None
    written: dict[str, str] = {}
    if target is not None:
        plan = solve(target, gpus, nodes, result.safe_batch, min_micro=result.min_batch, multiple_of=multiple_of,
                     model_parallel=model_parallel)
        written = write_plan_configs(plan, deepspeed=deepspeed, accelerate=accelerate)
    if as_json:
        # The same top-level keys as `find --json`, so scripts read either the same way.
        data = {"max_micro": result.max_batch, "safe_micro": result.safe_batch,
                **(plan.to_dict() if plan is not None else {}), **result.to_dict()}
        if plan is not None:
            data["plan"] = plan.to_dict()
        typer.echo(json.dumps({**data, **written}, indent=2))
        return
    typer.echo(f"note: these are estimates for {spec.name} from a fake-tensor trace (no GPU used); "
               "probe on the GPU itself for exact figures")
    typer.echo(str(result))
    if plan is not None:
        typer.echo("plan (estimated): " + plan.describe())
        typer.echo(f"HF TrainingArguments: {' '.join(plan.hf_flags(deepspeed))}")
    for kind, path in written.items():
        typer.echo(f"wrote {path} ({kind.replace('_', ' ')})")


@command("gpus")
def gpus_command(as_json: bool = typer.Option(False, "--json", help="Print one JSON object.")) -> None:
    """List the GPUs `autobatch estimate --gpu` knows, with total and usable memory."""
    import json

    from .gpus import DEFAULT_GPU, GPUS

    if as_json:
        typer.echo(json.dumps({"default": DEFAULT_GPU, "gpus": [g.to_dict() for g in GPUS.values()]}, indent=2))
        return
    for spec in GPUS.values():
        typer.echo(str(spec))
    typer.echo(f"default: {DEFAULT_GPU}; any other card: --gpu-memory 40GiB (usable = total − CUDA context)")


# --- tune / cache ---------------------------------------------------------------------------


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

    from .models import load_model
    from .probe import make_backend
    from .tune import tune

    settings = {"auto": None, "both": [False, True], "on": [True], "off": [False]}
    if checkpointing not in settings:
        fail(f"--checkpointing must be auto, both, on or off, but got {checkpointing!r}")
    backend = make_backend(device or ("cpu" if memory is not None else None), memory)
    source = load_model(model, **({} if seq_len is None else {"seq_len": seq_len}))
    workload = source.to_workload(optimizer=optimizer, dtype=dtype)

    def progress(m: Any) -> None:
        rate = "-" if m.samples_per_second is None else f"{m.samples_per_second:,.1f} samples/s"
        typer.echo(f"trial {m.trial_number}: {m.candidate.label}: {rate} ({m.state.lower()})", err=True)

    result = tune(workload, target, backend, n_trials=trials, gpus_per_node=gpus, nodes=nodes,
                  timed_steps=timed_steps, checkpointing=settings[checkpointing], headroom=_headroom(headroom),
                  max_batch=max_batch, min_micro=min_micro, multiple_of=multiple_of, seed=seed,
                  use_cache=not no_cache, on_trial=progress)
    if plot is not None:
        from .plot import plot_tune

        plot_tune(result, plot)
    if as_json:
        typer.echo(json.dumps({**result.to_dict(), **({"plot": plot} if plot else {})}, indent=2))
        return
    typer.echo(str(result))
    typer.echo("plan: " + result.best.candidate.plan.describe())
    if plot is not None:
        typer.echo(f"wrote {plot} (plot)")


cache_app = typer.Typer(help="The on-disk cache of probe results and tuning studies.", no_args_is_help=True)
app.add_typer(cache_app, name="cache")


@cache_app.command("list")
def cache_list_command(as_json: bool = typer.Option(False, "--json", help="Print one JSON object.")) -> None:
    """List cached probe results, newest first, and the tuning studies."""
    import json

    from .cache import cache_dir, list_entries
    from .tune import list_studies

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


@cache_app.command("clear")
def cache_clear_command() -> None:
    """Delete every cached probe result and the tuning studies."""
    from .cache import cache_dir, clear

    removed = clear()
    typer.echo(f"removed {removed} file{'s' if removed != 1 else ''} from {cache_dir()}")


def main() -> None:
    from .distributed import exit_rank, is_launched

    if not is_launched():
        app(prog_name="autobatch")
        return
    try:
        app(prog_name="autobatch")
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    exit_rank(code)  # under torchrun / accelerate launch: see exit_rank for why


if __name__ == "__main__":
    sys.exit(main())

"""``autobatch find``: probe the largest per-GPU batch on every GPU, then plan the target."""

from __future__ import annotations

from typing import Any

import typer

from ._app import command, fail, outputs
from .lengths import parse_seq_lens, run_length_table
from .options import (
    AccelerateOut,
    AsJson,
    DeepSpeedOut,
    DeviceName,
    Dtype,
    GpuMemory,
    GpuName,
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
    FsdpUnitOption,
    NumClasses,
    OffloadOption,
    OptimizerName,
    Script,
    SeqLens,
    SimulatedMemory,
    StrategyOption,
    TrainSeqLen,
    TrustRemoteCode,
    check_micro_range,
    headroom_value,
    model_load_options,
    size_value,
)
from .output import console, plan_lines, print_written


def _cached_line(probe: Any, no_trace_prior: bool) -> str:
    """What a cached answer is: probed earlier, nothing ran now, and whether the trace led that search."""
    how = "the fake-tensor trace led that search" if probe.trace_led else "its trials alone searched"
    again = " without the trace" if probe.trace_led and no_trace_prior else ""
    when = probe.extra.get("probed_at")
    return f"cached: probed {'at ' + when if when else 'earlier'}, nothing ran now ({how}); --no-cache probes again{again}"


def _trial_table(finding: Any) -> Any:
    from rich.table import Table

    from ..units import format_bytes

    title = "trials (cached: they ran when this was probed)" if finding.cached else "trials"
    table = Table(title=title, title_justify="left")
    for column in ("batch", "fits", "peak", "reserved", "fwd+bwd", "optimizer", "s/step"):
        table.add_column(column, justify="right")
    for t in finding.probe.trials:
        never = not t.fits and not t.optimizer_bytes  # out of memory before the optimizer step ran
        table.add_row(
            str(t.batch), "yes" if t.fits else "OOM", format_bytes(t.peak_bytes), format_bytes(t.reserved_bytes),
            format_bytes(t.forward_backward_bytes), "-" if never else format_bytes(t.optimizer_bytes),
            "-" if t.seconds_per_step is None else f"{t.seconds_per_step:.3f}",
        )
    return table


def _device_line(info: Any) -> str:
    from ..units import format_bytes

    others = "" if info.used_by_others_bytes is None else f", {format_bytes(info.used_by_others_bytes)} held by other processes"
    return (f"device: {info.name} on {info.host}: total {format_bytes(info.total_bytes)}, "
            f"free {format_bytes(info.free_bytes)}{others}, capacity for the probe {format_bytes(info.capacity_bytes)}")

__all__ = ["find_command"]


@command("find", examples=[
    "autobatch find --model gpt2 --target 224",
    "autobatch find --model tiny-gpt2 --target 96 --device cpu --memory 8MiB --deepspeed ds.json",
])
def find_command(
    model: ModelSpec,
    target: int | None = typer.Option(None, "--target", min=1, rich_help_panel="Plan", show_default="the safe batch on every GPU",
                                      help="Global batch per optimizer step."),
    gpus: int | None = typer.Option(None, "--gpus", min=1, rich_help_panel="Plan", show_default="the GPUs visible here; 1 on CPU",
                                    help="GPUs per node (not the total: world size = --gpus × --nodes)."),
    nodes: Nodes = 1,
    model_parallel: ModelParallel = 1,
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
    multiple_of: MultipleOf = None,
    device: DeviceName = None,
    memory: SimulatedMemory = None,
    gpu: GpuName = None,
    gpu_memory: GpuMemory = None,
    no_cache: bool = typer.Option(False, "--no-cache", help="Probe again even when a result for this setup is cached."),
    no_trace_prior: bool = typer.Option(
        False, "--no-trace-prior",
        help="By default a fake-tensor trace of the training step leads the search (fewer trials, the same exact "
             "max batch). This searches with real trials alone; the safe batch, predicted between trials, may "
             "differ by a few. A cached answer is shown as it is: add --no-cache to search again.",
    ),
    deepspeed: DeepSpeedOut = None,
    accelerate: AccelerateOut = None,
    hf: HfOut = None,
    script: Script = "train.py",
    plot: str | None = typer.Option(None, "--plot", rich_help_panel="Output",
                                    help="Draw peak memory against batch into this PNG (needs the plot extra)."),
    timeout: float = typer.Option(
        300.0, "--timeout", min=1.0,
        help="Seconds a rank waits for the others (under a launcher, or one worker per GPU here) before all stop with one error.",
    ),
    strategy: StrategyOption = None,
    offload: OffloadOption = None,
    fsdp_unit: FsdpUnitOption = None,
    as_json: AsJson = False,
) -> None:
    """Probe the largest per-GPU batch with real training steps, then plan --target exactly.

    With no CUDA GPU here and no --device, it estimates for --gpu (or --gpu-memory) from a
    fake-tensor trace instead, and says so. With --strategy, the model trains wrapped as that
    strategy (DDP, FSDP, ZeRO) as rank 0 of the --gpus × --nodes ranks on torch's fake process
    group, so one device answers for all of them."""
    import json

    import torch

    from .strategies import strategies_from_options

    strategies = strategies_from_options(strategy, offload, fsdp_unit)
    if strategies is not None and len(strategies) > 1 and (deepspeed or accelerate or hf or plot):
        fail(f"configs and plots are written for one strategy, but --strategy names {len(strategies)}; "
             "compare them first, then run again with the one you pick")

    from ..configs import check_plan_outputs, write_plan_configs
    from ..models import load_model
    from ..pipeline import find_plan
    from ..planning.solver import check_request
    from ..probing.probe import make_backend

    room = headroom_value(headroom)  # flags are checked before any model is built
    check_micro_range(min_micro, max_micro)
    if memory is not None:
        size_value(memory, "--memory")
    if gpu is not None and gpu_memory is not None:
        fail(f"--gpu {gpu} and --gpu-memory {gpu_memory} both name the GPU to estimate for; pass one")
    probe_here = device is not None or memory is not None or torch.cuda.is_available()
    if probe_here and (gpu is not None or gpu_memory is not None):
        where = (f"--device {device}" if device is not None else f"the CPU against --memory {memory}" if memory is not None
                 else "the CUDA GPU here")
        flag = "--gpu" if gpu is not None else "--gpu-memory"
        fail(f"{flag} names a GPU to estimate for, but find probes {where} with real steps; drop {flag}, "
             f"or run `autobatch estimate {flag} …` for an estimate")
    check_plan_outputs(deepspeed=deepspeed, accelerate=accelerate, hf=hf)  # before any trial: a typo
    lengths = parse_seq_lens(seq_len)
    table_wanted = bool(lengths and len(lengths) > 1) or evaluation
    if table_wanted and plot is not None:
        fail("--plot draws one probe's memory curve; with several --seq-len values or --eval there is no single "
             "curve to draw: drop --plot, or probe one length without --eval")
    if not probe_here:
        # No GPU to probe: estimate for a named one (fake-tensor trace), saying so first.
        if plot is not None:
            fail("--plot draws the trials of a probe, and with no CUDA GPU here there is none (an estimate runs "
                 "instead); drop --plot, or run find on the GPU machine")
        from ..estimating.gpus import resolve_gpu
        from .estimate import ESTIMATE_NOTED, estimate_command

        spec = resolve_gpu(gpu, None if gpu_memory is None else size_value(gpu_memory, "--gpu-memory"))
        chosen = ("--gpu-memory" if gpu_memory is not None else "--gpu" if gpu is not None
                  else "the default; pick your card with --gpu, see `autobatch gpus`")
        typer.echo(f"note: no CUDA GPU here, so these are estimates for {spec.name} ({chosen}) from a fake-tensor "
                   "trace; run find on the GPU machine for exact figures", err=True)
        noted = ESTIMATE_NOTED.set(True)  # said above, on stderr
        try:
            estimate_command(
                model=model, gpu=gpu, gpu_memory=gpu_memory, target=target, gpus=gpus or 1, nodes=nodes,
                model_parallel=model_parallel, multiple_of=multiple_of, seq_len=seq_len, evaluation=evaluation,
                train_seq_len=train_seq_len, input_shape=input_shape,
                num_classes=num_classes, trust_remote_code=trust_remote_code, dtype=dtype,
                optimizer=optimizer, grad_checkpointing=grad_checkpointing, headroom=headroom, max_micro=max_micro,
                min_micro=min_micro, fragmentation=1.05, workspace="64MiB", deepspeed=deepspeed, accelerate=accelerate,
                hf=hf, script=script, strategy=strategy, offload=offload, fsdp_unit=fsdp_unit, as_json=as_json,
            )
        finally:
            ESTIMATE_NOTED.reset(noted)
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
    from ..pipeline import Finding, local_gpu_count, plan_from_probe, probe_worker, probed_strategy

    if table_wanted:
        if is_launched():
            fail("several --seq-len values and --eval probe one device; run find without a launcher "
                 "(or one length per launched run)")
        run_length_table(
            model=model, lengths=lengths, evaluation=evaluation, train_seq_len=train_seq_len, estimate_for=None,
            device=device, memory=memory, load=model_load_options(None, input_shape, num_classes, trust_remote_code),
            settings=dict(optimizer=optimizer, dtype=dtype, grad_checkpointing=grad_checkpointing),
            options=dict(max_batch=max_micro, min_batch=min_micro, headroom=room),
            planning=dict(target=target, gpus_per_node=1 if gpus is None else gpus, nodes=nodes,
                          model_parallel=model_parallel, multiple_of=multiple_of),
            outputs=dict(deepspeed=deepspeed, accelerate=accelerate, hf=hf), as_json=as_json, use_cache=not no_cache,
        )
        return
    seq_len = lengths[0] if lengths else None
    load = model_load_options(seq_len, input_shape, num_classes, trust_remote_code)
    settings = dict(optimizer=optimizer, dtype=dtype, grad_checkpointing=grad_checkpointing)
    options = dict(max_batch=max_micro, min_batch=min_micro, headroom=room)
    planning = dict(target=target, nodes=nodes, model_parallel=model_parallel, multiple_of=multiple_of)
    status_console = console(stderr=True)
    if strategies is not None and len(strategies) > 1 and is_launched():
        fail(f"under a launcher every rank trains one strategy, but --strategy names {len(strategies)}; compare them "
             "without the launcher (one process answers for --gpus N ranks), then launch with the one you pick")
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
        from ..pipeline import trace_prior_for
        from .strategies import user_deepspeed_config

        env = rank_env()
        backend = make_backend(device or (f"cuda:{env.local_rank}" if memory is None else "cpu"), memory)
        with process_group("gloo" if backend.device.type == "cpu" else None, timeout_s=timeout):
            workload = load_model(model, **load).to_workload(**settings)
            sharded = {} if strategies is None else {"strategy": strategies[0],
                                                     "deepspeed_config": user_deepspeed_config(deepspeed)}
            # The trace leads an unsharded search on every rank, as without a launcher.
            prior = None if no_trace_prior or strategies is not None else trace_prior_for(
                workload, backend, min_batch=min_micro)
            result = probe_distributed(workload, backend, **options, timeout_s=timeout, prior=prior, **sharded)
        if not is_main_process():
            return  # only rank 0 prints and writes files
        if nodes == 1 and env.world_size > env.local_world_size:
            planning["nodes"] = env.world_size // env.local_world_size
        agreed = result.to_probe_result()
        plan = plan_from_probe(agreed, gpus_per_node=gpus or env.local_world_size, **planning)
        finding = Finding(agreed, plan, ranks_report=str(result),
                          strategy=probed_strategy(agreed, None if strategies is None else strategies[0]))
    elif strategies is None and device is None and memory is None and (gpu_count := local_gpu_count()) > 1:
        # Several GPUs and no launcher: start one worker per GPU ourselves (same lockstep path).
        status_console.print(f"probing {gpu_count} GPUs, one worker each…", highlight=False)
        worker = {**options, "timeout_s": timeout, "use_trace_prior": not no_trace_prior}
        agreed, report = spawn_local(probe_worker, (model, load, settings, worker), timeout_s=timeout)
        plan = plan_from_probe(agreed, gpus_per_node=gpus or gpu_count, **planning)
        finding = Finding(agreed, plan, ranks_report=report)
    else:
        backend = make_backend(device or ("cpu" if memory is not None else None), memory)
        workload = load_model(model, **load).to_workload(**settings)
        with status_console.status("probing…") as status:
            def progress(trial: Any) -> None:
                status.update(f"probing… batch {trial.batch} {'fits' if trial.fits else 'is out of memory'}")

            if strategies is not None:
                from .strategies import find_strategies, print_strategy_rows

                findings = find_strategies(workload, strategies, backend, gpus=gpus, deepspeed=deepspeed,
                                           options=options, planning=planning, on_trial=progress,
                                           use_trace_prior=not no_trace_prior)
                if len(findings) > 1:
                    print_strategy_rows(findings, _device_line(backend.info()), as_json=as_json)
                    return
                finding = findings[0]
            else:
                finding = find_plan(workload, gpus_per_node=gpus, backend=backend, max_batch=max_micro,
                                    min_micro=min_micro, headroom=room, on_trial=progress,
                                    use_cache=not no_cache, use_trace_prior=not no_trace_prior, **planning)
    plan = finding.plan
    changes: list[str] = []
    written = write_plan_configs(plan, deepspeed=deepspeed, accelerate=accelerate, hf=hf, written=outputs(),
                                 changes=changes, strategy=finding.strategy, probed_zero=finding.probed_zero)
    if plot is not None:
        from ..tuning.plot import plot_probe

        plot_probe(finding.probe, plot, chosen=plan.micro_batch)
        written["plot"] = plot
    if as_json:
        typer.echo(json.dumps({**finding.to_dict(), **written, **({"changes": changes} if changes else {})}, indent=2, ensure_ascii=False))
        return
    out = console()
    out.print(_device_line(finding.probe.device), highlight=False)
    if finding.cached:  # before the trials it shows: they ran earlier, and how that search went
        out.print(_cached_line(finding.probe, no_trace_prior), highlight=False, markup=False)
    if finding.ranks_report:
        out.print(finding.ranks_report, highlight=False)
    if finding.strategy is not None:
        from .strategies import strategy_table

        out.print(strategy_table([finding]))
    out.print(_trial_table(finding))
    out.print(str(finding.probe), highlight=False)
    out.print("plan: " + plan.describe(), highlight=False)
    for line in plan_lines(plan, deepspeed=deepspeed, accelerate=accelerate, script=script,
                           strategy=finding.strategy):
        out.print(line, highlight=False, markup=False)
    print_written(written)
    for line in changes:
        out.print(f"updated {line}", highlight=False, markup=False)

"""``autobatch find``: probe the largest per-GPU batch on every GPU, then plan the target."""

from __future__ import annotations

from ._app import command, outputs
from .options import (
    AccelerateOut,
    AsJson,
    Attention,
    DeepSpeedOut,
    DeviceName,
    Dtype,
    Evaluation,
    FindTarget,
    FsdpUnitOption,
    GpuMemory,
    GpuName,
    GpusHere,
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
    NoCache,
    NoTracePrior,
    Nodes,
    NumClasses,
    OffloadOption,
    OptimizerName,
    PlotOut,
    Script,
    SeqLens,
    SimulatedMemory,
    StrategyOption,
    Timeout,
    TrainSeqLen,
    TrustRemoteCode,
    Uneven,
    request_from,
)
from .render import print_report

__all__ = ["find_command", "answer_and_print"]


@command("find", examples=[
    "autobatch find --model gpt2 --target 224",
    "autobatch find --model tiny-gpt2 --target 96 --device cpu --memory 8MiB --deepspeed ds.json",
    "torchrun --standalone --nproc-per-node 2 -m autobatch find --model tiny-mlp --target 20000 --device cpu "
    "--memory 40MiB,20MiB --uneven",
])
def find_command(
    model: ModelSpec, target: FindTarget = None, gpus: GpusHere = None, nodes: Nodes = 1,
    model_parallel: ModelParallel = 1, seq_len: SeqLens = None, evaluation: Evaluation = False,
    train_seq_len: TrainSeqLen = None, input_shape: InputShape = None, num_classes: NumClasses = 10,
    trust_remote_code: TrustRemoteCode = False, attention: Attention = None, dtype: Dtype = "fp32",
    optimizer: OptimizerName = "adamw",
    grad_checkpointing: GradCheckpointing = False, grads_held: GradsHeld = False, headroom: Headroom = "5%",
    max_micro: MaxMicro = None,
    min_micro: MinMicro = None, multiple_of: MultipleOf = None, device: DeviceName = None,
    memory: SimulatedMemory = None, gpu: GpuName = None, gpu_memory: GpuMemory = None, no_cache: NoCache = False,
    no_trace_prior: NoTracePrior = False, deepspeed: DeepSpeedOut = None, accelerate: AccelerateOut = None,
    hf: HfOut = None, script: Script = "train.py", plot: PlotOut = None, timeout: Timeout = 300.0,
    strategy: StrategyOption = None, offload: OffloadOption = None, fsdp_unit: FsdpUnitOption = None,
    uneven: Uneven = False, as_json: AsJson = False,
) -> None:
    """Probe the largest per-GPU batch with real training steps, then plan --target exactly.

    With no CUDA GPU here and no --device, it estimates for --gpu (or --gpu-memory) from a
    fake-tensor trace instead, and says so. With --strategy, the model trains wrapped as that
    strategy (DDP, FSDP, ZeRO) as rank 0 of the --gpus × --nodes ranks on torch's fake process
    group, so one device answers for all of them."""
    answer_and_print(request_from(locals()), as_json=as_json)


def answer_and_print(request: object, *, as_json: bool) -> None:
    """Answer ``request`` with notes and progress on stderr (a spinner on a terminal, a line every few
    seconds in a log; only rank 0 under a launcher), then print the report on stdout."""
    import typer

    from .. import answer, rank_env
    from .output import console

    quiet = request.mode == "probe" and request.launched and not rank_env().is_main

    def note(text: str) -> None:
        if not quiet:  # every rank says the same: rank 0 says it once
            typer.echo(f"note: {text}", err=True)

    err = console(stderr=True)
    if not err.is_terminal or quiet:
        report = answer(request, on_note=note, written=outputs(), on_progress=None if quiet else _lines())
        print_report(report, as_json=as_json)
        return
    with err.status("probing…" if request.mode == "probe" else "estimating…") as status:
        def trial_done(trial: object) -> None:
            status.update(f"probing… batch {trial.batch} {'fits' if trial.fits else 'is out of memory'}")

        report = answer(request, on_trial=trial_done if request.mode == "probe" else None, on_note=note,
                        written=outputs(), on_progress=lambda text: status.update(f"{text}…"))
    print_report(report, as_json=as_json)


_EVERY_S = 5.0  # in a log, how often long work says how far it is


def _lines() -> object:
    """Progress as a line on stderr now and then (a log has no spinner): at most one every few seconds."""
    import time

    import typer

    last = [-_EVERY_S]

    def line(text: str) -> None:
        now = time.monotonic()
        if now - last[0] >= _EVERY_S:
            last[0] = now
            typer.echo(f"… {text}", err=True)

    return line

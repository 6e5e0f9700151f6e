"""What commands print: a plan with its launch lines, files written, and consoles that never wrap a pipe.

``solve``, ``find`` and ``estimate`` print a plan the same way (:func:`print_plan`). Output that
goes to a file or another program is not wrapped at 80 columns (:func:`console`): a line such
as the HF flags stays one line that a script can read.
"""

from __future__ import annotations

from typing import Any

import shlex

import typer

__all__ = ["console", "plan_lines", "print_plan", "print_written"]

_UNWRAPPED = 10_000  # columns for output that is not a terminal: no line is ever folded


def console(stderr: bool = False) -> Any:
    """A rich Console for stdout (or stderr): the terminal's width, or unwrapped when redirected."""
    import sys

    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    tty = getattr(stream, "isatty", lambda: False)()
    return Console(file=stream, soft_wrap=not tty, width=None if tty else _UNWRAPPED)


def plan_lines(plan: Any, *, deepspeed: str | None = None, accelerate: str | None = None,
               script: str = "train.py", strategy: Any = None, precision: str | None = None,
               grad_checkpointing: bool = False, probed_zero: dict[str, Any] | None = None,
               launcher: str | None = None) -> list[str]:
    """The HF, Lightning, torchrun (and accelerate, and the ``launcher`` the job ran under) lines that run
    ``plan``, one per framework, with the strategy, precision, checkpointing and ZeRO bucket sizes the batch
    was probed with."""
    from .. import accelerate_command, hf_flags, launcher_command, lightning_settings, torchrun_command

    lightning = lightning_settings(plan, strategy=strategy, precision=precision, probed_zero=probed_zero)
    trainer = ", ".join(f"{k}={v!r}" for k, v in lightning["trainer"].items())
    flags = hf_flags(plan, deepspeed, strategy, precision=precision, grad_checkpointing=grad_checkpointing,
                     probed_zero=probed_zero)
    lines = [
        f"HF TrainingArguments: {shlex.join(flags)}",
        f"Lightning: Trainer({trainer}), DataLoader(batch_size={lightning['dataloader']['batch_size']})"
        + (f"; configure_model: {lightning['configure_model']}" if "configure_model" in lightning else ""),
        f"torchrun: {torchrun_command(plan, script)}",
    ]
    own = None if launcher is None else launcher_command(plan, script, launcher)
    if own is not None:  # the launcher this job ran under, as well
        lines.append(f"{_LAUNCHERS[launcher]}: {own}")
    if accelerate is not None:
        lines.append(f"accelerate: {accelerate_command(plan, script, config_file=accelerate, deepspeed_config_file=deepspeed)}")
    if plan.model_parallel > 1:
        # Only Lightning's line above groups the ranks (ModelParallelStrategy, where the strategy allows it).
        grouped = getattr(lightning["trainer"].get("strategy"), "name", None) == "ModelParallelStrategy"
        lines.append(f"model parallel: {plan.model_parallel} ranks hold one model and share each micro batch, so "
                     f"{plan.world_size} of the {plan.world_size * plan.model_parallel} processes are data-parallel; "
                     f"{'the HF, torchrun and accelerate lines' if grouped else 'these lines'} "
                     "launch every process, and the batch is as planned only where "
                     "your tensor or pipeline parallelism groups them so (HF: TrainingArguments(parallelism_config=...))")
    if precision in _PURE:  # nothing above carries it: the HF Trainer and accelerate train in the model's dtype
        lines.append(f"weights: {precision} was probed with the model itself in {_PURE[precision]}: load it so "
                     f"(from_pretrained(..., dtype={_PURE[precision]}), or model.to({_PURE[precision]})), with no autocast")
    return lines


_PURE = {"bf16-true": "torch.bfloat16", "fp16-true": "torch.float16"}
_LAUNCHERS = {"deepspeed": "DeepSpeed launcher", "slurm": "srun", "mpirun": "mpirun"}


def print_plan(plan: Any, *, label: str = "", **launch: Any) -> None:
    """The plan's arithmetic, then the line each framework needs to run it (``launch``: see :func:`plan_lines`)."""
    typer.echo(label + plan.describe())
    for line in plan_lines(plan, **launch):
        typer.echo(line)


def print_written(written: dict[str, str]) -> None:
    for kind, path in written.items():
        typer.echo(f"wrote {path} ({kind.replace('_', ' ')})")

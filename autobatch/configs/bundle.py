"""Write every config a plan is asked for, in one call (what ``solve``, ``find`` and ``estimate`` do)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..strategy import Strategy
from .accelerate import describe_changes, write_accelerate_config
from .deepspeed import write_deepspeed_config
from .files import _JSON, _YAML, ConfigFileError, keep_original, read_config, write_config
from .hf import hf_training_args
from .trained import trained_with

if TYPE_CHECKING:
    from ..planning.plan import Plan

__all__ = ["check_plan_outputs", "write_plan_configs"]

PathLike = str | os.PathLike[str]


def _accelerate_precision(path: PathLike | None) -> str | None:
    """The ``mixed_precision`` an existing accelerate file holds (it moves into the DeepSpeed JSON)."""
    if path is None or not os.path.exists(path):
        return None
    value = str(read_config(path).get("mixed_precision", "no")).lower()
    return value if value in ("bf16", "fp16") else None


def check_plan_outputs(
    *, deepspeed: PathLike | None = None, accelerate: PathLike | None = None, hf: PathLike | None = None
) -> None:
    """Raise now what :func:`write_plan_configs` would raise after a probe: a wrong suffix, a
    directory, or an existing file that cannot be read (DeepSpeed and accelerate files are merged).
    """
    suffixes = {"deepspeed": _JSON, "accelerate": _YAML + _JSON, "hf": _JSON + _YAML}
    for flag, given in (("deepspeed", deepspeed), ("accelerate", accelerate), ("hf", hf)):
        if given is None:
            continue
        path = Path(given)
        if path.suffix.lower() not in suffixes[flag]:
            raise ConfigFileError(path, f"for --{flag} must end in {', '.join(suffixes[flag])}, but got {str(path)!r}",
                                  "rename it")
        if path.is_dir():
            raise ConfigFileError(path, f"for --{flag} must be a file, but {str(path)!r} is a directory",
                                  f"pass a file name inside it, e.g. {str(path / ('config' + suffixes[flag][0]))!r}")
        if path.exists():
            read_config(path)  # merged into later: it has to parse
        _check_writable(path, flag)


def _check_writable(path: Path, flag: str) -> None:
    """Raise now where ``path`` could not be written after a probe: its folder (or the nearest one that
    exists, under which the writer makes the rest) must take a new file, tried and removed at once, so
    that a failed write never leaves the other files half done."""
    folder = path.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        if not folder.is_dir():
            raise NotADirectoryError(f"{str(folder)!r} is not a folder")
        if path.exists() and not os.access(path, os.W_OK):
            raise PermissionError(f"{str(path)!r} is read-only")
        if path.parent.exists():
            fd, tried = tempfile.mkstemp(dir=folder, prefix=f".{path.name}.", suffix=".tmp")
            os.close(fd)
            os.unlink(tried)
        else:
            os.rmdir(tempfile.mkdtemp(dir=folder, prefix=f".{path.name}."))
    except OSError as exc:
        raise ConfigFileError(path, f"for --{flag} must be writable, but {str(path)!r} cannot be: {exc}",
                              "pass a path in a folder you can write to") from None


def write_plan_configs(
    plan: Plan,
    *,
    deepspeed: PathLike | None = None,
    accelerate: PathLike | None = None,
    hf: PathLike | None = None,
    keep_auto: bool = False,
    written: dict[str, str] | None = None,
    changes: list[str] | None = None,
    eval_batch: int | None = None,
    strategy: Strategy | str | None = None,
    probed_zero: dict[str, Any] | None = None,
    precision: str | None = None,
    grad_checkpointing: bool | None = None,
) -> dict[str, str]:
    """Write the requested files from one plan; return ``{kind: path}`` of what was written.

    Args:
        plan: the plan every file agrees with.
        deepspeed: DeepSpeed JSON; an existing file keeps every key but the three batch keys.
        accelerate: accelerate config YAML (pointing at ``deepspeed`` when both are given); an
            existing file keeps every key the plan does not decide.
        hf: HF ``TrainingArguments`` values, JSON or YAML by suffix (pointing at ``deepspeed`` too); an
            existing file keeps every key the plan does not decide.
        keep_auto: leave ``"auto"`` batch values in an existing DeepSpeed file.
        written: filled as each file is written (and returned), so that a caller interrupted
            half-way knows what is already on disk.
        changes: gets one line per existing file that was merged, saying what changed in it.
        eval_batch: the probed evaluation batch, written to the HF arguments as
            ``per_device_eval_batch_size``.
        strategy: the strategy the micro batch was probed under; every file trains with it
            (DeepSpeed stage and offload, accelerate's FSDP or DeepSpeed plugin, HF ``fsdp``/``deepspeed``).
        probed_zero: the ZeRO values (bucket sizes) the probe ran with, added to the DeepSpeed file (and to
            the HF arguments' DeepSpeed dict where no file is written).
        precision, grad_checkpointing: what the micro batch was probed with (``"bf16"``/``"fp16"``
            autocast; gradient checkpointing): every file trains with them, since the batch fits
            only so. An accelerate file's own ``mixed_precision``, which accelerate refuses beside
            a DeepSpeed file, is moved into the DeepSpeed JSON rather than dropped.

    ``strategy``, ``probed_zero``, ``precision`` and ``grad_checkpointing`` not given are read from
    ``plan.trained_with``.

    Example:
        >>> write_plan_configs(plan, deepspeed="ds.json", accelerate="accelerate.yaml")  # doctest: +SKIP
        {'deepspeed_config': 'ds.json', 'accelerate_config': 'accelerate.yaml'}
    """
    found = trained_with(plan, strategy=strategy, probed_zero=probed_zero, precision=precision,
                         grad_checkpointing=grad_checkpointing)
    strategy, probed_zero, precision = found.strategy, found.probed_zero, found.precision
    grad_checkpointing = found.grad_checkpointing
    written = {} if written is None else written
    changes = [] if changes is None else changes

    def merged(path: PathLike, write: Callable[[], object]) -> None:
        before = read_config(path) if os.path.exists(path) else None
        kept_as = keep_original(path) if before is not None else None  # its comments: a rewrite keeps none
        try:
            write()
        except ConfigFileError as exc:
            if not written:
                raise
            done = ", ".join(written.values())  # what is on disk already: the user must know
            raise ConfigFileError(exc.path, exc.problem, f"{exc.fix} (already written from this plan: {done})") from None
        if before is not None:
            after = read_config(path)
            what = describe_changes(before, after)
            kept = len([k for k in before if k in after and before[k] == after[k]])
            comments = (f" (its comments are in {kept_as}, the file as it was: a rewrite keeps none)"
                        if kept_as is not None else "")
            changes.append(f"{os.fspath(path)}: " + ("; ".join(what) if what else "nothing changed")
                           + f"; kept {kept} key{'s' if kept != 1 else ''} as {'they were' if kept != 1 else 'it was'}"
                           + comments)

    if deepspeed is not None:
        moved = precision or _accelerate_precision(accelerate)
        merged(deepspeed, lambda: write_deepspeed_config(plan, deepspeed, keep_auto=keep_auto,
                                                         for_accelerate=True,  # the HF line names it too
                                                         strategy=strategy, probed_zero=probed_zero, precision=moved))
        written["deepspeed_config"] = str(deepspeed)
    if accelerate is not None:
        merged(accelerate, lambda: write_accelerate_config(plan, accelerate, deepspeed, strategy=strategy,
                                                           precision=precision))
        written["accelerate_config"] = str(accelerate)
    if hf is not None:
        # The user's other TrainingArguments (learning rate, output_dir, …) stay: only the plan's keys change,
        # and a way of sharding the plan replaces the other one (the Trainer refuses fsdp and deepspeed together).
        args = hf_training_args(plan, deepspeed, eval_batch=eval_batch, strategy=strategy, precision=precision,
                                grad_checkpointing=grad_checkpointing, probed_zero=probed_zero)
        sharded_by = {"fsdp", "fsdp_config"} if "deepspeed" in args else {"deepspeed"} if "fsdp" in args else set()
        if precision in ("bf16", "fp16"):  # the Trainer refuses fp16 and bf16 both on
            sharded_by.add("fp16" if precision == "bf16" else "bf16")

        def hf_merged() -> None:
            before = read_config(hf) if os.path.exists(hf) else {}
            write_config(hf, {**{k: v for k, v in before.items() if k not in sharded_by}, **args})

        merged(hf, hf_merged)
        written["hf_args"] = str(hf)
    return written

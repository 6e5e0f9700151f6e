"""``find``/``estimate`` with several ``--seq-len`` values or ``--eval``: the table over lengths.

One row per length (exact max and safe batch, and the evaluation batch with ``--eval``), the
token budget with its arithmetic, and the plan for the length trained at.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import typer

from ..errors import AutobatchError

__all__ = ["parse_seq_lens", "run_length_table"]

_FLAGS = {"gpus_per_node": "--gpus"}


def parse_seq_lens(text: str | None) -> list[int] | None:
    """``"256,512,1024"`` → ``[256, 512, 1024]``; ``None`` stays ``None``."""
    if text is None:
        return None
    try:
        lengths = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        lengths = []
    if not lengths or min(lengths) < 1:
        raise AutobatchError(
            f"--seq-len must be one positive integer or several separated by commas, but got {text!r}; "
            "write e.g. --seq-len 1024 or --seq-len 256,512,1024,2048"
        )
    return list(dict.fromkeys(lengths))


def run_length_table(
    *, model: str, lengths: list[int] | None, evaluation: bool, train_seq_len: int | None, estimate_for: dict[str, Any] | None,
    device: str | None, memory: str | None, load: dict[str, Any], settings: dict[str, Any], options: dict[str, Any],
    planning: dict[str, Any], outputs: dict[str, Any], as_json: bool, use_cache: bool,
) -> None:
    """Probe (or, with ``estimate_for``, trace) every length, plan the training length, print, write.

    ``load``/``settings`` build the workload (see :func:`autobatch.models.load_model`), ``options``
    are ``headroom``/``max_batch``/``min_batch``, ``planning`` goes to :meth:`LengthTable.plan`,
    ``outputs`` are the config paths (``deepspeed``, ``accelerate``, ``hf``).
    """
    from ..configs import hf_flags, write_plan_configs
    from ..lengths import probe_lengths
    from ..pipeline import Finding, plan_summary
    from ..planning.plan import require_positive_int

    for name, value in planning.items():  # before the first trial: a typo must not cost the whole table
        if value is not None:
            require_positive_int(_FLAGS.get(name, f"--{name.replace('_', '-')}"), value)
    load = {**load, "seq_len": max(lengths) if lengths else None}  # the longest is checked against the model
    if train_seq_len is not None and train_seq_len not in (lengths or []):
        raise AutobatchError(f"--train-seq-len must be one of the --seq-len values ({', '.join(map(str, lengths))}), "
                             f"but got {train_seq_len}; add it to --seq-len")
    backend = None
    if estimate_for is not None:
        from ..estimating.estimate import load_fake_model

        source = load_fake_model(model, **load)
    else:
        from ..models import load_model
        from ..probing.probe import make_backend

        backend = make_backend(device or ("cpu" if memory is not None else None), memory)
        source = load_model(model, **load)
    if lengths is None and source.make_batch_at is None:  # --eval alone, a model without lengths: its own shape
        base = source.to_workload(**settings)
        workload = replace(base, make_batch=lambda b, _seq_len: base.make_batch(b))
    else:
        if lengths is None and source.seq_len is None:
            raise AutobatchError(f"{model}'s make_batch takes a sequence length (b, seq_len); pass --seq-len")
        lengths = lengths or [source.seq_len]
        workload = source.to_length_workload(lengths, **settings)
    table = probe_lengths(workload, lengths or [None], backend, evaluation=evaluation, train_seq_len=train_seq_len,
                          **options, **(estimate_for or {}))
    if backend is not None and use_cache:
        from ..tuning.probed import store_rows

        store_rows(table, workload, backend, options)
    plan = table.plan(**planning)
    row = table.train_row
    eval_batch = row.eval.safe_batch if row.eval is not None else None
    written = write_plan_configs(plan, eval_batch=eval_batch, **outputs)
    if as_json:
        data: dict[str, Any]
        if len(table.rows) == 1:  # one length: the keys `find --json` always had, and the evaluation batch
            data = (Finding(row.train, plan).to_dict() if not table.estimated
                    else {**plan_summary(plan), **row.train.to_dict(), "plan": plan.to_dict()})
            if row.eval is not None:
                data.update(eval_max_batch=row.eval.max_batch, eval_safe_batch=row.eval.safe_batch,
                            eval_trials=[t.to_dict() for t in row.eval.trials])
        else:
            data = {**table.to_dict(), "plan": plan.to_dict()}
        typer.echo(json.dumps({**data, **written}, indent=2, ensure_ascii=False))
        return
    for line in table.lines():
        typer.echo(line)
    where = "" if table.train_seq_len is None else f" at seq_len {table.train_seq_len}"
    typer.echo(f"plan{where}{' (estimated)' if table.estimated else ''}: {plan.describe()}")
    if eval_batch is not None:
        typer.echo(f"evaluation{where}: per_device_eval_batch_size {eval_batch} "
                   f"(max {row.eval.max_batch}, forward under torch.no_grad())")
    flags = hf_flags(plan, outputs.get("deepspeed"))
    if eval_batch is not None:
        flags += ["--per_device_eval_batch_size", str(eval_batch)]
    typer.echo(f"HF TrainingArguments: {' '.join(flags)}")
    for kind, path in written.items():
        typer.echo(f"wrote {path} ({kind.replace('_', ' ')})")

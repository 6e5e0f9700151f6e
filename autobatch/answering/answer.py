"""``answer``: the one pipeline from a :class:`~autobatch.Request` to a :class:`~autobatch.Report`.

Every decision lives here: plan alone, estimate or probe; under a launcher, one worker per GPU,
or one process; one row, a row per strategy, or a row per length. Then the plan is solved and
the configs are written. ``find`` is its short form for a model in hand.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from ..configs import write_plan_configs
from ..distributed.zero import BUCKET_KEYS
from ..estimating.spawned import warmed
from ..errors import AutobatchError, RequestError
from ..modelinfo import per_gpu_statistics
from ..pipeline import Finding, find_plan, local_gpu_count, plan_from_probe, probe_worker
from ..planning.plan import Plan, TrainedWith
from ..planning.solver import solve
from ..probing.probe import make_backend
from ..probing.progress import listening
from ..probing.workload import default_loss
from ..strategy import SIZE_BASED_MIN_PARAMS
from .held import HELD_NOTE, held_again
from .launched import launched
from .mixed import FALLBACK_NOTE, estimate_mixed, mixed_gpus
from .report import Report
from .request import Request
from .rows import (
    estimate_overheads,
    estimate_strategy_rows,
    estimate_workload,
    length_table,
    strategy_rows,
    workload_of,
)

__all__ = ["answer", "find"]

Note = Callable[[str], None]


def answer(request: Request, *, on_trial: Callable[[Any], None] | None = None, on_note: Note | None = None,
           written: dict[str, str] | None = None, on_progress: Callable[[str], None] | None = None) -> Report:
    """Answer ``request``: probe or estimate its rows, solve the plan, write the configs it names.

    Args:
        request: what to answer; it was checked whole when it was built.
        on_trial: called with each trial as it ends (one probe at a time), for progress.
        on_note: called with each note as it is said (an estimate instead of a probe, a card
            without bf16), before the work it announces; the notes are in the report too.
        written: filled with ``{kind: path}`` as each file is written, so that a caller
            interrupted half-way knows what is already on disk.
        on_progress: called while a trace or a training step runs past two seconds, with what it
            is, its batch and the seconds so far (``"tracing gpt2 at batch 64 on fake tensors: 5 s"``),
            every second, from a thread beside the work (:mod:`autobatch.probing.progress`).

    Example:
        >>> import autobatch, torch
        >>> request = autobatch.Request(model=torch.nn.Linear(64, 10), target=96, device="cpu", memory="64KiB",
        ...     make_batch=lambda b: (torch.randn(b, 64), torch.randint(0, 10, (b,))), headroom=0)
        >>> report = autobatch.answer(request)
        >>> report.plan.micro_batch * report.plan.grad_accum * report.plan.world_size
        96
    """
    if not isinstance(request, Request):
        raise AutobatchError(f"answer takes an autobatch.Request, but got {type(request).__name__}; build one, "
                             "e.g. autobatch.answer(autobatch.Request(target=224, max_micro=9))")
    notes: list[str] = []

    def note(text: str) -> None:
        if text in notes:  # the re-probe with the gradients held says the first probe's notes again
            return
        notes.append(text)
        if on_note is not None:
            on_note(text)

    with listening(on_progress):
        return _answer(request, on_trial, note, notes, written)


def _answer(request: Request, on_trial: Callable[[Any], None] | None, note: Note, notes: list[str],
            written: dict[str, str] | None) -> Report:
    if request.mode == "solve":
        fixed = request.micro_batch
        plan = solve(request.target, request.gpus_here(), request.nodes, fixed or request.max_micro,
                     min_micro=fixed or request.min_micro or 1, multiple_of=request.multiple_of,
                     model_parallel=request.model_parallel, base_lr=request.base_lr, base_batch=request.base_batch)
        for chosen in request.strategies or ():
            if chosen.is_fsdp and chosen.unit is None:
                note(SIZE_NOTE.format(strategy=chosen.name))
        return _written(Report(request, plan), into=written, notes=notes, note=note)
    report = (_estimate if request.mode == "estimate" else _probe)(request, note, on_trial)
    if held_again(report.request, report):  # its micro-steps hold the gradients the trials freed
        note(HELD_NOTE.format(micro=report.plan.micro_batch, accum=report.plan.grad_accum))
        report = (_estimate if request.mode == "estimate" else _probe)(replace(request, grads_held=True), note, on_trial)
    if not report.main_rank:
        return _found_under(report)
    if report.uneven is not None and report.plan is not None and any(request.outputs().values()):
        note(FALLBACK_NOTE.format(uniform=report.plan))
    said = _batchnorm_note(report)
    if said is not None:
        note(said)
    # Only where the probe held sizes of its own: a model with no hidden size ran DeepSpeed's, as the plugin will.
    zero = report.probed_zero or {}
    if any(key in zero for key in BUCKET_KEYS) and request.accelerate is not None and request.deepspeed is None:
        note(PLUGIN_NOTE.format(accelerate=request.accelerate, held=_held(zero)))
    return _written(report, into=written, notes=notes, note=note)


# solve knows no model, so no block to wrap: FSDP is written wrapped by size, and says so.
SIZE_NOTE = ("{strategy} with no --fsdp-unit: solve knows no model, so every file and line wraps by size (a unit per "
             f"module of at least {SIZE_BASED_MIN_PARAMS:,} parameters; a small model is one unit); name the block to "
             "wrap each one, e.g. --fsdp-unit LlamaDecoderLayer, as find does for a model that has blocks")


def _batchnorm_note(report: Report) -> str | None:
    """What a plan of one sample per GPU does to the model's BatchNorm, where it has one whose
    statistics are each GPU's own (``--min-micro 1`` lets the plan go below BatchNorm's 2)."""
    plan, uneven = report.plan, report.uneven
    micros = ({plan.micro_batch} if plan is not None else set()) | (
        {rank.micro_batch for rank in uneven.ranks} if uneven is not None else set())
    if 1 not in micros:
        return None
    results = [row.probe for row in report.rows if hasattr(row, "probe")]
    if report.lengths is not None:
        results += [row.train for row in report.lengths.rows]
    layers = sorted({name for result in results for name in result.extra.get("batchnorm", ())})
    ranks = plan.world_size if plan is not None else uneven.world_size
    per_gpu = per_gpu_statistics(layers, ranks)
    if not per_gpu:
        return None
    return BATCHNORM_NOTE.format(layers=" and ".join(per_gpu))


# A batch of one trains where a channel holds more than one value (a conv net's pixels), so the probe passed.
BATCHNORM_NOTE = ("the plan trains 1 sample per GPU, and the model's {layers} takes its statistics from each GPU's "
                  "own micro batch: from one sample, training fails where a channel holds one value ('Expected more "
                  "than 1 value per channel when training') and elsewhere normalises each sample by itself; "
                  "--min-micro 2 (min_micro=2 from Python; the default for a model with BatchNorm) plans at least "
                  "2, or torch.nn.SyncBatchNorm.convert_sync_batchnorm(model) takes them over every GPU")


def _held(zero: dict[str, Any]) -> str:
    """The bucket sizes a ZeRO probe held, as ``key=value`` pairs."""
    return ", ".join(f"{key}={zero[key]}" for key in BUCKET_KEYS if key in zero)


# accelerate's DeepSpeed plugin (an accelerate file without a DeepSpeed file) has no key for a bucket size.
PLUGIN_NOTE = ("{accelerate} trains ZeRO through accelerate's DeepSpeed plugin, which takes no bucket sizes: DeepSpeed's "
               "own (a 500,000,000-element gradient bucket, 954 MiB a GPU in fp16) where the probe held {held}; "
               "add --deepspeed ds.json and the accelerate config names that file, which holds the probed ones")


def _found_under(report: Report) -> Report:
    """The report whose plan carries what its batch was found under (:class:`TrainedWith`), which every
    config helper then trains with: ``deepspeed_config(autobatch.find(…, dtype="bf16"))`` is bf16."""
    from dataclasses import replace

    if report.plan is None or report.plan.trained_with is not None:
        return report
    found = TrainedWith(strategy=report.strategy, probed_zero=report.probed_zero, **report.training())
    return replace(report, plan=replace(report.plan, trained_with=found))


def _written(report: Report, *, into: dict[str, str] | None, notes: list[str] | None = None,
             note: Note | None = None) -> Report:
    """The report with the configs (and the plot) its request names written, and what merging changed;
    its plan carries what its batch was found under, which every config helper then trains with.
    A folder made for a file is noted."""
    from dataclasses import replace

    report = _found_under(report)
    request, plan = report.request, report.plan
    paths = [Path(p) for p in (*request.outputs().values(), request.plot) if p is not None]
    missing = sorted({p.parent for p in paths if not p.parent.exists()})
    written = {} if into is None else into
    changes: list[str] = []
    if plan is not None and len(report.rows) <= 1:  # the plan carries its strategy, precision, …: every file trains so
        write_plan_configs(plan, **request.outputs(), keep_auto=request.keep_auto, written=written, changes=changes,
                           eval_batch=report.eval_batch)
    if request.plot is not None and report.finding is not None:
        from ..tuning.plot import plot_probe

        plot_probe(report.finding.probe, request.plot, chosen=plan.micro_batch)
        written["plot"] = str(request.plot)
    made = [str(folder) for folder in missing if folder.is_dir()]
    if made and note is not None:
        note(f"made the folder{'s' if len(made) > 1 else ''} {', '.join(made)}, which did not exist, for the files written")
    return replace(report, written=dict(written), changes=tuple(changes), notes=tuple(notes or report.notes))


def _estimate(request: Request, note: Note, on_trial: Callable[[Any], None] | None = None) -> Report:
    """No GPU to probe, or a named one: the same steps traced on fake tensors for ``request``'s GPU."""
    from ..estimating.estimate import estimate
    from ..estimating.gpus import lacks_bf16, resolve_gpu

    if mixed_gpus(request) is not None:
        return estimate_mixed(request, note)
    spec = resolve_gpu(request.gpu, request.gpu_memory)
    if not request.estimate:
        chosen = ("--gpu-memory" if request.gpu_memory is not None else "--gpu" if request.gpu is not None
                  else "the default; pick your card with --gpu, see `autobatch gpus`")
        note(f"no CUDA GPU here, so these are estimates for {spec.name} ({chosen}) from a fake-tensor trace; "
             "run find on the GPU machine for exact figures")
    if lacks_bf16(spec, request.precision):
        note(f"{spec.name} has no bf16 ({spec.notes}): the estimate is of bf16 as asked, but on this card train "
             "with fp16 or fp32 (--dtype fp16)")
    gpus = request.gpus_here()
    data_parallel = gpus * request.nodes // max(1, request.model_parallel)  # DDP's ranks, each holding its buckets
    if request.strategies is not None:
        rows = estimate_strategy_rows(request, spec, on_trial=on_trial)
        plan = rows[0].plan if len(rows) == 1 and isinstance(rows[0], Finding) else None
        return Report(request, plan, rows=tuple(rows), gpu=spec)
    overheads = estimate_overheads(request)
    if request.table:
        table, _ = length_table(request, None, {"gpu": spec, "overheads": overheads, "data_parallel": data_parallel})
        plan = table.plan(gpus_per_node=gpus, **request.planning())
        return Report(request, plan, lengths=table, gpu=spec)
    result = estimate(estimate_workload(request), spec, overheads=overheads, headroom=request.headroom, max_batch=request.max_micro,
                      min_batch=request.min_micro, data_parallel=data_parallel,
                      on_trial=on_trial)
    plan = None
    if request.target is not None:
        plan = solve(request.target, gpus, request.nodes, result.safe_batch, min_micro=result.min_batch,
                     multiple_of=request.multiple_of, model_parallel=request.model_parallel,
                     base_lr=request.base_lr, base_batch=request.base_batch)
    return Report(request, plan, rows=(Finding(result, plan),), gpu=spec)


def _probe(request: Request, note: Note, on_trial: Callable[[Any], None] | None) -> Report:
    """Real steps: every rank under a launcher, one worker per GPU, or this process's device."""
    if request.launched:
        return launched(request, note)
    strategies = request.strategies
    gpu_count = local_gpu_count()
    if (strategies is None and not request.table and isinstance(request.model, str) and request.device is None
            and request.memory is None and gpu_count > 1):
        from ..distributed.launch import spawn_local

        note(f"probing {gpu_count} GPUs, one worker each…")
        worker = {"max_batch": request.max_micro, "min_batch": request.min_micro, "headroom": request.headroom,
                  "timeout_s": request.timeout, "use_trace_prior": request.trace_prior}
        agreed, ranks = spawn_local(probe_worker, (request.model, request.load_options(request.one_length),
                                                   request.settings(), worker), timeout_s=request.timeout)
        plan = plan_from_probe(agreed, gpus_per_node=request.gpus_per_node or gpu_count, **request.planning())
        return Report(request, plan, rows=(Finding(agreed, plan, ranks_report=ranks),))
    backend = make_backend(request.device or ("cpu" if request.memory is not None else None), request.memory)
    if request.table:
        table, workload = length_table(request, backend, None)
        if request.cache:
            from ..tuning.probed import store_rows

            store_rows(table, workload, backend, dict(max_batch=request.max_micro, min_batch=request.min_micro,
                                                      headroom=request.headroom))
        plan = table.plan(gpus_per_node=request.gpus_here(), **request.planning())
        return Report(request, plan, lengths=table, device=backend.info())
    # A named model's trace process (beside GPU trials, or sharded ones) starts as the model is built
    # here, and builds its own copy meanwhile.
    traced_apart = strategies is not None or backend.device.type == "cuda"
    with warmed() if request.trace_prior and traced_apart else nullcontext():
        workload = workload_of(request)
        if strategies is not None:
            rows = strategy_rows(request, lambda _: (workload, backend), on_trial=on_trial,
                                 use_trace_prior=request.trace_prior)
            plan = rows[0].plan if len(rows) == 1 and isinstance(rows[0], Finding) else None
            return Report(request, plan, rows=tuple(rows), device=backend.info())
        finding = find_plan(workload, gpus_per_node=request.gpus_per_node, backend=backend,
                            max_batch=request.max_micro, min_micro=request.min_micro, headroom=request.headroom,
                            on_trial=on_trial, use_cache=request.cache, use_trace_prior=request.trace_prior,
                            **request.planning())
    return Report(request, finding.plan, rows=(finding,), device=finding.probe.device)


_RENAMED = {"max_batch": "max_micro", "use_trace_prior": "trace_prior", "use_cache": "cache"}


# The other tools' names for a Request field (Lightning's devices, accelerate's num_processes, the HF
# Trainer's gradient_checkpointing, torchrun's nproc_per_node...): what a user types before reading ours.
_PEERS = {**dict.fromkeys(("n_gpus", "num_gpus", "devices", "world_size", "nproc_per_node", "num_processes"), "gpus_per_node"),
          **dict.fromkeys(("num_nodes", "nnodes"), "nodes"),
          **dict.fromkeys(("precision", "mixed_precision", "amp"), "dtype"),
          **dict.fromkeys(("gradient_checkpointing", "activation_checkpointing"), "grad_checkpointing"),
          **dict.fromkeys(("max_micro_batch", "max_batch_size", "max_micro_batch_size", "max_per_device"),
                          "max_micro"),
          **dict.fromkeys(("global_batch", "global_batch_size", "train_batch_size"), "target"),
          **dict.fromkeys(("micro_batch_size", "per_device_train_batch_size"), "micro_batch"),
          **dict.fromkeys(("budget", "memory_limit"), "memory")}


def _known(options: dict[str, Any]) -> None:
    """One line for an option ``find`` does not take, naming the keyword meant: a flag's own spelling
    (``gpus`` for ``--gpus``, ``no_cache`` for ``--no-cache``) finds the field it sets."""
    import dataclasses
    import difflib

    fields = sorted(f.name for f in dataclasses.fields(Request) if f.init)
    for key in options:
        if key in fields or key == "on_trial":
            continue
        word = key.removeprefix("no_")
        meant = ([_PEERS[word]] if word in _PEERS else [f for f in fields if f.startswith(word)]) \
            or difflib.get_close_matches(word, fields, n=1, cutoff=0.6) or [f for f in fields if word.startswith(f)]
        value = not options[key] if key.startswith("no_") and isinstance(options[key], bool) else options[key]
        if key == "batch_size":  # a DataLoader's is per GPU, a config's often global: both are asked apart
            raise RequestError([f"find() takes no option 'batch_size'; use target={value!r} for the global batch, "
                                f"or micro_batch={value!r} for a fixed batch per GPU"])
        fix = (f"use {meant[0]}={value!r}" if meant
               else f"use one of the Request fields: {', '.join(fields)}")
        raise RequestError([f"find() takes no option {key!r}; {fix}"])


def find(
    model: torch.nn.Module | Callable[[], torch.nn.Module],
    make_batch: Callable[[int], Any],
    *,
    target: int | None = None,
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor] = default_loss,
    optimizer: Any = "adamw",
    dtype: str | torch.dtype | None = None,
    grad_checkpointing: bool = False,
    device: str | None = None,
    memory: int | str | None = None,
    **options: Any,
) -> Plan:
    """The plan for ``target`` from a probe of your model, in one call, before training.

    The short form of :func:`answer` for a model in hand: it builds the :class:`~autobatch.Request`
    and returns the report's plan. It always probes (a GPU, or the CPU against ``memory``).

    Args:
        model: your model (left bit-identical) or a function building it.
        make_batch: ``make_batch(b)`` returns a batch of ``b`` samples at the worst-case shape.
        target: the global batch per optimizer step; default the safe batch on every GPU.
        loss_fn, optimizer, dtype, grad_checkpointing: as in :class:`~autobatch.Workload`.
        device, memory: ``"cuda"`` (default when available) or ``"cpu"`` with a simulated ``memory``.
        options: any other :class:`~autobatch.Request` field (``gpus_per_node``, ``nodes``,
            ``headroom``, ``strategy`` — e.g. ``strategy="zero3", gpus_per_node=8`` probes one rank
            of eight under ZeRO-3 …; ``trace_prior=False`` searches without the fake-tensor trace's lead),
            and ``on_trial``, called with each trial as it ends.

    Example:
        >>> import torch, autobatch
        >>> model = torch.nn.Linear(64, 10)
        >>> plan = autobatch.find(model, lambda b: (torch.randn(b, 64), torch.randint(0, 10, (b,))),
        ...                       target=96, device="cpu", memory="64KiB", headroom=0)
        >>> plan.micro_batch * plan.grad_accum * plan.world_size
        96
    """
    options = {_RENAMED.get(k, k): v for k, v in options.items()}
    _known(options)
    on_trial = options.pop("on_trial", None)
    request = Request(model=model, make_batch=make_batch, loss_fn=loss_fn, optimizer=optimizer,
                      dtype="fp32" if dtype is None else dtype, grad_checkpointing=grad_checkpointing, target=target,
                      device=device, memory=memory, estimate=False, **options)
    return answer(request, on_trial=on_trial).plan

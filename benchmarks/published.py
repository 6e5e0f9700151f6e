"""The estimate against published measurements of real GPU training runs.

``python -m benchmarks.published`` takes every observation in ``benchmarks/published_observations.json``
(a model, GPU, lengths, precision, optimizer, checkpointing, strategy and world size from a
published source, with the exact quote, and a batch that fit, ran out of memory, or a measured
peak), estimates it on fake tensors at exactly that batch, each in its own process, and writes
``docs/benchmarks/published.md``: observed against predicted, the peak's error against the figure
the source read (nvidia-smi: the estimate's reserved peak plus the card's CUDA context;
``max_memory_allocated`` or unnamed: the traced allocated peak), and for each point what it lacks.

``--ids ID …`` runs some, ``--timeout S`` bounds each point (default 600 s), ``--out DIR``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import re
import statistics
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "benchmarks/published_observations.json"
COMMAND = "python -m benchmarks.published"

__all__ = ["load", "lacks", "caveats", "optimizer_step", "grads_held", "frozen", "floor_bytes", "said", "predict", "run", "markdown", "main"]

# Cards the catalogue does not hold, by their total memory (the context is the default 500 MiB).
OTHER_CARDS = {"titan-rtx-24gb": "24GiB", "titan-x-12gb": "12GiB", "p100-16gb": "16280MiB"}
CATALOGUE = {"rtx3090-24gb": "rtx-3090", "rtx4090-24gb": "rtx-4090", "a10g-24gb": "a10g", "v100-16gb": "v100-16gb",
             "a100-40gb": "a100-40gb", "a100-80gb": "a100-80gb"}
# The sources' FSDP is FSDP1 (PyTorch 1.12's, accelerate's plugin of that time, Lightning Fabric's FSDPStrategy).
STRATEGIES = {"fsdp": "fsdp1", "zero2": "zero2", "zero3": "zero3", "zero3-offload": "zero3", "zero1": "zero1"}


def load(path: Path = DATA) -> list[dict[str, Any]]:
    return json.loads(path.read_text())


def lacks(obs: dict[str, Any]) -> list[str]:
    """What keeps a point from being estimated as the source ran it (empty: nothing)."""
    missing = []
    if "TensorFlow" in (obs.get("framework") or ""):
        missing.append("a TensorFlow run (the estimate traces PyTorch's allocations)")
    if obs["gpu"] is None:
        missing.append("the card is not named")
    if obs["strategy"] == "zero3-offload" and obs["world_size"] is None:
        missing.append("the world size is not stated")
    return missing


def caveats(obs: dict[str, Any]) -> list[str]:
    """Terms the run had that the estimate does not model (it still answers; the table says so)."""
    said = " ".join([obs.get("notes") or "", *obs.get("missing", [])])
    found = []
    if obs.get("padding") == "longest":  # each batch padded to its longest sample, not to seq_len
        found.append("dynamic padding: its samples are shorter than the maximum the estimate takes")
    if "optimizer_in_bwd True" in said:
        found.append("the optimizer step fused into the backward")
    if "ChunkedOutputLoss" in said:
        found.append("a chunked cross-entropy")
    if "PagedAdamW8bit" in said:
        found.append("paged 8-bit AdamW (taken as AdamW8bit)")
    if "retries at a smaller batch" in said:
        found.append("a fit, not the largest: the next batch tried is not recorded")
    return found


def _optimizer(obs: dict[str, Any]) -> Any:
    """The run's optimizer; where the source does not state it, its tool's default (timm's
    benchmark: SGD), else AdamW. Stepped as the run stepped it (:func:`optimizer_step`)."""
    import torch

    name = obs["optimizer"] or ("sgd" if any("default optimizer is sgd" in m for m in obs.get("missing", [])) else "adamw")
    step = optimizer_step(obs)
    classes = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam}
    if step == "multi-tensor" or name not in classes or obs["strategy"] not in ("single", "ddp"):
        return name  # torch's default on a GPU since 2.0, as the estimate steps it (a wrapper: its own)
    option = {"fused": True} if step == "fused" else {"foreach": False}
    return lambda params: classes[name](params, lr=1e-4, **option)


def optimizer_step(obs: dict[str, Any]) -> str:
    """How the run's AdamW stepped, which sets the step's temporaries: ``"one-tensor"`` (a parameter
    at a time: torch before 2.0, and the transformers Trainer's own AdamW of that time),
    ``"fused"`` (nanoGPT asks for it on a GPU) or ``"multi-tensor"`` (torch's default on a GPU since 2.0)."""
    framework = obs.get("framework") or ""
    if "nanoGPT" in framework:
        return "fused"
    return "one-tensor" if _before_torch_2(obs) else "multi-tensor"


# Sources run on torch 1.x (their framework names its version, or a transformers release of that time).
_TORCH_1 = ("PyTorch 1.", "transformers 4.2", "v4.21", "transformers ~2", "transformers master (~4.2")


def _before_torch_2(obs: dict[str, Any]) -> bool:
    return any(mark in (obs.get("framework") or "") for mark in _TORCH_1)


def grads_held(obs: dict[str, Any]) -> bool:
    """Whether the run's gradients stayed allocated into the next forward: every accumulation micro-step
    after the first, and, before torch 2.0, every step of a loop that zeroed them with ``zero_grad()``,
    whose default then was ``set_to_none=False`` (zeros kept). Unsharded steps only: the wrappers own theirs."""
    if obs["strategy"] not in ("single", "ddp"):
        return False
    return (obs["grad_accum"] or 1) > 1 or _before_torch_2(obs)


def frozen(model: Any, names: Any) -> Any:
    """``model`` with the parameters of its submodules ``names`` frozen, as the run froze them (the seq2seq
    examples' ``--freeze_embeds``: T5's shared embedding, and with it the LM head tied to it): they get
    no gradients and no optimizer state."""
    for name in names:
        for param in model.get_submodule(name).parameters():
            param.requires_grad_(False)
    return model


# Optimizer state a parameter keeps, in its own bytes: what any run with that optimizer holds from its first step.
_STATE = {"adamw": 2, "adam": 2, "sgd": 1}


def floor_bytes(model: Any, optimizer: str) -> int:
    """The bytes a run holds at its peak whatever its batch, by hand: the weights, and the optimizer state of
    the trainable ones (``adamw8bit``: bitsandbytes' block-wise sizes). A peak measured below it cannot
    be of the setup the source states."""
    from autobatch.probing.eight_bit import state_bytes

    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    trainable = [p for p in model.parameters() if p.requires_grad]
    if optimizer == "adamw8bit":
        return weights + sum(state_bytes(p.numel()) for p in trainable)
    return weights + _STATE.get(optimizer, 0) * sum(p.numel() * p.element_size() for p in trainable)


def _card(gpu: str) -> dict[str, str]:
    return {"gpu": CATALOGUE[gpu]} if gpu in CATALOGUE else {"gpu_memory": OTHER_CARDS[gpu]}


def predict(obs: dict[str, Any]) -> dict[str, Any]:
    """The estimate at the observed batch (run in the child): fit or not, reserved and allocated peaks."""
    import torch

    import autobatch
    from autobatch.estimating.gpus import resolve_gpu
    from benchmarks.published_models import build

    built, make = build(obs["model"], obs["task_head"], obs.get("attention") or "sdpa", obs.get("target_len"))
    seq, image, batch = obs["seq_len"], obs["image_size"], obs["per_gpu_batch"]
    precision = obs["precision"] or "fp32"
    pure = {"bf16-pure": torch.bfloat16, "fp16-pure": torch.float16}.get(precision)
    dtype = {"fp16-amp": "fp16", "bf16-amp": "bf16"}.get(precision)

    def factory() -> torch.nn.Module:
        return frozen(built(), obs.get("frozen") or ())

    def model() -> torch.nn.Module:
        # Pure low-precision weights: built in that dtype (a cast after would swap tied weights).
        if pure is None:
            return factory()
        default = torch.get_default_dtype()
        torch.set_default_dtype(pure)
        try:
            return factory()
        finally:
            torch.set_default_dtype(default)

    work = autobatch.Workload(model, lambda b: make(b, seq, image), optimizer=_optimizer(obs), dtype=dtype,
                              grad_checkpointing=bool(obs["grad_checkpointing"]),
                              grads_held=grads_held(obs),
                              name=obs["id"])
    card = _card(obs["gpu"])
    spec = resolve_gpu(card.get("gpu"), card.get("gpu_memory"))
    if obs.get("context_bytes_measured"):  # the source measured its CUDA context: that, not the catalogue's
        spec = replace(spec, context_bytes=obs["context_bytes_measured"])
    seen: list[Any] = []
    world = obs["world_size"] or 1
    with torch.device("meta"):  # shapes and dtypes only
        floor = floor_bytes(model(), obs["optimizer"] or "adamw") if obs["strategy"] == "single" else None

    def figures(trial: Any) -> dict[str, Any]:
        """The traced trial at the observed batch (``None``: nothing fit) on the run's card."""
        return {"fits": trial is not None and trial.fits, "reserved": trial and trial.reserved_bytes,
                "allocated": trial and trial.peak_bytes, "context": spec.context_bytes,
                "capacity": spec.total_bytes - spec.context_bytes, "floor": floor}

    if obs["strategy"] in ("single", "ddp"):
        try:
            autobatch.estimate(work, spec, headroom=0,
                               min_batch=batch, max_batch=batch, on_trial=seen.append,
                               data_parallel=world if obs["strategy"] == "ddp" else 1)
        except autobatch.NoBatchFitsError:
            pass
        return figures(seen[0])
    with tempfile.TemporaryDirectory() as tmp:
        written = {}
        if obs.get("deepspeed"):  # the zero_optimization values the run's DeepSpeed config held, as a file to read
            path = Path(tmp) / "ds.json"
            path.write_text(json.dumps({"zero_optimization": obs["deepspeed"]}))
            written = {"deepspeed": path, "target": batch * world}  # a file written needs a plan
        request = autobatch.Request(model=model, make_batch=lambda b: make(b, seq, image), optimizer=_optimizer(obs),
                                    dtype=dtype or "fp32", grad_checkpointing=bool(obs["grad_checkpointing"]),
                                    strategy=STRATEGIES[obs["strategy"]], gpus_per_node=world, estimate=True,
                                    min_micro=batch, max_micro=batch, headroom=0,
                                    offload=obs.get("offload"),
                                    cuda_context=obs.get("context_bytes_measured"), **card, **written)
        try:
            autobatch.answer(request, on_trial=seen.append)
        except autobatch.NoBatchFitsError:
            pass
    return figures(next((t for t in seen if t.batch == batch), None))


def _child(obs: dict[str, Any], timeout: int) -> dict[str, Any]:
    try:
        proc = subprocess.run([sys.executable, "-m", "benchmarks.published", "--one", obs["id"]], cwd=ROOT,
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"the estimate took more than {timeout} s"}
    if proc.returncode < 0:
        return {"error": f"the estimate's process was killed (signal {-proc.returncode}: host memory, most likely)"}
    if proc.returncode != 0:
        lines = [line for line in proc.stderr.strip().splitlines() if line.strip() and not line.startswith(" ")]
        raised = [line for line in lines if re.match(r"^[\w.]*(Error|Exception)\b", line)]
        said = (raised or lines or [f"exit {proc.returncode}"])[-1]
        return {"error": said[:200]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _error(obs: dict[str, Any], got: dict[str, Any]) -> float | None:
    if obs["outcome"] != "peak" or got.get("reserved") is None:
        return None
    measured = obs["peak_bytes_measured"]
    predicted = got["reserved"] + got["context"] if obs["peak_measured_by"] == "nvidia-smi" else got["allocated"]
    return (predicted - measured) / measured


def said(obs: dict[str, Any], got: dict[str, Any]) -> list[str]:
    """What the table says beside a point's estimate: the terms its run had that the estimate lacks
    (:func:`caveats`), and a measured peak below the floor its stated setup must hold (:func:`floor_bytes`)."""
    found = caveats(obs)
    if obs["outcome"] == "peak" and got.get("floor") and obs["peak_bytes_measured"] < got["floor"]:
        found.append(f"its peak is below the {got['floor'] / 2**30:.2f} GiB the weights and the optimizer's "
                     "state alone take: not the run as stated")
    return found


def run(observations: list[dict[str, Any]], timeout: int) -> list[dict[str, Any]]:
    rows = []
    for obs in observations:
        got = {"error": "; ".join(lacks(obs))} if lacks(obs) else _child(obs, timeout)
        row = {"id": obs["id"], "obs": obs, "got": got, "peak_error": _error(obs, got), "caveats": said(obs, got)}
        if "fits" in got and obs["outcome"] in ("fit", "oom"):
            row["right"] = got["fits"] == (obs["outcome"] == "fit")
        elif "fits" in got:
            row["right"] = got["fits"]  # a peak measured: the run fit
        rows.append(row)
        print(f"  {obs['id']}: {got}", file=sys.stderr, flush=True)
    return rows


def _gib(n: float | None) -> str:
    return "–" if n is None else f"{n / 2**30:.2f}"


def markdown(rows: list[dict[str, Any]], argv: list[str]) -> str:
    answered = [r for r in rows if "fits" in r["got"]]
    right = [r for r in answered if r.get("right")]
    errors = [r["peak_error"] for r in rows if r["peak_error"] is not None]
    lines = [
        "# The estimate against published GPU measurements",
        "",
        f"`{COMMAND}{' ' + ' '.join(argv) if argv else ''}` · {dt.date.today().isoformat()} · "
        f"{len(rows)} published observations (`benchmarks/published_observations.json`: each with its source and quote)",
        "",
        f"**Answered {len(answered)} of {len(rows)}; fit or out of memory as observed: {len(right)} of {len(answered)}.**",
    ]
    if errors:
        lines.append(f"**Peaks: {len(errors)} compared, error {min(errors):+.0%} to {max(errors):+.0%}, "
                     f"median {statistics.median(errors):+.0%}; within 10 %: {sum(abs(e) <= 0.10 for e in errors)}.**")
    lines += [
        "",
        "Peaks read by nvidia-smi are compared with the estimate's reserved peak plus the CUDA context (the one "
        "the source measured where it did, else the card's in the catalogue); "
        "those read by `max_memory_allocated` (or unnamed) with the traced allocated peak. "
        "GiB are 2³⁰ bytes.",
        "",
        "| observation | model | card | seq / image | precision | optimizer | ckpt | strategy × world | batch | "
        "observed | predicted | peak observed | peak predicted | error | right | lacks |",
        "|---|---|---|---|---|---|---|---|---:|---|---|---:|---:|---:|---|---|",
    ]
    for row in rows:
        obs, got = row["obs"], row["got"]
        predicted = ("fits" if got["fits"] else "out of memory") if "fits" in got else "–"
        peak_pred = None
        if got.get("reserved") is not None:
            peak_pred = got["reserved"] + got["context"] if obs["peak_measured_by"] == "nvidia-smi" else got["allocated"]
        lines.append(
            f"| [{obs['id']}]({obs['source_url']}) | {obs['model']} | {obs['gpu'] or '–'} | "
            f"{obs['seq_len'] or obs['image_size'] or '–'} | {obs['precision'] or '–'} | {obs['optimizer'] or '–'} | "
            f"{'yes' if obs['grad_checkpointing'] else 'no'} | {obs['strategy']} × {obs['world_size'] or '?'} | "
            f"{obs['per_gpu_batch']} | {obs['outcome']} | {predicted} | "
            f"{_gib(obs['peak_bytes_measured']) if obs['outcome'] == 'peak' else '–'} | {_gib(peak_pred)} | "
            f"{'–' if row['peak_error'] is None else format(row['peak_error'], '+.0%')} | "
            f"{'–' if 'right' not in row else 'yes' if row['right'] else '**no**'} | "
            f"{'; '.join(filter(None, [got.get('error', ''), *row.get('caveats', [])]))} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.splitlines()[0])
    parser.add_argument("--ids", nargs="*", default=None)
    parser.add_argument("--timeout", type=int, default=600)
    parser.add_argument("--out", default=str(ROOT / "docs/benchmarks"))
    parser.add_argument("--merge", action="store_true", help="run --ids again and replace their rows in the record")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    observations = load()
    if args.one:
        print(json.dumps(predict(next(o for o in observations if o["id"] == args.one))))
        return []
    if args.ids:
        observations = [o for o in observations if o["id"] in args.ids]
    rows = run(observations, args.timeout)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.merge:  # the record's other rows keep their estimates; what each run is and lacks is read afresh
        again = {r["id"]: r for r in rows}
        current = {o["id"]: o for o in load()}
        rows = [again.get(r["id"]) or {**r, "obs": current[r["id"]], "caveats": said(current[r["id"]], r["got"])}
                for r in json.loads((out / "published.json").read_text())]
        argv = []
    shown = [a for i, a in enumerate(argv) if a != "--out" and not (i and argv[i - 1] == "--out")]
    (out / "published.md").write_text(markdown(rows, shown))
    (out / "published.json").write_text(json.dumps(rows, indent=1) + "\n")
    return rows


if __name__ == "__main__":
    main()

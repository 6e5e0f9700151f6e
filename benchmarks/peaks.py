"""Peaks a real GPU measured at fixed batches, beside the trace's for the same settings.

``find`` records the card's peaks only at the batches its search tried. This records them at
batches chosen to answer questions the estimate left open: eager against fused (SDPA) attention,
autocast fp16, gradient checkpointing, vision models, llama-1b, and bert-large at 512 tokens near
what a 16 GiB card holds. It also records the CUDA context: what the device has in use beyond
what the caching allocator reserved, after CUDA starts, after the first matrix product and
convolution, and after each model has trained.

On the GPU machine (``python -m benchmarks.gpu run`` calls it)::

    python -m benchmarks.peaks run --out DIR/peaks.json

Anywhere, from the record::

    python -m benchmarks.peaks report docs/benchmarks/peaks.json

writes ``docs/benchmarks/peaks.md``: the card's allocated and reserved peaks against the trace's
tensor bytes and its booking through the caching-allocator model at each batch.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

__all__ = ["PeakCase", "CASES", "run", "traced", "markdown", "report", "main"]


@dataclass(frozen=True)
class PeakCase:
    name: str
    model: str                  # a key of benchmarks.published_models.BUILDERS
    head: str
    batches: tuple[int, ...]
    dtype: str | None = None    # autocast: "bf16", "fp16"; None: fp32
    seq_len: int | None = None
    image_size: int | None = None
    attention: str = "sdpa"
    grad_checkpointing: bool = False

    def workload(self, model: Any) -> Any:
        import autobatch
        from benchmarks.published_models import build

        _, make = build(self.model, self.head, self.attention)
        return autobatch.Workload(model, lambda b: make(b, self.seq_len, self.image_size), dtype=self.dtype,
                                  grad_checkpointing=self.grad_checkpointing, name=self.name)

    def factory(self) -> Any:
        from benchmarks.published_models import build

        return build(self.model, self.head, self.attention)[0]


BERT_L = "bert-large-uncased"
CASES = [
    # The HF docs' V100 experiment (docs/benchmarks/published.md), on this card: eager and fused attention.
    PeakCase("bert-large-cls-eager", BERT_L, "sequence-classification", (4, 8), seq_len=512, attention="eager"),
    PeakCase("bert-large-cls-sdpa", BERT_L, "sequence-classification", (4, 8), seq_len=512),
    PeakCase("bert-large-cls-eager-fp16", BERT_L, "sequence-classification", (4, 8), "fp16", 512, attention="eager"),
    PeakCase("bert-large-cls-eager-ckpt", BERT_L, "sequence-classification", (1, 4), seq_len=512, attention="eager",
             grad_checkpointing=True),
    # benchmarks/speed.py's bert-large, which the estimate fits 12 of on a 16 GiB card.
    PeakCase("bert-large-mlm-sdpa", BERT_L, "masked-lm", (11, 12, 13), seq_len=512),
    PeakCase("gpt2-eager", "gpt2", "causal-lm", (8,), seq_len=1024, attention="eager"),
    PeakCase("gpt2-sdpa", "gpt2", "causal-lm", (8,), seq_len=1024),
    PeakCase("llama-1b-bf16", "meta-llama/Llama-3.2-1B", "causal-lm", (2, 8), "bf16", 2048),
    PeakCase("vit-base-bf16", "vit_base_patch16_224", "image-classification", (64, 128), "bf16", image_size=224),
    PeakCase("resnet50", "resnet50", "image-classification", (64, 128), image_size=224),
]


def _in_use() -> dict[str, int]:
    import torch

    if not torch.cuda.is_available():  # a dry run on the CPU
        return {"used": 0, "reserved": 0, "allocated": 0}
    free, total = torch.cuda.mem_get_info()
    return {"used": total - free, "reserved": torch.cuda.memory_reserved(), "allocated": torch.cuda.memory_allocated()}


def _context() -> dict[str, Any]:
    """The device's use beyond the allocator's reservation, as CUDA, cuBLAS and cuDNN start."""
    import torch

    steps: dict[str, Any] = {}
    torch.zeros(1, device="cuda")
    steps["cuda_started"] = _in_use()
    a = torch.randn(256, 256, device="cuda")
    (a @ a).sum().item()
    steps["after_matmul"] = _in_use()
    x = torch.randn(2, 3, 32, 32, device="cuda")
    torch.nn.functional.conv2d(x, torch.randn(8, 3, 3, 3, device="cuda")).sum().item()
    steps["after_conv"] = _in_use()
    del a, x
    torch.cuda.empty_cache()
    return steps


def run(out: Path, cases: list[PeakCase] = CASES) -> dict[str, Any]:
    """Train each case at its batches on this process's GPU; ``out`` is rewritten after each case.

    Without CUDA it is a dry run of the same code on a simulated CPU budget (checks the script here)."""
    import torch

    from autobatch import SimulatedBackend
    from autobatch.probing.backends.cuda import CudaBackend
    from autobatch.probing.preserve import borrowed_model
    from autobatch.probing.probe import training_trial

    cuda = torch.cuda.is_available()
    card = ({"gpu": torch.cuda.get_device_name(0), "total_bytes": torch.cuda.get_device_properties(0).total_memory}
            if cuda else {"gpu": "cpu (dry run)", "total_bytes": 64 * 2**30})
    record: dict[str, Any] = {"card": {**card, "torch": torch.__version__, "cuda": torch.version.cuda,
                                       "date": dt.date.today().isoformat()},
                              "context": _context() if cuda else {}, "cases": []}
    backend = CudaBackend(0) if cuda else SimulatedBackend(card["total_bytes"])
    for case in cases:
        start = time.perf_counter()
        row: dict[str, Any] = {"case": asdict(case), "trials": []}
        try:
            with torch.device("cuda" if cuda else "cpu"):
                model = case.factory()()
            work = case.workload(model)
            with borrowed_model(model, backend.device, grad_checkpointing=case.grad_checkpointing) as lent:
                for batch in case.batches:
                    trial = training_trial(work, lent, backend, batch)
                    row["trials"].append({**trial.to_dict(), "in_use_after": _in_use()})
            del model, lent
            backend.release()
            row["in_use_after_release"] = _in_use()
        except Exception as exc:  # keep what the other cases measure
            row["error"] = f"{type(exc).__name__}: {str(exc)[:500]}"
        row["seconds"] = round(time.perf_counter() - start, 1)
        record["cases"].append(row)
        print(f"  {case.name}: {[(t['batch'], t['fits'], t['peak_bytes'], t['reserved_bytes']) for t in row['trials']]}"
              f" {row.get('error', '')} {row['seconds']} s", file=sys.stderr, flush=True)
        out.write_text(json.dumps(record, indent=1) + "\n")
    return record


def traced(case: PeakCase, batches: list[int], capacity: int) -> dict[int, dict[str, Any]]:
    """The trace's figures for ``case`` at ``batches``: tensor bytes and the allocator model's booking."""
    from autobatch.estimating.estimate import _new_fake_mode, trace_batches, training_copy
    from autobatch.estimating.replay import book

    mode = _new_fake_mode()
    work = case.workload(case.factory())
    work = replace(work, model=training_copy(work, mode))  # as the estimate copies it
    curve = trace_batches(work, work.model, fake_mode=mode, primed=False)
    figures = {}
    for batch in batches:
        booking = book(curve.requests(batch), capacity)
        figures[batch] = {"allocated": curve.trial(batch).peak_bytes, "reserved": booking.peak_reserved,
                          "fits": booking.fits}
    return figures


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def _gap(a: float, b: float) -> str:
    return f"{(a - b) / b:+.1%}"


def markdown(record: dict[str, Any], traces: dict[str, dict[int, dict[str, Any]] | str]) -> str:
    card, context = record["card"], record["context"]
    lines = [
        "# Peaks on a real GPU at fixed batches, against the trace",
        "",
        f"{card['date']} · {card['gpu']} · torch {card['torch']}, CUDA {card['cuda']} · AdamW, two steps a trial",
        "",
        "Written by `python -m benchmarks.peaks report docs/benchmarks/peaks.json` from the card's record "
        "(made there by `python -m benchmarks.gpu run`). *Card*: `max_memory_allocated` and "
        "`max_memory_reserved` over the trial. *Trace*: the fake-tensor trace's tensor bytes, and its "
        "requests booked through the caching-allocator model (`autobatch/estimating/replay.py`), made when "
        "the report is written.",
        "",
        "CUDA context (device memory in use beyond the allocator's reservation): "
        + ", ".join(f"{k.replace('_', ' ')} {_gib(v['used'] - v['reserved'])} GiB" for k, v in context.items())
        + ".",
        "",
        "| case | batch | card: allocated GiB | trace | gap | card: reserved GiB | booked | gap | context after GiB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in record["cases"]:
        name = row["case"]["name"]
        got = traces.get(name)
        if row.get("error"):
            lines.append(f"| {name} | – | {row['error'][:80]} | | | | | | |")
            continue
        for t in row["trials"]:
            mine = got.get(t["batch"]) if isinstance(got, dict) else None
            after = t["in_use_after"]
            if not t["fits"]:
                lines.append(f"| {name} | {t['batch']} | out of memory | | | | | | |")
                continue
            lines.append(
                f"| {name} | {t['batch']} | {_gib(t['peak_bytes'])} | {_gib(mine['allocated']) if mine else '–'} | "
                f"{_gap(mine['allocated'], t['peak_bytes']) if mine else (got if isinstance(got, str) else '–')} | "
                f"{_gib(t['reserved_bytes'])} | {_gib(mine['reserved']) if mine else '–'} | "
                f"{_gap(mine['reserved'], t['reserved_bytes']) if mine else '–'} | "
                f"{_gib(after['used'] - after['reserved'])} |")
    gaps = [(row["case"]["name"], t["batch"], mine["allocated"] / t["peak_bytes"] - 1, mine["reserved"] / t["reserved_bytes"] - 1)
             for row in record["cases"] if isinstance(traces.get(row["case"]["name"]), dict)
             for t in row["trials"] if t["fits"] and (mine := traces[row["case"]["name"]].get(t["batch"]))]
    if gaps:
        worst = max(gaps, key=lambda g: abs(g[2]))
        off = sorted({name for name, _, _, r in gaps if abs(r) > 0.05})
        lines += ["", f"Tensor bytes: within {abs(worst[2]):.1%} of the card at all {len(gaps)} batches (the farthest: "
                  f"{worst[0]} at {worst[1]}). Booked reserved: within 5 % at "
                  f"{sum(abs(r) <= 0.05 for *_, r in gaps)} of {len(gaps)}"
                  + (f"; beyond it: {', '.join(off)}." if off else ".")]
    return "\n".join(lines) + "\n"


def report(source: Path, out: Path = ROOT / "docs/benchmarks/peaks.md") -> str:
    record = json.loads(source.read_text())
    traces: dict[str, Any] = {}
    for row in record["cases"]:
        case = PeakCase(**{**row["case"], "batches": tuple(row["case"]["batches"])})
        try:
            traces[case.name] = traced(case, [t["batch"] for t in row["trials"] if t["fits"]],
                                       record["card"]["total_bytes"])
        except Exception as exc:
            traces[case.name] = f"trace failed: {type(exc).__name__}"
    text = markdown(record, traces)
    out.write_text(text)
    return text


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.peaks", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    r = sub.add_parser("run")
    r.add_argument("--out", required=True)
    r.add_argument("--cases", nargs="*", default=None, help="names from: " + ", ".join(c.name for c in CASES))
    p = sub.add_parser("report")
    p.add_argument("source", nargs="?", default=str(ROOT / "docs/benchmarks/peaks.json"))
    args = parser.parse_args(argv)
    if args.what == "run":
        cases = [c for c in CASES if c.name in args.cases] if args.cases else CASES
        run(Path(args.out), cases)
    else:
        print(report(Path(args.source)))


if __name__ == "__main__":
    main()

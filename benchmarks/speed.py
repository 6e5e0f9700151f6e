"""How fast an estimate is, as ratios to a bare trace of the same model, each measured in a fresh process.

``python -m benchmarks.speed`` runs, each in its own process (as a user's command runs), timing the
work from the model's build to the answer (the interpreter's start and imports are left out, alike
for every row):

* ``bare``: llama-1b (2048 tokens, bf16, AdamW) built on fake tensors and traced for two whole
  steps at batch 1, the unit the others are divided by;
* ``six``: ``estimate --model llama-1b --gpu a100-80gb --gpus 8 --strategy ddp,fsdp1,fsdp2,zero1,zero2,zero3
  --dtype bf16`` through ``autobatch.answer``;
* ``bert-large``: bert-large at 512 tokens on a 16 GiB card, one GPU (the published V100 rows);
* ``gpt2`` in fp32 and bf16 on an a100-80gb;
* ``llama-7b`` as rank 0 of 8 and ``llama-70b`` as rank 0 of 64, under ZeRO-3 (each trial a trace).

Writes ``docs/benchmarks/speed.md`` and ``speed.json``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
COMMAND = "python -m benchmarks.speed"
STRATEGIES = "ddp,fsdp1,fsdp2,zero1,zero2,zero3"

__all__ = ["CASES", "run_one", "markdown", "main"]

CASES = {
    "bare": "llama-1b, 2048 tokens, bf16: two whole steps traced at batch 1 (the unit)",
    "six": f"llama-1b as rank 0 of 8 on an a100-80gb under {STRATEGIES.replace(',', ', ')}",
    "bert-large": "bert-large, 512 tokens, fp32, a 16 GiB card",
    "gpt2-fp32": "gpt2, 1024 tokens, fp32, a100-80gb",
    "gpt2-bf16": "gpt2, 1024 tokens, bf16, a100-80gb",
    "llama-7b": "llama-7b, 4096 tokens, bf16, as rank 0 of 8 on an a100-80gb under zero3",
    "llama-70b": "llama-70b, 4096 tokens, bf16, checkpointed, as rank 0 of 64 on an h100-80gb under zero3",
}
# Llama-7B and 70B (issue: every strategy on fake tensors, item 1): any size, as one rank of many.
_BIG = {"llama-7b": dict(gpu="a100-80gb", gpus_per_node=8),
        "llama-70b": dict(gpu="h100-80gb", gpus_per_node=8, nodes=8, grad_checkpointing=True)}


def run_one(case: str) -> dict[str, Any]:
    """One case in this process: its seconds and what it answered (called in the child)."""
    import autobatch
    from autobatch.estimating.estimate import estimate, load_fake_model, trace_trial

    start = time.perf_counter()
    if case == "bare":
        work = load_fake_model("llama-1b").to_workload(dtype="bf16")
        trial = trace_trial(work, work.model, 1, fake_mode=next(work.model.parameters()).fake_mode, primed=False)
        return {"seconds": time.perf_counter() - start, "peak_bytes": trial.peak_bytes}
    if case in _BIG:
        report = autobatch.answer(autobatch.Request(model=case, strategy="zero3", dtype="bf16", estimate=True,
                                                    **_BIG[case]))
        probe = report.rows[0].probe
        return {"seconds": time.perf_counter() - start, "max_batch": probe.max_batch, "safe_batch": probe.safe_batch,
                "trials": [t.batch for t in probe.trials], "read_off_the_curve": []}
    if case == "six":
        report = autobatch.answer(autobatch.Request(model="llama-1b", gpu="a100-80gb", gpus_per_node=8,
                                                    strategy=STRATEGIES, dtype="bf16", estimate=True))
        seconds = time.perf_counter() - start
        rows = {row.strategy.name: {"max_batch": row.probe.max_batch, "trials": [t.batch for t in row.probe.trials]}
                for row in report.rows}
        return {"seconds": seconds, "rows": rows}
    if case == "bert-large":
        from benchmarks.published_models import BUILDERS

        build, make = BUILDERS["bert-large-uncased"]("masked-lm")
        result = estimate(autobatch.Workload(build, lambda b: make(b, 512, None), name="bert-large"), gpu_memory="16GiB")
    else:
        dtype = case.split("-")[1]
        result = estimate(load_fake_model("gpt2").to_workload(dtype=None if dtype == "fp32" else dtype), "a100-80gb")
    return {"seconds": time.perf_counter() - start, "max_batch": result.max_batch, "safe_batch": result.safe_batch,
            "trials": [t.batch for t in result.trials], "read_off_the_curve": result.extra["traced_once_for"]}


def _child(case: str) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-m", "benchmarks.speed", "--one", case], cwd=ROOT, capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if proc.returncode != 0:
        raise RuntimeError(f"{case} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def markdown(record: dict[str, Any]) -> str:
    """The table, from the record ``main`` writes (``speed.json``): written, never typed."""
    runs = record["runs"]
    unit = runs["bare"]["seconds"]
    lines = [
        "# Estimate speed, as ratios to a bare trace",
        "",
        f"`{COMMAND}` · {record['date']} · {record['machine']} · each case a fresh process, timed from the"
        " model's build to the answer",
        "",
        "| case | what | seconds | × the bare trace | answer |",
        "|---|---|---:|---:|---|",
    ]
    for case, what in CASES.items():
        run = runs[case]
        if case == "six":
            answer = ", ".join(f"{name} {row['max_batch']} ({len(row['trials'])} trials)" for name, row in run["rows"].items())
        elif case == "bare":
            answer = f"peak {run['peak_bytes'] / 2**30:.2f} GiB"
        else:
            answer = (f"max {run['max_batch']}, safe {run['safe_batch']}; trials {', '.join(map(str, run['trials']))}"
                      + (f" ({', '.join(map(str, run['read_off_the_curve'])) or 'none'} read off the curve)"
                         if case not in _BIG else " (each traced as the sharded step)"))
        lines.append(f"| {case} | {what} | {run['seconds']:.1f} | {run['seconds'] / unit:.1f} | {answer} |")
    lines += ["", "Goals (issue: estimates that match published GPU measurements, item 6): the six strategies in at",
              "most 12× the bare trace; bert-large in at most 10 s on 2 cores.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "docs/benchmarks"))
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.one:
        print(json.dumps(run_one(args.one)))
        return {}
    runs = {}
    for case in CASES:
        runs[case] = _child(case)
        print(f"  {case}: {runs[case]['seconds']:.1f} s", file=sys.stderr, flush=True)
    record = {"date": dt.date.today().isoformat(), "machine": f"{platform.processor() or 'CPU'}, {os.cpu_count()} cores",
              "runs": runs}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "speed.md").write_text(markdown(record))
    (out / "speed.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out / 'speed.md'}", file=sys.stderr)
    return record


if __name__ == "__main__":
    main()

"""The runs docs/benchmarks/README.md lists for a GPU machine: one command there, one report here.

On the GPU machine, from the repository root::

    python -m benchmarks.gpu run --out DIR

runs ``pytest -m gpu`` (the command block's own lines are run below, not twice), then each
``autobatch`` line of the block with its ``--json`` output kept, and writes ``DIR/gpu.json``
(the card, the versions, every command's JSON, return code and seconds) and ``DIR/pytest-gpu.txt``.
Back on any machine::

    python -m benchmarks.gpu report DIR/gpu.json

writes ``docs/benchmarks/gpu.md``: each ``find`` on the real card beside the ``estimate`` for the
same card and settings, and the tests' summary line.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import json
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path
from collections.abc import Callable
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "docs/benchmarks/README.md"

__all__ = ["commands", "run", "report", "main"]


def commands() -> list[str]:
    """The lines of README's ``bash gpu`` block."""
    block = re.search(r"```bash gpu\n(.*?)```", README.read_text(), re.S).group(1)
    return [line.strip() for line in block.splitlines() if line.strip()]


def _card() -> dict[str, Any]:
    import torch

    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True)
    return {"gpu": torch.cuda.get_device_name(0), "total_bytes": torch.cuda.get_device_properties(0).total_memory,
            "nvidia_smi": smi.stdout.strip(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "date": dt.date.today().isoformat()}


def run(out: Path, timeout: int = 150) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    record: dict[str, Any] = {"card": _card(), "runs": []}
    start = time.perf_counter()
    # A GPU image may lack a dependency only test_tune imports at the top (optuna): leave that file out.
    missing = [] if importlib.util.find_spec("optuna") else ["--ignore", "tests/test_tune.py"]
    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-k", "not gpu_command_runs",
                            "-p", "no:cacheprovider", *missing], cwd=ROOT, capture_output=True, text=True)
    (out / "pytest-gpu.txt").write_text(tests.stdout + tests.stderr)
    record["pytest"] = {"rc": tests.returncode, "seconds": round(time.perf_counter() - start, 1),
                        "summary": (tests.stdout.strip().splitlines() or [""])[-1]}
    print(record["pytest"], flush=True)
    for line in commands():
        argv = shlex.split(line)
        if argv[0] != "autobatch":
            continue
        start = time.perf_counter()
        try:
            proc = subprocess.run([sys.executable, "-m", "autobatch", *argv[1:]], cwd=ROOT, capture_output=True,
                                  text=True, timeout=timeout)
            rc, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
        except subprocess.TimeoutExpired as e:
            rc, stdout, stderr = "timeout", e.stdout or "", e.stderr or ""
        try:
            answer = json.loads(stdout)
        except (json.JSONDecodeError, TypeError):
            answer = None
        record["runs"].append({"command": line, "rc": rc, "seconds": round(time.perf_counter() - start, 1),
                               "json": answer, "stderr_tail": str(stderr)[-2000:]})
        print(line, rc, record["runs"][-1]["seconds"], flush=True)
        (out / "gpu.json").write_text(json.dumps(record, indent=1) + "\n")
    (out / "gpu.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


def _settings(command: str) -> tuple[str, str]:
    argv = shlex.split(command)
    model = argv[argv.index("--model") + 1]
    dtype = argv[argv.index("--dtype") + 1] if "--dtype" in argv else "fp32"
    return model, dtype


def estimate_now(command: str, gpu: str = "h200") -> dict[str, Any] | None:
    """The estimate this checkout gives for a ``find`` command's settings on ``gpu``."""
    argv = shlex.split(command)
    argv = [a for a in argv[2:] if a != "--json"]
    proc = subprocess.run([sys.executable, "-m", "autobatch", "estimate", *argv, "--gpu", gpu, "--json"], cwd=ROOT,
                          capture_output=True, text=True)
    return json.loads(proc.stdout) if proc.returncode == 0 else None


def _gap(estimated: int | None, found: int | None) -> str:
    return f"{(estimated - found) / found:+.1%}" if estimated and found else "–"


def report(source: Path, out: Path = ROOT / "docs/benchmarks/gpu.md",
           estimate: Callable[[str], dict[str, Any] | None] = estimate_now) -> str:
    """``docs/benchmarks/gpu.md`` from a run's ``gpu.json``: each find beside the estimate made then
    (on the GPU machine) and the estimate this checkout makes now for the same settings."""
    record = json.loads((source / "gpu.json" if source.is_dir() else source).read_text())
    card, runs = record["card"], record["runs"]
    lines = [
        "# On a real GPU",
        "",
        f"{card['date']} · {card['gpu']} ({card['nvidia_smi']}) · torch {card['torch']}, CUDA {card['cuda']}",
        "",
        "Written by `python -m benchmarks.gpu report docs/benchmarks/gpu.json` from the runs' record "
        "(`gpu.json`, made there by `python -m benchmarks.gpu run`); the last columns are this checkout's "
        "estimate for the same settings, made when the report is written.",
        "",
        f"`pytest -m gpu`: {record['pytest']['summary']}.",
        "",
        "| model | dtype | found on the card: max | safe | trials | trace s | find s | estimated then: max | "
        "vs found | estimated now: max | safe | vs found |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    guessed = {_settings(r["command"]): r for r in runs if " estimate " in f" {r['command']} "}
    for run_ in runs:
        if " find " not in f" {run_['command']} ":
            continue
        key = _settings(run_["command"])
        found = run_["json"] or {}
        then = (guessed.get(key) or {}).get("json") or {}
        now = estimate(run_["command"]) or {}
        fmax = found.get("max_batch")
        trace = (found.get("trace_prior") or {}).get("seconds")
        lines.append(
            f"| {key[0]} | {key[1]} | {fmax if fmax is not None else run_['rc']} | {found.get('safe_batch', '–')} | "
            f"{len(found.get('trials') or []) or '–'} | {trace if trace is not None else '–'} | {run_['seconds']} | "
            f"{then.get('max_batch', '–')} | {_gap(then.get('max_batch'), fmax)} | {now.get('max_batch', '–')} | "
            f"{now.get('safe_batch', '–')} | {_gap(now.get('max_batch'), fmax)} |")
    lines += ["", "Commands run there:", "", "```bash", *[r["command"] for r in runs], "```", ""]
    text = "\n".join(lines)
    out.write_text(text)
    return text


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    r = sub.add_parser("run")
    r.add_argument("--out", required=True)
    r.add_argument("--timeout", type=int, default=150)
    p = sub.add_parser("report")
    p.add_argument("source", nargs="?", default=str(ROOT / "docs/benchmarks/gpu.json"))
    args = parser.parse_args(argv)
    if args.what == "run":
        run(Path(args.out), args.timeout)
    else:
        print(report(Path(args.source)))


if __name__ == "__main__":
    main()

"""The runs docs/benchmarks/README.md lists for a GPU machine: one command there, one report here.

On the GPU machine, from the repository root::

    python -m benchmarks.gpu run --out DIR

runs, most wanted first and within ``--budget`` seconds: the peaks at fixed batches
(``benchmarks.peaks``, into ``DIR/peaks.json``), ``pytest -m gpu`` (the command block's own lines
are run below, not twice; ``DIR/pytest-gpu.txt``), the wall-time table on a capped card
(``benchmarks.wall``), then each ``autobatch find`` line of the block with its ``--json`` output
kept. ``DIR/gpu.json`` holds the card, the versions, and every part's JSON, return code and
seconds. Back on any machine::

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

    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True).stdout.strip()
    except FileNotFoundError:
        smi = ""
    cuda = torch.cuda.is_available()
    return {"gpu": torch.cuda.get_device_name(0) if cuda else "none",
            "total_bytes": torch.cuda.get_device_properties(0).total_memory if cuda else 0,
            "nvidia_smi": smi, "torch": torch.__version__, "cuda": torch.version.cuda,
            "date": dt.date.today().isoformat()}


def _left(deadline: float) -> float:
    return deadline - time.perf_counter()


def _finds() -> list[str]:
    """The block's ``find`` lines, llama-1b first (never measured on a card yet). The block's
    ``estimate`` lines need no GPU: the report makes them on any machine."""
    finds = [line for line in commands() if line.startswith("autobatch find ")]
    return sorted(finds, key=lambda line: "llama-1b" not in line)


PARTS = ("peaks", "pytest", "wall", "finds")


def run(out: Path, timeout: int = 150, budget: float = 540, cap: str = "16GiB",
        peak_cases: list[str] | None = None, parts: tuple[str, ...] = PARTS, thread: bool = False,
        wall_cases: list[str] | None = None) -> dict[str, Any]:
    """Everything a GPU machine is for, most wanted first, within ``budget`` seconds in all: the
    peaks at fixed batches (``benchmarks.peaks``), ``pytest -m gpu``, the wall-time table on a card
    capped at ``cap`` (``benchmarks.wall``; with ``thread``, once every case is timed, each case
    again with the trace on a thread while time is left), then the block's ``find`` lines; only
    the ``parts`` named. Each part is written to ``out`` as it ends, so a run cut short keeps what
    it measured."""
    deadline = time.perf_counter() + budget
    out.mkdir(parents=True, exist_ok=True)
    record: dict[str, Any] = {"card": _card(), "runs": [], "skipped": [f"{p} (not asked)" for p in PARTS
                                                                        if p not in parts]}

    def save() -> None:
        (out / "gpu.json").write_text(json.dumps(record, indent=1) + "\n")

    def bounded(argv: list[str], limit: float) -> tuple[Any, str, str, float]:
        start = time.perf_counter()
        try:
            proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=limit)
            return proc.returncode, proc.stdout, proc.stderr, round(time.perf_counter() - start, 1)
        except subprocess.TimeoutExpired as e:
            text = lambda b: b.decode(errors="replace") if isinstance(b, bytes) else (b or "")
            return f"timeout ({limit:.0f} s)", text(e.stdout), text(e.stderr), round(time.perf_counter() - start, 1)

    if "peaks" in parts:
        rc, _, err, seconds = bounded([sys.executable, "-m", "benchmarks.peaks", "run", "--out",
                                       str(out / "peaks.json"), *(["--cases", *peak_cases] if peak_cases else [])],
                                      min(150, _left(deadline) - 10))
        record["peaks"] = {"rc": rc, "seconds": seconds, "stderr_tail": err[-3000:]}
        print("peaks", rc, seconds, flush=True)
        save()
    if "pytest" in parts:
        # A GPU image may lack a dependency only test_tune imports at the top (optuna): leave that file out.
        missing = [] if importlib.util.find_spec("optuna") else ["--ignore", "tests/test_tune.py"]
        rc, stdout, stderr, seconds = bounded([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-k",
                                               "not gpu_command_runs", "-p", "no:cacheprovider", *missing],
                                              max(30.0, min(150, _left(deadline) - 200)))
        (out / "pytest-gpu.txt").write_text(stdout + stderr)
        record["pytest"] = {"rc": rc, "seconds": seconds, "summary": (stdout.strip().splitlines() or [""])[-1]}
        print(record["pytest"], flush=True)
        save()
    if "wall" in parts:
        _wall(record, cap, deadline, thread, save, wall_cases)
    for line in _finds() if "finds" in parts else ():
        if _left(deadline) < 40:
            record["skipped"].append(line)
            continue
        argv = shlex.split(line)
        rc, stdout, stderr, seconds = bounded([sys.executable, "-m", "autobatch", *argv[1:]],
                                              min(timeout, _left(deadline) - 10))
        try:
            answer = json.loads(stdout)
        except (json.JSONDecodeError, TypeError):
            answer = None
        record["runs"].append({"command": line, "rc": rc, "seconds": seconds, "json": answer,
                               "stderr_tail": str(stderr)[-2000:]})
        print(line, rc, seconds, flush=True)
        save()
    save()
    return record


def _wall(record: dict[str, Any], cap: str, deadline: float, thread: bool, save: Callable[[], None],
          names: list[str] | None = None) -> None:
    """The wall-time table's runs, into ``record["wall"]``: every case (or those ``names``d, in
    that order) trace-led and alone, then, with ``thread``, each again traced on a thread of the
    trials' process while time is left."""
    from benchmarks import wall

    by_name = {case.name: case for case in wall.CASES}
    cases = [by_name[n] for n in names] if names else wall.CASES
    record["wall"] = {"cap": cap, "rows": [], "date": record["card"]["date"]}

    def timed(case: Any, mode: str) -> dict[str, Any]:
        trace, beside = wall.MODES[mode]
        try:
            return wall.child(case, device="cuda", trace=trace, beside=beside, dtype="bf16", cap=cap,
                              timeout=min(90, _left(deadline) - 10))
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            return {"error": str(exc)[-1500:]}

    for case in cases:
        if _left(deadline) < 60:
            record["skipped"].append(f"wall {case.name}")
            continue
        runs = {mode: timed(case, mode) for mode in ("trace", "trials")}
        record["wall"]["rows"].append({"case": case.name, "kind": case.kind, **runs})
        print("wall", case.name, {m: r.get("max_batch", r.get("error", "")[:80]) for m, r in runs.items()}, flush=True)
        save()

    def cost(row: dict[str, Any]) -> float:  # what the trace still cost there, most first
        return -(row["trace"].get("process_seconds", 0) - row["trials"].get("process_seconds", 0))

    for row in sorted(record["wall"]["rows"], key=cost) if thread else ():  # the cases timed, not those skipped
        case = by_name[row["case"]]
        if _left(deadline) < 60:
            record["skipped"].append(f"wall {case.name} on a thread")
            continue
        row["thread"] = timed(case, "thread")
        print("wall", case.name, "on a thread", row["thread"].get("process_seconds"), flush=True)
        save()


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
    """``docs/benchmarks/gpu.md`` from a run's ``gpu.json``: each find beside the estimate this
    checkout makes now for the same settings on that card. Writes ``wall_cuda.md`` beside it too,
    where the run holds the wall-time table."""
    record = json.loads((source / "gpu.json" if source.is_dir() else source).read_text())
    card, runs = record["card"], record["runs"]
    lines = [
        "# On a real GPU",
        "",
        f"{card['date']} · {card['gpu']} ({card['nvidia_smi']}) · torch {card['torch']}, CUDA {card['cuda']}",
        "",
        "Written by `python -m benchmarks.gpu report docs/benchmarks/gpu.json` from the runs' record "
        "(`gpu.json`, made there by `python -m benchmarks.gpu run`); the last columns are this checkout's "
        "estimate for the same settings on that card, made when the report is written. The peaks at fixed "
        "batches are in `peaks.md`, the wall-time table in `wall_cuda.md`.",
        "",
        f"`pytest -m gpu`: {record['pytest']['summary']}.",
        "",
        "| model | dtype | found on the card: max | safe | trials | trace s | find s | estimated now: max | safe | vs found |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for run_ in runs:
        if " find " not in f" {run_['command']} ":
            continue
        key = _settings(run_["command"])
        found = run_["json"] or {}
        now = estimate(run_["command"]) or {}
        fmax = found.get("max_batch")
        trace = (found.get("trace_prior") or {}).get("seconds")
        lines.append(
            f"| {key[0]} | {key[1]} | {fmax if fmax is not None else run_['rc']} | {found.get('safe_batch', '–')} | "
            f"{len(found.get('trials') or []) or '–'} | {trace if trace is not None else '–'} | {run_['seconds']} | "
            f"{now.get('max_batch', '–')} | {now.get('safe_batch', '–')} | {_gap(now.get('max_batch'), fmax)} |")
    lines += ["", "Commands run there:", "", "```bash", *[r["command"] for r in runs], "```", ""]
    text = "\n".join(lines)
    out.write_text(text)
    if (record.get("wall") or {}).get("rows"):
        (out.parent / "wall_cuda.md").write_text(wall_table(record))
    return text


def wall_table(record: dict[str, Any]) -> str:
    """The wall-time table of a GPU run (``benchmarks.wall``'s, on the capped card)."""
    from benchmarks import wall

    rows = [r for r in record["wall"]["rows"] if "error" not in r["trace"] and "error" not in r["trials"]]
    cap = record["wall"]["cap"]
    thread = ["--thread"] if any("thread" in r for r in rows) else []
    names = [r["case"] for r in record["wall"]["rows"]]
    cases = ["--cases", *names] if names != [c.name for c in wall.CASES] else []
    return wall.markdown(rows, device="cuda", dtype="bf16", cap=cap,
                         argv=["--device", "cuda", "--cap", cap, *cases, *thread],
                         date=record["wall"].get("date", record["card"]["date"]))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    r = sub.add_parser("run")
    r.add_argument("--out", required=True)
    r.add_argument("--timeout", type=int, default=150, help="seconds one find may take")
    r.add_argument("--budget", type=float, default=540, help="seconds for the whole run")
    r.add_argument("--cap", default="16GiB", help="GPU memory per process for the wall-time table")
    r.add_argument("--peak-cases", nargs="*", default=None, help="benchmarks.peaks cases (default: all)")
    r.add_argument("--parts", nargs="*", choices=PARTS, default=list(PARTS), help="what to run (default: all)")
    r.add_argument("--wall-cases", nargs="*", default=None, help="benchmarks.wall cases, in order (default: all)")
    r.add_argument("--thread", action="store_true",
                   help="the wall table also times each case traced on a thread of the trials' process")
    p = sub.add_parser("report")
    p.add_argument("source", nargs="?", default=str(ROOT / "docs/benchmarks/gpu.json"))
    args = parser.parse_args(argv)
    if args.what == "run":
        run(Path(args.out), args.timeout, args.budget, args.cap, args.peak_cases, tuple(args.parts), args.thread,
            args.wall_cases)
    else:
        print(report(Path(args.source)))


if __name__ == "__main__":
    main()

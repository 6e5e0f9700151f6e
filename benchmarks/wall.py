"""Wall time and trials of ``find`` with the fake-tensor trace leading against trials alone.

``python -m benchmarks.wall`` runs every case twice, each run in a fresh process (as a user's
``autobatch find`` runs): once by default, once with ``trace_prior=False``. Both answers must be
the same batch; what differs is the trials and the wall time. Writes
``docs/benchmarks/wall_<device>.md``.

On a GPU (``--device cuda``, the default there) every run is real training on the card, capped
with ``--cap`` (``torch.cuda.set_per_process_memory_fraction``) so that the answers are those of a
card of that size. On the CPU (``--device cpu``) each case has a simulated budget.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
COMMAND = "python -m benchmarks.wall"
MODELS_FILE = "benchmarks/wall_models.py"

__all__ = ["WallCase", "CASES", "SHARDED", "ALL", "MODES", "run_one", "child", "run", "markdown", "main"]


@dataclass(frozen=True)
class WallCase:
    name: str
    model: str
    kind: str
    seq_len: int | None = None          # on a GPU
    cpu_seq_len: int | None = None      # on the CPU, where long sequences take minutes a step
    cpu_memory: str = "64MiB"           # the simulated budget on the CPU
    strategy: str | None = None         # a sharded probe, as rank 0 of ``gpus``
    gpus: int = 1

    def request(self, device: str, trace: bool, dtype: str) -> dict[str, Any]:
        cpu = device == "cpu"
        seq_len = self.cpu_seq_len if cpu else self.seq_len
        return {
            "model": self.model if ":" not in self.model else str(ROOT / self.model),
            **({"seq_len": seq_len} if seq_len else {}),
            **({"strategy": self.strategy, "gpus_per_node": self.gpus} if self.strategy else {}),
            "device": device,
            **({"memory": self.cpu_memory} if cpu else {}),
            "dtype": dtype,
            "trace_prior": trace,
            "headroom": 0,
        }


CASES = [
    WallCase("tiny-gpt2", "tiny-gpt2", "tiny decoder", seq_len=64, cpu_seq_len=64, cpu_memory="24MiB"),
    WallCase("gpt2", "gpt2", "gpt2-small decoder", seq_len=1024, cpu_seq_len=128, cpu_memory="4GiB"),
    WallCase("vit-base", f"{MODELS_FILE}:vit_base", "vision (ViT-B/16, 224²)", cpu_memory="3GiB"),
    WallCase("bert-base", "bert-base", "BERT encoder, masked LM", seq_len=512, cpu_seq_len=128, cpu_memory="3GiB"),
    WallCase("clip-base", f"{MODELS_FILE}:clip_base", "contrastive (CLIP ViT-B/32)", cpu_memory="4GiB"),
]
# Sharded probes, as rank 0 of four on one device: the trace wraps a fake copy as the strategy does.
SHARDED = [
    WallCase("tiny-gpt2 zero1", "tiny-gpt2", "tiny decoder, ZeRO-1 on 4 GPUs", seq_len=64, cpu_seq_len=64,
             cpu_memory="24MiB", strategy="zero1", gpus=4),
    WallCase("tiny-llama fsdp2", "tiny-llama", "tiny Llama, FSDP2 on 4 GPUs", seq_len=64, cpu_seq_len=64,
             cpu_memory="24MiB", strategy="fsdp2", gpus=4),
]
ALL = CASES + SHARDED  # what a run times by default, and the names --cases takes


def run_one(case: WallCase, *, device: str, trace: bool, dtype: str, cap: str | None,
            beside: str = "process") -> dict[str, Any]:
    """One ``answer`` in this process: its batch, trials and seconds (called in the child).
    ``beside="thread"`` traces beside GPU trials on a thread of this process, as before the trace
    had a process of its own (:mod:`autobatch.estimating.spawned`), for the comparison."""
    import torch

    import autobatch
    from autobatch.estimating import spawned
    from autobatch.units import parse_bytes

    spawned.SPAWNS = spawned.SPAWNS and beside == "process"

    if device == "cuda" and cap:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, parse_bytes(cap) / total))
    start = time.perf_counter()
    report = autobatch.answer(autobatch.Request(**case.request(device, trace, dtype)))
    seconds = time.perf_counter() - start
    result = report.rows[0].probe
    return {
        "max_batch": result.max_batch,
        "trials": len(result.trials),
        "oom_trials": sum(not t.fits for t in result.trials),
        "trace_prior": result.trace_record,
        "steps": [[t.batch, t.fits, t.seconds_per_step] for t in result.trials],  # each trial: batch, fit, s/step
        "answer_seconds": round(seconds, 2),
        "device_name": torch.cuda.get_device_name(0) if device == "cuda" else platform.processor() or "cpu",
    }


def child(case: WallCase, *, device: str, trace: bool, dtype: str, cap: str | None,
          timeout: float | None = None, beside: str = "process") -> dict[str, Any]:
    """:func:`run_one` in a fresh process, as a user's ``autobatch find`` runs, with its wall time."""
    argv = [sys.executable, "-m", "benchmarks.wall", "--one", case.name, "--device", device, "--dtype", dtype,
            "--trace" if trace else "--no-trace", *(["--cap", cap] if cap else []), "--beside", beside]
    start = time.perf_counter()
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{case.name} (trace={trace}) failed:\n{proc.stderr[-3000:]}")
    return {**json.loads(proc.stdout.strip().splitlines()[-1]), "process_seconds": round(wall, 2)}


REPEAT_UNDER = 60.0  # seconds: a case whose runs take longer is timed once (its differences dwarf the swings)
MODES = {"trace": (True, "process"), "trials": (False, "process"), "thread": (True, "thread")}  # trace?, beside


def run(cases: list[WallCase], *, device: str, dtype: str, cap: str | None,
        thread: bool = False, repeat: int = 1) -> list[dict[str, Any]]:
    """Each case's searches, each in a fresh process: trace-led and alone (and, with ``thread``,
    trace-led with the trace on a thread of the trials' process, as it ran before it had its own).

    With ``repeat`` above one, each mode of a case whose runs take under :data:`REPEAT_UNDER` seconds
    runs that many times, the modes taking turns (so a spell of load on the machine falls on both):
    there this machine's swings, a second or two, are as large as what is measured. The row keeps
    each mode's run of median wall time, and every run's seconds under ``repeats``."""
    rows = []
    modes = ("trace", "trials", *(("thread",) if thread else ()))
    for case in cases:
        tried: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
        for round_ in range(repeat):
            if round_ and max(runs[-1].get("process_seconds", 0) for runs in tried.values()) >= REPEAT_UNDER:
                break
            for mode in modes:
                tried[mode].append(child(case, device=device, trace=MODES[mode][0], beside=MODES[mode][1],
                                         dtype=dtype, cap=cap))
        runs = {mode: _median_run(done) for mode, done in tried.items()}
        # On the CPU both must agree (one deterministic budget); on a real GPU they may not, where
        # the fit is not monotone near the edge (kernels and the allocator's blocks change with the
        # batch): the table shows both.
        if device == "cpu" and runs["trace"]["max_batch"] != runs["trials"]["max_batch"]:
            raise RuntimeError(f"{case.name}: the trace-led search answered {runs['trace']['max_batch']}, "
                               f"trials alone {runs['trials']['max_batch']}")
        rows.append({"case": case.name, "kind": case.kind, **runs})
        print(f"  {case.name}: {runs['trace']['max_batch']} · trace {runs['trace']['trials']} trials "
              f"{runs['trace']['process_seconds']} s · alone {runs['trials']['trials']} trials "
              f"{runs['trials']['process_seconds']} s", file=sys.stderr, flush=True)
    return rows


def _median_run(done: list[dict[str, Any]]) -> dict[str, Any]:
    """The run of median wall time (the lower middle of an even count), with every run's seconds."""
    timed = sorted((r for r in done if "process_seconds" in r), key=lambda r: r["process_seconds"])
    if len(done) == 1 or not timed:
        return done[0]
    return {**timed[(len(timed) - 1) // 2], "repeats": [r.get("process_seconds") for r in done]}


def _answers(traced: dict[str, Any], alone: dict[str, Any]) -> str:
    a, b = traced["max_batch"], alone["max_batch"]
    return str(a) if a == b else f"{a} / {b} alone"


def _repeats(rows: list[dict[str, Any]]) -> int:
    return max((len(row["trace"].get("repeats", [None])) for row in rows), default=1)


def markdown(rows: list[dict[str, Any]], *, device: str, dtype: str, cap: str | None, argv: list[str],
             date: str | None = None) -> str:
    name = rows[0]["trace"]["device_name"] if rows else device
    where = (f"{name}, capped at {cap} per process" if cap else name) if device == "cuda" else (
        f"CPU ({name}), simulated budgets as listed")
    threads = any("thread" in row for row in rows)
    lines = [
        f"# Wall time: the trace leading against trials alone ({device})",
        "",
        f"`{COMMAND} {' '.join(argv)}`".replace("  ", " ").replace(" `", "`"),
        "",
        f"{date or dt.date.today().isoformat()} · {where} · {dtype} · AdamW · headroom 0 · each run a fresh process"
        + (f"; where a case's runs take under {REPEAT_UNDER:.0f} s, each figure the median of {repeats} runs, the "
           "modes taking turns" if (repeats := _repeats(rows)) > 1 else ""),
        "",
        "| model | what | budget | answer | trials: trace-led | trials alone | wall s: trace-led | alone | "
        + ("on a thread | " if threads else "") + "trace s | led |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|" + ("---:|" if threads else "") + "---|",
    ]
    for row in rows:
        traced, alone = row["trace"], row["trials"]
        record = traced["trace_prior"] or {}
        budget = next((c.cpu_memory for c in ALL if c.name == row["case"]), "") if device == "cpu" else (cap or "card")
        on_thread = (f"{row['thread']['process_seconds']:.1f} | " if "process_seconds" in row.get("thread", {})
                     else "– | ") if threads else ""
        lines.append(
            f"| {row['case']} | {row['kind']} | {budget} | {_answers(traced, alone)} | {traced['trials']} "
            f"({traced['oom_trials']} OOM) | {alone['trials']} ({alone['oom_trials']} OOM) | "
            f"{traced['process_seconds']:.1f} | {alone['process_seconds']:.1f} | {on_thread}"
            f"{record.get('seconds') if record.get('seconds') is not None else '–'}"
            f"{' (waited ' + str(record['waited']) + ')' if 'waited' in record else ''} | "
            f"{'yes' if record.get('led') else 'no: ' + str(record.get('reason') or record.get('failure'))} |"
        )
    total_t = sum(r["trace"]["process_seconds"] for r in rows)
    total_a = sum(r["trials"]["process_seconds"] for r in rows)
    lines += ["", f"Total wall time: {total_t:.1f} s trace-led, {total_a:.1f} s trials alone."]
    timed = [r for r in rows if "process_seconds" in r.get("thread", {})]
    if timed:
        lines[-1] += (f" Where the trace also ran on a thread of the trials' process ({len(timed)} of {len(rows)}): "
                      f"{sum(r['thread']['process_seconds'] for r in timed):.1f} s that way, "
                      f"{sum(r['trace']['process_seconds'] for r in timed):.1f} s in its own process, "
                      f"{sum(r['trials']['process_seconds'] for r in timed):.1f} s alone.")
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default=None)
    parser.add_argument("--dtype", default=None, help="default: bf16 on a GPU, fp32 on the CPU")
    parser.add_argument("--cap", default=None, help="GPU memory per process, e.g. 24GiB (default: the whole card)")
    parser.add_argument("--cases", nargs="*", default=None, help="names from: " + ", ".join(c.name for c in ALL))
    parser.add_argument("--out", default=str(ROOT / "docs/benchmarks"))
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--trace", action=argparse.BooleanOptionalAction, default=True, help=argparse.SUPPRESS)
    parser.add_argument("--beside", choices=["process", "thread"], default="process", help=argparse.SUPPRESS)
    parser.add_argument("--repeat", type=int, default=1,
                        help="run each mode of a case whose runs take under a minute this many times, taking "
                             "turns, and show the median (default 1)")
    parser.add_argument("--thread", action="store_true",
                        help="also time each case traced on a thread of the trials' process (a GPU's trace "
                             "has a process of its own), for the comparison")
    args = parser.parse_args(argv)
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    by_name = {c.name: c for c in ALL}
    if args.one:
        print(json.dumps(run_one(by_name[args.one], device=args.device, trace=args.trace, dtype=dtype, cap=args.cap,
                                 beside=args.beside)))
        return []
    cases = [by_name[n] for n in args.cases] if args.cases else ALL
    if args.repeat < 1:
        parser.error(f"--repeat must be at least 1, but got --repeat {args.repeat}")
    rows = run(cases, device=args.device, dtype=dtype, cap=args.cap, thread=args.thread, repeat=args.repeat)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shown = [a for i, a in enumerate(argv) if not a.startswith("--out") and not (i and argv[i - 1] == "--out")]
    (out / f"wall_{args.device}.md").write_text(markdown(rows, device=args.device, dtype=dtype, cap=args.cap, argv=shown))
    (out / f"wall_{args.device}.json").write_text(json.dumps(rows, indent=1) + "\n")
    print(f"wrote {out / f'wall_{args.device}.md'}", file=sys.stderr)
    return rows


if __name__ == "__main__":
    main()

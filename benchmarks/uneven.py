"""When a plan per rank pays: mixed clusters, the uniform plan against the uneven one, from estimates.

``python -m benchmarks.uneven`` estimates each card of each mix (``autobatch estimate --gpu
MIX --uneven`` on fake tensors: no GPU needed), then compares, for the same target, the uniform plan
(every rank at the smallest card's safe batch) with the plan per rank: the samples one micro-step
of every rank carries, the micro-steps per optimizer step, and the slowest rank's step, with the
cards' peak speeds as their relative speed (an estimate times nothing). Writes
``docs/benchmarks/uneven.md``, and the same table into docs/uneven.md.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from autobatch import Request, answer

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = str(ROOT / "docs" / "benchmarks")

MIXES = ("a100-80gb:4,a100-40gb:4", "a100-80gb:4,v100-32gb:4", "h100-80gb:4,a100-80gb:4", "rtx-4090:2,rtx-3090:2")


def run_mix(mix: str, *, model: str, seq_len: int | None, dtype: str, target: int) -> dict[str, Any]:
    started = time.perf_counter()
    report = answer(Request(model=model, seq_len=seq_len, dtype=dtype, gpu=mix, target=target, uneven=True,
                            estimate=True))
    plan, uneven = report.plan, report.uneven
    world = uneven.world_size
    per_card, first = [], 0
    for card in report.cards:  # the mix's cards in rank order: the first rank of each
        rank = uneven.ranks[first]
        per_card.append({**card, "micro_batch": rank.micro_batch, "grad_accum": rank.grad_accum})
        first += card["count"]
    return {
        "mix": mix,
        "cards": per_card,
        "target": target,
        "uniform": None if plan is None else (plan.micro_batch, plan.grad_accum),
        "uniform_per_micro_step": None if plan is None else plan.micro_batch * world,
        "uneven_per_micro_step": sum(r.micro_batch for r in uneven.ranks),
        "uniform_steps": None if plan is None else plan.grad_accum,
        "uneven_steps": max(r.grad_accum for r in uneven.ranks),
        "uniform_time": uneven.uniform_seconds,
        "uneven_time": uneven.step_seconds,
        "reason": uneven.reason,
        "seconds": round(time.perf_counter() - started, 1),
    }


def markdown(results: list[dict[str, Any]], *, model: str, seq_len: int | None, dtype: str) -> str:
    at = f"{model}" + (f" at {seq_len} tokens" if seq_len else "") + f", {dtype}, AdamW"
    lines = [
        "# When a plan per rank pays: mixed clusters",
        "",
        f"`python -m benchmarks.uneven` ({at}; estimates from a fake-tensor trace, no GPU). For each mix:",
        "each card's safe batch; the uniform plan (every rank at the smallest card's safe batch) against",
        "the plan per rank (`--uneven`) for the same target; the samples one micro-step of every rank",
        "carries; the most micro-steps a rank runs per optimizer step; and the slowest rank's step,",
        "relative, with the cards' peak speeds as their speeds (DDP: accumulation per rank).",
        "",
        "| mix | safe batch per card | target | uniform m × k | uneven m × k per card | samples per micro-step | "
        "micro-steps | slowest rank's step (relative) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        safe = ", ".join(f"{c['gpu']} {c['safe_batch']}" for c in r["cards"])
        uneven = ", ".join(f"{c['gpu']} {c['micro_batch']} × {c['grad_accum']}" for c in r["cards"])
        uniform = "none" if r["uniform"] is None else f"{r['uniform'][0]} × {r['uniform'][1]}"
        gain = "" if not r["uniform_time"] else f" (−{1 - r['uneven_time'] / r['uniform_time']:.0%})"
        lines.append(
            f"| {r['mix']} | {safe} | {r['target']} | {uniform} | {uneven} "
            f"| {r['uniform_per_micro_step']} → **{r['uneven_per_micro_step']}** "
            f"| {r['uniform_steps']} → {r['uneven_steps']} "
            f"| 1 → **{r['uneven_time'] / r['uniform_time']:.2f}**{gain} |"
        )
    lines += ["", "Each plan reaches the target exactly; the uniform plan stays the default and is what the "
              "config files hold."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--target", type=int, default=512)
    parser.add_argument("--mix", action="append", help="a mixed --gpu list (repeatable); default four mixes")
    parser.add_argument("--out", default=DEFAULT_OUT, help="folder for uneven.md")
    args = parser.parse_args(argv)
    results = [run_mix(mix, model=args.model, seq_len=args.seq_len, dtype=args.dtype, target=args.target)
               for mix in args.mix or MIXES]
    text = markdown(results, model=args.model, seq_len=args.seq_len, dtype=args.dtype)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "uneven.md").write_text(text)
    if args.mix is None and args.out == DEFAULT_OUT:
        into_guide(text)
    print(text)
    return results


def into_guide(text: str, guide: Path = ROOT / "docs" / "uneven.md") -> None:
    """The table, between its markers in docs/uneven.md too, so the guide shows what the benchmark wrote."""
    table = "\n".join(line for line in text.splitlines() if line.startswith("|"))
    head, rest = guide.read_text().split("<!-- uneven-table", 1)
    marker, _, tail = rest.partition("\n")
    _, _, tail = tail.partition("<!-- /uneven-table -->")
    guide.write_text(f"{head}<!-- uneven-table{marker}\n{table}\n<!-- /uneven-table -->{tail}")


if __name__ == "__main__":
    main()

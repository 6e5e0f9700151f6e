"""Trials for a table over sequence lengths against one probe per length, on the simulated budget.

``python -m benchmarks.lengths`` runs each case twice: ``probe_lengths`` over its lengths, and
``probe`` at each length on its own. Both are exact (each row is checked against the separate
probe's max), so the only difference is the number of trials. Writes
``docs/benchmarks/lengths.md``. ``--gpt2`` adds tiny-gpt2 (transformers; slower per trial).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autobatch import SimulatedBackend, Workload, probe, probe_lengths

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from docs.examples.causal_lm import workload as causal_lm  # noqa: E402


@dataclass(frozen=True)
class LengthCase:
    name: str
    budget: str
    lengths: tuple[int, ...]

    def workload(self) -> Workload:
        if self.name == "tiny-gpt2":
            from autobatch.models import load_model

            return load_model("tiny-gpt2", seq_len=max(self.lengths)).to_length_workload(self.lengths)
        return causal_lm()


CASES = [
    LengthCase("tiny causal LM", "4MiB", (32, 64, 128, 256)),
    LengthCase("tiny causal LM", "16MiB", (32, 64, 128, 256)),
    LengthCase("tiny causal LM", "1MiB", (16, 24, 32, 48)),
]
GPT2 = LengthCase("tiny-gpt2", "8MiB", (16, 32, 64, 128))


def run_case(case: LengthCase) -> dict[str, Any]:
    started = time.perf_counter()
    table = probe_lengths(case.workload(), list(case.lengths), SimulatedBackend(case.budget))
    work = case.workload()
    separate = {}
    for s in case.lengths:
        at = Workload(work.model, lambda b, s=s: work.make_batch(b, s), loss_fn=work.loss_fn, name=work.name)
        separate[s] = probe(at, SimulatedBackend(case.budget))
    rows = {row.seq_len: row for row in table.rows}
    return {
        "case": f"{case.name} @ {case.budget}",
        "lengths": list(case.lengths),
        "max_batch": [rows[s].max_batch for s in case.lengths],
        "exact": all(rows[s].max_batch == separate[s].max_batch for s in case.lengths),
        "table_trials": [len(rows[s].train.trials) for s in case.lengths],
        "separate_trials": [len(separate[s].trials) for s in case.lengths],
        "predicted": [rows[s].predicted for s in case.lengths],
        "max_tokens": table.max_tokens,
        "seconds": round(time.perf_counter() - started, 1),
    }


def markdown(results: list[dict[str, Any]]) -> str:
    lines = [
        "# A table over sequence lengths: trials against one probe per length",
        "",
        "`python -m benchmarks.lengths` (CPU, simulated budget). Each row of the table is exact (equal to",
        "the separate probe's max at that length); the columns count training trials. Lengths are searched",
        "longest first; \"predicted\" is the max batch the fit of the longer lengths predicted before any",
        "trial at that length (`-` for the first).",
        "",
        "| case | lengths | max batch | predicted | trials, table | trials, separate | total: table / separate | max_tokens |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        predicted = ", ".join("-" if p is None else str(p) for p in r["predicted"])
        lines.append(
            f"| {r['case']} | {', '.join(map(str, r['lengths']))} | {', '.join(map(str, r['max_batch']))} | {predicted} "
            f"| {', '.join(map(str, r['table_trials']))} | {', '.join(map(str, r['separate_trials']))} "
            f"| **{sum(r['table_trials'])} / {sum(r['separate_trials'])}** | {r['max_tokens']:,} |"
        )
    if not all(r["exact"] for r in results):
        lines += ["", "**Some rows differ from the separate probe: " +
                  ", ".join(r["case"] for r in results if not r["exact"]) + "**"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpt2", action="store_true", help="add tiny-gpt2 (needs transformers)")
    parser.add_argument("--out", default=str(ROOT / "docs" / "benchmarks"), help="folder for lengths.md")
    args = parser.parse_args(argv)
    cases = CASES + ([GPT2] if args.gpt2 else [])
    results = [run_case(case) for case in cases]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "lengths.md").write_text(markdown(results))
    print(markdown(results))
    return results


if __name__ == "__main__":
    main()

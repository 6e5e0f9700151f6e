"""The GPU run's report and the wall-time benchmark: generated tables, not typed ones."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import gpu, wall
from tests.ranks import slow

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "docs/benchmarks/gpu.json"


def _rows(text: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines()
            if line.startswith("| ") and not line.startswith("| model")]


def test_the_gpu_report_puts_every_find_beside_its_estimates(tmp_path):
    text = gpu.report(RECORD, tmp_path / "gpu.md", estimate=lambda command: {"max_batch": 100, "safe_batch": 95})
    record = json.loads(RECORD.read_text())
    finds = [r for r in record["runs"] if " find " in f" {r['command']} "]
    rows = _rows(text)
    assert len(rows) == len(finds) == 4
    gpt2 = rows[1]
    assert gpt2[:3] == ["gpt2", "fp32", "74"] and gpt2[7] == "100" and gpt2[-1] == "+35.1%"
    assert [r[:3] for r in rows] == [["llama-1b", "bf16", "15"], ["gpt2", "fp32", "74"], ["gpt2", "bf16", "93"],
                                     ["bert-base", "bf16", "348"]]


def test_the_committed_wall_table_on_the_card_is_the_records_own():
    record = json.loads(RECORD.read_text())
    assert (ROOT / "docs/benchmarks/wall_cuda.md").read_text() == gpu.wall_table(record)
    assert {r["case"] for r in record["wall"]["rows"]} <= {c.name for c in wall.CASES}
    written = [line for line in gpu.wall_table(record).splitlines() if line.startswith("|")]
    assert "\n".join(written) in (ROOT / "docs/search.md").read_text()


def test_the_committed_gpu_table_is_the_reports_own(tmp_path):
    # Everything but this checkout's estimate (the last three columns, made when it is written).
    text = gpu.report(RECORD, tmp_path / "gpu.md", estimate=lambda command: None)
    committed = (ROOT / "docs/benchmarks/gpu.md").read_text()
    assert [r[:-3] for r in _rows(text)] == [r[:-3] for r in _rows(committed)]


def test_the_gpu_block_is_the_one_the_run_takes():
    assert [c for c in gpu.commands() if c.startswith("autobatch find")][0].startswith("autobatch find --model gpt2")


@slow("both searches of the wall benchmark's first case (~10 s); the table it wrote is checked against the guide "
      "by default")
def test_the_wall_benchmark_times_both_searches_and_writes_its_table():
    # One run of each search in this process (the benchmark starts a fresh process for each).
    case = wall.CASES[0]
    runs = {mode: wall.run_one(case, device="cpu", trace=mode == "trace", dtype="fp32", cap=None)
            for mode in ("trace", "trials")}
    assert runs["trace"]["max_batch"] == runs["trials"]["max_batch"] > 0
    traced = runs["trace"]["trace_prior"]
    # tiny-gpt2's trials take hundredths of a second, its trace about one: it runs between them for as
    # long as they took, and says so where it did not finish
    assert traced["between"] is True and runs["trials"]["trace_prior"]["led"] is False
    assert traced["led"] or traced["reason"].startswith(("the trials were cheaper than the trace",
                                                         "the trace would have cost more than the trials it saves"))
    for r in runs.values():
        r["process_seconds"] = r["answer_seconds"]
    text = wall.markdown([{"case": case.name, "kind": case.kind, **runs}], device="cpu", dtype="fp32", cap=None,
                         argv=["--device", "cpu"])
    assert f"| {case.name} |" in text and "Total wall time" in text


def test_the_search_guides_wall_table_is_the_one_the_benchmark_wrote():
    written = [line for line in (ROOT / "docs/benchmarks/wall_cpu.md").read_text().splitlines() if line.startswith("|")]
    guide = (ROOT / "docs/search.md").read_text()
    assert len(written) >= 2 + 5 and "\n".join(written) in guide


def test_the_speed_table_is_written_from_its_record_and_the_guides_quote_it():
    import json

    from benchmarks import speed

    record = json.loads((ROOT / "docs/benchmarks/speed.json").read_text())
    assert (ROOT / "docs/benchmarks/speed.md").read_text() == speed.markdown(record)
    runs = record["runs"]
    assert set(runs) == set(speed.CASES) and set(runs["six"]["rows"]) == set(speed.STRATEGIES.split(","))
    ratio = runs["six"]["seconds"] / runs["bare"]["seconds"]
    assert f"take {runs['six']['seconds']:.0f} s, {ratio:.0f}× a bare" in (ROOT / "docs/sharding.md").read_text()
    assert f"strategies in {runs['six']['seconds']:.0f} s" in (ROOT / "README.md").read_text()
    assert f"takes {runs['bert-large']['seconds']:.1f} s" in (ROOT / "docs/estimate.md").read_text()
    sharding = " ".join((ROOT / "docs/sharding.md").read_text().split())
    assert (f"ZeRO-3 takes {runs['llama-7b']['seconds']:.0f} s, llama-70b (checkpointed) as rank 0 of 64 takes "
            f"{runs['llama-70b']['seconds']:.0f} s") in sharding


def test_the_wall_benchmark_repeats_the_quick_cases_taking_turns_and_keeps_each_modes_median(monkeypatch):
    # This machine's swings (a second or two) are as large as the quick cases' differences: each of
    # their modes runs three times, taking turns, and the row keeps the median run; a dear case once.
    seconds = {("tiny-gpt2", True): iter([9.0, 7.0, 8.0]), ("tiny-gpt2", False): iter([8.5, 9.5, 6.5]),
               ("gpt2", True): iter([85.0]), ("gpt2", False): iter([150.0])}
    order = []

    def child(case, *, trace, **_):
        order.append((case.name, trace))
        taken = next(seconds[case.name, trace])
        return {"max_batch": 27, "trials": 4, "oom_trials": 1, "trace_prior": {"led": False, "reason": "x"},
                "process_seconds": taken, "device_name": "cpu"}

    monkeypatch.setattr(wall, "child", child)
    rows = wall.run(wall.CASES[:2], device="cpu", dtype="fp32", cap=None, repeat=3)
    assert order == [("tiny-gpt2", True), ("tiny-gpt2", False)] * 3 + [("gpt2", True), ("gpt2", False)]
    tiny, gpt2 = rows
    assert tiny["trace"]["process_seconds"] == 8.0 and tiny["trace"]["repeats"] == [9.0, 7.0, 8.0]
    assert tiny["trials"]["process_seconds"] == 8.5 and "repeats" not in gpt2["trace"]
    text = wall.markdown(rows, device="cpu", dtype="fp32", cap=None, argv=["--device", "cpu", "--repeat", "3"])
    assert "each figure the median of 3 runs, the modes taking turns" in text
    assert "| 8.0 | 8.5 |" in text and "| 85.0 | 150.0 |" in text

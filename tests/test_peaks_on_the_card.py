"""The trace against an H200's peaks at fixed batches (docs/benchmarks/peaks.json, made there by
``python -m benchmarks.gpu run``): eager attention against fused, and the committed table is the record's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import peaks
from tests.ranks import slow

ROOT = Path(__file__).resolve().parents[1]
RECORD = json.loads((ROOT / "docs/benchmarks/peaks.json").read_text())


def _case(name: str) -> tuple[peaks.PeakCase, dict]:
    row = next(r for r in RECORD["cases"] if r["case"]["name"] == name)
    return peaks.PeakCase(**{**row["case"], "batches": tuple(row["case"]["batches"])}), row


class _Gpt2(dict):
    """Per attention: the card's trial at batch 8 and the trace's figures there, traced when first asked."""

    def __missing__(self, attention: str) -> tuple[dict, dict]:
        case, row = _case(f"gpt2-{attention}")
        (card,) = row["trials"]
        self[attention] = card, peaks.traced(case, [card["batch"]], RECORD["card"]["total_bytes"])[card["batch"]]
        return self[attention]


@pytest.fixture(scope="module")
def gpt2() -> _Gpt2:
    return _Gpt2()


# gpt2 with fused attention is checked against this card by default in tests/test_allocator_replay.py
@pytest.mark.parametrize("attention", ["eager", pytest.param("sdpa", marks=slow("gpt2 traced again (~6 s)"))])
def test_the_trace_is_within_a_percent_of_the_cards_peaks(gpt2, attention):
    card, mine = gpt2[attention]
    assert card["fits"] and mine["fits"]
    assert abs(mine["allocated"] / card["peak_bytes"] - 1) < 0.01
    assert abs(mine["reserved"] / card["reserved_bytes"] - 1) < 0.01


@slow("gpt2 traced with both attentions (~12 s)")
def test_eager_attention_costs_what_it_cost_on_the_card(gpt2):
    # Eager attention keeps the probabilities (batch × heads × seq² per layer): 9.6 GiB more at 8 × 1024.
    on_card = gpt2["eager"][0]["peak_bytes"] - gpt2["sdpa"][0]["peak_bytes"]
    traced = gpt2["eager"][1]["allocated"] - gpt2["sdpa"][1]["allocated"]
    assert on_card > 9 * 2**30
    assert abs(traced / on_card - 1) < 0.01


def test_the_committed_table_holds_the_cards_figures():
    text = (ROOT / "docs/benchmarks/peaks.md").read_text()
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines()
            if line.startswith("| ") and not line.startswith("| case")]
    recorded = [(r["case"]["name"], t) for r in RECORD["cases"] for t in r["trials"]]
    assert len(rows) == len(recorded) >= 19
    for row, (name, trial) in zip(rows, recorded):
        assert row[:2] == [name, str(trial["batch"])]
        assert row[2] == f"{trial['peak_bytes'] / 2**30:.2f}" and row[5] == f"{trial['reserved_bytes'] / 2**30:.2f}"
    context = RECORD["context"]["cuda_started"]
    assert f"cuda started {(context['used'] - context['reserved']) / 2**30:.2f} GiB" in text

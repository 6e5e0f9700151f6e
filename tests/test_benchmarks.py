"""A quick run of the benchmark harness: one small case, every adapter, the written outputs.

The full comparison (``python -m benchmarks.run``, the command docs/benchmarks/compare.md shows)
takes minutes and is run by hand; here it runs on one case (``SMOKE_CASE``) into a temporary
folder through the same ``main`` entry point.
"""

from __future__ import annotations

import json

import pytest
from tests.extras import need

need("lightning")
need("accelerate")

import benchmarks.tools  # noqa: E402
from benchmarks.cases import CASES, SMOKE_CASE, by_name  # noqa: E402
from benchmarks.run import headline, main  # noqa: E402
from benchmarks.tools import TOOLS, true_max  # noqa: E402


pytestmark = pytest.mark.usefixtures("frozen_suite_heap")  # accelerate and Lightning collect garbage per trial


@pytest.fixture(autouse=True)
def quick_accelerate(monkeypatch):
    # From 1024 accelerate needs ~45 trials to reach this case's maximum; from 16, nine.
    monkeypatch.setattr(benchmarks.tools, "ACCELERATE_START", 16)


@pytest.fixture(scope="module")
def truth():
    return true_max(SMOKE_CASE.workload(), SMOKE_CASE.budget)


def test_cases_have_distinct_names_and_resolve():
    assert len({c.name for c in CASES}) == len(CASES)
    assert by_name(SMOKE_CASE.name) == SMOKE_CASE
    with pytest.raises(ValueError, match="no case named"):
        by_name("nope @ 1MiB")


def test_true_max_is_the_last_fit_before_the_first_failure(truth):
    assert truth.fits[truth.max_batch] and not truth.fits[truth.max_batch + 1]
    assert min(truth.fits) == 2  # BatchNorm: the scan starts at 2
    assert all(truth.fits[b] for b in range(2, truth.max_batch + 1))


@pytest.mark.parametrize("tool", list(TOOLS))
def test_each_adapter_returns_a_batch_that_trains(tool, truth):
    run = TOOLS[tool](SMOKE_CASE.workload(), SMOKE_CASE.budget)
    assert run.returned is not None and 1 <= run.returned <= truth.max_batch
    assert run.trials == len(run.tried) >= 1 and run.steps >= run.trials
    # One oracle: every verdict a tool saw is the scan's verdict at that batch.
    assert all(truth.fits[b] == ok for b, ok in run.tried if b in truth.fits)
    if tool.startswith("autobatch"):
        assert run.returned == truth.max_batch


def test_main_writes_table_json_and_plot(tmp_path):
    need("matplotlib")
    # Lightning's adapters ran above; here the two quick tools keep the test short.
    assert main(["--out", str(tmp_path), "--cases", SMOKE_CASE.name, "--tools", "autobatch", "accelerate"]) == 0
    data = json.loads((tmp_path / "compare.json").read_text())
    assert [c["case"] for c in data["cases"]] == [SMOKE_CASE.name]
    assert set(data["summary"]) == {"autobatch", "accelerate"}
    assert data["headline"] == headline(data["summary"])
    text = (tmp_path / "compare.md").read_text()
    assert data["headline"] in text and "python -m benchmarks.run" in text and "no GPU" in text
    assert (tmp_path / "compare.png").stat().st_size > 0


def test_the_contrastive_case_grows_with_the_square_of_the_batch():
    from autobatch import SimulatedBackend
    from autobatch.probing.trial import run_trial

    case = by_name("clip @ 2MiB")
    work = case.workload()
    model, backend = work.model(), SimulatedBackend("1GiB")
    peak = {b: run_trial(work, model, backend, b).forward_backward_bytes for b in (100, 200, 300)}
    # Equal steps in the batch, growing steps in memory: the b × b logits and their softmax.
    assert peak[300] - peak[200] > 1.2 * (peak[200] - peak[100]) > 0

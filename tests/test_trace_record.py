"""Every result says whether the fake-tensor trace led its search and, where it did not, why: one line
of the text and ``trace_prior: {"led": false, "reason": …}`` in ``--json``, on every path, never by
the key's absence (the trace led by the trace, turned off, failed, a sharded probe under a launcher,
a length table, an estimate, a drop-in, a result cached before the record existed)."""

from __future__ import annotations

import json

from typer.testing import CliRunner

import autobatch
from autobatch import SimulatedBackend, probe_lengths
from autobatch.cli import app
from autobatch.estimating.estimate import IS_THE_TRACE
from autobatch.integrations._common import UNTRACED, probe_here
from autobatch.lengths.runner import LED_BY_LENGTHS
from autobatch.pipeline import SHARDED_UNDER_A_LAUNCHER, TURNED_OFF, launched_prior
from autobatch.probing.search import NoTrace
from autobatch.tuning.cache import probe_result_from_dict
from docs.examples.causal_lm import workload as causal_lm
from tests.tiny import mlp_workload


def _not_led(record: dict) -> str:
    assert record["led"] is False and record["reason"]
    return record["reason"]


def test_find_without_the_trace_says_so_in_one_line_and_in_json(trace_first) -> None:
    args = ["find", "--model", "tiny-mlp", "--device", "cpu", "--memory", "2MiB", "--target", "64", "--no-cache"]
    text = CliRunner().invoke(app, [*args, "--no-trace-prior"])
    assert text.exit_code == 0 and f"the trials alone searched: {TURNED_OFF}" in text.stdout
    data = json.loads(CliRunner().invoke(app, [*args, "--no-trace-prior", "--json"]).stdout)
    assert _not_led(data["trace_prior"]) == TURNED_OFF == _not_led(data["probe"]["trace_prior"])
    led = json.loads(CliRunner().invoke(app, [*args, "--json"]).stdout)
    assert led["trace_prior"]["led"] is True and led["trace_prior"]["reason"] is None


def test_an_estimate_a_length_table_and_a_drop_in_each_say_why() -> None:
    estimate = autobatch.estimate(mlp_workload(), gpu_memory="1GiB", max_batch=64)
    assert _not_led(estimate.to_dict()["trace_prior"]) == IS_THE_TRACE
    table = probe_lengths(causal_lm(), [32, 64], SimulatedBackend("1MiB"), headroom=0)
    assert {_not_led(row.train.to_dict()["trace_prior"]) for row in table.rows} == {LED_BY_LENGTHS}
    assert _not_led(probe_here(mlp_workload(), SimulatedBackend("2MiB")).to_dict()["trace_prior"]) == UNTRACED


def test_a_sharded_probe_under_a_launcher_says_why_the_trials_alone_search() -> None:
    work, backend = mlp_workload(), SimulatedBackend("2MiB")
    assert launched_prior(work, backend, True, "fsdp2", None).reason == SHARDED_UNDER_A_LAUNCHER
    assert launched_prior(work, backend, False, None, None).reason == TURNED_OFF
    assert launched_prior(work, backend, True, None, None).report is not None  # the trace leads DDP's ranks
    # and the lockstep probe records it as it is handed (a world of one gloo rank)
    with autobatch.process_group("gloo"):
        result = autobatch.probe_distributed(mlp_workload(), SimulatedBackend("2MiB"), max_batch=8,
                                             prior=NoTrace(SHARDED_UNDER_A_LAUNCHER))
    assert _not_led(result.to_probe_result().to_dict()["trace_prior"]) == SHARDED_UNDER_A_LAUNCHER
    assert result.trace_line() == f"the trials alone searched: {SHARDED_UNDER_A_LAUNCHER}"


def test_a_result_cached_before_the_record_existed_says_so() -> None:
    data = autobatch.probe(mlp_workload(), SimulatedBackend("2MiB"), max_batch=4).to_dict()
    del data["trace_prior"]
    old = probe_result_from_dict(data)
    assert "no record of the trace" in _not_led(old.to_dict()["trace_prior"])
    # one stored with the trace's figures but no "led": led where nothing failed
    data["trace_prior"] = {"traced_batches": [2, 4], "seconds": 0.5, "failure": None}
    assert probe_result_from_dict(data).trace_led


def test_a_no_trace_searches_as_no_prior_does() -> None:
    run = lambda b: autobatch.Trial(b, 100 + 7 * b <= 1000, 100 + 7 * b, 100 + 7 * b, resident_bytes=100)
    alone = autobatch.search_max(run, 1000)
    assert [t.batch for t in autobatch.search_max(run, 1000, prior=NoTrace("why")).trials] == \
        [t.batch for t in alone.trials]

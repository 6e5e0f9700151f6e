"""An estimate's rows lead one another: the same activations under FSDP and ZeRO, another state.

Each row of a traced estimate searches on its own trials; one whose step computes alike (FSDP,
ZeRO: in the run's dtype) is led by the row before it, moved onto its own first trial, and so
tries the boundary next. DDP (fp32 weights under autocast) neither leads nor is led.
"""

from __future__ import annotations

import doctest

import autobatch
from autobatch.estimating import lead
from autobatch.estimating.estimate import IS_THE_TRACE


def rows(strategies: str, fragmentation: float | None = 1.1) -> dict:
    # A row leads the next where a multiplier takes the allocator (--fragmentation); booked (the default), each
    # row's own first two trials lead it (tests/test_fresh_log.py)
    report = autobatch.answer(autobatch.Request(model="tiny-gpt2", gpu_memory="600MiB", gpus_per_node=4,
                                                strategy=strategies, estimate=True, dtype="bf16",
                                                fragmentation=fragmentation))
    return {row.strategy.name: row.probe for row in report.rows}


def test_a_row_led_by_the_one_before_it_tries_the_boundary_next_and_answers_as_alone():
    led = rows("fsdp1,fsdp2")
    alone = rows("fsdp2")["fsdp2"]
    assert [t.batch for t in alone.trials] == [1, 17, 58, 59]
    assert led["fsdp2"].max_batch == alone.max_batch == 58
    assert [t.batch for t in led["fsdp2"].trials] == [1, 58, 59]  # a trial fewer: the slope came with the lead
    assert [t.batch for t in led["fsdp1"].trials] == [1, 17, 58, 59]  # the first of its kind: nothing to lead it
    assert not lead.leads("ddp") and lead.leads("fsdp1")  # DDP's fp32 weights under autocast: other activations
    said = led["fsdp2"].extra["trace_prior"]
    # not the trace as a prior (an estimate's trials are traces): another row's traced trials, named
    assert said["led"] is False and said["reason"] == IS_THE_TRACE and said["led_by"] == "fsdp1"
    assert led["fsdp2"].trace_line() == ("led by the fsdp1 row's traced trials (the same activations, another "
                                         "state); the answer rests on this row's own")
    assert "led_by" not in led["fsdp1"].extra["trace_prior"] and led["fsdp1"].extra["trace_prior"]["reason"] == IS_THE_TRACE


def test_the_examples_run():
    assert doctest.testmod(lead).failed == 0


def test_each_row_of_an_estimates_json_says_it_is_estimated():
    import json

    from typer.testing import CliRunner

    from autobatch.cli import app

    res = CliRunner().invoke(app, ["estimate", "--model", "tiny-mlp", "--gpu-memory", "600MiB", "--gpus", "4",
                                   "--strategy", "ddp,fsdp2", "--max-micro", "4", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["estimated"] is True and [row["estimated"] for row in out["strategies"]] == [True, True]

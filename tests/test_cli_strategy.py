"""``find --strategy`` (one row per strategy, configs that carry it) and ``check --strategy``."""

from __future__ import annotations

import json
import re
import os

import pytest
from typer.testing import CliRunner

from autobatch.cli import app
from tests.extras import need

runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, list(args), env={"COLUMNS": "200"})  # the table's rows on one line each


def test_find_compares_strategies_one_row_each():
    need("deepspeed")
    res = invoke("find", "--model", "tiny-mlp", "--device", "cpu", "--memory", "4MiB", "--gpus", "4",
                 "--strategy", "ddp,fsdp2,zero3", "--max-batch", "3", "--json", "--no-trace-prior")
    assert res.exit_code == 0, res.output
    rows = json.loads(res.stdout)["strategies"]
    assert [r["probe"]["sharding"]["strategy"]["name"] for r in rows] == ["ddp", "fsdp2", "zero3"]
    for row in rows:
        sharding = row["probe"]["sharding"]
        assert sharding["world_size"] == 4
        assert set(sharding["per_rank"]) == {"parameters", "buffers", "optimizer_state", "gradients", "activations", "other", "peak"}
    ddp, fsdp2, zero3 = (r["probe"]["sharding"]["per_rank"]["parameters"] for r in rows)
    assert fsdp2 < ddp and zero3 < ddp  # a shard, not the whole model
    # a strategy under which nothing fits is a row of its own
    text = invoke("find", "--model", "tiny-mlp", "--device", "cpu", "--memory", "1MiB", "--gpus", "4",
                  "--strategy", "ddp,fsdp2", "--max-batch", "2")
    assert text.exit_code == 0, text.output
    assert "per rank, at the max batch" in text.stdout and "no batch fits" in text.stdout
    assert re.search(r"│ ddp\s+│\s+4 │\s+0 │", text.stdout)  # the failed row names its ranks too
    assert "fsdp2: max batch 2 per rank (limited by the --max-micro / max_batch= cap)" in text.stdout  # the cap, not memory
    assert "2 (cap)" in text.stdout
    # where the search had room, the trace ran between the trials for as long as they took, and each
    # strategy's line says whether it led, or why not (whether it does: test_sharded_probe.py)
    led = invoke("find", "--model", "tiny-mlp", "--device", "cpu", "--memory", "4MiB", "--gpus", "4",
                 "--strategy", "ddp,fsdp2", "--max-micro", "64")
    lines = [line for line in led.stdout.splitlines() if line.startswith(("ddp: max batch 64", "fsdp2: max batch 64"))]
    assert len(lines) == 2 and all(re.search(r"trials 1✓, (\d+✓, )?64✓ \((led by the fake-tensor trace|the trials "
                                             r"alone searched: (the trials were cheaper than the trace|the trace "
                                             r"would have cost more than the trials it saves))", line)
                                   for line in lines), led.stdout


def test_find_with_one_strategy_writes_it_into_the_configs(tmp_path):
    ds, acc, hf = tmp_path / "ds.json", tmp_path / "accelerate.yaml", tmp_path / "hf.json"
    res = invoke("find", "--model", "tiny-mlp", "--device", "cpu", "--memory", "4MiB", "--gpus", "2",
                 "--strategy", "fsdp2", "--max-batch", "2", "--accelerate", str(acc), "--hf", str(hf),
                 "--no-trace-prior")  # the configs are the point here (the trace's lead: test_sharded_probe.py)
    assert res.exit_code == 0, res.output
    assert "FSDP" in acc.read_text() and "fsdp_version: 2" in acc.read_text()
    assert json.loads(hf.read_text())["fsdp"] is True
    # tiny-mlp has no blocks: it was probed wrapped by size, as torch's and accelerate's size-based
    # policies wrap (one unit under 10**8 parameters), and both files say so rather than wrap each Linear
    assert "fsdp_auto_wrap_policy: SIZE_BASED_WRAP" in acc.read_text() and "fsdp_min_num_params: 100000000" in acc.read_text()
    assert "Linear" not in acc.read_text()
    assert json.loads(hf.read_text())["fsdp_config"]["min_num_params"] == 10**8
    res = invoke("find", "--model", "tiny-mlp", "--device", "cpu", "--memory", "4MiB", "--gpus", "2",
                 "--strategy", "fsdp2", "--max-batch", "2", "--deepspeed", str(ds))
    assert res.exit_code == 2 and "the plan is for fsdp2" in res.output
    assert "max batch" not in res.output  # refused before the first trial, not after the probe


@pytest.mark.parametrize("strategy", [(), ("--strategy", "ddp")], ids=["unsharded", "ddp"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "bf16-true"])
def test_a_deepspeed_file_for_an_autocast_probe_is_refused_before_the_first_trial(tmp_path, strategy, dtype):
    # it wrote DeepSpeed's bf16 engine (bf16 weights and gradients beside an fp32 master copy) for a batch found
    # with fp32 weights under autocast: a different step, 94 where ZeRO-1's engine fits 98 for tiny-gpt2 in 64MiB
    ds = tmp_path / "ds.json"
    res = invoke("find", "--model", "tiny-gpt2", "--device", "cpu", "--memory", "64MiB", "--dtype", dtype, *strategy,
                 "--deepspeed", str(ds))
    assert res.exit_code == 2 and f"--deepspeed with --dtype {dtype} trains in DeepSpeed's {dtype[:4]} engine" in res.output
    # pure bf16 weights were written as an fp32 DeepSpeed file (no precision section): half the weights' memory
    assert "--strategy zero1" in res.output and "max batch" not in res.output and not ds.exists()
    assert invoke("solve", "--target", "8", "--deepspeed", str(ds)).exit_code == 0  # no probe: nothing to differ


def test_a_zero_row_without_deepspeed_installed_is_refused_before_any_row_runs(monkeypatch):
    # the ddp row ran first, then the zero2 row failed the whole command and the ddp answer was lost
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else find_spec(name, *a))
    res = invoke("find", "--model", "tiny-mlp", "--device", "cpu", "--memory", "4MiB", "--gpus", "2",
                 "--strategy", "ddp,zero2", "--max-micro", "2")
    assert res.exit_code == 2 and "probing a ZeRO strategy needs deepspeed, which is not installed" in res.output
    assert "max batch" not in res.output
    assert invoke("solve", "--target", "8", "--gpus", "2", "--strategy", "zero2").exit_code == 0  # a plan alone needs none


def test_check_takes_a_misspelt_strategy_as_a_usage_error():
    res = invoke("check", "--gpus", "4", "--micro-batch", "2", "--grad-accum", "1", "--strategy", "zero4")
    assert res.exit_code == 2 and "strategy must be one of ddp, fsdp2" in res.output


def test_solve_writes_the_strategy_into_the_configs_deepspeed_reads(tmp_path):
    from tests.deepspeed_parse import deepspeed_parse

    ds = tmp_path / "ds.json"
    res = invoke("solve", "--target", "64", "--gpus", "8", "--max-micro", "4", "--strategy", "zero3",
                 "--offload", "optimizer", "--deepspeed", str(ds))
    assert res.exit_code == 0, res.output
    parsed = deepspeed_parse(json.loads(ds.read_text()), world_size=8)
    assert parsed.zero_optimization_stage == 3 and parsed.train_batch_size == 64
    assert json.loads(ds.read_text())["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    several = invoke("solve", "--target", "64", "--gpus", "8", "--strategy", "zero2,zero3")
    assert several.exit_code == 2 and "for one strategy" in several.output


@pytest.mark.parametrize("args, match", [
    (("--strategy", "zero4"), "strategy must be one of ddp, fsdp2"),
    (("--offload", "optimizer"), "no --strategy was given"),
    (("--strategy", "ddp,fsdp2", "--deepspeed", "ds.json"), "written for one strategy"),
    (("--strategy", "fsdp2", "--offload", "optimizer"), "FSDP's CPU offload (CPUOffloadPolicy) moves the parameters"),
    (("--strategy", "fsdp1", "--offload", "optimizer"), "FSDP's CPU offload (CPUOffload) moves the parameters"),
])
def test_bad_strategy_options_fail_before_any_trial(args, match):
    res = invoke("find", "--model", "tiny-mlp", "--device", "cpu", "--memory", "1MiB", *args)
    assert res.exit_code == 2
    assert match in res.output and "Traceback" not in res.output


def test_check_says_when_the_micro_batch_was_probed_under_another_strategy(tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
                              "zero_optimization": {"stage": 2}}))
    res = invoke("check", "--gpus", "4", "--deepspeed", str(ds), "--strategy", "zero3", "--json")
    assert res.exit_code == 1, res.output
    problems = json.loads(res.stdout)["problems"]
    (mismatch,) = [p for p in problems if p["code"] == "strategy-mismatch"]
    assert "probed under zero3" in mismatch["message"] and "trains with zero2" in mismatch["message"]
    assert "may run out of memory" in mismatch["message"]
    same = invoke("check", "--gpus", "4", "--deepspeed", str(ds), "--strategy", "zero2")
    assert same.exit_code == 0, same.output


def test_estimate_with_a_strategy_probes_rank_0_of_w_against_the_gpus_memory():
    res = invoke("estimate", "--model", "tiny-mlp", "--gpu-memory", "600MiB", "--gpus", "8",
                 "--strategy", "ddp,fsdp2", "--max-batch", "2", "--json")
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["estimated"] is True
    rows = out["strategies"]
    assert [r["probe"]["sharding"]["world_size"] for r in rows] == [8, 8]
    ddp, fsdp2 = (r["probe"]["sharding"]["per_rank"]["parameters"] for r in rows)
    assert fsdp2 < ddp
    # both traced on fake tensors (no memory, seconds at any size); DDP as its buckets, without its reducer
    assert [r["probe"]["device"]["kind"] for r in rows] == ["fake", "fake"]
    assert rows[0]["probe"]["sharding"]["per_rank"]["buffers"] == ddp  # the buckets: a copy of the gradients
    assert "real steps" not in res.stderr


@pytest.mark.skipif(not os.environ.get("AUTOBATCH_SLOW_TESTS"), reason=(
    "llama-1b as rank 0 of 8 under ZeRO-3 (~3 min and 11 GB of host memory); set AUTOBATCH_SLOW_TESTS=1 to include it"))
def test_the_llama_measurement_in_docs_sharding_runs_and_holds_two_bytes_per_parameter() -> None:
    """docs/sharding.md's llama-1b command, verbatim: rank 0 of 8 keeps 2.0 P between steps under ZeRO-3."""
    import json
    import re
    import shlex
    import subprocess
    import sys
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "sharding.md").read_text()
    command = re.search(r"```text\n(autobatch find --model llama-1b[^\n]*)\n```", text).group(1)
    done = subprocess.run([sys.executable, "-m", "autobatch", *shlex.split(command)[1:]], capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr
    rank = json.loads(done.stdout)["probe"]["sharding"]["per_rank"]
    resident = rank["parameters"] + rank["buffers"] + rank["optimizer_state"]
    assert 1.95 < resident / 1_235_814_400 < 2.05

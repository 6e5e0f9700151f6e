"""``find --uneven`` under a launcher: every rank finds its own largest batch, the plan per rank sums to
the target, and training with it on gloo ranks of different budgets gives the weights one process
gets from the whole batch.

* Each rank's own max is checked against the lockstep probe with every rank on that rank's budget
  (its answer is exact, and checked against real ranks elsewhere), for DDP, FSDP2 and ZeRO-3 by
  default, and FSDP1, ZeRO-1 and ZeRO-2 in the slow run.
* Three gloo ranks on 48, 40 and 36 KiB plan 100 samples (which three ranks cannot share evenly),
  then train three SGD steps with :class:`~autobatch.training.UnevenBatchSampler` and the uneven
  loss scale, for a per-sample mean and a token mean; the weights match one process within 1e-5.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from autobatch.distributed.launch import spawn_local
from tests import uneven_jobs
from tests.extras import need
from tests.ranks import slow

BUDGETS = ("3MiB", "2MiB")


def _own(strategies: tuple[str | None, ...]) -> None:
    uneven = spawn_local(uneven_jobs.own_limits_job, (strategies, BUDGETS, True), nprocs=2, backend="gloo",
                         timeout_s=120)
    alike = spawn_local(uneven_jobs.own_limits_job, (strategies, (BUDGETS[0], BUDGETS[0]), False), nprocs=2,
                        backend="gloo", timeout_s=120)
    for name in map(str, strategies):
        mine = uneven[0][name]
        assert uneven[1][name] == mine  # every rank holds the same limits
        (big, big_safe, big_times), (small, small_safe, small_times) = mine["own"]
        assert big == alike[0][name]["max_batch"]  # rank 0 alone at its budget: what both at it reach
        assert small == mine["max_batch"] < big   # rank 1 limits the uniform answer, and is its own max
        assert big_times is small_times is None   # simulated budgets time nothing a GPU would


def test_each_rank_finds_its_own_largest_batch() -> None:
    need("deepspeed")
    _own((None, "fsdp2", "zero3"))


@slow("the other sharded strategies on two gloo ranks, twice (~30 s)")
def test_each_rank_finds_its_own_largest_batch_under_fsdp1_zero1_and_zero2() -> None:
    need("deepspeed")
    _own(("fsdp1", "zero1", "zero2"))


@pytest.fixture(scope="module")
def trained() -> list[dict]:
    return spawn_local(uneven_jobs.probe_then_train, (100, "48KiB,40KiB,36KiB"), nprocs=3, backend="gloo",
                       timeout_s=120)


def test_the_plan_per_rank_comes_from_each_ranks_own_probe(trained) -> None:
    pairs, limits = trained[0]["pairs"], trained[0]["limits"]
    assert all(rank["pairs"] == pairs for rank in trained)
    assert sum(m * k for m, k in pairs) == 100
    assert [safe for _, safe in limits] == sorted((safe for _, safe in limits), reverse=True)
    assert len({safe for _, safe in limits}) == 3  # three budgets, three limits
    assert all(m <= safe for (m, _), (_, safe) in zip(pairs, limits))
    assert any(k > 1 for _, k in pairs)  # the smaller ranks accumulate


@pytest.mark.parametrize("kind", ["mean", "token"])
def test_training_with_it_gives_the_weights_of_the_whole_batch(trained, kind) -> None:
    whole = uneven_jobs.train_whole_batch(kind, 100)
    start = (uneven_jobs.mlp() if kind == "mean" else uneven_jobs.lm()).state_dict()
    for rank in trained:
        weights = rank["trained"][kind]
        assert max((weights[k] - whole[k]).abs().max().item() for k in whole) < 1e-5
    assert max((whole[k] - start[k]).abs().max().item() for k in whole) > 0.05  # it trained


def test_a_search_that_ended_searches_again_where_its_fit_fails_beside_the_others() -> None:
    # One rank (a world of one): its largest fit, 50, runs out of memory when it trains again beside
    # the others' larger batches (here: the second time); its search goes on below it and ends at 40.
    import torch

    from autobatch.distributed.agreement import Comm
    from autobatch.distributed.launch import process_group
    from autobatch.distributed.own_limits import _in_rounds
    from autobatch.probing.trial import Trial

    limit, calls = [50], []

    def run(b: int) -> Trial:
        calls.append(b)
        if calls.count(50) == 2:
            limit[0] = 40
        return Trial(b, b <= limit[0], 100 + 10 * b, 100 + 10 * b, resident_bytes=100)

    os.environ.pop("RANK", None)
    with process_group("gloo"):
        outcome, history = _in_rounds(Comm(torch.device("cpu"), 30.0), run, [], capacity=600, min_batch=1,
                                      max_batch=None)
    assert outcome.max_batch == 40
    assert calls.count(50) == 2 and 41 in calls and calls[-1] == 40  # the last round trained the answer


# --- the command line ---------------------------------------------------------------------------------


def _torchrun(args: list[str], cwd: Path, nprocs: int = 2) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                             str(nprocs), "-m", "autobatch", *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise AssertionError(f"{args} did not finish within 120 s") from None
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


def test_find_uneven_under_torchrun_prints_the_plan_per_rank_and_files_keep_the_uniform_one(tmp_path) -> None:
    done = _torchrun(["find", "--model", "tiny-mlp", "--target", "20000", "--device", "cpu", "--memory",
                      "40MiB,20MiB", "--uneven", "--json", "--deepspeed", "ds.json"], tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    data = json.loads(done.stdout)
    per_rank = data["per_rank"]
    assert sum(r["micro_batch"] * r["grad_accum"] for r in per_rank) == 20000 == data["uneven"]["global_batch"]
    assert per_rank[0]["safe_batch"] > per_rank[1]["safe_batch"]
    assert per_rank[0]["micro_batch"] > per_rank[1]["micro_batch"]
    assert all(r["micro_batch"] <= r["safe_batch"] for r in per_rank)
    written = json.loads((tmp_path / "ds.json").read_text())
    assert written["train_micro_batch_size_per_gpu"] == data["plan"]["micro_batch"]  # the uniform plan
    assert written["gradient_accumulation_steps"] == data["plan"]["grad_accum"]
    assert "the files written carry the uniform plan" in done.stderr
    assert any("carry the uniform plan" in n for n in data["notes"])


def test_find_uneven_text_shows_each_ranks_arithmetic(tmp_path) -> None:
    done = _torchrun(["find", "--model", "tiny-mlp", "--target", "9999", "--device", "cpu", "--memory",
                      "40MiB,20MiB", "--uneven"], tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "uneven plan: " in done.stdout and "= 9999 per step" in done.stdout
    assert "rank 0: " in done.stdout and "rank 1: " in done.stdout
    assert "uniform plan: none reaches 9999 on these ranks" in done.stdout  # 9999 is odd: only uneven reaches it


@pytest.mark.parametrize("args,message", [
    (["find", "--model", "tiny-mlp", "--target", "8", "--device", "cpu", "--memory", "8MiB", "--uneven"],
     "--uneven plans a batch per rank from each rank's own probe, which needs a launcher"),
    (["estimate", "--model", "tiny-mlp", "--target", "8", "--gpu", "a100-80gb", "--uneven"],
     "--uneven plans mixed GPUs, so --gpu must list them with their counts"),
    (["estimate", "--model", "tiny-mlp", "--target", "9", "--gpu", "a100-80gb:1,a100-40gb:1", "--uneven",
      "--deepspeed", "ds.json"], "--deepspeed hold one micro batch for every rank"),
    (["estimate", "--model", "tiny-mlp", "--gpu", "a100-80gb:2,t4:x"], "--gpu must list NAME:COUNT parts"),
    (["estimate", "--model", "tiny-mlp", "--gpu", "a100-80gb:2,t4:2", "--gpus", "8"],
     "--gpu a100-80gb:2,t4:2 names 4 GPUs, but --gpus 8 × --nodes 1 is 8"),
    (["estimate", "--model", "tiny-mlp", "--gpu", "a100-80gb:2,t4:2", "--uneven", "--model-parallel", "2"],
     "--uneven plans each data-parallel rank alone, but --model-parallel 2"),
    (["solve", "--target", "8", "--max-micro", "4", "--uneven"], None),
])
def test_uneven_where_it_cannot_apply_is_one_line(args, message, tmp_path) -> None:
    from typer.testing import CliRunner

    from autobatch.cli import app

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"):
        os.environ.pop(name, None)
    result = CliRunner().invoke(app, args)
    assert result.exit_code != 0 and "Traceback" not in result.output
    if message is None:  # solve has no --uneven: typer says so
        assert "No such option: --uneven" in result.output
        return
    assert message in result.output, result.output


def test_find_uneven_on_one_launched_rank_is_one_line(tmp_path) -> None:
    done = _torchrun(["find", "--model", "tiny-mlp", "--target", "8", "--device", "cpu", "--memory", "8MiB",
                      "--uneven"], tmp_path, nprocs=1)
    # the rank says one line and exits 2; the traceback after it is torchrun's own, about its child
    assert done.returncode != 0 and "/autobatch/" not in done.stderr
    rank_says = done.stderr.split("\n")[0]
    assert rank_says.startswith("Error: --uneven balances several ranks, but the launcher started one")


def test_estimate_a_mixed_cluster_plans_each_card(tmp_path) -> None:
    from typer.testing import CliRunner

    from autobatch.cli import app

    result = CliRunner().invoke(app, ["estimate", "--model", "tiny-gpt2", "--gpu",
                                                      "a100-80gb:2,v100-16gb:2", "--target", "1000", "--uneven",
                                                      "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    cards = {c["gpu"]: c for c in data["gpus"]}
    assert cards["a100-80gb"]["count"] == 2 and cards["a100-80gb"]["safe_batch"] > cards["v100-16gb"]["safe_batch"]
    per_rank = data["per_rank"]
    assert sum(r["samples"] for r in per_rank) == 1000
    # balanced by the cards' peak speeds (312 against 125 TFLOPS): the A100s take about 2.5× the samples
    assert per_rank[0]["samples"] / per_rank[2]["samples"] == pytest.approx(312 / 125, rel=0.02)
    assert data["uneven"]["speeds"] == "peak"
    assert data["plan"]["micro_batch"] * data["plan"]["world_size"] * data["plan"]["grad_accum"] == 1000
    assert data["plan"]["world_size"] == 4
    plain = CliRunner().invoke(app, ["estimate", "--model", "tiny-gpt2", "--gpu", "a100-80gb:2,v100-16gb:2",
                                     "--target", "1000"])
    assert plain.exit_code == 0 and "uneven plan" not in plain.output  # the uniform plan stays the default
    assert "2 × v100-16gb: max batch" in plain.output


def test_on_emulated_gpus_each_rank_is_timed_and_planned(tmp_path) -> None:
    # Two torchrun ranks, each on its own emulated GPU (64 and 40 MiB) and the real CUDA path: the
    # step times of each rank's trials make its line, and the plan per rank carries them.
    root = Path(__file__).resolve().parents[1]
    from tests.test_launchers import LAUNCHER_VARIABLES, _free_port

    base = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES and not k.startswith(("SLURM_", "OMPI_"))}
    base["PYTHONPATH"] = os.pathsep.join([str(root), base.get("PYTHONPATH", "")])
    port = str(_free_port())
    ranks = [subprocess.Popen([sys.executable, "-m", "tests.launched_rank", str(tmp_path), "2", "uneven"], cwd=root,
                              env={**base, "RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r),
                                   "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    for process in ranks:
        text, _ = process.communicate(timeout=240)
        assert process.returncode == 0, text[-3000:]
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert seen[0]["per_rank"] == seen[1]["per_rank"]
    assert seen[0]["machine_gpus_used"] == [0] and seen[1]["machine_gpus_used"] == [1]
    zero, one = seen[0]["per_rank"]
    assert zero["max_batch"] > one["max_batch"] and zero["safe_batch"] > one["safe_batch"]
    assert zero["micro_batch"] * zero["grad_accum"] + one["micro_batch"] * one["grad_accum"] == 1000
    assert zero["seconds_per_sample"] > 0 and one["seconds_per_sample"] > 0  # timed on the CUDA path


def test_the_guides_table_is_the_one_the_benchmark_wrote() -> None:
    root = Path(__file__).resolve().parents[1]
    bench = [line for line in (root / "docs" / "benchmarks" / "uneven.md").read_text().splitlines()
             if line.startswith("|")]
    guide = (root / "docs" / "uneven.md").read_text().split("<!-- uneven-table")[1].split("<!-- /uneven-table -->")[0]
    assert [line for line in guide.splitlines() if line.startswith("|")] == bench and len(bench) >= 6


def test_the_benchmark_writes_its_table(tmp_path) -> None:
    from benchmarks.uneven import main

    [result] = main(["--model", "tiny-gpt2", "--seq-len", "64", "--dtype", "fp32", "--mix", "a100-80gb:1,v100-16gb:1",
                     "--target", "1000", "--out", str(tmp_path)])
    text = (tmp_path / "uneven.md").read_text()
    assert "| a100-80gb:1,v100-16gb:1 | a100-80gb " in text
    cards = result["cards"]
    assert sum(c["micro_batch"] * c["grad_accum"] for c in cards) == 1000
    assert result["uneven_time"] < result["uniform_time"]  # 312 against 125 TFLOPS: the split pays

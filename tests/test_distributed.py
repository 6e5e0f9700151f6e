"""The lockstep probe across real processes: gloo on localhost, a simulated budget per rank.

Four process groups in all (each import of torch costs seconds on a shared CPU):

* world 3, started like torchrun starts workers (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT
  in the environment), budgets 4, 3.5 and 3 MiB: every rank returns the minimum, the trial
  sequences agree, DDP costs its gradient buckets and the probe reports that figure;
* world 2, rank 1's batch builder raises a ValueError mid-search: both ranks exit non-zero
  with that error, well within the bound;
* the two commands of ``docs/distributed.md``: real torchrun, and ``spawn_local`` (no launcher).

The same file is the worker: ``python tests/test_distributed.py CASE OUT`` with the rank in the
environment. Every group has a hard timeout in the parent, so nothing here can hang.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from unittest import mock
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # as a worker script, the repository root is not on the path
    sys.path.insert(0, str(ROOT))

from autobatch import SimulatedBackend, probe  # noqa: E402
from autobatch.distributed import (  # noqa: E402
    is_launched, probe_distributed, process_group, rank_env,
)
from autobatch.errors import AutobatchError, ConfigError  # noqa: E402
from autobatch.estimating.prior import try_trace_prior  # noqa: E402
from autobatch.pipeline import trace_prior_for  # noqa: E402
from tests.tiny import TinyLM, lm_workload  # noqa: E402

KIB = 1024
BASE, STEP = 4096 * KIB, 512 * KIB  # rank r probes a device of BASE - r * STEP bytes
TIMEOUT_S = 90  # hard bound per process group, start-up included (15-30 s unloaded; the CPU is shared)


def budget(rank: int) -> int:
    return BASE - rank * STEP


# --- the worker side ------------------------------------------------------------------------


def _case_budgets(out: Path) -> None:
    rank = rank_env().rank
    torch.manual_seed(rank)  # different weights per rank: DDP's broadcast must not leak into the user's model
    model = TinyLM()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with process_group("gloo", timeout_s=30):
        work = lm_workload(model)
        plain = probe_distributed(work, SimulatedBackend(budget(rank)), wrap=None)
        ddp = probe_distributed(work, SimulatedBackend(budget(rank)), wrap="ddp")
        # Each rank's prior a little different: the ranks must still read one and the same.
        traced = try_trace_prior(work, device_type="cpu")  # the ranks train on the CPU
        led = probe_distributed(work, SimulatedBackend(budget(rank)), wrap=None,
                                prior=lambda b: traced(b) + rank * 4096)
        backend = SimulatedBackend(budget(rank))
        # find's own prior on the CPU: traced between the trials, which a search in lockstep asks outright
        between = probe_distributed(work, backend, wrap=None, prior=trace_prior_for(work, backend))
    restored = all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    out.joinpath(f"rank{rank}.json").write_text(json.dumps(
        {"plain": plain.to_dict(), "ddp": ddp.to_dict(), "led": led.to_dict(), "between": between.to_dict(), "restored": restored,
         "text": str(ddp)}))


def _case_error(out: Path) -> None:
    rank = rank_env().rank

    def make_batch(b: int):
        if rank == 1 and b > 1:
            raise ValueError(f"boom on rank 1 at batch {b}")
        return torch.randint(0, 128, (b, 32)), torch.randint(0, 128, (b, 32))

    work = lm_workload()
    work = type(work)(work.model, make_batch, loss_fn=work.loss_fn, name="lm")
    with process_group("gloo", timeout_s=30):
        probe_distributed(work, SimulatedBackend(budget(rank)))


# --- the test side --------------------------------------------------------------------------


def cpu_env() -> dict[str, str]:
    """The environment for worker processes: gloo on the CPU with simulated budgets, even where GPUs exist.

    The example and the workers pick NCCL and ``cuda:<rank>`` whenever CUDA is available; these
    tests are about simulated budgets, so the GPUs are hidden from them.
    """
    return {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1",
            "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(case: str, world: int, out: Path) -> tuple[list[subprocess.CompletedProcess], float]:
    """Start ``world`` workers the way torchrun does; wait at most TIMEOUT_S for all of them."""
    port = _free_port()
    procs = []
    for rank in range(world):
        env = {
            **cpu_env(), "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        }
        procs.append(subprocess.Popen([sys.executable, __file__, case, str(out)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    start, done = time.monotonic(), []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=max(1.0, TIMEOUT_S - (time.monotonic() - start)))
            done.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    except subprocess.TimeoutExpired:
        pytest.fail(f"{case}: the {world} workers did not all finish within {TIMEOUT_S} s")
    finally:
        for p in procs:  # only the processes started here
            if p.poll() is None:
                p.kill()
                p.wait()
    return done, time.monotonic() - start


@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("budgets")
    done, _ = launch("budgets", 3, out)
    assert all(p.returncode == 0 for p in done), "\n".join(p.stderr[-3000:] for p in done)
    return [json.loads(out.joinpath(f"rank{r}.json").read_text()) for r in range(3)]


def test_every_rank_returns_the_minimum_over_ranks(three_ranks: list[dict]) -> None:
    alone = probe(lm_workload(), SimulatedBackend(budget(2)))  # the smallest device, probed by itself
    for result in three_ranks:
        assert result["plain"]["max_batch"] == alone.max_batch
        assert result["plain"]["limiting_ranks"] == [2]
        assert result["plain"]["capacity_bytes"] == budget(2)
    assert len({json.dumps(r["ddp"], sort_keys=True) for r in three_ranks}) == 1  # the same answer everywhere


def test_trial_sequences_are_identical_on_all_ranks(three_ranks: list[dict]) -> None:
    for key in ("plain", "ddp", "led", "between"):
        agreed = [[t["batch"] for t in r[key]["trials"]] for r in three_ranks]
        assert agreed[0] == agreed[1] == agreed[2]
        local = [[t["batch"] for t in rank["trials"]] for rank in three_ranks[0][key]["ranks"]]
        assert local == [agreed[0]] * 3  # each rank ran exactly the agreed sequence


def test_the_trace_leads_every_rank_to_the_same_answer_in_no_more_trials(three_ranks: list[dict]) -> None:
    plain, led = three_ranks[0]["plain"], three_ranks[0]["led"]
    assert led["max_batch"] == plain["max_batch"] and led["limiting_ranks"] == [2]
    assert [(t["batch"], t["fits"]) for t in led["trials"]] == [(1, True), (24, True), (30, True), (31, False)]
    assert [(t["batch"], t["fits"]) for t in plain["trials"]] == [(1, True), (12, True), (30, True), (31, False)]
    for rank in three_ranks:  # the trace run between the trials, asked outright by every rank alike: it led
        between = rank["between"]
        assert between["max_batch"] == plain["max_batch"]
        assert between["trace_prior"]["led"] is True and between["trace_prior"]["between"] is True


def test_the_report_says_what_each_rank_could_do_alone(three_ranks: list[dict]) -> None:
    ranks = three_ranks[0]["plain"]["ranks"]
    assert [r["device"]["capacity_bytes"] for r in ranks] == [budget(r) for r in range(3)]
    assert ranks[2]["exact_max"] == three_ranks[0]["plain"]["max_batch"]
    for r in ranks[:2]:  # larger devices passed the batch that failed on rank 2; their own max is a prediction
        assert r["largest_fit"] > three_ranks[0]["plain"]["max_batch"]
        assert r["predicted_max"] >= r["largest_fit"]
    assert "limits the plan" in three_ranks[0]["text"]


def test_ddp_buckets_raise_the_peak_and_the_probe_reports_that_figure(three_ranks: list[dict]) -> None:
    plain, ddp = three_ranks[0]["plain"], three_ranks[0]["ddp"]
    assert ddp["wrapped"] == "ddp" and plain["wrapped"] is None
    param_bytes = sum(p.numel() * p.element_size() for p in TinyLM().parameters())
    first = {key: r["trials"][0] for key, r in (("plain", plain), ("ddp", ddp))}
    assert first["plain"]["batch"] == first["ddp"]["batch"] == 1
    # One bucket holds every gradient of this small model: exactly its parameters' bytes more.
    assert first["ddp"]["peak_bytes"] - first["plain"]["peak_bytes"] == param_bytes
    assert ddp["fixed_bytes"] > plain["fixed_bytes"]
    assert ddp["max_batch"] <= plain["max_batch"]


def test_the_users_model_is_restored_on_every_rank(three_ranks: list[dict]) -> None:
    assert all(r["restored"] for r in three_ranks)


def test_a_non_oom_error_on_one_rank_stops_every_rank_with_it(tmp_path: Path) -> None:
    done, seconds = launch("error", 2, tmp_path)
    assert seconds < TIMEOUT_S
    assert [p.returncode != 0 for p in done] == [True, True]
    assert "ValueError: boom on rank 1" in done[1].stderr
    assert "RankFailedError: rank 1 failed while running the trial at batch" in done[0].stderr
    assert "ValueError: boom on rank 1" in done[0].stderr


def _run_doc_command(command: list[str]) -> str:
    env = cpu_env()
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)  # the command decides whether there is a launcher, not this test's environment
    try:
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:  # subprocess.run kills the process it started
        pytest.fail(f"{' '.join(command)} did not finish within {TIMEOUT_S} s")
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def _check_doc_output(stdout: str) -> None:
    # Rank 0 alone prints: one report, limited by the smaller simulated device of rank 1.
    assert stdout.count("tiny-lm on 2 rank(s) under DDP") == 1
    assert "(limited by memory on rank 1)" in stdout
    rows = [line for line in stdout.splitlines() if line.startswith(("0 ", "1 "))]
    assert len(rows) == 2 and rows[1].endswith("exact <- limits the plan") and "predicted" in rows[0]
    assert "led by the fake-tensor trace (traced once for every batch in " in stdout  # each rank traced alike


def test_doc_command_torchrun() -> None:
    """docs/distributed.md, first command, verbatim (torchrun's module form)."""
    command = "python -m torch.distributed.run --nproc-per-node 2 docs/examples/distributed_probe.py".split()
    _check_doc_output(_run_doc_command([sys.executable, *command[1:]]))


def test_doc_command_without_a_launcher_uses_spawn_local() -> None:
    """docs/distributed.md, second command, verbatim."""
    command = "python docs/examples/distributed_probe.py --nproc 2".split()
    _check_doc_output(_run_doc_command([sys.executable, *command[1:]]))


# --- no processes needed ----------------------------------------------------------------------


def test_rank_env_reads_what_torchrun_sets() -> None:
    env = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
           "MASTER_ADDR": "node0", "MASTER_PORT": "29500"}
    assert is_launched(env) and not is_launched({})
    got = rank_env(env)
    assert (got.rank, got.world_size, got.local_rank, got.local_world_size, got.master_port) == (5, 8, 1, 4, 29500)
    assert rank_env({}).world_size == 1 and rank_env({}).is_main


def test_rank_env_reports_every_bad_variable_at_once() -> None:
    with pytest.raises(ConfigError, match="RANK must be a whole number.*MASTER_PORT must be a whole number"):
        rank_env({"RANK": "x", "WORLD_SIZE": "2", "MASTER_PORT": "p"})
    with pytest.raises(ConfigError, match="RANK must be below WORLD_SIZE \\(2\\), but got RANK=2"):
        rank_env({"RANK": "2", "WORLD_SIZE": "2"})
    for port in ("0", "70000"):  # no TCP port: the rendezvous failed later as ranks that "did not come"
        with pytest.raises(ConfigError, match=f"MASTER_PORT must be a TCP port, from 1 to 65535, but got MASTER_PORT={port}"):
            rank_env({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": port})


def test_a_port_another_process_holds_is_named_as_such_not_as_ranks_that_never_came() -> None:
    import socket

    from autobatch.distributed.launch import process_group

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        with mock.patch.dict(os.environ, env), pytest.raises(AutobatchError) as raised:
            with process_group("gloo", timeout_s=5):
                pass
    assert f"could not listen at 127.0.0.1:{port}" in str(raised.value) and "another process holds that port" in str(raised.value)


def test_worker_processes_see_no_gpu_so_they_run_gloo_on_simulated_budgets() -> None:
    assert cpu_env()["CUDA_VISIBLE_DEVICES"] == ""


def test_probe_distributed_needs_a_process_group() -> None:
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    with pytest.raises(AutobatchError, match="needs an initialized torch.distributed process group"):
        probe_distributed(lm_workload(), SimulatedBackend("1MiB"))


if __name__ == "__main__":
    {"budgets": _case_budgets, "error": _case_error}[sys.argv[1]](Path(sys.argv[2]))


def test_a_fence_whose_store_is_gone_stops_watching_without_a_thread_traceback() -> None:
    # a hung rank's log got "Exception in thread … DistNetworkError: Connection reset by peer" from the watcher
    import threading

    from autobatch.distributed.fence import TrialFence

    class Gone:
        def check(self, keys):
            raise dist.DistNetworkError("Connection reset by peer")

    fence = TrialFence.__new__(TrialFence)
    fence._stop, fence._store, fence.key = threading.Event(), Gone(), "fence/0"
    seen: list[BaseException] = []
    hook, threading.excepthook = threading.excepthook, lambda args: seen.append(args.exc_value)
    try:
        watcher = threading.Thread(target=fence._watch)
        watcher.start()
        watcher.join(5)
    finally:
        threading.excepthook = hook
    assert not watcher.is_alive() and seen == []

"""Every launcher's ranks, read as it sets them, and each rank on its own GPU.

Unit tests read each launcher's variables. The matrix then starts real processes with only the
variables each launcher sets (torchrun and ``accelerate launch``, the DeepSpeed launcher, ``srun``,
``mpirun``), each on a machine of emulated GPUs (tests/emulated_cuda.py: ``CUDA_VISIBLE_DEVICES``
as CUDA reads it, NCCL carried by gloo), and runs ``find`` as a user would: each rank must probe
its own GPU of the machine, and the plan must have the job's nodes and GPUs per node.
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from autobatch import Request, RequestError, rank_env
from autobatch.distributed.environment import RankEnv, is_launched, launcher_of
from autobatch.errors import ConfigError
from tests.emulated_cuda import EmulatedGpu, visible_gpus

ROOT = Path(__file__).resolve().parents[1]
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "LOCAL_SIZE", "CROSS_RANK",
                      "CROSS_SIZE", "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES")


# --- each launcher's variables ----------------------------------------------------------------------

def test_torchrun_and_accelerate_launch() -> None:
    env = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1",
           "MASTER_ADDR": "n0", "MASTER_PORT": "29500", "ACCELERATE_MIXED_PRECISION": "bf16"}
    assert rank_env(env) == RankEnv(5, 8, 1, 4, "n0", 29500, node_rank=1, nodes=2, launcher="torchrun")


def test_the_deepspeed_launcher_says_local_size_and_cross_rank() -> None:
    # Four ranks as 2 nodes × 2: read as 1 node × 4 before (only LOCAL_WORLD_SIZE was read).
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_SIZE": "2", "CROSS_RANK": "1", "CROSS_SIZE": "2",
           "MASTER_ADDR": "n0", "MASTER_PORT": "29500"}
    assert rank_env(env) == RankEnv(3, 4, 1, 2, "n0", 29500, node_rank=1, nodes=2, launcher="deepspeed")


def test_srun_sets_no_rank_but_its_own_names() -> None:
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NNODES": "2", "SLURM_NODEID": "1",
           "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_JOB_ID": "4071234", "SLURM_JOB_NODELIST": "gpu[07-08,11]"}
    # the rendezvous: the first node of the list, and a port every task derives from the job id
    assert rank_env(env) == RankEnv(5, 8, 1, 4, "gpu07", 15000 + 1234, node_rank=1, nodes=2, launcher="slurm")
    # MASTER_ADDR/MASTER_PORT, where the job script exports them, win
    assert rank_env({**env, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400"}).master_addr == "10.0.0.1"
    # uneven tasks per node: this node's entry
    assert rank_env({**env, "SLURM_TASKS_PER_NODE": "3,5", "SLURM_NODEID": "1"}).local_world_size == 5


def test_srun_with_one_task_or_an_interactive_shell_is_no_job() -> None:
    one = {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_LOCALID": "0"}
    shell = {"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0", "SLURM_JOB_NAME": "bash"}
    assert not is_launched(one) and not is_launched(shell) and rank_env(shell).world_size == 1


def test_mpirun() -> None:
    env = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_COMM_WORLD_NODE_RANK": "1", "MASTER_ADDR": "n0",
           "MASTER_PORT": "29500"}
    assert rank_env(env) == RankEnv(3, 4, 1, 2, "n0", 29500, node_rank=1, nodes=2, launcher="mpirun")


def test_each_launchers_bad_variable_is_named_as_it_spells_it() -> None:
    with pytest.raises(ConfigError, match=r"SLURM_PROCID must be below SLURM_NTASKS \(2\), but got SLURM_PROCID=2"):
        rank_env({"SLURM_PROCID": "2", "SLURM_NTASKS": "2"})
    with pytest.raises(ConfigError, match=r"OMPI_COMM_WORLD_LOCAL_RANK must be a whole number"):
        rank_env({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "x"})
    with pytest.raises(ConfigError, match=r"SLURM_TASKS_PER_NODE must read like 4\(x2\),3"):
        rank_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_TASKS_PER_NODE": "two"})


def test_one_visible_gpu_is_device_0_whatever_the_local_rank() -> None:
    env = rank_env({"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "3", "SLURM_NTASKS_PER_NODE": "4"})
    assert env.device_index(visible=1) == 0 and env.device_index(visible=4) == 3
    with pytest.raises(ConfigError, match="local rank is 3 but only 2 GPUs are visible"):
        env.device_index(visible=2)


@pytest.mark.parametrize("environ", [
    {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"},
    {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_SIZE": "2"},
    {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "1"},
    {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1"},
], ids=["torchrun", "deepspeed", "srun", "mpirun"])
def test_a_named_gpu_under_any_launcher_is_refused_in_one_line(monkeypatch, environ) -> None:
    _clear(monkeypatch)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    assert launcher_of() is not None
    with pytest.raises(RequestError, match=r"under a launcher every rank probes its own GPU") as caught:
        Request(model="tiny-mlp", target=8, device="cuda:1")
    assert "\n" not in str(caught.value)
    Request(model="tiny-mlp", target=8, device="cuda")  # its own GPU, without an index, is fine


def test_one_budget_per_rank_needs_a_launcher_and_one_per_rank(monkeypatch) -> None:
    _clear(monkeypatch)
    with pytest.raises(RequestError, match=r"memory='60MiB,40MiB'|memory 60MiB,40MiB gives one budget per rank, "
                                           r"which needs a launcher"):
        Request(model="tiny-mlp", target=8, device="cpu", memory="60MiB,40MiB")
    for name, value in {"RANK": "1", "WORLD_SIZE": "3", "LOCAL_RANK": "1"}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(RequestError, match="gives 2 budgets, but the launcher started 3 ranks"):
        Request(model="tiny-mlp", target=8, device="cpu", memory="60MiB,40MiB")
    request = Request(model="tiny-mlp", target=9, device="cpu", memory="60MiB,40MiB,20MiB")
    assert [request.memory_of(r) for r in range(3)] == ["60MiB", "40MiB", "20MiB"]


def test_cuda_visible_devices_as_cuda_reads_it() -> None:
    machine = [EmulatedGpu(i) for i in range(3)]
    pick = lambda setting: [g.index for g in visible_gpus(machine, setting)]  # noqa: E731
    assert pick(None) == [0, 1, 2] and pick("2,0") == [2, 0] and pick("1") == [1]
    assert pick("0,7,1") == [0] and pick("") == [] and pick("1,1") == [1] and pick("a,0") == []


# --- real processes, each with only its launcher's variables ----------------------------------------

def _clear(monkeypatch) -> None:
    for name in list(os.environ):
        if name in LAUNCHER_VARIABLES or name.startswith(("SLURM_", "OMPI_")):
            monkeypatch.delenv(name)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _slurm_job_with_free_port() -> str:
    """A job id whose derived port (15000 + its last four digits) is free here, tried in a random order (another
    pytest process looking at the same moment picks another)."""
    jobs = list(range(4242, 10000, 97))
    random.Random().shuffle(jobs)  # a generator of its own: the tests' global one is left as it was
    for job in jobs:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", 15000 + job))
            except OSError:
                continue
        return str(770000 + job)
    raise RuntimeError("no free port in 15000-24999")


def _scenarios() -> dict[str, tuple[int, list[dict[str, str]]]]:
    """Launcher → (the machine's GPUs, each rank's variables): two ranks each."""
    port = [str(_free_port()) for _ in range(3)]
    rendezvous = lambda i: {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port[i]}  # noqa: E731
    job = _slurm_job_with_free_port()
    return {
        # one node, both GPUs visible to both ranks: rank r takes GPU r
        "torchrun": (2, [{"RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": "2",
                          "GROUP_RANK": "0", **rendezvous(0)} for r in range(2)]),
        # two nodes of one GPU each, as the DeepSpeed launcher says it
        "deepspeed": (1, [{"RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_SIZE": "1",
                           "CROSS_RANK": str(r), "CROSS_SIZE": "2", **rendezvous(1)} for r in range(2)]),
        # srun --ntasks-per-node=2 --gpus-per-task=1: one GPU left to each task, local ranks 0 and 1;
        # no MASTER_ADDR/PORT: the node list and the job id give them
        "srun": (2, [{"SLURM_PROCID": str(r), "SLURM_LOCALID": str(r), "SLURM_NTASKS": "2", "SLURM_NNODES": "1",
                      "SLURM_NODEID": "0", "SLURM_TASKS_PER_NODE": "2", "SLURM_JOB_ID": job,
                      "SLURM_JOB_NODELIST": "localhost", "SLURM_JOB_NAME": "train", "CUDA_VISIBLE_DEVICES": str(r)}
                     for r in range(2)]),
        # mpirun over two nodes of one GPU each
        "mpirun": (1, [{"OMPI_COMM_WORLD_RANK": str(r), "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
                        "OMPI_COMM_WORLD_LOCAL_SIZE": "1", "OMPI_COMM_WORLD_NODE_RANK": str(r), **rendezvous(2)}
                       for r in range(2)]),
    }


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> dict[str, list[dict]]:
    """Every scenario's ranks, started together, and what each wrote."""
    base = {k: v for k, v in os.environ.items()
            if k not in LAUNCHER_VARIABLES and not k.startswith(("SLURM_", "OMPI_"))}
    base["PYTHONPATH"] = os.pathsep.join([str(ROOT), base.get("PYTHONPATH", "")])
    running = []
    for name, (machine, ranks) in _scenarios().items():
        out = tmp_path_factory.mktemp(name)
        for variables in ranks:
            running.append((name, out, subprocess.Popen(
                [sys.executable, "-m", "tests.launched_rank", str(out), str(machine)], cwd=ROOT,
                env={**base, **variables}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)))
    outputs = {}
    for name, out, process in running:
        text, _ = process.communicate(timeout=240)
        assert process.returncode == 0, f"{name}: {text[-3000:]}"
        outputs[name] = out
    return {name: [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))] for name, out in outputs.items()}


@pytest.mark.parametrize("name, launcher, gpus_used, visible, nodes, per_node", [
    ("torchrun", "torchrun", [[0], [1]], 2, 1, 2),
    ("deepspeed", "deepspeed", [[0], [0]], 1, 2, 1),
    ("srun", "slurm", [[0], [1]], 1, 1, 2),
    ("mpirun", "mpirun", [[0], [0]], 1, 2, 1),
])
def test_each_rank_probes_its_own_gpu_and_the_plan_has_the_jobs_shape(launched, name, launcher, gpus_used, visible,
                                                                      nodes, per_node) -> None:
    ranks = launched[name]
    assert [r["rank"] for r in ranks] == [0, 1]
    for rank, used in zip(ranks, gpus_used):
        assert rank["launcher"] == launcher and rank["world_size"] == 2
        assert rank["visible"] == visible
        assert rank["machine_gpus_used"] == used  # its own GPU of the machine, never another rank's
        assert (rank["plan_nodes"], rank["plan_gpus_per_node"], rank["plan_world"]) == (nodes, per_node, 2)
        assert rank["nodes"] == nodes and rank["local_world_size"] == per_node
    assert ranks[0]["micro_batch"] == ranks[1]["micro_batch"]  # every rank agrees


@pytest.mark.parametrize("name", ["torchrun", "deepspeed", "srun", "mpirun"])
def test_a_plan_that_accumulates_is_probed_again_with_the_gradients_held_by_every_rank(launched, name) -> None:
    # under a launcher it was a note only (a second rendezvous on the launcher's port hung the DeepSpeed
    # launcher's ranks), and the micro batch stayed the one found with the gradients freed
    ranks = launched[name]
    for rank in ranks:
        assert rank["grad_accum"] == 2 and rank["grads_held"], rank
        assert sum("answered again with them held" in n for n in rank["notes"]) == 1, rank
    assert ranks[0]["max_batch"] == ranks[1]["max_batch"]  # the held probe agreed too


def test_the_gradients_held_lower_a_ddp_ranks_batch_so_the_second_probe_matters() -> None:
    # what every launched rank's second probe answers, where the held gradients move it: rank 0 of two DDP
    # ranks in one process (torch's fake process group), against the freed answer every rank had kept
    import autobatch

    def rank0(held: bool) -> int:
        return autobatch.answer(autobatch.Request(model="tiny-mlp", device="cpu", memory="4MiB", headroom=0,
                                                  strategy="ddp", gpus_per_node=2, grads_held=held,
                                                  trace_prior=False)).finding.probe.max_batch

    assert rank0(True) < rank0(False)  # 572 where 647 had been answered


def test_one_budget_per_rank_on_the_command_line(monkeypatch) -> None:
    from typer.testing import CliRunner

    from autobatch.cli import app

    _clear(monkeypatch)
    result = CliRunner().invoke(app, ["find", "--model", "tiny-mlp", "--target", "8", "--device", "cpu",
                                      "--memory", "60MiB,40MiB"])
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert "--memory 60MiB,40MiB gives one budget per rank, which needs a launcher" in result.output
    result = CliRunner().invoke(app, ["find", "--model", "tiny-mlp", "--target", "8", "--device", "cpu",
                                      "--memory", "60MiB,40"])
    assert result.exit_code != 0 and "--memory needs a unit" in result.output

"""Sharded trials run on the GPU they measure, and leave no DeepSpeed group behind.

FSDP2 builds its mesh on the current GPU and DeepSpeed puts its engine on ``LOCAL_RANK``; before,
``--device cuda:1`` trained on GPU 0 and measured GPU 1. FSDP and DeepSpeed cannot run on the
emulated GPUs (they need real CUDA), so these tests stand at the boundary: the device each
wrapper is handed, on two emulated GPUs, and the groups made and destroyed, on the fake group.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch.distributed import distributed_c10d

from autobatch.distributed.fake_group import fake_process_group
from autobatch.distributed.sharded_trial import run_sharded_trial
from autobatch.probing.backends import SimulatedBackend
from autobatch.probing.probe import make_backend
from autobatch.strategy import parse_strategy
from tests import sharded_jobs
from tests.emulated_cuda import EmulatedGpu, emulated
from tests.extras import need


class Handed(Exception):
    """Raised where the wrapper would start, once what it was handed is recorded."""


@pytest.mark.parametrize("name", ["zero1", "zero2", "zero3"])
def test_every_group_deepspeed_makes_is_destroyed_with_its_trial(name: str) -> None:
    need("deepspeed")
    with fake_process_group(2):
        before = len(distributed_c10d._world.pg_map)
        for _ in range(3):
            run_sharded_trial(sharded_jobs.workload(), sharded_jobs.blocks(), parse_strategy(name),
                              SimulatedBackend("64MiB"), 2)
            assert len(distributed_c10d._world.pg_map) == before


def _gpus() -> list[EmulatedGpu]:
    return [EmulatedGpu(i, total_bytes=256 << 20, context_bytes=0) for i in range(2)]


def test_fsdp2_builds_its_mesh_and_shards_on_the_gpu_measured(monkeypatch) -> None:
    import torch.distributed.device_mesh as device_mesh
    import torch.distributed.fsdp as fsdp

    seen = {}

    def mesh(device_type, shape, **kwargs):
        seen["mesh"] = (device_type, torch.cuda.current_device())
        return object()

    def shard(module, **kwargs):
        seen["shard"] = torch.cuda.current_device()
        raise Handed

    monkeypatch.setattr(device_mesh, "init_device_mesh", mesh)
    monkeypatch.setattr(fsdp, "fully_shard", shard)
    with emulated(_gpus(), patch=monkeypatch), fake_process_group(2):
        backend = make_backend("cuda:1")
        with pytest.raises(Handed):
            run_sharded_trial(sharded_jobs.workload(), sharded_jobs.blocks(), parse_strategy("fsdp2"), backend, 2)
        after = torch.cuda.current_device()
    assert seen == {"mesh": ("cuda", 1), "shard": 1}
    assert after == 0  # the caller's current GPU, as it was


def test_deepspeed_takes_the_gpu_measured_as_its_local_rank(monkeypatch) -> None:
    need("deepspeed")
    from autobatch.distributed.zero import _deepspeed

    deepspeed = _deepspeed()
    seen = {}

    def initialize(**kwargs):
        seen.update(local_rank=os.environ.get("LOCAL_RANK"), current=torch.cuda.current_device())
        raise Handed

    monkeypatch.setattr(deepspeed, "initialize", initialize)
    monkeypatch.setenv("LOCAL_RANK", "0")  # what the fake group (or a launcher) says
    import deepspeed.runtime.zero.utils as zero_utils

    check = zero_utils.assert_ints_same_as_other_ranks
    with emulated(_gpus(), patch=monkeypatch), fake_process_group(2):
        groups = len(distributed_c10d._world.pg_map)
        with pytest.raises(Handed):
            run_sharded_trial(sharded_jobs.workload(), sharded_jobs.blocks(), parse_strategy("zero2"),
                              make_backend("cuda:1"), 2)
        assert len(distributed_c10d._world.pg_map) == groups
        after = torch.cuda.current_device()
    assert seen == {"local_rank": "1", "current": 1}
    # a failed initialize leaves nothing changed: LOCAL_RANK, the current GPU, DeepSpeed's rank checks
    assert os.environ["LOCAL_RANK"] == "0" and after == 0
    assert zero_utils.assert_ints_same_as_other_ranks is check


def test_under_srun_deepspeed_gets_the_local_rank_srun_gave(monkeypatch) -> None:
    # srun sets SLURM_LOCALID and no LOCAL_RANK, which DeepSpeed requires ("DeepSpeed requires the
    # LOCAL_RANK environment variable"): the trial lends it for the engine's setup, then takes it back.
    need("deepspeed")
    from autobatch.distributed.zero import _deepspeed

    deepspeed = _deepspeed()
    seen = {}

    def initialize(**kwargs):
        seen["local_rank"] = os.environ.get("LOCAL_RANK")
        raise Handed

    monkeypatch.setattr(deepspeed, "initialize", initialize)
    for name, value in {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1",
                        "SLURM_NTASKS_PER_NODE": "2"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with fake_process_group(4, rank=3):
        os.environ.pop("LOCAL_RANK", None)  # the fake group lends its own; srun would not have
        with pytest.raises(Handed):
            run_sharded_trial(sharded_jobs.workload(), sharded_jobs.blocks(), parse_strategy("zero2"),
                              SimulatedBackend("64MiB"), 2)
        assert "LOCAL_RANK" not in os.environ
    assert seen == {"local_rank": "1"}

"""A model already on the GPU waits in host memory while sharded trials run, and comes back bit for bit.

Each sharded trial wraps its own copy; the user's model left on the GPU beside it would hold a
whole unsharded copy the job never holds. The emulated GPUs cannot show this (their tensors say
``cpu``), so the move itself is checked on a real GPU, and the parts that run anywhere here.
"""

from __future__ import annotations

import pytest
import torch

import autobatch
from autobatch.distributed.sharded_trial import off_the_gpu
from autobatch.distributed.simulated_world import probe_sharded
from autobatch.probing.backends import CudaBackend
from tests import sharded_jobs


def test_a_model_in_host_memory_is_left_as_it_is() -> None:
    model = sharded_jobs.blocks()
    storages = [p.untyped_storage().data_ptr() for p in model.parameters()]
    with off_the_gpu(model):
        pass
    assert [p.untyped_storage().data_ptr() for p in model.parameters()] == storages


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_model_on_the_gpu_is_not_counted_beside_its_shards_and_comes_back() -> None:
    model = sharded_jobs.blocks().cuda()
    params = list(model.parameters())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with off_the_gpu(model):
        assert all(p.device.type == "cpu" for p in model.parameters())
    on_gpu = probe_sharded(autobatch.Workload(model, sharded_jobs.long_batch), CudaBackend("cuda"), "fsdp2", 2,
                           max_batch=64)
    on_host = probe_sharded(autobatch.Workload(sharded_jobs.blocks(), sharded_jobs.long_batch), CudaBackend("cuda"),
                            "fsdp2", 2, max_batch=64)
    assert on_gpu.max_batch == on_host.max_batch
    assert list(model.parameters()) == params and all(p.device.type == "cuda" for p in params)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())

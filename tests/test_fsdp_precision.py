"""FSDP in bf16 or fp16 trains with the mixed precision the frameworks that launch it set, as they set it.

accelerate, Lightning and the HF Trainer (through accelerate) wrap FSDP with ``param_dtype`` and
``reduce_dtype`` the run's dtype. Traced with autocast alone, the bf16 copies autocast makes of
the gathered fp32 weights are saved for backward, where FSDP cannot free them.
"""

from __future__ import annotations

import pytest
import torch

import autobatch
from autobatch.distributed.fake_group import fake_process_group
from autobatch.distributed.traced_trials import OneWrapper
from autobatch.distributed import sharding
from autobatch.estimating.fake_backends import fake_backend
from autobatch.strategy import parse_strategy
from tests import sharded_jobs
from tests.extras import need
from tests.ranks import slow


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_the_policies_are_accelerates_and_lightnings_own(dtype):
    need("accelerate")
    from accelerate.utils import FullyShardedDataParallelPlugin

    work = autobatch.Workload(sharded_jobs.blocks, sharded_jobs.batch, dtype=dtype)
    ours = {1: sharding._fsdp1_precision(work), 2: sharding._fsdp2_precision(work)}
    for version in (1, 2):
        plugin = FullyShardedDataParallelPlugin(fsdp_version=version)
        plugin.set_mixed_precision(dtype)  # what accelerate does for `mixed_precision: bf16` next to FSDP
        assert ours[version] == plugin.mixed_precision_policy, version
    need("lightning")
    from lightning.fabric.plugins.precision.fsdp import FSDPPrecision

    assert ours[1] == FSDPPrecision({"bf16": "bf16-mixed", "fp16": "16-mixed"}[dtype]).mixed_precision_config
    fp32 = autobatch.Workload(sharded_jobs.blocks, sharded_jobs.batch)
    assert sharding._fsdp1_precision(fp32) is None
    assert sharding._fsdp2_precision(fp32) == torch.distributed.fsdp.MixedPrecisionPolicy()


class _Seen(torch.nn.Module):
    """A block that records the dtype of the weight its forward computes with."""

    seen: list[torch.dtype] = []

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(sharded_jobs.WIDTH, sharded_jobs.WIDTH)

    def forward(self, x):
        _Seen.seen.append(self.linear.weight.dtype)
        return torch.relu(self.linear(x))


@pytest.mark.parametrize("name", ["fsdp2", pytest.param("fsdp1", marks=slow("FSDP1's policy is checked against "
                                                                              "accelerate's and Lightning's above (~2 s)"))])
def test_a_traced_step_computes_with_gathered_bf16_weights_and_holds_less(name, monkeypatch):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        model = torch.nn.Sequential(*[_Seen() for _ in range(4)])
    work = autobatch.Workload(model, sharded_jobs.batch, dtype="bf16")

    def peak() -> int:
        _Seen.seen.clear()
        with fake_process_group(4):
            one = OneWrapper(work, model, parse_strategy(name), fake_backend(model, 1 << 40, fused_attention=False))
            try:
                return one(8).trial.peak_bytes
            finally:
                one.close()

    mixed = peak()
    assert set(_Seen.seen) == {torch.bfloat16}
    # autocast alone, as before: it computes in bf16 from fp32 weights and keeps its copies for backward
    monkeypatch.setattr(sharding, "_fsdp2_precision", lambda w: torch.distributed.fsdp.MixedPrecisionPolicy())
    monkeypatch.setattr(sharding, "_fsdp1_precision", lambda w: None)
    alone = peak()
    assert set(_Seen.seen) == {torch.float32}
    assert mixed < alone


def test_fsdp2_in_bf16_on_fake_tensors_takes_the_same_trials_as_real_steps():
    _, real = sharded_jobs.fake_and_real("fsdp2", 150_000, dtype="bf16")
    assert real.max_batch >= 2

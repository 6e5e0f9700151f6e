"""DDP traced on fake tensors: its buckets, without its reducer, equal the real wrapper byte for byte."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from autobatch import SimulatedBackend
from autobatch.distributed.fake_group import fake_process_group
from autobatch.distributed.ddp import traced_buckets
from autobatch.distributed.simulated_world import probe_sharded
from autobatch.estimating.estimate import fake_model
from autobatch.estimating.fake_backends import _new_fake_mode, fake_backend
from tests.tiny import cnn_workload, lm_workload, mlp_workload


def _multi_tensor(params):  # the step a GPU takes (foreach), on both sides: the trace steps as on a GPU
    return torch.optim.AdamW(params, foreach=True)


@pytest.mark.parametrize("make", [mlp_workload, lm_workload, cnn_workload])
def test_ddp_traced_on_fake_tensors_equals_the_real_wrapper_at_every_batch(make):
    work = replace(make(), optimizer=_multi_tensor)
    real = probe_sharded(work, SimulatedBackend("3MiB"), "ddp", world_size=4, headroom=0)
    fake = replace(work, model=fake_model(work.model, _new_fake_mode()))
    traced = probe_sharded(fake, fake_backend(fake.model, 3 << 20, fused_attention=False, cuda_autocast=False),
                           "ddp", world_size=4, headroom=0)
    assert traced.max_batch == real.max_batch
    by_batch = {t.batch: t for t in real.trials}
    for t in traced.trials:  # the batches both tried: the same peaks, phase by phase
        if t.batch in by_batch:
            r = by_batch[t.batch]
            assert (t.peak_bytes, t.forward_backward_bytes, t.optimizer_bytes) == (
                r.peak_bytes, r.forward_backward_bytes, r.optimizer_bytes)
    assert traced.extra["sharding"]["per_rank"] == real.extra["sharding"]["per_rank"]


class _TwoDtypes(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 2048),
                                        torch.nn.Linear(2048, 1024))
        self.side = torch.nn.Linear(4, 4).to(torch.bfloat16)
        self.body[1].bias.requires_grad_(False)  # frozen: no bucket room

    def forward(self, x, z):
        return self.body(x).sum() + self.side(z).float().sum()


def test_ddps_buckets_are_the_real_reducers_in_its_steady_steps():
    from autobatch.distributed.sharding import _bucket_as_is

    with fake_process_group(2):
        model = _TwoDtypes()
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        ddp.register_comm_hook(None, _bucket_as_is)
        for _ in range(2):  # the reducer rebuilds its buckets after the first step
            ddp(torch.randn(2, 1024), torch.randn(2, 4, dtype=torch.bfloat16)).backward()
        real = [(b.buffer().numel(), b.buffer().dtype) for b in ddp.reducer._get_zeros_like_grad_buckets()]
        traced = [(b.numel(), b.dtype) for b in traced_buckets(model)]

    def per_dtype(buckets):
        return {dtype: sum(n for n, d in buckets if d == dtype) for _, dtype in buckets}

    # The same bytes in each dtype, the frozen bias in none, and as many buckets: a first one of at
    # most 1 MiB, then up to 25 MiB (which parameters share one follows the order gradients arrive in,
    # which autograd does not fix, so the split itself is not compared).
    assert per_dtype(traced) == per_dtype(real) == {torch.bfloat16: 20, torch.float32: 2098176 + 3146752}
    assert len(traced) == len(real) == 3


def test_an_estimate_traces_a_module_passed_in_under_every_strategy_and_leaves_it_as_it_was():
    from autobatch import Request, answer
    from tests.tiny import mlp

    torch.manual_seed(0)
    model = mlp()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    report = answer(Request(model=model, make_batch=lambda b: (torch.randn(b, 64), torch.randint(0, 10, (b,))),
                            gpu_memory="600MiB", estimate=True, gpus_per_node=4, strategy="ddp,fsdp2", max_micro=64))
    assert [row.probe.device.kind for row in report.rows] == ["fake", "fake"]  # no real step on this CPU
    ddp, fsdp2 = (row.probe.extra["sharding"]["per_rank"] for row in report.rows)
    assert ddp["buffers"] == ddp["parameters"] == 4 * sum(p.numel() for p in model.parameters())
    assert fsdp2["parameters"] < ddp["parameters"]
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(not isinstance(p, torch._subclasses.fake_tensor.FakeTensor) for p in model.parameters())


@pytest.mark.parametrize("memory,says", [("100MiB", "must exceed its CUDA context"),
                                         ("520MiB", "must exceed the libraries' workspaces")])
def test_a_card_its_context_and_workspaces_fill_fails_every_strategy_with_one_line(memory, says):
    from autobatch import Request, answer
    from autobatch.errors import AutobatchError

    for strategy in ("ddp", "fsdp2"):
        with pytest.raises(AutobatchError, match=says):
            answer(Request(model="tiny-mlp", gpu_memory=memory, estimate=True, gpus_per_node=4, strategy=strategy))

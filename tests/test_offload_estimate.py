"""ZeRO offload estimated on fake tensors: the GPU's tensors on cpu:0, the host's on cpu, counted apart.

DeepSpeed's own engine runs the steps; what it keeps on its device counts, what it offloads does
not. Each term is checked against a hand count of the model, and the state's place against the
engine's own tensors.
"""

from __future__ import annotations

import pytest
import torch

from autobatch.distributed.fake_group import fake_process_group
from autobatch.distributed.traced_trials import OneWrapper
from autobatch.errors import AutobatchError
from autobatch.estimating.fake_backends import GPU_APART, fake_backend
from autobatch.probing.workload import Workload
from autobatch.strategy import Strategy
from tests.extras import need

H, W = 128, 4


def pairs() -> torch.nn.Module:
    # hidden (the widest Linear input) 2H: DeepSpeed's reduce bucket 4H² elements; the largest parameter 2H²
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(H, 2 * H, bias=False), torch.nn.ReLU(),
                                                     torch.nn.Linear(2 * H, H, bias=False)) for _ in range(2)])


P, LARGEST = 8 * H * H, 2 * H * H  # parameters, and the largest one's elements


@pytest.fixture(scope="module")
def work():
    need("deepspeed")
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        model = pairs()
    return Workload(model, lambda b: torch.randn(b, 8, H), dtype="bf16")


def trial(work, strategy: Strategy, batch: int = 4):
    """Rank 0 of W's trial (two steps), its terms, and where the engine keeps its optimizer's state and
    its fp32 master partitions."""
    backend = fake_backend(work.model, 1 << 40, host_apart=strategy.offload is not None)
    with fake_process_group(W):
        one = OneWrapper(work, work.model, strategy, backend)
        try:
            done = one(batch)
            engine_optimizer = one.wrapped.optimizer
            inner = engine_optimizer.optimizer  # the torch optimizer DeepSpeed steps
            state = [t.device for s in inner.state.values() for t in s.values() if t.dim() > 0]
            flat = (getattr(engine_optimizer, "single_partition_of_fp32_groups", None)  # ZeRO-1/2
                    or engine_optimizer.fp32_partitioned_groups_flat)  # ZeRO-3
            masters = [t.device for t in flat]
        finally:
            one.close()
    from deepspeed.accelerator import get_accelerator

    assert get_accelerator().current_device_name() == "cpu"  # its own device again once the wrapper closed
    return done, set(state), set(masters)


def test_zero2_offload_keeps_no_master_weights_or_state_on_the_gpu(work):
    kept, kept_state, kept_masters = trial(work, Strategy("zero2"))
    moved, moved_state, moved_masters = trial(work, Strategy("zero2", offload="optimizer"))
    # without offload: bf16 weights, the fp32 master partition and AdamW's two moments on the GPU
    assert kept.breakdown.parameters == 2 * P
    assert kept.breakdown.buffers == 4 * P // W
    assert 0 <= kept.breakdown.optimizer_state - 8 * P // W < 64  # and the step counts
    assert kept_state == kept_masters == {torch.device("cpu")}  # one device: the trace's host is not apart
    # offloaded: the masters and the moments on the host; the GPU keeps its bf16 weights and DeepSpeed's
    # gradient buffer for the copy to the host, the largest parameter's size in bf16
    assert moved.breakdown.parameters == 2 * P
    assert moved.breakdown.buffers == 2 * LARGEST
    assert moved.breakdown.optimizer_state == 0
    assert moved_state == moved_masters == {torch.device("cpu")}
    assert moved.trial.peak_bytes < kept.trial.peak_bytes - 4 * P // W


def test_zero3_offload_of_parameters_keeps_only_what_a_step_gathers(work):
    optimizer, _, _ = trial(work, Strategy("zero3", offload="optimizer"))
    params, state, masters = trial(work, Strategy("zero3", offload="params"))
    # the bf16 partition stays on the GPU with the optimizer offloaded; with the parameters, it goes too
    assert optimizer.breakdown.parameters == 2 * P // W
    assert params.breakdown.parameters == 0
    assert optimizer.breakdown.optimizer_state == params.breakdown.optimizer_state == 0
    assert state == masters == {torch.device("cpu")}
    assert params.trial.peak_bytes < optimizer.trial.peak_bytes


def test_a_tensor_made_from_data_lands_on_the_gpu_apart_and_a_scalar_keeps_its_value():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        model = torch.nn.Linear(4, 4)
    backend = fake_backend(model, 1 << 30, host_apart=True)
    assert backend.device == GPU_APART
    with backend.track():
        keys = torch.empty(2, 3, device=GPU_APART)
        cache = torch.tensor([], device=keys.device)  # as transformers' cache starts
        assert torch.cat([cache, keys.flatten()]).device == GPU_APART
        assert int(torch.tensor(7, device=GPU_APART)) == 7
        host = torch.empty(1000)  # the host's: not counted
    assert backend.peak().allocated == 2 * 3 * 4 + 6 * 4


@pytest.mark.parametrize("strategy", [Strategy("zero3", offload="optimizer"), Strategy("fsdp2", offload="params"),
                                      Strategy("fsdp1", offload="params")])
def test_real_cpu_steps_still_refuse_offload_and_name_the_estimate(strategy):
    from autobatch import SimulatedBackend
    from autobatch.distributed.simulated_world import probe_sharded

    asked = f"autobatch estimate --model pairs --gpus 4 --strategy {strategy.name} --offload {strategy.offload}"
    with pytest.raises(AutobatchError, match=asked):
        probe_sharded(Workload(pairs, lambda b: torch.randn(b, H), name="pairs"), SimulatedBackend("1GiB"), strategy, 4)


def test_estimate_offload_from_the_command_line_answers_with_the_state_on_the_host():
    import json

    from typer.testing import CliRunner

    from autobatch.cli import app

    need("deepspeed")
    res = CliRunner().invoke(app, ["estimate", "--model", "tiny-mlp", "--gpu-memory", "600MiB", "--gpus", "4",
                                   "--strategy", "zero2", "--offload", "optimizer", "--max-batch", "2", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    sharding = out["probe"]["sharding"]
    assert out["estimated"] is True and out["probe"]["device"]["kind"] == "fake"
    assert sharding["strategy"]["offload"] == "optimizer"
    assert sharding["deepspeed_zero_optimization"]["offload_optimizer"] == {"device": "cpu"}
    assert sharding["per_rank"]["optimizer_state"] == 0 < sharding["per_rank"]["parameters"]
    assert out["trained_with"] == {"precision": None, "grad_checkpointing": False}


def test_offload_on_a_list_without_zero_names_every_strategy_it_was_given():
    from autobatch.strategy import parse_strategies

    with pytest.raises(AutobatchError, match=r"^offload='optimizer' applies to none of ddp, fsdp2; add zero1, zero2 "
                                             r"or zero3 to the strategies, or drop offload$"):
        parse_strategies("ddp,fsdp2", offload="optimizer")
    assert [s.label for s in parse_strategies("ddp,zero2", offload="optimizer")] == ["ddp", "zero2+offload-optimizer"]


# --- FSDP2's CPUOffloadPolicy ----------------------------------------------------------------------


def fsdp_trial(name: str, dtype: str, offload: str | None, batch: int = 4):
    """Rank 0 of W's FSDP trial, and the devices of its sharded parameters and optimizer state."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        model = pairs()
    work = Workload(model, lambda b: torch.randn(b, 8, H), dtype=dtype)
    backend = fake_backend(work.model, 1 << 40, host_apart=offload is not None)
    with fake_process_group(W):
        one = OneWrapper(work, work.model, Strategy(name, offload=offload), backend)
        try:
            done = one(batch)
            params = [getattr(p, "to_local", lambda p=p: p)() for p in one.wrapped.module.parameters()]
            places = ({p.device for p in params},
                      {t.device for s in one.wrapped.optimizer.state.values() for t in s.values() if t.dim() > 0})
        finally:
            one.close()
    return done, places


@pytest.mark.parametrize("name, dtype", [("fsdp2", "fp32"), ("fsdp2", "bf16"), ("fsdp1", "fp32"), ("fsdp1", "bf16")])
def test_fsdp_offload_keeps_no_shard_gradient_or_state_on_the_gpu_only_what_a_step_gathers(name, dtype):
    from torch._subclasses.fake_tensor import FakeTensor

    kept, (params, state) = fsdp_trial(name, dtype, None)
    moved, (moved_params, moved_state) = fsdp_trial(name, dtype, "params")
    # on the device: the fp32 shard, its gradient (held between steps) and AdamW's two moments, by hand
    assert kept.breakdown.parameters == 4 * P // W
    held = 8 + (4 if name == "fsdp1" else 0)  # FSDP1 keeps its flat gradient shard between steps too
    assert 0 <= kept.breakdown.optimizer_state - held * P // W < 64  # and the step counts
    assert params == state == {torch.device("cpu")}  # one device: the trace's host is not apart
    # offloaded: all three on the host; the device keeps nothing of them between steps
    assert moved.breakdown.parameters == moved.breakdown.gradients == moved.breakdown.optimizer_state == 0
    assert moved_params == moved_state == {torch.device("cpu")}
    # a step still gathers one unit at a time onto the device, with the same activations; the shards it
    # copies over to gather and the gradient shards it copies back are the device's for a while (a unit:
    # one of the two blocks; a fp32 shard of it 4 * P / 2 / W bytes): FSDP2 holds at most two such
    # copies at once, FSDP1 each unit's shard and gradient shard until backward ends (four)
    state_kept = kept.breakdown.parameters + kept.breakdown.gradients + kept.breakdown.optimizer_state
    copies = moved.trial.peak_bytes - (kept.trial.peak_bytes - state_kept)
    assert 0 < copies <= (2 if name == "fsdp2" else 4) * (4 * P // 2 // W)
    # what FSDP1's offload needed on fake tensors went with its wrapper
    assert "data" not in vars(FakeTensor) and "synchronize" not in vars(torch.cpu.Stream)
    assert torch.Tensor.pin_memory is torch._C.TensorBase.pin_memory


def test_estimate_fsdp2_offload_from_the_command_line_and_the_configs_that_train_so(tmp_path):
    import json

    import yaml
    from typer.testing import CliRunner

    from autobatch.cli import app

    args = ["estimate", "--model", "tiny-gpt2", "--gpu-memory", "600MiB", "--gpus", "4", "--strategy", "fsdp2",
            "--max-micro", "8"]
    runner = CliRunner()
    res = runner.invoke(app, [*args, "--offload", "params", "--json", "--target", "64", "--accelerate", str(tmp_path / "a.yaml"),
                              "--hf", str(tmp_path / "hf.json")])
    assert res.exit_code == 0, res.output
    per_rank = json.loads(res.stdout)["probe"]["sharding"]["per_rank"]
    kept = json.loads(runner.invoke(app, [*args, "--json"]).stdout)["probe"]["sharding"]["per_rank"]
    assert per_rank["parameters"] == per_rank["gradients"] == per_rank["optimizer_state"] == 0 < kept["parameters"]
    assert yaml.safe_load((tmp_path / "a.yaml").read_text())["fsdp_config"]["fsdp_offload_params"] is True
    assert json.loads((tmp_path / "hf.json").read_text())["fsdp_config"]["cpu_offload"] is True
    text = runner.invoke(app, [*args, "--offload", "params"]).stdout
    assert "fsdp2+offload-params" in text
    assert "against its usable 100 MiB, 600 MiB less its 500 MiB CUDA context" in text  # where the 500 MiB went
    assert "strategy=ModelParallelStrategy(data_parallel_size=4, tensor_parallel_size=1)), DataLoader(batch_size=8); " \
           "configure_model: fully_shard(each GPT2Block, then the module, mesh=self.device_mesh['data_parallel'], " \
           "offload_policy=CPUOffloadPolicy())" in text

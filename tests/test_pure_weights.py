"""--dtype bf16-true / fp16-true: the weights, their gradients and the optimizer's state in that dtype.

Lightning's ``bf16-true`` and torchtune's ``dtype: bf16`` train so: no fp32 copy anywhere, no
autocast. Each term is counted by hand on the tiny MLP (85,002 parameters).
"""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

import autobatch
from autobatch.cli import app
from autobatch.errors import AutobatchError
from autobatch.estimating.estimate import fake_model, trace_trial
from autobatch.estimating.fake_backends import _new_fake_mode
from autobatch.models import load_model
from autobatch.probing.workload import weights_dtype

P = 85_002  # tiny-mlp's parameters, in 6 tensors (3 weights, 3 biases)


def _mlp(dtype: str) -> autobatch.Workload:
    return load_model("tiny-mlp", weights=weights_dtype(dtype)).to_workload(dtype=dtype)


@pytest.mark.parametrize(("dtype", "size"), [("bf16-true", 2), ("fp16-true", 2), ("fp32", 4)])
def test_what_stays_between_steps_is_weights_and_moments_in_the_weights_dtype(dtype, size):
    work = _mlp(dtype)
    assert {p.dtype for p in work.model.parameters()} == {weights_dtype(dtype) or torch.float32}
    trial = autobatch.run_trial(work, work.model, autobatch.SimulatedBackend(1 << 30), 8)
    # the weights and AdamW's two moments, each `size` bytes a parameter, and a 4-byte step count per tensor
    assert trial.resident_bytes == 3 * size * P + 6 * 4
    assert torch.get_default_dtype() == torch.float32  # built in bf16, the default put back


def test_the_trace_equals_real_steps_and_inputs_take_the_weights_dtype():
    work = _mlp("bf16-true")
    mode = _new_fake_mode()
    model = fake_model(lambda: load_model("tiny-mlp", weights=torch.bfloat16).model, mode)
    for batch in (2, 64):
        real = autobatch.run_trial(work, work.model, autobatch.SimulatedBackend(1 << 30), batch)
        traced = trace_trial(work, model, batch, fake_mode=mode, fused_attention=False, cuda_autocast=False)
        assert (traced.peak_bytes, traced.resident_bytes) == (real.peak_bytes, real.resident_bytes), batch


def test_a_factory_is_built_in_the_dtype_and_a_module_must_hold_it():
    factory = autobatch.Workload(lambda: torch.nn.Linear(8, 2), lambda b: torch.randn(b, 8), dtype="bf16-true")
    assert factory.model().weight.dtype == torch.bfloat16 and torch.get_default_dtype() == torch.float32
    from dataclasses import replace

    assert replace(factory, dtype="fp16-true").model().weight.dtype == torch.float16  # rebuilt for the new dtype
    assert replace(factory, dtype="bf16").model().weight.dtype == torch.float32  # autocast: fp32 weights
    with pytest.raises(AutobatchError, match=r"bf16-true trains bfloat16 weights, but the model passed in holds "
                                             r"float32 ones; cast it first \(model.to\(torch.bfloat16\)\)"):
        autobatch.Workload(torch.nn.Linear(8, 2), lambda b: torch.randn(b, 8), dtype="bf16-true")
    held = autobatch.Workload(torch.nn.Linear(8, 2).to(torch.bfloat16), lambda b: torch.randn(b, 8), dtype="bf16-true")
    assert autobatch.run_trial(held, held.model, autobatch.SimulatedBackend(1 << 20), 4).fits


def test_the_cli_plans_it_and_writes_lightnings_precision_and_no_mixed_precision(tmp_path):
    runner = CliRunner()
    res = runner.invoke(app, ["find", "--model", "tiny-mlp", "--dtype", "bf16-true", "--device", "cpu", "--memory",
                              "2MiB", "--json", "--hf", str(tmp_path / "hf.json"), "--accelerate", str(tmp_path / "a.yaml")])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["trained_with"] == {"precision": "bf16-true", "grad_checkpointing": False}
    fp32 = json.loads(runner.invoke(app, ["find", "--model", "tiny-mlp", "--device", "cpu", "--memory", "2MiB",
                                          "--json"]).stdout)
    assert out["max_batch"] > 2 * fp32["max_batch"]  # activations and state at half the bytes
    hf = json.loads((tmp_path / "hf.json").read_text())
    assert "bf16" not in hf and "fp16" not in hf  # the Trainer trains a bf16 model as it is: no autocast asked
    assert "mixed_precision: bf16" not in (tmp_path / "a.yaml").read_text()
    text = runner.invoke(app, ["find", "--model", "tiny-mlp", "--dtype", "bf16-true", "--device", "cpu", "--memory",
                               "2MiB"]).stdout  # the HF Trainer trains in the model's dtype: say how to load it
    assert "weights: bf16-true was probed with the model itself in torch.bfloat16: load it so " \
           "(from_pretrained(..., dtype=torch.bfloat16), or model.to(torch.bfloat16)), with no autocast" in text
    assert "weights:" not in runner.invoke(app, ["find", "--model", "tiny-mlp", "--dtype", "bf16", "--device", "cpu",
                                                 "--memory", "2MiB"]).stdout
    from autobatch.configs.lightning import lightning_settings
    from autobatch.planning.plan import Plan

    assert lightning_settings(Plan(4, 1), precision="bf16-true")["trainer"]["precision"] == "bf16-true"
    est = runner.invoke(app, ["estimate", "--model", "tiny-mlp", "--dtype", "fp16-true", "--gpu-memory", "600MiB",
                              "--max-micro", "64", "--json"])
    assert est.exit_code == 0, est.output
    assert json.loads(est.stdout)["max_batch"] == 64


def test_zero_with_pure_weights_is_one_line_naming_the_fix():
    res = CliRunner().invoke(app, ["estimate", "--model", "tiny-mlp", "--dtype", "bf16-true", "--gpus", "4",
                                   "--strategy", "zero2"])
    assert res.exit_code == 2
    assert "--dtype bf16-true trains pure low-precision weights, but DeepSpeed keeps fp32 master weights beside " \
           "them; use --dtype bf16 with ZeRO" in res.output


def test_a_batch_is_made_in_the_weights_dtype_so_a_simulated_budget_holds_no_fp32_copy():
    # Made in fp32 and cast, the batch held both copies on a simulated budget (the host is the device):
    # a linear model whose input dominates answered 2531 in bf16 where fp32 answered 2573.
    def work(dtype, model):
        return autobatch.Workload(model, lambda b: (torch.randn(b, 64), torch.randint(0, 10, (b,))), dtype=dtype)

    pure = autobatch.probe(work("bf16-true", torch.nn.Linear(64, 10).to(torch.bfloat16)), autobatch.SimulatedBackend("1MiB"))
    full = autobatch.probe(work("fp32", torch.nn.Linear(64, 10)), autobatch.SimulatedBackend("1MiB"))
    assert pure.max_batch > 1.9 * full.max_batch
    assert torch.get_default_dtype() == torch.float32

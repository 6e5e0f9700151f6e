"""Estimates on fake tensors: exact against the simulated probe, monotone, labelled, and the CLI."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from autobatch.probing.backends import SimulatedBackend
from autobatch.cli import app
from autobatch.errors import AutobatchError, NoBatchFitsError
from autobatch.estimating.estimate import estimate, fake_model, trace_trial
from autobatch.estimating.overheads import Overheads
from autobatch.probing.probe import probe
from autobatch.probing.trial import run_trial
from autobatch.probing.workload import Workload
from torch._subclasses.fake_tensor import FakeTensorMode
from tests.tiny import TinyLM, cnn_workload, lm_workload, mlp, mlp_workload
from tests.extras import need

class _Attention(torch.nn.Module):
    """Self-attention through SDPA, as transformers models call it."""

    def __init__(self) -> None:
        super().__init__()
        # Several layers: the math path keeps each layer's seq² probabilities until backward.
        self.projs = torch.nn.ModuleList(torch.nn.Linear(16, 48) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for proj in self.projs:
            q, k, v = proj(x).chunk(3, dim=-1)
            # An explicit mask, as transformers passes one: the CPU dispatcher then takes the math path.
            mask = torch.ones(x.shape[-2], x.shape[-2], dtype=torch.bool).tril()
            x = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return x


WORKLOADS = {"mlp": (mlp_workload, "8MiB"), "lm": (lm_workload, "16MiB"), "cnn": (cnn_workload, "4MiB")}


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_traced_peaks_equal_the_simulated_backends_measured_peaks(name):
    make, _ = WORKLOADS[name]
    work = make()
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    model = fake_model(work.model, mode)
    for batch in (2, 16):
        real = run_trial(work, work.model(), SimulatedBackend("1TiB"), batch)
        # As on this CPU (a GPU's optimizer steps on all tensors at once: tests/test_data_dependent.py).
        fake = trace_trial(work, model, batch, fake_mode=mode, fused_attention=False, cuda_autocast=False)
        for field in ("peak_bytes", "reserved_bytes", "forward_backward_bytes", "optimizer_bytes", "resident_bytes"):
            assert getattr(fake, field) == pytest.approx(getattr(real, field), rel=0.02), field


@pytest.mark.parametrize("held", [False, True])
@pytest.mark.parametrize("name", list(WORKLOADS))
def test_a_trace_primes_the_optimizer_instead_of_running_a_first_step_and_books_the_same(name, held):
    # The estimate's trace makes the optimizer's state with one step on zero gradients, then runs
    # the one steady step; a prior's trace (it records a log) runs both steps. Every figure agrees.
    from dataclasses import replace

    from autobatch.estimating.replay import AllocationLog

    make, _ = WORKLOADS[name]
    work = replace(make(), grads_held=held)
    mode = FakeTensorMode()
    model = fake_model(work.model, mode)
    primed = trace_trial(work, model, 8, fake_mode=mode)
    two_steps = trace_trial(work, model, 8, fake_mode=mode, log=AllocationLog())
    for field in ("peak_bytes", "reserved_bytes", "forward_backward_bytes", "optimizer_bytes", "resident_bytes"):
        assert getattr(primed, field) == getattr(two_steps, field), field


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_estimate_without_overheads_agrees_with_the_simulated_probe(name):
    make, budget = WORKLOADS[name]
    est = estimate(make(), gpu_memory=budget, overheads=Overheads.none())
    real = probe(make(), SimulatedBackend(budget))
    assert est.max_batch == pytest.approx(real.max_batch, rel=0.03)
    assert est.safe_batch == pytest.approx(real.safe_batch, rel=0.03)
    assert est.capacity_bytes == real.capacity_bytes


def test_predictions_grow_monotonically_with_memory():
    work = lm_workload()
    results = [estimate(work, gpu_memory=f"{mib}MiB", overheads=Overheads.none()) for mib in (4, 8, 16, 32)]
    maxes = [r.max_batch for r in results]
    safes = [r.safe_batch for r in results]
    assert maxes == sorted(maxes) and len(set(maxes)) == 4
    assert safes == sorted(safes) and all(s <= m for s, m in zip(safes, maxes))


def test_overheads_shrink_the_batch_and_fused_attention_keeps_less():
    work = lm_workload()
    bare = estimate(work, gpu_memory="16MiB", overheads=Overheads.none())
    padded = estimate(work, gpu_memory="16MiB", overheads=Overheads(fragmentation=1.2, workspace_bytes=1 << 20,
                                                                    fused_attention=False, context_bytes=0))
    assert padded.max_batch < bare.max_batch
    attn = Workload(_Attention, lambda b: torch.randn(b, 2, 128, 16))
    math = estimate(attn, gpu_memory="16MiB", overheads=Overheads.none())
    fused = estimate(attn, gpu_memory="16MiB", overheads=Overheads(1.0, 0, True, 0))
    assert math.traced[0].batch == fused.traced[0].batch == 1
    assert fused.traced[0].peak_bytes < math.traced[0].peak_bytes  # no seq² probabilities kept


def test_result_is_labelled_as_an_estimate_and_the_users_model_is_untouched():
    model = mlp()
    before = [p.detach().clone() for p in model.parameters()]
    result = estimate(Workload(model, lambda b: (torch.randn(b, 64), torch.randint(0, 10, (b,))), name="mine"), "t4")
    assert result.estimated and result.to_dict()["estimated"] is True
    assert str(result).startswith("estimate for t4 (no GPU used")
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters())
    assert result.capacity_bytes == result.gpu.usable_bytes


def test_nothing_fits_and_bad_settings_fail_with_one_line():
    with pytest.raises(NoBatchFitsError, match="even a batch of 1"):
        estimate(lm_workload(), gpu_memory="100KiB", overheads=Overheads.none())
    with pytest.raises(AutobatchError, match="fragmentation .* must be ≥ 1"):
        Overheads(fragmentation=0.9)
    with pytest.raises(AutobatchError, match="must exceed its CUDA context .*; pass a larger --gpu-memory"):
        estimate(lm_workload(), gpu_memory="100MiB")


@pytest.mark.parametrize("args, fix", [(["--gpu-memory", "100MiB"], "pass a larger --gpu-memory"),
                                       (["--cuda-context", "100GiB"], "pass a smaller --cuda-context"),
                                       (["--cuda-context", "100GiB", "--seq-len", "16,32"], "pass a smaller --cuda-context")])
def test_a_cuda_context_the_card_cannot_hold_names_the_option_to_change(args, fix):
    """The fix names what the user set: a context they passed is too large, a card they sized too small."""
    result = CliRunner().invoke(app, ["estimate", "--model", "tiny-gpt2", *args])
    assert result.exit_code == 2 and "must exceed its CUDA context" in result.stderr and fix in result.stderr, result.output
    with pytest.raises(AutobatchError, match="gradient_checkpointing_enable"):
        estimate(Workload(TinyLM, lm_workload().make_batch, loss_fn=lm_workload().loss_fn, grad_checkpointing=True))


# --- CLI: mirrors every command shown in docs/estimate.md, one for one ---------------------

runner = CliRunner()


def test_cli_gpus():
    result = runner.invoke(app, ["gpus"])
    assert result.exit_code == 0 and "a100-80gb" in result.output and "default: a100-80gb" in result.output
    header = next(line for line in result.output.splitlines() if "name" in line)  # each column says what it is
    assert all(column in header for column in ("total", "CUDA context", "usable", "vendor", "notes")), result.output
    data = json.loads(runner.invoke(app, ["gpus", "--json"]).output)
    assert data["default"] == "a100-80gb" and len(data["gpus"]) >= 13


def test_cli_unknown_gpu_is_one_line():
    result = runner.invoke(app, ["estimate", "--model", "tiny-gpt2", "--gpu", "b200"])
    assert result.exit_code == 2
    assert result.output.count("\n") == 1 and "gpu must be one of v100-16gb" in result.output


def test_cli_estimate_plans_and_writes_deepspeed(tmp_path):
    need("autobatch.models")
    need("transformers")
    out = tmp_path / "ds.json"
    result = runner.invoke(app, ["estimate", "--model", "tiny-gpt2", "--gpu", "t4", "--target", "224", "--gpus", "8",
                                 "--nodes", "2", "--deepspeed", str(out)])
    assert result.exit_code == 0, result.output
    said = [line for line in result.output.splitlines() if not line.startswith("…")]  # progress, past 2 s, aside
    assert said[0].startswith("note: these are estimates for t4")
    assert "= 224" in result.output
    assert json.loads(out.read_text())["train_batch_size"] == 224
    data = json.loads(runner.invoke(app, ["estimate", "--model", "tiny-gpt2", "--gpu-memory", "2GiB", "--json"]).stdout)  # progress past 2 s goes to stderr
    assert data["estimated"] is True and data["gpu"]["vendor"] == "custom" and data["max_batch"] >= data["safe_batch"] > 0


def test_gradient_checkpointing_is_traced_and_leads_the_search(trace_first):
    # The fused attention route is not taken when the checkpoint recomputes the forward in backward:
    # with it on both passes disagreed and torch refused (a traceback from estimate, no lead for find).
    from typer.testing import CliRunner

    from autobatch.cli import app

    estimated = CliRunner().invoke(app, ["estimate", "--model", "tiny-gpt2", "--grad-checkpointing", "--max-micro", "8"])
    assert estimated.exit_code == 0 and "estimated max batch 8" in estimated.stdout, estimated.output
    found = CliRunner().invoke(app, ["find", "--model", "tiny-gpt2", "--device", "cpu", "--memory", "8MiB",
                                     "--grad-checkpointing", "--no-cache"])
    assert found.exit_code == 0 and "led by the fake-tensor trace" in found.stdout, found.output
    assert "deprecated" not in found.stderr  # transformers' current name for the switch, not the old one


def test_no_workspace_and_no_cuda_context_are_sizes_too():
    """0B is a plausible overhead (no workspace; a --gpu-memory already less its context), refused before."""
    runner = CliRunner()
    result = runner.invoke(app, ["estimate", "--model", "tiny-mlp", "--gpu", "t4", "--workspace", "0B",
                                 "--cuda-context", "0B", "--json"])
    assert result.exit_code == 0, result.output
    overheads = json.loads(result.stdout)["overheads"]
    assert overheads["workspace_bytes"] == 0 and overheads["context_bytes"] == 0
    for flag in ("--workspace", "--cuda-context"):
        bad = runner.invoke(app, ["estimate", "--model", "tiny-mlp", flag, "-1GiB"])
        assert bad.exit_code == 2 and f"{flag} must be a size of 0B or more" in bad.stderr, bad.output
    bad = runner.invoke(app, ["estimate", "--model", "tiny-mlp", "--gpu-memory", "0B"])
    assert bad.exit_code == 2 and "--gpu-memory must be a positive size" in bad.stderr, bad.output
    bad = runner.invoke(app, ["estimate", "--model", "tiny-mlp", "--gpu", "t4", "--headroom", "100GiB"])
    assert bad.exit_code == 2 and "smaller than the device capacity" in bad.stderr and "e.g. --headroom 0.05" in bad.stderr


@pytest.mark.parametrize("seq_len, gpu", [(512, "a100-80gb"), (128, "a10g")])
def test_the_safe_batch_rests_on_adjacent_reads_of_the_booked_curve(seq_len, gpu):
    # gpt2 at 512 tokens on an a100-80gb answered safe 79 from a line through the trials, where the booking at
    # 80 kept the headroom (and --max-micro 80, which traced it, answered 80)
    from autobatch.estimating.estimate import load_fake_model

    result = estimate(load_fake_model("gpt2", seq_len=seq_len).to_workload(), gpu)
    limit = result.capacity_bytes - result.headroom_bytes
    read = {t.batch: t for t in result.trials}
    assert result.safe_batch in read and read[result.safe_batch].reserved_bytes <= limit
    if result.safe_batch < result.max_batch:
        assert read[result.safe_batch + 1].reserved_bytes > limit
    assert result.extra["traced_once_for"] == [t.batch for t in result.trials]  # every one a read off the one trace
    if seq_len == 512:
        assert result.safe_batch == 80

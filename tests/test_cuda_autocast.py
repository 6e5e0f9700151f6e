"""A trace made on the CPU casts as CUDA's autocast casts (autobatch/estimating/cuda_autocast.py).

The CPU's autocast keeps softmax and layer_norm in bf16 where CUDA's runs them in float32: on an
H200, gpt2 at 1024 tokens in bf16 fit 93 (94 failed) while the trace under the CPU's rules
estimated 110 (docs/benchmarks/gpu.md). The expected dtypes below are CUDA's rules as torch's
ATen/autocast_mode.h lists them, written out by hand.
"""

from __future__ import annotations

import doctest

import pytest
import torch
import torch.nn.functional as F

from autobatch import SimulatedBackend, Workload
from autobatch.estimating import cuda_autocast
from autobatch.estimating.cuda_autocast import cuda_policy
from autobatch.estimating.estimate import fake_model, trace_trial
from autobatch.estimating.fake_backends import _new_fake_mode
from autobatch.probing.trial import run_trial

BF16 = torch.bfloat16
FP32 = torch.float32


def _dtypes() -> dict[str, torch.dtype]:
    x = torch.randn(4, 8)
    w = torch.randn(8, 8)
    target = torch.zeros(4, dtype=torch.long)
    y = x @ w
    return {
        "matmul": y.dtype,
        "linear": F.linear(x, w).dtype,
        "einsum": torch.einsum("ij,jk->ik", x, w).dtype,
        "softmax": torch.softmax(y, -1).dtype,
        "log_softmax": torch.log_softmax(y, -1).dtype,
        "softmax with its dtype": torch.softmax(y, -1, dtype=BF16).dtype,
        "layer_norm": F.layer_norm(y, (8,)).dtype,
        "gelu": F.gelu(y).dtype,
        "sum": y.sum().dtype,
        "exp": y.exp().dtype,
        "cross_entropy": F.cross_entropy(y, target).dtype,
        "mse_loss": F.mse_loss(y, y.detach()).dtype,
    }


CUDA_RULES = {
    "matmul": BF16, "linear": BF16, "einsum": BF16,                # lower precision
    "softmax": FP32, "log_softmax": FP32, "sum": FP32,             # float32 unless a dtype is given
    "softmax with its dtype": BF16,
    "layer_norm": FP32, "exp": FP32, "mse_loss": FP32,             # float32
    "gelu": BF16,                                                  # not cast: the input's dtype
    "cross_entropy": FP32,                                         # a bf16 log_softmax, a float32 nll_loss
}


def test_under_the_policy_the_cpu_casts_as_cuda_does():
    with torch.autocast("cpu", dtype=BF16), cuda_policy():
        assert _dtypes() == CUDA_RULES


def test_the_cpus_own_rules_come_back_after_it():
    with torch.autocast("cpu", dtype=BF16):
        before = _dtypes()
    with torch.autocast("cpu", dtype=BF16), cuda_policy():
        pass
    with torch.autocast("cpu", dtype=BF16):
        assert _dtypes() == before
    assert before["softmax"] == BF16 and before["layer_norm"] == BF16  # why the policy exists


def test_nested_entries_share_one_registration_and_gradients_flow():
    x = torch.randn(4, 8, requires_grad=True)
    with torch.autocast("cpu", dtype=BF16), cuda_policy():
        with cuda_policy():
            loss = F.cross_entropy(torch.softmax(x @ x.T, -1), torch.zeros(4, dtype=torch.long))
        loss.backward()
        assert torch.softmax(x.to(BF16), -1).dtype == FP32  # still entered
    assert x.grad is not None and x.grad.dtype == FP32
    with torch.autocast("cpu", dtype=BF16):
        assert torch.softmax(x.to(BF16), -1).dtype == BF16


class _EagerAttention(torch.nn.Module):
    """Attention written out, as gpt2's eager path is: its probabilities are kept for backward."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(32, 96)
        self.norm = torch.nn.LayerNorm(32)

    def forward(self, x):
        q, k, v = self.qkv(self.norm(x)).chunk(3, -1)
        return (torch.softmax(q @ k.transpose(-1, -2), -1) @ v).float().mean()


def _traced(cuda: bool, dtype: str | None, batch: int = 4) -> int:
    work = Workload(_EagerAttention, lambda b: torch.randn(b, 64, 32), dtype=dtype)
    mode = _new_fake_mode()
    model = fake_model(work.model, mode)
    return trace_trial(work, model, batch, fake_mode=mode, cuda_autocast=cuda).forward_backward_bytes


def test_a_gpus_trace_keeps_float32_probabilities_in_bf16():
    # Each sample's 64×64 probabilities: 4 bytes under CUDA's rules, 2 under the CPU's, and the
    # layer norm's output likewise (64×32); the rest of the step is the same.
    gap = _traced(True, "bf16") - _traced(False, "bf16")
    assert gap >= 4 * (64 * 64 * 2)
    assert _traced(True, None) == _traced(False, None)  # without autocast the rules do not matter


def test_a_cpu_budgets_prior_casts_as_its_trials_do():
    # find on a simulated CPU budget: the trials run the CPU's rules, and so does their trace.
    work = Workload(_EagerAttention, lambda b: torch.randn(b, 64, 32), dtype="bf16")
    torch.manual_seed(0)
    model = _EagerAttention()
    trial = run_trial(work, model, SimulatedBackend(1 << 40), 4)
    assert _traced(False, "bf16") == trial.forward_backward_bytes


def test_the_examples_run():
    assert doctest.testmod(cuda_autocast).failed == 0


@pytest.mark.parametrize("name", ["softmax", "layer_norm", "log_softmax"])
def test_the_rules_name_ops_cuda_registers(name):
    # The lists are read from torch's header by hand: each name must be an op CUDA's autocast has.
    assert any(op.split(".")[0] == name for op in cuda_autocast._overloads("AutocastCUDA"))


def test_a_thread_outside_the_policy_keeps_the_cpus_rules_while_another_is_inside():
    import threading

    inside, outside = threading.Event(), threading.Event()
    seen: dict[str, dict[str, torch.dtype]] = {}

    def trace():
        with torch.autocast("cpu", dtype=BF16), cuda_policy():
            inside.set()
            outside.wait(10)
            seen["inside"] = _dtypes()

    with torch.autocast("cpu", dtype=BF16):
        cpu_rules = _dtypes()
    thread = threading.Thread(target=trace)
    thread.start()
    inside.wait(10)
    with torch.autocast("cpu", dtype=BF16):
        seen["outside"] = _dtypes()  # the kernels are replaced now, for every thread
    outside.set()
    thread.join()
    assert seen["outside"] == cpu_rules
    assert seen["inside"] == CUDA_RULES

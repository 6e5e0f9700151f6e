"""--grads-held: the gradients stay allocated into the next step's forward, as in every accumulation
micro-step after the first, or a loop that zeroes with set_to_none=False. Counted by hand on a
two-layer MLP; carried by the probe, the estimate, DDP's sharded trial and the cache's fingerprint;
refused in one line where an engine keeps its own gradients."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

import autobatch
from autobatch import SimulatedBackend, Workload, run_trial
from autobatch.cli import app
from autobatch.tuning.fingerprint import fingerprint


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))


def _batch(b: int):
    return torch.randn(b, 64), torch.randint(0, 10, (b,))


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_the_forward_holds_the_gradients_the_backward_had_not_yet_made(optimizer) -> None:
    def forward_backward(held: bool) -> int:
        work = Workload(_model, _batch, optimizer=optimizer, grads_held=held)
        return run_trial(work, _model(), SimulatedBackend("64MiB"), 32).forward_backward_bytes

    # A plain step peaks in the backward once the last layer's gradients exist (256·10 + 10 floats);
    # held, the first layer's are there too: 64·256 + 256 floats, 66,560 bytes more.
    assert forward_backward(True) - forward_backward(False) == 4 * (64 * 256 + 256)


def test_a_probe_and_an_estimate_fit_less_with_the_gradients_held() -> None:
    def probed(held: bool) -> int:
        return autobatch.probe(Workload(_model, _batch, grads_held=held), SimulatedBackend("1MiB"),
                               headroom=0).max_batch

    def estimated(held: bool) -> int:
        return autobatch.estimate(Workload(_model, _batch, grads_held=held), gpu_memory="1GiB", max_batch=None,
                                  overheads=autobatch.Overheads.none()).max_batch

    assert probed(True) < probed(False) and estimated(True) < estimated(False)
    plain, held = (fingerprint(Workload(_model, _batch, grads_held=h), SimulatedBackend("1MiB").info())
                   for h in (False, True))
    assert plain != held  # a cached probe without them never answers one with them


def test_the_command_line_takes_it_and_refuses_it_where_an_engine_keeps_its_own() -> None:
    args = ["find", "--model", "tiny-mlp", "--device", "cpu", "--memory", "8MiB", "--no-cache", "--json"]
    assert CliRunner().invoke(app, [*args, "--grads-held"]).exit_code == 0
    assert CliRunner().invoke(app, [*args, "--grads-held", "--strategy", "ddp", "--gpus", "2"]).exit_code == 0
    refused = CliRunner().invoke(app, [*args[:-1], "--grads-held", "--strategy", "zero3"])
    assert refused.exit_code == 2 and "Traceback" not in refused.output
    assert "--grads-held holds an unsharded step's gradients into the next forward" in refused.output

"""--optimizer adamw8bit: bitsandbytes' AdamW8bit as memory, without bitsandbytes. Its states are
counted by hand (uint8 moments and a float32 absmax per 256 elements for a parameter of 4096 elements
or more, float32 moments below, two 256-entry maps), and a probe and an estimate fit more with it."""

from __future__ import annotations

import doctest

import torch
from typer.testing import CliRunner

import autobatch
from autobatch import SimulatedBackend, Workload
from autobatch.cli import app
from autobatch.probing import eight_bit
from autobatch.probing.eight_bit import EightBitAdamW, state_bytes


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))


def _batch(b: int):
    return torch.randn(b, 128), torch.randint(0, 10, (b,))


def test_its_states_are_bitsandbytes_sizes_counted_by_hand() -> None:
    model = _model()
    optimizer = EightBitAdamW(model.parameters())
    torch.nn.functional.cross_entropy(model(_batch(4)[0]), _batch(4)[1]).backward()
    optimizer.step()
    held = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values())
    held += sum(t.numel() * t.element_size() for t in optimizer.maps)
    # weight 128×128 = 16384 ≥ 4096: 2 × 16384 + 8 × 64 absmax; weight 10×128 = 1280 and the biases (128, 10)
    # below 4096: float32 moments, 8 bytes each; two maps of 256 float32
    by_hand = (2 * 16384 + 8 * 64) + 8 * 1280 + 8 * 128 + 8 * 10 + 2 * 256 * 4
    assert held == by_hand == sum(state_bytes(p.numel()) for p in model.parameters()) + 2048
    assert doctest.testmod(eight_bit).failed == 0


def test_a_probe_fits_more_with_8_bit_states_than_with_adamw() -> None:
    def best(optimizer: str) -> int:
        work = Workload(_model, _batch, optimizer=optimizer)
        return autobatch.probe(work, SimulatedBackend("512KiB"), headroom=0, prior=None).max_batch

    assert best("adamw8bit") > best("adamw")


def test_the_command_line_takes_it_for_a_probe_and_an_estimate() -> None:
    for command in (["find", "--device", "cpu", "--memory", "2MiB", "--no-cache"], ["estimate", "--gpu-memory", "1GiB"]):
        result = CliRunner().invoke(app, [*command, "--model", "tiny-mlp", "--optimizer", "adamw8bit", "--max-micro",
                                          "64", "--json"])
        assert result.exit_code == 0, result.output
    bad = CliRunner().invoke(app, ["find", "--model", "tiny-mlp", "--device", "cpu", "--memory", "2MiB",
                                   "--optimizer", "adamw4bit"])
    assert bad.exit_code != 0 and "adamw8bit" in bad.output

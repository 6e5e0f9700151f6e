"""``autobatch verify-ga``: flags, text and JSON output, exit codes 0 PASS / 1 FAIL / 3 FLAGGED / 2 error."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

from autobatch.cli import app
from tests.extras import need

runner = CliRunner()
VOCAB = 53


class PlainLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = torch.nn.Embedding(VOCAB, 16), torch.nn.Linear(16, VOCAB)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.emb(input_ids).cumsum(1)))


def _load_fake(spec: str, *, seq_len: int | None = None, **_: object) -> SimpleNamespace:
    if spec == "fake-lm":
        return SimpleNamespace(model=PlainLM(), task="causal-lm", vocab_size=VOCAB, seq_len=seq_len or 16)
    if spec == "fake-bn":
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 3))
        return SimpleNamespace(
            model=model, task="classification",
            make_batch=lambda b: (torch.randn(b, 4), torch.randint(0, 3, (b,))),
            loss_fn=lambda m, batch: F.cross_entropy(m(batch[0]), batch[1]),
        )
    from autobatch.errors import AutobatchError

    raise AutobatchError(f"unknown model {spec!r}")


@pytest.fixture
def fake_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stands in for autobatch.models so the command's wiring is tested whatever the registry holds."""
    module = types.ModuleType("autobatch.models")
    module.load_model = _load_fake  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "autobatch.models", module)


def run(*args: str) -> tuple[int, str]:
    result = runner.invoke(app, ["verify-ga", *args])
    return result.exit_code, result.output


# --- wiring, with a stand-in registry -------------------------------------------------------


def test_naive_fails_with_exit_code_1_and_names_the_cause(fake_registry: None) -> None:
    code, out = run("--model", "fake-lm", "--micro-batch", "1", "--grad-accum", "8")
    assert code == 1, out
    assert out.startswith("verify-ga: FAIL")
    assert "# 1 micro batch * 8 grad accum * 1 rank = 8 samples" in out
    assert "mean of means" in out


def test_normalised_passes_with_exit_code_0(fake_registry: None) -> None:
    code, out = run("--model", "fake-lm", "--micro-batch", "2", "--grad-accum", "4", "--normalised")
    assert code == 0, out
    assert out.startswith("verify-ga: PASS")


def test_json_output_is_one_object_with_the_verdict(fake_registry: None) -> None:
    code, out = run("--model", "fake-lm", "--micro-batch", "1", "--grad-accum", "4", "--gpus", "2",
                    "--seq-len", "12", "--json")
    assert code == 1
    d = json.loads(out)
    assert d["status"] == "FAIL" and d["world_size"] == 2 and d["global_batch"] == 8 and d["exit_code"] == 1
    assert d["rel_error"] > 0.05 and d["likely_cause"]


def test_tolerance_flag_is_used(fake_registry: None) -> None:
    code, out = run("--model", "fake-lm", "--micro-batch", "1", "--grad-accum", "8", "--tolerance", "10", "--json")
    assert code == 0 and json.loads(out)["tolerance"] == 10.0


def test_batchnorm_is_flagged_with_exit_code_3(fake_registry: None) -> None:
    code, out = run("--model", "fake-bn", "--micro-batch", "1", "--grad-accum", "4")
    assert code == 3, out
    assert out.startswith("verify-ga: FLAGGED") and "BatchNorm" in out


def test_bad_flags_are_one_line_and_exit_code_2(fake_registry: None) -> None:
    code, out = run("--model", "fake-lm", "--micro-batch", "0", "--grad-accum", "8")
    assert code == 2
    assert out.strip() == "Error: --micro-batch must be ≥ 1, but got '0' (see: autobatch verify-ga --help)"


def test_a_missing_registry_is_explained(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "autobatch.models", None)  # makes the import fail
    code, out = run("--model", "tiny-gpt2", "--micro-batch", "1", "--grad-accum", "8")
    assert code == 2 and "needs autobatch.models" in out


# --- the commands docs/gradient-accumulation.md shows, with the real registry ---------------


@pytest.fixture
def registry() -> None:
    need("autobatch.models")


DOCS = Path(__file__).resolve().parents[1] / "docs" / "gradient-accumulation.md"

# Every `autobatch verify-ga …` line the page shows, and the exit code it documents.
DOCS_COMMANDS = {
    "autobatch verify-ga --model tiny-gpt2 --micro-batch 1 --grad-accum 8": 1,
    "autobatch verify-ga --model tiny-gpt2 --micro-batch 1 --grad-accum 8 --normalised": 0,
    "autobatch verify-ga --model tiny-gpt2 --micro-batch 2 --grad-accum 4 --json": 1,
    "autobatch verify-ga --model tiny-llama --micro-batch 1 --grad-accum 4 --gpus 2 --normalised": 0,
    "autobatch verify-ga --model tiny-cnn --micro-batch 1 --grad-accum 8": 3,
}


def test_the_docs_show_only_tested_commands() -> None:
    shown = {line.removeprefix("$ ").strip() for line in DOCS.read_text().splitlines()
             if line.removeprefix("$ ").startswith("autobatch verify-ga ")}
    assert shown == set(DOCS_COMMANDS)


@pytest.mark.parametrize("command", list(DOCS_COMMANDS))
def test_docs_command(registry: None, command: str) -> None:
    code, out = run(*command.split()[2:])
    assert code == DOCS_COMMANDS[command], out
    if "--json" in command:
        assert json.loads(out)["status"] == "FAIL"
    elif code == 1:
        assert "mean of means" in out
    elif code == 3:
        assert "BatchNorm" in out and "by design" in out


@pytest.mark.parametrize("seed", ["0", "12345", "-5"])
def test_the_naive_loss_fails_whatever_the_seed(seed: str) -> None:
    # seeds 12345 and -5 paired the lengths so that both micro-batches held 64 tokens: a naive loss passed
    code, out = run("--model", "tiny-gpt2", "--micro-batch", "2", "--grad-accum", "2", f"--seed={seed}")
    assert code == 1 and "verify-ga: FAIL" in out and "mean of means" in out, out


def test_micro_batches_that_all_hold_the_same_tokens_are_flagged_not_passed() -> None:
    # at --seq-len 2 every sequence has 2 tokens: a mean of means is the whole mean, so no loss can be told apart
    code, out = run("--model", "tiny-gpt2", "--micro-batch", "1", "--grad-accum", "2", "--seq-len", "2")
    assert code == 3 and "verify-ga: FLAGGED" in out and "cannot tell a per-micro-batch loss" in out, out
    code, out = run("--model", "tiny-gpt2", "--micro-batch", "1", "--grad-accum", "2", "--seq-len", "2", "--normalised")
    assert code == 0 and "verify-ga: PASS" in out, out  # the right loss passes: nothing to flag

"""`find`: one truth per figure in --json, every output flag on every path, and flags checked before the first trial."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

import autobatch
from autobatch.cli import app
from tests.extras import need

runner = CliRunner()
PROBE = ("--device", "cpu", "--memory", "4MiB", "--no-cache")


def invoke(*args: str):
    return runner.invoke(app, list(args))


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def no_trials(monkeypatch):
    """Fail the test if any probe trial runs."""
    import importlib

    probe_module = importlib.import_module("autobatch.probing.probe")  # the attribute is the function

    def refuse(*args, **kwargs):
        raise AssertionError("a trial ran before the flags were checked")

    monkeypatch.setattr(probe_module, "run_trial", refuse)


# --- item 2: --json -------------------------------------------------------------------------


def test_find_json_top_level_figures_are_the_probes():
    result = invoke("find", "--model", "tiny-mlp", *PROBE, "--target", "64", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["max_batch"] == data["probe"]["max_batch"]
    assert data["safe_batch"] == data["probe"]["safe_batch"]
    assert data["max_batch"] > data["safe_batch"]  # 5 % headroom: two different figures
    assert "max_micro" not in data and "safe_micro" not in data
    assert data["plan"]["max_micro"] == data["safe_batch"] and data["micro_batch"] == data["plan"]["micro_batch"]


def test_estimate_json_traced_agrees_with_trials(no_gpu):
    result = invoke("find", "--model", "tiny-cnn", "--gpu", "t4", "--target", "64", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    verdicts = {t["batch"]: t["fits"] for t in data["trials"]}
    assert any(not fits for fits in verdicts.values())
    assert {t["batch"]: t["fits"] for t in data["traced"]} == verdicts
    assert data["max_batch"] == max(b for b, fits in verdicts.items() if fits)
    assert "max_micro" not in data and data["plan"]["max_micro"] == data["safe_batch"]


# --- item 5: every output flag on every path --------------------------------------------------


def test_hf_args_are_written_on_the_estimate_path(no_gpu, tmp_path):
    hf = tmp_path / "args.json"
    result = invoke("find", "--model", "tiny-mlp", "--target", "64", "--hf", str(hf))
    assert result.exit_code == 0, result.output
    assert json.loads(hf.read_text())["per_device_train_batch_size"] * json.loads(hf.read_text())["gradient_accumulation_steps"] == 64
    assert f"wrote {hf}" in result.stdout


def test_plot_is_refused_up_front_on_the_estimate_path(no_gpu, tmp_path):
    result = invoke("find", "--model", "tiny-mlp", "--plot", str(tmp_path / "p.png"))
    assert result.exit_code == 2 and "--plot" in result.stderr and not (tmp_path / "p.png").exists()


def test_plot_is_written_with_json(tmp_path):
    need("matplotlib")
    png = tmp_path / "p.png"
    result = invoke("find", "--model", "tiny-mlp", *PROBE, "--plot", str(png), "--json")
    assert result.exit_code == 0, result.output
    assert png.stat().st_size > 0 and json.loads(result.stdout)["plot"] == str(png)


# --- item 7: flags checked before the first trial ------------------------------------------------


@pytest.mark.parametrize("flags, words", [
    (("--target", "0"), "target"),
    (("--gpus", "0"), "gpus"),
    (("--nodes", "0"), "nodes"),
    (("--gpus", "2", "--model-parallel", "3"), "--model-parallel"),
    (("--target", "7", "--gpus", "2"), "no exact plan"),
    (("--deepspeed", "x.txt"), ".json"),
    (("--accelerate", "x.txt"), ".yaml"),
    (("--hf", "x.txt"), ".json"),
    (("--multiple-of", "0"), "--multiple-of"),
])
def test_find_checks_flags_before_the_first_trial(no_trials, tmp_path, flags, words):
    result = invoke("find", "--model", "tiny-mlp", *PROBE, *flags)
    assert result.exit_code == 2, result.output
    assert words in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_find_checks_the_plot_path_before_the_first_trial(no_trials, tmp_path):
    result = invoke("find", "--model", "tiny-mlp", *PROBE, "--plot", str(tmp_path))
    assert result.exit_code == 2 and "directory" in result.stderr


def test_find_reads_an_existing_deepspeed_file_before_the_first_trial(no_trials, tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text("{not json")
    result = invoke("find", "--model", "tiny-mlp", *PROBE, "--deepspeed", str(ds))
    assert result.exit_code == 2 and "must be valid JSON" in result.stderr


def test_tune_checks_timed_steps_before_probing(no_trials):
    need("optuna")
    result = invoke("tune", "--model", "tiny-mlp", "--target", "8", *PROBE[:4], "--timed-steps", "0")
    assert result.exit_code == 2 and "--timed-steps" in result.stderr


# --- item 9: the no-GPU hint --------------------------------------------------------------------


def test_no_gpu_hint_suggests_nothing_that_wastes_minutes(no_gpu):
    result = invoke("find", "--model", "tiny-mlp", "--target", "64")
    assert result.exit_code == 0, result.output
    assert "--device cpu" not in result.stderr and "--memory" not in result.stderr
    assert "autobatch gpus" in result.stderr


# --- item 4: the global RNG -----------------------------------------------------------------


def test_find_leaves_the_global_rng_untouched():
    torch.manual_seed(1234)
    before = torch.random.get_rng_state()
    plan = autobatch.find(lambda: torch.nn.Linear(16, 4), lambda b: (torch.randn(b, 16), torch.randint(0, 4, (b,))),
                          target=8, device="cpu", memory="64KiB", headroom=0)
    assert plan.global_batch == 8
    assert torch.equal(torch.random.get_rng_state(), before)

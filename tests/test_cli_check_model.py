from __future__ import annotations

import json

from typer.testing import CliRunner

from autobatch.cli import app

runner = CliRunner()


def test_check_model_with_batchnorm_and_one_sample_per_gpu_is_a_problem():
    res = runner.invoke(app, ["check", "--target", "32", "--gpus", "4", "--micro-batch", "1", "--grad-accum", "8",
                              "--model", "tiny-cnn", "--json"])
    assert res.exit_code == 1
    codes = [p["code"] for p in json.loads(res.stdout)["problems"]]
    assert codes == ["batchnorm"]


def test_check_model_without_batchnorm_passes_and_big_models_cost_nothing():
    for model in ("tiny-gpt2", "gpt2-xl"):  # built on the meta device: no weights in memory
        res = runner.invoke(app, ["check", "--target", "32", "--gpus", "4", "--micro-batch", "1",
                                  "--grad-accum", "8", "--model", model])
        assert res.exit_code == 0, res.output


def test_check_unknown_model_is_one_line():
    res = runner.invoke(app, ["check", "--target", "32", "--micro-batch", "1", "--grad-accum", "32", "--model", "nope"])
    assert res.exit_code == 2 and res.stderr.startswith("Error: unknown model 'nope'")

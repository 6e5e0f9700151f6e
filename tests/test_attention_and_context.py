"""--attention (the attention a transformers model is built with) and --cuda-context (the CUDA context an
estimate takes off the card), from Python and the command line."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

import autobatch
from autobatch.cli import app
from autobatch.errors import AutobatchError
from autobatch.estimating.gpus import lookup_gpu
from autobatch.models import load_model

GIB = 2**30


def _estimate(**fields):
    return autobatch.answer(autobatch.Request(model="tiny-gpt2", seq_len=128, gpu_memory="1GiB", estimate=True,
                                              headroom=0, **fields)).rows[0].probe


@pytest.mark.parametrize("spec", ["tiny-gpt2", "tiny-llama", "tiny-bert"])
def test_each_transformers_family_is_built_with_the_attention_asked_for(spec):
    assert load_model(spec).model.config._attn_implementation == "sdpa"  # transformers' own default
    assert load_model(spec, attention="eager").model.config._attn_implementation == "eager"


def test_eager_attention_keeps_the_probabilities_per_sample():
    # tiny-gpt2 at 128 tokens: 2 layers × 2 heads × 128² probabilities a sample, fp32 softmax out and a
    # bool dropout mask at least (5 bytes an element): eager holds at least that much more per sample.
    eager, fused = _estimate(attention="eager"), _estimate(attention="sdpa")
    assert eager.bytes_per_sample - fused.bytes_per_sample >= 2 * 2 * 128 * 128 * 5
    assert eager.max_batch < fused.max_batch


@pytest.mark.parametrize("spec,attention,said", [
    ("tiny-gpt2", "flash", "attention must be one of eager, sdpa, but got 'flash'"),
    ("tiny-mlp", "eager", "tiny-mlp is built by its own code; drop --attention"),
])
def test_an_attention_that_cannot_be_built_is_one_line_before_anything_runs(spec, attention, said):
    with pytest.raises(AutobatchError, match=said.replace("(", r"\(").replace(")", r"\)")):
        load_model(spec, attention=attention)
    result = CliRunner().invoke(app, ["estimate", "--model", spec, "--attention", attention, "--gpu-memory", "1GiB"])
    assert result.exit_code != 0 and said in result.output and "Traceback" not in result.output


def test_the_cuda_context_asked_for_comes_off_the_card():
    card = lookup_gpu("v100-16gb")
    result = CliRunner().invoke(app, ["estimate", "--model", "tiny-gpt2", "--gpu", "v100-16gb", "--cuda-context",
                                      "1.3GiB", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["capacity_bytes"] == card.total_bytes - int(1.3 * GIB)
    default = autobatch.answer(autobatch.Request(model="tiny-gpt2", gpu="v100-16gb", estimate=True)).rows[0].probe
    assert default.capacity_bytes == card.usable_bytes


@pytest.mark.parametrize("value,said", [("1.3", "--cuda-context needs a unit"), ("lots", "--cuda-context must be")])
def test_a_cuda_context_that_is_no_size_is_one_line(value, said):
    result = CliRunner().invoke(app, ["estimate", "--model", "tiny-gpt2", "--gpu", "v100-16gb", "--cuda-context", value])
    assert result.exit_code != 0 and said in result.output and "Traceback" not in result.output

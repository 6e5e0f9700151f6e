"""hf: models train with the head their config names (config.json's "architectures"): sequence and token
classification, image classification and seq2seq, each with the batches its head takes, probed for real
and estimated on fake tensors alike."""

from __future__ import annotations

import pytest
import torch

import autobatch
from autobatch.errors import AutobatchError
from autobatch.models import load_model
from tests.extras import need
from tests.ranks import slow


def _configs():
    t = need("transformers")
    bert = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, vocab_size=128,
                max_position_embeddings=64, num_labels=3)
    return {
        "sequence-classification": t.BertConfig(**bert, architectures=["BertForSequenceClassification"]),
        "token-classification": t.BertConfig(**bert, architectures=["BertForTokenClassification"]),
        "image-classification": t.ViTConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=2, image_size=32, patch_size=8, num_labels=5,
                                            architectures=["ViTForImageClassification"]),
        "seq2seq": t.T5Config(d_model=32, d_ff=64, num_layers=2, num_heads=2, d_kv=16, vocab_size=128,
                              decoder_start_token_id=0, pad_token_id=0, architectures=["T5ForConditionalGeneration"]),
    }


def _spec(tmp_path, task: str) -> str:
    _configs()[task].save_pretrained(tmp_path / task)
    return f"hf:{tmp_path / task}"


@pytest.mark.parametrize("task", ["sequence-classification", "token-classification", "image-classification",
                                  "seq2seq"])
def test_each_head_a_config_names_is_built_with_its_batches(tmp_path, task):
    seq = None if task == "image-classification" else 16
    source = load_model(_spec(tmp_path, task), seq_len=seq)
    assert source.task == task and type(source.model).__name__ == _configs()[task].architectures[0]
    batch = source.make_batch(3)
    shapes = {k: tuple(v.shape) for k, v in batch.items()}
    assert shapes == {"sequence-classification": {"input_ids": (3, 16), "labels": (3,)},
                      "token-classification": {"input_ids": (3, 16), "labels": (3, 16)},
                      "image-classification": {"pixel_values": (3, 3, 32, 32), "labels": (3,)},
                      "seq2seq": {"input_ids": (3, 16), "labels": (3, 16)}}[task]
    classes = {"sequence-classification": 3, "token-classification": 3, "image-classification": 5}.get(task)
    if classes:
        assert int(batch["labels"].max()) < classes
    assert torch.isfinite(source.model(**batch).loss)


@pytest.mark.parametrize("task", ["image-classification", pytest.param("seq2seq", marks=slow(
    "T5 probed for real and traced (~10 s); its head's batches are checked above by default"))])
def test_a_head_probes_for_real_and_estimates_on_fake_tensors(tmp_path, task):
    spec = _spec(tmp_path, task)
    seq = None if task == "image-classification" else 16
    real = autobatch.answer(autobatch.Request(model=spec, seq_len=seq, device="cpu", memory="24MiB", headroom=0,
                                              max_micro=512, trace_prior=False)).rows[0].probe
    guess = autobatch.answer(autobatch.Request(model=spec, seq_len=seq, gpu_memory="1GiB", estimate=True,
                                               max_micro=64)).rows[0].probe
    assert 1 < real.max_batch < 512 and guess.max_batch > 0


def test_an_image_head_takes_no_sequence_length(tmp_path):
    with pytest.raises(AutobatchError, match="takes no sequence length"):
        load_model(_spec(tmp_path, "image-classification"), seq_len=16)

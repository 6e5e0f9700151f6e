"""transformers models built from configs, for :mod:`autobatch.models` (imported only when one is built)."""

from __future__ import annotations

from typing import Any

import torch

from .errors import AutobatchError, MissingDependencyError

__all__ = ["ATTENTION", "HEADS", "import_transformers", "hf_model", "max_positions", "token_batches", "image_batches"]

# transformers' attention implementations a model can be built with: "sdpa" fuses (a GPU keeps O(seq) per
# layer), "eager" keeps the probabilities (O(seq²)); the model's own default when none is asked for
ATTENTION = ("eager", "sdpa")

# The head a config names (config.json's "architectures", as saved with a checkpoint): the name's ending,
# transformers' auto class, the task it trains (its batches: token_batches or image_batches)
HEADS = (("ForSequenceClassification", "AutoModelForSequenceClassification", "sequence-classification"),
         ("ForTokenClassification", "AutoModelForTokenClassification", "token-classification"),
         ("ForImageClassification", "AutoModelForImageClassification", "image-classification"),
         ("ForConditionalGeneration", "AutoModelForSeq2SeqLM", "seq2seq"))


def import_transformers() -> Any:
    """transformers, quiet, or one line saying which extra installs it."""
    try:
        import transformers
    except ImportError:
        raise MissingDependencyError(
            "this model needs transformers, which is not installed; pip install 'autobatch[hf]'"
        ) from None
    transformers.logging.set_verbosity_error()
    return transformers


def hf_model(config: Any, family: str, trust_remote_code: bool = False,
             attention: str | None = None) -> tuple[torch.nn.Module, str]:
    """The model for ``config`` with a causal or masked language-model head, and which it is."""
    tf = import_transformers()
    options: dict[str, Any] = {"trust_remote_code": trust_remote_code}
    if attention is not None:
        options["attn_implementation"] = attention
    named = (getattr(config, "architectures", None) or [""])[0]
    for ending, auto, task in HEADS:
        if named.endswith(ending):
            try:
                return getattr(tf, auto).from_config(config, **options), task
            except ValueError:  # another kind's generation head (vision and language): a language-model head
                break
    if family == "bert" or getattr(config, "model_type", "") in ("bert", "roberta", "distilbert", "deberta-v2"):
        return tf.AutoModelForMaskedLM.from_config(config, **options), "masked-lm"
    try:
        return tf.AutoModelForCausalLM.from_config(config, **options), "causal-lm"
    except ValueError:
        pass
    try:
        return tf.AutoModelForMaskedLM.from_config(config, **options), "masked-lm"
    except ValueError:
        kind = getattr(config, "model_type", type(config).__name__)
        raise AutobatchError(
            f"hf: models train as causal or masked language models here, or with the head their config's "
            f"architectures name (sequence or token classification, image classification, seq2seq), but {kind!r} "
            f"names none ({named or 'no architectures'}); add the head to config.json's \"architectures\" (e.g. "
            f"\"{type(config).__name__.removesuffix('Config')}ForImageClassification\"), or build it in your own file "
            "and pass --model file.py:fn returning an autobatch.Workload with its batches and loss") from None


def max_positions(config: Any) -> int | None:
    """The longest sequence ``config`` allows, where it says."""
    for key in ("n_positions", "max_position_embeddings"):
        value = getattr(config, key, None)
        if isinstance(value, int):
            return value
    return None


def token_batches(config: Any, seq_len: int, task: str) -> Any:
    """``make_batch(b)`` for a model on tokens: ``seq_len`` random tokens a sample and the labels ``task`` takes.

    Full-length sequences, the worst case a padded batch can reach, so no padding mask: on real tensors
    transformers drops a mask of all ones before fused (SDPA) attention, which a trace on fake tensors
    cannot see (it kept llama-1b's mask, 0.69 GiB a sample above an H200's peak)."""
    vocab, classes = config.vocab_size, getattr(config, "num_labels", 2)

    def make_batch(b: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, vocab, (b, seq_len))
        if task == "sequence-classification":
            return {"input_ids": ids, "labels": torch.randint(0, classes, (b,))}
        if task == "token-classification":
            return {"input_ids": ids, "labels": torch.randint(0, classes, (b, seq_len))}
        return {"input_ids": ids, "labels": ids.clone()}  # language models; seq2seq: targets as long as inputs

    return make_batch


def image_batches(config: Any) -> Any:
    """``make_batch(b)`` for an image classifier: random images of the config's size and channels, and labels."""
    size = getattr(config, "image_size", 224)
    height, width = (size, size) if isinstance(size, int) else tuple(size)
    channels, classes = getattr(config, "num_channels", 3), getattr(config, "num_labels", 2)

    def make_batch(b: int) -> dict[str, torch.Tensor]:
        return {"pixel_values": torch.randn(b, channels, height, width), "labels": torch.randint(0, classes, (b,))}

    return make_batch


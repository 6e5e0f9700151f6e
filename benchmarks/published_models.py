"""The published runs' models, built from transformers configs with random weights (no download).

Each builder returns ``(model factory, make_batch(b, seq_len, image_size), loss_fn or None)`` for the
architecture and task head the source trained. Hyperparameters are the published model cards'.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["BUILDERS", "build"]


def _tokens(vocab: int) -> Callable[[int, int | None, int | None], dict[str, torch.Tensor]]:
    def make_batch(b: int, seq: int | None, image: int | None) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, vocab, (b, seq))
        return {"input_ids": ids, "labels": ids.clone()}
    return make_batch


def _classes(vocab: int, labels: int) -> Callable[[int, int | None, int | None], dict[str, torch.Tensor]]:
    def make_batch(b: int, seq: int | None, image: int | None) -> dict[str, torch.Tensor]:
        return {"input_ids": torch.randint(0, vocab, (b, seq)), "labels": torch.randint(0, labels, (b,))}
    return make_batch


def _images(labels: int = 1000) -> Callable[[int, int | None, int | None], dict[str, torch.Tensor]]:
    def make_batch(b: int, seq: int | None, image: int | None) -> dict[str, torch.Tensor]:
        return {"pixel_values": torch.randn(b, 3, image, image), "labels": torch.randint(0, labels, (b,))}
    return make_batch


def _bert(large: bool, head: str, vocab: int = 30522):
    import transformers as t

    config = t.BertConfig(vocab_size=vocab, hidden_size=1024 if large else 768, num_hidden_layers=24 if large else 12,
                          num_attention_heads=16 if large else 12, intermediate_size=4096 if large else 3072)
    if head == "masked-lm":
        return (lambda: t.BertForMaskedLM(config)), _tokens(vocab)
    return (lambda: t.BertForSequenceClassification(config)), _classes(vocab, 2)


def _gpt2(layers: int, width: int, heads: int):
    import transformers as t

    config = t.GPT2Config(n_layer=layers, n_embd=width, n_head=heads)
    return (lambda: t.GPT2LMHeadModel(config)), _tokens(config.vocab_size)


def _llama(**shape: Any):
    import transformers as t

    config = t.LlamaConfig(**shape)
    return (lambda: t.LlamaForCausalLM(config)), _tokens(config.vocab_size)


def _phi3():
    import transformers as t

    config = t.Phi3Config(hidden_size=3072, intermediate_size=8192, num_hidden_layers=32, num_attention_heads=32,
                          num_key_value_heads=32, vocab_size=32064, max_position_embeddings=4096)
    return (lambda: t.Phi3ForCausalLM(config)), _tokens(config.vocab_size)


def _t5(d_ff: int, heads: int, d_kv: int):
    import transformers as t

    config = t.T5Config(d_model=1024, d_ff=d_ff, num_layers=24, num_decoder_layers=24, num_heads=heads, d_kv=d_kv,
                        decoder_start_token_id=0, pad_token_id=0)
    return (lambda: t.T5ForConditionalGeneration(config)), _tokens(config.vocab_size)


def _deberta_v2_xlarge():
    import transformers as t

    config = t.DebertaV2Config(hidden_size=1536, num_hidden_layers=24, num_attention_heads=24, intermediate_size=6144,
                               vocab_size=128100, relative_attention=True, position_buckets=256,
                               max_relative_positions=-1, pos_att_type=["p2c", "c2p"], norm_rel_ebd="layer_norm",
                               share_att_key=True, position_biased_input=False, num_labels=3)
    return (lambda: t.DebertaV2ForSequenceClassification(config)), _classes(128100, 3)


def _blenderbot_400m():
    import transformers as t

    config = t.BlenderbotConfig(vocab_size=8008, d_model=1280, encoder_layers=2, decoder_layers=12,
                                encoder_attention_heads=32, decoder_attention_heads=32, encoder_ffn_dim=5120,
                                decoder_ffn_dim=5120)
    return (lambda: t.BlenderbotForConditionalGeneration(config)), _tokens(8008)


def _vision(kind: str):
    import transformers as t

    if kind == "vit":
        return (lambda: t.ViTForImageClassification(t.ViTConfig(num_labels=1000))), _images()
    if kind == "resnet50":
        return (lambda: t.ResNetForImageClassification(t.ResNetConfig(num_labels=1000))), _images()
    if kind == "convnext_base":
        config = t.ConvNextConfig(hidden_sizes=[128, 256, 512, 1024], depths=[3, 3, 27, 3], num_labels=1000)
        return (lambda: t.ConvNextForImageClassification(config)), _images()
    if kind == "swin_base":
        config = t.SwinConfig(embed_dim=128, depths=[2, 2, 18, 2], num_heads=[4, 8, 16, 32], num_labels=1000)
        return (lambda: t.SwinForImageClassification(config)), _images()
    if kind == "efficientnet_b0":
        config = t.EfficientNetConfig(width_coefficient=1.0, depth_coefficient=1.0, image_size=224, hidden_dim=1280,
                                      num_labels=1000)
        return (lambda: t.EfficientNetForImageClassification(config)), _images()
    raise KeyError(kind)


BUILDERS: dict[str, Callable[[str], tuple[Any, Any]]] = {
    "bert-large-uncased": lambda head: _bert(True, head),
    "bert-base-uncased": lambda head: _bert(False, head),
    "bert-base-cased": lambda head: _bert(False, head, vocab=28996),
    "gpt2": lambda head: _gpt2(12, 768, 12),
    "gpt2-large": lambda head: _gpt2(36, 1280, 20),
    "gpt2-xl": lambda head: _gpt2(48, 1600, 25),
    "t5-large": lambda head: _t5(4096, 16, 64),
    "t5-3b": lambda head: _t5(16384, 32, 128),
    "microsoft/deberta-v2-xlarge-mnli": lambda head: _deberta_v2_xlarge(),
    "facebook/blenderbot-400M-distill": lambda head: _blenderbot_400m(),
    "TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T": lambda head: _llama(
        hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4,
        vocab_size=32000),
    "meta-llama/Llama-3.2-1B": lambda head: _llama(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
        vocab_size=128256, tie_word_embeddings=True, head_dim=64),
    "meta-llama/Llama-3.2-3B": lambda head: _llama(
        hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8,
        vocab_size=128256, tie_word_embeddings=True, head_dim=128),
    "meta-llama/Llama-2-7b-hf": lambda head: _llama(
        hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
        vocab_size=32000),
    "meta-llama/Llama-3.1-8B": lambda head: _llama(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        vocab_size=128256),
    "microsoft/Phi-3-mini-4k-instruct": lambda head: _phi3(),
    "vit_base_patch16_224": lambda head: _vision("vit"),
    "resnet50": lambda head: _vision("resnet50"),
    "convnext_base": lambda head: _vision("convnext_base"),
    "swin_base_patch4_window7_224": lambda head: _vision("swin_base"),
    "efficientnet_b0": lambda head: _vision("efficientnet_b0"),
}


def build(model: str, head: str, attention: str = "sdpa", target_len: int | None = None) -> tuple[Any, Any]:
    """``(factory, make_batch(b, seq_len, image_size))`` for a published run's model, or ``KeyError``;
    ``attention`` is the implementation it ran (``"eager"`` keeps the probabilities, ``"sdpa"`` fuses).
    A seq2seq run's labels (the decoder's tokens) are ``target_len`` long where given, else ``seq_len``."""
    factory, make_source = BUILDERS[model](head)

    def make_batch(b: int, seq: int | None, image: int | None) -> dict[str, torch.Tensor]:
        batch = make_source(b, seq, image)
        if head == "seq2seq" and target_len is not None:
            batch["labels"] = make_source(b, target_len, image)["input_ids"]
        return batch

    def built() -> torch.nn.Module:
        module = factory()
        if attention == "eager" and hasattr(module, "set_attn_implementation"):
            module.set_attn_implementation("eager")
        elif attention == "eager":
            module.config._attn_implementation = "eager"
        return module

    return built, make_batch

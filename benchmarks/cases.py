"""The benchmark cases: a model, a batch at its worst-case shape, and a simulated memory budget.

Budgets are chosen so the true maxima run from single digits to hundreds and none is a power
of two (a power of two is the one answer doubling finds by luck). Every model is built by a
factory under a fixed seed, so each tool trains an identical fresh copy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from autobatch import Workload

__all__ = [
    "Case", "CASES", "GPT2_CASES", "SMOKE_CASE", "by_name", "mlp", "conv_bn", "tiny_lm", "TinyTransformerLM", "gpt2_small",
    "TinyCLIP", "tiny_clip",
]

GPT2_SEQ = 32


def _seeded(build: Callable[[], torch.nn.Module]) -> Callable[[], torch.nn.Module]:
    def factory() -> torch.nn.Module:
        torch.manual_seed(0)
        return build()

    factory.__name__ = build.__name__
    factory.__doc__ = build.__doc__
    return factory


@_seeded
def mlp() -> torch.nn.Module:
    """3072 → 256 → 256 → 10: a flattened 32×32 RGB image in, ten classes out."""
    return torch.nn.Sequential(
        torch.nn.Linear(3072, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)
    )


@_seeded
def conv_bn() -> torch.nn.Module:
    """Two conv + BatchNorm blocks: a per-device batch of at least 2 (field report 4)."""
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
        torch.nn.Conv2d(16, 32, 3, padding=1, stride=2), torch.nn.BatchNorm2d(32), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(32, 10),
    )


class TinyTransformerLM(torch.nn.Module):
    """Pre-norm encoder layers under a causal mask: a language model small enough for a CPU."""

    def __init__(self, vocab: int = 256, dim: int = 64, seq: int = 64, layers: int = 2):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.pos = torch.nn.Parameter(torch.zeros(seq, dim))
        layer = torch.nn.TransformerEncoderLayer(dim, 4, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        return self.head(self.blocks(self.emb(x) + self.pos[: x.shape[1]], mask=mask, is_causal=True))


@_seeded
def tiny_lm() -> torch.nn.Module:
    """Two layers, width 64, vocabulary 256, 64 tokens."""
    return TinyTransformerLM()


class TinyCLIP(torch.nn.Module):
    """Image and text towers scored against each other: every image with every text of the batch.

    The contrastive loss's b × b similarity matrix (and its softmax, both ways, and their
    gradients) grows with the square of the batch: at a few hundred samples it outweighs the
    activations, which grow with the batch.
    """

    def __init__(self, features: int = 256, vocab: int = 256, dim: int = 32):
        super().__init__()
        self.image = torch.nn.Sequential(torch.nn.Linear(features, 128), torch.nn.ReLU(), torch.nn.Linear(128, dim))
        self.embed = torch.nn.Embedding(vocab, dim)
        self.text = torch.nn.Linear(dim, dim)
        self.log_scale = torch.nn.Parameter(torch.tensor(2.659))  # log(1 / 0.07), as CLIP starts

    def forward(self, images: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        i = torch.nn.functional.normalize(self.image(images), dim=-1)
        t = torch.nn.functional.normalize(self.text(self.embed(tokens).mean(1)), dim=-1)
        return self.log_scale.exp() * i @ t.T


@_seeded
def tiny_clip() -> torch.nn.Module:
    """A two-tower contrastive model: 256 image features, 8 tokens, 32-dimensional embeddings."""
    return TinyCLIP()


def _clip_loss(model: torch.nn.Module, batch) -> torch.Tensor:
    images, tokens = batch
    logits = model(images, tokens)
    labels = torch.arange(logits.shape[0])
    return (torch.nn.functional.cross_entropy(logits, labels) + torch.nn.functional.cross_entropy(logits.T, labels)) / 2


@_seeded
def gpt2_small() -> torch.nn.Module:
    """gpt2-small (124M parameters) from its default config, randomly initialised: no download."""
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config())


def _lm_loss(model: torch.nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())


def _workload(model: str) -> Workload:
    if model == "mlp":
        return Workload(mlp, lambda b: (torch.randn(b, 3072), torch.randint(0, 10, (b,))), name="mlp")
    if model == "conv-bn":
        return Workload(conv_bn, lambda b: (torch.randn(b, 3, 32, 32), torch.randint(0, 10, (b,))), name="conv-bn")
    if model == "tiny-lm":
        return Workload(
            tiny_lm,
            lambda b: (torch.randint(0, 256, (b, 64)), torch.randint(0, 256, (b, 64))),
            loss_fn=_lm_loss,
            name="tiny-lm",
        )
    if model == "clip":
        return Workload(
            tiny_clip,
            lambda b: (torch.randn(b, 256), torch.randint(0, 256, (b, 8))),
            loss_fn=_clip_loss,
            name="clip",
        )
    if model == "gpt2":
        return Workload(
            gpt2_small,
            lambda b: {
                "input_ids": torch.randint(0, 50257, (b, GPT2_SEQ)),
                "labels": torch.randint(0, 50257, (b, GPT2_SEQ)),
            },
            name=f"gpt2 seq {GPT2_SEQ}",
        )
    raise ValueError(f"model must be one of mlp, conv-bn, tiny-lm, clip, gpt2, but got {model!r}")


@dataclass(frozen=True)
class Case:
    """One benchmark case.

    Args:
        model: ``mlp``, ``conv-bn``, ``tiny-lm``, ``clip`` or ``gpt2``.
        budget: the simulated device memory, e.g. ``"20MiB"``.
        scan: ``"full"`` scans every batch from the smallest allowed up; ``"window"`` (gpt2, too
            slow to scan from 1 on a CPU) scans a window around the boundary; see ``tools.true_max``.

    Example:
        >>> Case("mlp", "20MiB").name
        'mlp @ 20MiB'
    """

    model: str
    budget: str
    scan: str = "full"

    @property
    def name(self) -> str:
        return f"{self.model} @ {self.budget}"

    def workload(self) -> Workload:
        return _workload(self.model)


CASES: tuple[Case, ...] = (
    # The MLP's optimizer step (AdamW's temporaries) outweighs its activations below ~470
    # samples, so no budget gives it a small maximum: it covers the hundreds. Each case's
    # exhaustive scan runs every batch up to its maximum, hence few cases in the hundreds.
    Case("mlp", "20MiB"),
    Case("conv-bn", "1600KiB"),
    Case("conv-bn", "12MiB"),
    Case("conv-bn", "80MiB"),
    Case("tiny-lm", "6MiB"),
    Case("tiny-lm", "30MiB"),
    # The contrastive loss's b × b similarity matrix outweighs the activations from ~150
    # samples: memory grows with the square of the batch (a chord through one point overshoots).
    Case("clip", "2MiB"),
)

# gpt2-small in fp32 with AdamW (~2 GiB of weights, gradients and state): tens of seconds per
# step on a small CPU, so it runs only when asked for (``--gpt2``).
GPT2_CASES: tuple[Case, ...] = (Case("gpt2", "3200MiB", scan="window"),)

SMOKE_CASE = Case("conv-bn", "1600KiB")  # the test suite's quick run


def by_name(name: str) -> Case:
    """The case called ``name`` (``"mlp @ 20MiB"``)."""
    for case in CASES + GPT2_CASES:
        if case.name == name:
            return case
    raise ValueError(f"no case named {name!r}; the cases are: {', '.join(c.name for c in CASES + GPT2_CASES)}")

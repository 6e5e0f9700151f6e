"""Tiny models and workloads shared by the tests: an MLP, a conv net with BatchNorm, a transformer LM."""

from __future__ import annotations

import torch

from autobatch import Workload


def mlp() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)
    )


def cnn() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
        torch.nn.Conv2d(8, 16, 3, padding=1, stride=2), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(16, 10),
    )


class TinyLM(torch.nn.Module):
    def __init__(self, vocab: int = 128, dim: int = 32, seq: int = 32):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.pos = torch.nn.Parameter(torch.zeros(seq, dim))
        self.block = torch.nn.TransformerEncoderLayer(dim, 2, 64, dropout=0.0, batch_first=True)
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.emb(x) + self.pos[: x.shape[1]]))


def lm_loss(model: torch.nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())


def mlp_workload(model=mlp) -> Workload:
    return Workload(model, lambda b: (torch.randn(b, 64), torch.randint(0, 10, (b,))), name="mlp")


def cnn_workload(model=cnn) -> Workload:
    return Workload(model, lambda b: (torch.randn(b, 3, 16, 16), torch.randint(0, 10, (b,))), name="cnn")


def lm_workload(model=TinyLM) -> Workload:
    return Workload(
        model, lambda b: (torch.randint(0, 128, (b, 32)), torch.randint(0, 128, (b, 32))), loss_fn=lm_loss, name="lm"
    )

"""A tiny causal language model whose batches come at any sequence length.

``autobatch find --model docs/examples/causal_lm.py:workload --seq-len 32,64,128,256 …`` probes
it at each length: ``make_batch(b, seq_len)`` takes the length as its second argument. One
attention block that stores its ``s × s`` scores, so memory per sample is linear plus quadratic
in the length, as in a real decoder without flash attention.
"""

from __future__ import annotations

import math

import torch

import autobatch

VOCAB, DIM, MAX_LEN = 16, 16, 256


class TinyCausalLM(torch.nn.Module):
    def __init__(self, vocab: int = VOCAB, dim: int = DIM, max_len: int = MAX_LEN):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.pos = torch.nn.Parameter(torch.zeros(max_len, dim))
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.head = torch.nn.Linear(dim, vocab)
        # Built once, like a model's registered causal mask: no memory per batch for it.
        self.register_buffer("mask", torch.ones(max_len, max_len, dtype=torch.bool).triu(1), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        s = ids.shape[1]
        x = self.emb(ids) + self.pos[:s]
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = (q @ k.transpose(1, 2)) / math.sqrt(q.shape[-1])
        x = x + scores.masked_fill(self.mask[:s, :s], float("-inf")).softmax(-1) @ v
        return self.head(x)


def next_token_loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.roll(-1, 1).flatten())


def make_batch(b: int, seq_len: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (b, seq_len))


def workload() -> autobatch.Workload:
    return autobatch.Workload(TinyCausalLM, make_batch, loss_fn=next_token_loss, name="tiny-causal-lm")

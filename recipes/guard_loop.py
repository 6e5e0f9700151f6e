"""A plain loop that survives a rare long batch: OOMGuard splits that one step, and the update stays the same.

Run (CPU, a simulated 600 KiB device, a few seconds):
    python recipes/guard_loop.py --memory 600KiB --steps 20
On a GPU, drop --memory (the guard catches the real out-of-memory error).

What it shows: one batch in ten is 4× longer than the rest. On a budget where the short batches
fit and the long ones do not, ``OOMGuard.backward`` runs the long batch's step again as 2, 4, …
micro-batches, each loss summed over its tokens and divided by the token count of the whole
batch, so the weights end where a device that fits every batch would put them. It prints every
split and compares the final weights with that reference run.
"""

from __future__ import annotations

import argparse
import logging

import torch

import autobatch
from autobatch.checking.accumulation import token_cross_entropy
from autobatch.guard import OOMGuard

VOCAB = 64


class LM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, 32)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.GELU(), torch.nn.Linear(128, 32))
        self.head = torch.nn.Linear(32, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        return self.head(h + self.mlp(h))


def batches(steps: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(steps):
        seq = 64 if i % 10 == 3 else 16  # one batch in ten is 4x longer
        ids = torch.randint(0, VOCAB, (8, seq), generator=g)
        out.append({"input_ids": ids, "labels": ids})
    return out


def loss_fn(model: torch.nn.Module, batch: dict[str, torch.Tensor]):
    return token_cross_entropy(model(batch["input_ids"]), batch["labels"], shift=True)


def train(memory: str, steps: int) -> tuple[LM, OOMGuard]:
    torch.manual_seed(0)
    model = LM()
    guard = OOMGuard(model, loss_fn, shift=True)
    with autobatch.SimulatedBackend(memory).track(list(model.parameters())):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for batch in batches(steps):
            guard.backward(batch)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        del optimizer
    return model, guard


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--memory", default="600KiB", help="simulated memory budget")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")

    model, guard = train(args.memory, args.steps)
    reference, _ = train("64MiB", args.steps)  # every batch fits whole
    worst = max(((a - b).norm() / a.norm()).item() for a, b in zip(reference.parameters(), model.parameters()))
    print(f"split steps: {[s.step for s in guard.history]} of {guard.steps}, "
          f"micro-batches per batch: {[s.pieces for s in guard.history]}")
    print(f"largest relative weight difference to the run that fits every batch: {worst:.1e}")
    print("same weights" if worst <= 1e-5 else "DIFFERENT weights")


if __name__ == "__main__":
    main()

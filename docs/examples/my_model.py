"""Your own model for ``autobatch find --model docs/examples/my_model.py:FUNCTION``.

``build`` returns an ``nn.Module``: autobatch trains it as a classifier on random inputs of
``--input-shape`` with ``--num-classes`` classes. ``workload`` returns a complete
``autobatch.Workload`` for anything else (your batches, your loss, your optimizer).
"""

from __future__ import annotations

import torch

import autobatch


def build() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(),
        torch.nn.Conv2d(16, 16, 3, padding=1, stride=2), torch.nn.ReLU(),
        torch.nn.Flatten(), torch.nn.Linear(16 * 16 * 16, 10),
    )


def workload() -> autobatch.Workload:
    def make_batch(b: int) -> dict[str, torch.Tensor]:
        return {"image": torch.randn(b, 3, 32, 32), "target": torch.randn(b, 10)}

    def loss_fn(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.nn.functional.mse_loss(model(batch["image"]), batch["target"])

    return autobatch.Workload(build, make_batch, loss_fn=loss_fn, optimizer="sgd", name="my-regressor")

"""The benchmark's vision and contrastive models, built from transformers configs (random weights).

Each function returns a complete :class:`~autobatch.Workload`, so ``--model
benchmarks/wall_models.py:vit_base`` works as any ``file.py:fn`` model does.
"""

from __future__ import annotations

import torch

from autobatch import Workload

__all__ = ["vit_base", "clip_base"]


def vit_base() -> Workload:
    """ViT-B/16 image classification at 224×224, 1000 classes (86M parameters)."""
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(num_labels=1000)

    def make_batch(b: int) -> dict[str, torch.Tensor]:
        return {"pixel_values": torch.randn(b, 3, 224, 224), "labels": torch.randint(0, 1000, (b,))}

    return Workload(lambda: ViTForImageClassification(config), make_batch, name="vit-base")


def clip_base() -> Workload:
    """CLIP ViT-B/32 with its text tower at 77 tokens, trained on the contrastive loss (151M
    parameters): its logits are batch × batch, so memory grows with the square of the batch."""
    from transformers import CLIPConfig, CLIPModel

    config = CLIPConfig()

    def make_batch(b: int) -> dict[str, torch.Tensor]:
        return {
            "input_ids": torch.randint(0, config.text_config.vocab_size, (b, 77)),
            "pixel_values": torch.randn(b, 3, config.vision_config.image_size, config.vision_config.image_size),
        }

    def loss_fn(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return model(**batch, return_loss=True).loss

    return Workload(lambda: CLIPModel(config), make_batch, loss_fn=loss_fn, name="clip-base")

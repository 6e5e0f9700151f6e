"""Facts about a model that change which batches are legal."""

from __future__ import annotations

import torch

__all__ = ["has_batchnorm", "min_batch_for"]


def has_batchnorm(model: torch.nn.Module) -> bool:
    """True when the model has a BatchNorm layer (or SyncBatchNorm), which needs ≥ 2 samples."""
    return any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())


def min_batch_for(model: torch.nn.Module) -> int:
    """The smallest per-device batch the model trains with: 2 with BatchNorm (field report 4), else 1."""
    return 2 if has_batchnorm(model) else 1

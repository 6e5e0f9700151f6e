"""Facts about a model that change which batches are legal."""

from __future__ import annotations

import torch

from .errors import AutobatchError

__all__ = ["has_batchnorm", "min_batch_for", "require_materialized"]


def has_batchnorm(model: torch.nn.Module) -> bool:
    """True when the model has a BatchNorm layer (or SyncBatchNorm), which needs ≥ 2 samples."""
    return any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())


def min_batch_for(model: torch.nn.Module) -> int:
    """The smallest per-device batch the model trains with: 2 with BatchNorm (field report 4), else 1."""
    return 2 if has_batchnorm(model) else 1


def require_materialized(model: torch.nn.Module) -> torch.nn.Module:
    """``model``, or a one-line error when lazy modules (``nn.LazyLinear``, …) have no shapes yet.

    A lazy parameter gets its shape at the first forward pass; until then its memory, and so any
    batch size, is unknown.
    """
    lazy = sorted({
        type(module).__name__
        for module in model.modules()
        for tensor in (*module._parameters.values(), *module._buffers.values())
        if tensor is not None and torch.nn.parameter.is_lazy(tensor)
    })
    if lazy:
        raise AutobatchError(
            f"every parameter must have a shape before probing, but the model has uninitialized lazy modules "
            f"({', '.join(lazy)}); run one forward pass on a sample batch before passing it, or use the "
            "non-lazy layers (nn.Linear, nn.Conv2d, …)"
        )
    return model

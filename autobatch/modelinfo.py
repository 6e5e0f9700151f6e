"""Facts about a model that change which batches are legal.

Importing it imports no torch (``check`` of a setup without a model stays light); the functions
that read a model import it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

from .errors import AutobatchError

__all__ = ["batchnorm_layers", "batchnorm_record", "has_batchnorm", "min_batch_for", "per_gpu_statistics", "require_materialized"]


def has_batchnorm(model: torch.nn.Module) -> bool:
    """True when the model has a BatchNorm layer (or SyncBatchNorm), which needs ≥ 2 samples."""
    return bool(batchnorm_layers(model))


def batchnorm_layers(model: torch.nn.Module) -> tuple[str, ...]:
    """The kinds of BatchNorm layer in the model, by class name (``("BatchNorm2d", "SyncBatchNorm")``)."""
    from torch.nn.modules.batchnorm import _BatchNorm

    return tuple(sorted({type(m).__name__ for m in model.modules() if isinstance(m, _BatchNorm)}))


def batchnorm_record(model: torch.nn.Module) -> dict[str, list[str]]:
    """``{"batchnorm": [...]}`` for a result's ``extra`` (what :func:`batchnorm_layers` names), or ``{}``."""
    layers = batchnorm_layers(model)
    return {"batchnorm": list(layers)} if layers else {}


def per_gpu_statistics(layers: tuple[str, ...] | list[str], ranks: int) -> tuple[str, ...]:
    """Those of ``layers`` whose training statistics come from each GPU's own micro batch: every
    BatchNorm, and SyncBatchNorm where one rank trains (on more it reduces them over the ranks, and
    trains on one sample per GPU; torch refuses that only on one rank).

    Example:
        >>> per_gpu_statistics(("BatchNorm2d", "SyncBatchNorm"), 8), per_gpu_statistics(("SyncBatchNorm",), 1)
        (('BatchNorm2d',), ('SyncBatchNorm',))
    """
    return tuple(name for name in layers if name != "SyncBatchNorm" or ranks < 2)


def min_batch_for(model: torch.nn.Module) -> int:
    """The smallest per-device batch the model trains with: 2 with BatchNorm (field report 4), else 1."""
    return 2 if has_batchnorm(model) else 1


def require_materialized(model: torch.nn.Module) -> torch.nn.Module:
    """``model``, or a one-line error when lazy modules (``nn.LazyLinear``, …) have no shapes yet.

    A lazy parameter gets its shape at the first forward pass; until then its memory, and so any
    batch size, is unknown.
    """
    from torch.nn.parameter import is_lazy

    lazy = sorted({
        type(module).__name__
        for module in model.modules()
        for tensor in (*module._parameters.values(), *module._buffers.values())
        if tensor is not None and is_lazy(tensor)
    })
    if lazy:
        raise AutobatchError(
            f"every parameter must have a shape before probing, but the model has uninitialized lazy modules "
            f"({', '.join(lazy)}); run one forward pass on a sample batch before passing it, or use the "
            "non-lazy layers (nn.Linear, nn.Conv2d, …)"
        )
    return model

"""Batches for the accumulation check: split a global batch, build padded LM batches, token losses."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..errors import AutobatchError
from .accumulation import token_cross_entropy

__all__ = ["split_batch", "padded_lm_batch", "lm_token_loss"]


LossFn = Callable[[torch.nn.Module, Any], torch.Tensor]


TokenLossFn = Callable[[torch.nn.Module, Any], "tuple[torch.Tensor, torch.Tensor | None]"]


def _batch_size(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0])
    values = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (list, tuple)) else ()
    for v in values:
        if isinstance(v, torch.Tensor) and v.dim():
            return int(v.shape[0])
    raise AutobatchError(
        f"cannot find the batch dimension of a {type(batch).__name__}; pass a tensor, or a dict/tuple of tensors "
        "with the samples on dim 0"
    )


def _slice(batch: Any, start: int, stop: int, size: int) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch[start:stop] if batch.dim() and batch.shape[0] == size else batch
    if isinstance(batch, Mapping):
        return {k: _slice(v, start, stop, size) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_slice(v, start, stop, size) for v in batch)
    return batch  # non-tensor values (flags, strings) belong to every micro-batch


def split_batch(batch: Any, micro_batch: int) -> list[Any]:
    """Cut a batch into consecutive micro-batches of ``micro_batch`` samples along dim 0.

    Tensors whose first dimension is the batch are sliced; everything else is shared.

    Example:
        >>> [t.tolist() for t in split_batch(torch.arange(4), 2)]
        [[0, 1], [2, 3]]
    """
    size = _batch_size(batch)
    if micro_batch < 1 or size % micro_batch:
        raise AutobatchError(f"the batch of {size} samples does not split into micro-batches of {micro_batch}")
    return [_slice(batch, i, i + micro_batch, size) for i in range(0, size, micro_batch)]


def _to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, Mapping):
        return {k: _to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to_device(v, device) for v in batch)
    return batch


def padded_lm_batch(
    batch_size: int,
    seq_len: int,
    vocab_size: int,
    *,
    seed: int = 0,
    min_len: int = 2,
    pad_token_id: int = 0,
    groups: int = 1,
) -> dict[str, torch.Tensor]:
    """A language-model batch of right-padded sequences whose lengths differ widely.

    Lengths are spread evenly from ``min_len`` to ``seq_len`` and shuffled, so micro-batches
    hold very different numbers of tokens and a mean of means is visible. Split into ``groups``
    equal micro-batches in order, they never all hold the same number of tokens where the lengths
    differ at all (a shuffle that pairs 2 with 64 and 23 with 43 would hide a mean of means).

    Returns:
        ``{"input_ids", "attention_mask", "labels"}``, each ``(batch_size, seq_len)``; labels
        are the input ids with -100 on padding (HF convention; the loss shifts them).

    Example:
        >>> b = padded_lm_batch(4, 8, 50)
        >>> sorted(b["attention_mask"].sum(1).tolist())
        [2, 4, 6, 8]
    """
    if seq_len < min_len or min_len < 2:
        raise AutobatchError(f"seq_len must be at least {max(2, min_len)} (the padded batch spreads its lengths from "
                             f"{max(2, min_len)} up), but got seq_len={seq_len}")
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.linspace(min_len, seq_len, batch_size).round().long()
    lengths = _uneven_groups(lengths[torch.randperm(batch_size, generator=gen)], groups)
    ids = torch.randint(1 if pad_token_id == 0 else 0, vocab_size, (batch_size, seq_len), generator=gen)
    mask = torch.arange(seq_len)[None, :] < lengths[:, None]
    ids = torch.where(mask, ids, torch.full_like(ids, pad_token_id))
    labels = torch.where(mask, ids, torch.full_like(ids, -100))
    return {"input_ids": ids, "attention_mask": mask.long(), "labels": labels}


def _uneven_groups(lengths: torch.Tensor, groups: int) -> torch.Tensor:
    """``lengths`` with two entries swapped where its ``groups`` consecutive equal parts would all sum alike:
    the first of the first part with the first entry of another part that differs from it."""
    size = len(lengths) // groups if groups > 0 and len(lengths) % groups == 0 else 0
    if size == 0 or groups == 1 or len(set(lengths.view(groups, size).sum(1).tolist())) > 1:
        return lengths
    other = next((j for j in range(size, len(lengths)) if lengths[j] != lengths[0]), None)
    if other is None:
        return lengths  # every part is alike: nothing tells them apart
    lengths = lengths.clone()
    lengths[[0, other]] = lengths[[other, 0]]
    return lengths


def _takes_attention_mask(model: torch.nn.Module) -> bool:
    params = inspect.signature(model.forward).parameters.values()
    return any(p.name == "attention_mask" or p.kind is p.VAR_KEYWORD for p in params)


def lm_token_loss(shift: bool = True) -> TokenLossFn:
    """A token-level loss for HF-style language models: ``(model, batch) -> (per_token_loss, mask)``.

    Calls ``model(input_ids=…, attention_mask=…)`` and reads ``.logits`` (or the output tensor).

    Args:
        shift: True for causal LMs (predict the next token), False for masked LMs.
    """

    def token_loss(model: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        if _takes_attention_mask(model):
            out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        else:  # plain modules that take the ids only
            out = model(batch["input_ids"])
        logits = out if isinstance(out, torch.Tensor) else out["logits"] if isinstance(out, Mapping) else out.logits
        return token_cross_entropy(logits, batch["labels"], shift=shift)

    return token_loss

def _mask_of(losses: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    return torch.ones_like(losses, dtype=torch.bool) if mask is None else mask.bool()

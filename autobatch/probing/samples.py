"""The worst case a dataset sample holds: its longest sequence, and batches made of it.

Memory follows the longest sequence a batch is padded to, not the typical one. Given real
batches (or single samples), :func:`longest_sample` finds the longest sequence the model will
see and where it is; :func:`repeat_sample` builds batches of any size from that sample, so the
probe trains on the real worst case rather than on a guessed shape.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import AutobatchError

__all__ = ["LongestSample", "longest_sample", "repeat_sample", "takes_seq_len", "default_seq_len", "check_sample_count"]

_MASK_KEYS = ("attention_mask",)


@dataclass(frozen=True)
class LongestSample:
    """Where the longest sequence of a dataset sample is, and how long it is.

    ``seq_len`` is the length the model sees (the padded length of the batch that holds it);
    ``real_tokens`` the tokens its attention mask keeps, when there is a mask.
    """

    seq_len: int
    real_tokens: int | None
    batch_index: int
    row: int
    batches: int
    samples: int
    sample: Any  # the batch that holds it, kept to build batches from

    def __str__(self) -> str:
        real = "" if self.real_tokens is None or self.real_tokens == self.seq_len else (
            f" ({self.real_tokens} real tokens, padded to {self.seq_len})")
        return (f"longest sequence in the sample: {self.seq_len} tokens{real}, batch {self.batch_index} row "
                f"{self.row}, of {self.samples:,} samples in {self.batches:,} batches")

    def to_dict(self) -> dict[str, Any]:
        return {"seq_len": self.seq_len, "real_tokens": self.real_tokens, "batch_index": self.batch_index,
                "row": self.row, "batches": self.batches, "samples": self.samples}


def _as_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, int) for v in value):
        return torch.tensor(value)
    return None


def _sequence(batch: Any) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The token tensor of a batch (or a single sample) and its attention mask, if any."""
    if isinstance(batch, Mapping):
        mask = next((_as_tensor(batch[k]) for k in _MASK_KEYS if k in batch), None)
        for key in ("input_ids", *batch.keys()):
            if key in batch and (tensor := _as_tensor(batch[key])) is not None and tensor.dim() >= 1:
                return tensor, mask
        return None
    if isinstance(batch, (list, tuple)) and batch and not isinstance(batch[0], int):
        return _sequence(batch[0])  # (inputs, targets): the inputs
    tensor = _as_tensor(batch)
    return (tensor, None) if tensor is not None and tensor.dim() >= 1 else None


def longest_sample(batches: Iterable[Any]) -> LongestSample:
    """Scan ``batches`` and return the longest sequence in them.

    Each item is a batch (a ``[b, s, …]`` tensor, a ``(inputs, targets)`` pair, a dict of tensors
    with ``input_ids``) or a single sample (``[s]`` tensor, a list of token ids, a dict of them).

    Example:
        >>> batches = [torch.zeros(4, 100, dtype=torch.long), torch.zeros(2, 300, dtype=torch.long)]
        >>> longest_sample(batches).seq_len
        300
    """
    best: LongestSample | None = None
    count = samples = 0
    for index, batch in enumerate(batches):
        count += 1
        found = _sequence(batch)
        if found is None:
            raise AutobatchError(
                f"batch {index} holds no token tensor (a tensor, (inputs, targets) or a dict with input_ids), "
                f"but a {type(batch).__name__}; pass batches of token ids"
            )
        tokens, mask = found
        single = tokens.dim() == 1
        rows = 1 if single else tokens.shape[0]
        samples += rows
        length = int(tokens.shape[-1] if single else tokens.shape[1])
        real = None
        row = 0
        if mask is not None:
            per_row = mask.reshape(rows, -1).sum(dim=1)
            row = int(per_row.argmax())
            real = int(per_row[row])
        if best is None or length > best.seq_len or (length == best.seq_len and (real or 0) > (best.real_tokens or 0)):
            best = LongestSample(length, real, index, row, 0, 0, batch)
    if best is None:
        raise AutobatchError("the dataset sample is empty; pass at least one batch")
    return LongestSample(best.seq_len, best.real_tokens, best.batch_index, best.row, count, samples, best.sample)


def _repeat(value: Any, row: int, rows: int, b: int, single: bool) -> Any:
    tensor = _as_tensor(value)
    if tensor is None:
        return value
    if single:
        return tensor.unsqueeze(0).expand(b, *tensor.shape).clone()
    if tensor.dim() >= 1 and tensor.shape[0] == rows:
        return tensor[row : row + 1].expand(b, *tensor.shape[1:]).clone()
    return tensor


def repeat_sample(longest: LongestSample) -> Callable[[int], Any]:
    """``make_batch(b)``: ``b`` copies of the longest sample, in the structure its batch had."""
    tokens, _ = _sequence(longest.sample)
    single = tokens.dim() == 1
    rows = 1 if single else tokens.shape[0]

    def make_batch(b: int) -> Any:
        sample = longest.sample
        if isinstance(sample, Mapping):
            return {k: _repeat(v, longest.row, rows, b, single) for k, v in sample.items()}
        if isinstance(sample, (list, tuple)) and sample and not isinstance(sample[0], int):
            return type(sample)(_repeat(v, longest.row, rows, b, single) for v in sample)
        return _repeat(sample, longest.row, rows, b, single)

    return make_batch


def takes_seq_len(make_batch: Callable[..., Any]) -> bool:
    """True when ``make_batch`` accepts a second argument, the sequence length."""
    try:
        params = inspect.signature(make_batch).parameters.values()
    except (TypeError, ValueError):  # builtins without a signature: assume the common form
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 2 or any(p.kind == p.VAR_POSITIONAL for p in params)


def default_seq_len(make_batch: Callable[..., Any]) -> int | None:
    """The default of ``make_batch``'s second argument, the sequence length, where it has a whole one.

    Example:
        >>> default_seq_len(lambda b, seq_len=128: None), default_seq_len(lambda b, seq_len: None)
        (128, None)
    """
    try:
        params = list(inspect.signature(make_batch).parameters.values())
    except (TypeError, ValueError):
        return None
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) < 2:
        return None
    default = positional[1].default
    return default if isinstance(default, int) and not isinstance(default, bool) and default >= 1 else None


def _shapes(batch: Any) -> list[tuple[int, ...]]:
    if isinstance(batch, torch.Tensor):
        return [tuple(batch.shape)]
    if isinstance(batch, Mapping):
        return [shape for value in batch.values() for shape in _shapes(value)]
    if isinstance(batch, (list, tuple)):
        return [shape for value in batch for shape in _shapes(value)]
    return []


def check_sample_count(batch: Any, batch_size: int, make_batch: Callable[..., Any] | None = None) -> None:
    """Refuse a batch in which no tensor has a dimension of ``batch_size``: ``make_batch`` ignored ``b``.

    A ``make_batch`` that always returns the same few samples trains at no batch but its own, and
    the probe would call every batch a fit ("max batch 1048576"). Batches with no tensors, and
    tensors of no dimension only, are left to the model.

    Example:
        >>> check_sample_count(torch.zeros(3, 8), 1)
        Traceback (most recent call last):
        ...
        autobatch.errors.AutobatchError: make_batch(1) must return a batch of 1 samples, but no tensor in it has a dimension of 1 (shapes: (3, 8)); build every tensor from b, e.g. torch.randn(b, 64)
    """
    shapes = [shape for shape in _shapes(batch) if shape]
    if not shapes or any(batch_size in shape for shape in shapes):
        return
    where = ""
    if make_batch is not None:
        code = getattr(make_batch, "__code__", None)
        if code is not None:
            where = f" ({code.co_filename}:{code.co_firstlineno}, {getattr(make_batch, '__qualname__', 'make_batch')})"
    listed = ", ".join(str(shape) for shape in shapes[:4]) + (", …" if len(shapes) > 4 else "")
    raise AutobatchError(
        f"make_batch({batch_size}) must return a batch of {batch_size} samples, but no tensor in it has a dimension "
        f"of {batch_size} (shapes: {listed}){where}; build every tensor from b, e.g. torch.randn(b, 64)"
    )

"""Losses that make gradient accumulation equal the big batch (field report 2).

The bug: a token loss with ``reduction="mean"`` averages over *each micro-batch's own*
non-padding tokens, and the training loop then averages those means over the GA steps
(``loss / grad_accum``). A token in a short micro-batch weighs more than a token in a long one:
a mean of means, not the mean over the big batch.

The fix: sum the per-token losses and divide by the number of non-ignored tokens in the
*whole* accumulated batch, counted up front over the GA micro-batches (and over all
data-parallel ranks). :func:`count_loss_tokens` does the counting and returns a
:class:`LossNormaliser` that turns each micro-batch's summed loss into its share of the
big-batch mean. :func:`count_loss_samples` does the same for per-sample losses.

Distributed maths. DDP, FSDP and DeepSpeed *average* gradients over the ``W`` ranks, so a
rank's loss must be ``sum_of_its_token_losses * W / N`` with ``N`` the token count over all
ranks: the average over ranks of ``W / N * (rank's sum)`` is ``(sum over all ranks) / N``, the
big-batch mean. When gradients are *summed* over ranks instead, the factor is ``1 / N``
(``grad_reduction="sum"``).

Example (a plain loop; see ``recipes/plain_loop_ga.py`` for the runnable version)::

    micro_batches = [next(data) for _ in range(grad_accum)]
    norm = count_loss_tokens(micro_batches, shift=True)        # all-reduced when distributed
    for mb in micro_batches:
        logits = model(mb["input_ids"])
        loss = norm.token_loss(*token_cross_entropy(logits, mb["labels"], shift=True))
        loss.backward()                                         # no "/ grad_accum": it is in norm
    optimizer.step()
    optimizer.zero_grad()
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from ..errors import AutobatchError

__all__ = [
    "LossNormaliser",
    "count_loss_tokens",
    "count_loss_samples",
    "token_cross_entropy",
]

GradReduction = Literal["mean", "sum"]


@dataclass(frozen=True)
class LossNormaliser:
    """Turns one micro-batch's *summed* loss into its share of the big-batch mean.

    ``loss = sum_of_item_losses * world_size / total``. Summed over the GA micro-batches
    and averaged over ``world_size`` ranks (what DDP does), the gradients equal those of the
    mean loss over the whole global batch.

    Usually built by :func:`count_loss_tokens` or :func:`count_loss_samples`; build it
    directly when you already know the count (e.g. HF Trainer's ``num_items_in_batch``).

    Args:
        total: Non-ignored items (tokens or samples) in the whole accumulated global batch:
            every GA micro-batch on every rank.
        world_size: The number of ranks gradients are *averaged* over; 1 when they are summed
            or when training on one device.

    Example:
        >>> norm = LossNormaliser(total=8)
        >>> float(norm.token_loss(torch.tensor([1.0, 3.0, 9.0]), torch.tensor([True, True, False])))
        0.5
    """

    total: int
    world_size: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.total, bool) or not isinstance(self.total, int) or self.total <= 0:
            raise AutobatchError(
                f"the accumulated batch must hold at least one non-ignored item, but got total={self.total!r}; "
                "check that not every label equals ignore_index (-100) in all GA micro-batches"
            )
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int) or self.world_size < 1:
            raise AutobatchError(f"world_size must be a positive integer, but got world_size={self.world_size!r}")

    @property
    def factor(self) -> float:
        """What each summed item loss is multiplied by: ``world_size / total``."""
        return self.world_size / self.total

    def __call__(self, loss_sum: torch.Tensor) -> torch.Tensor:
        """Scale a loss already summed over this micro-batch's non-ignored items."""
        return loss_sum * self.factor

    def token_loss(self, per_token_loss: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """This micro-batch's share of the big-batch mean, from per-token losses and a mask.

        Args:
            per_token_loss: Unreduced losses (e.g. ``cross_entropy(..., reduction="none")``).
            mask: True (or 1) where the token counts; same shape. ``None``: every entry counts.
        """
        if mask is None:
            return self(per_token_loss.sum())
        if mask.shape != per_token_loss.shape:
            raise AutobatchError(
                f"mask must have the shape of the per-token losses, but got {tuple(mask.shape)} "
                f"for losses of shape {tuple(per_token_loss.shape)}"
            )
        # where(), not multiply: a masked position may hold inf/NaN (e.g. an all-padding row).
        kept = torch.where(mask.bool(), per_token_loss, torch.zeros_like(per_token_loss))
        return self(kept.sum())

    def sample_loss(self, per_sample_loss: torch.Tensor) -> torch.Tensor:
        """This micro-batch's share of the big-batch mean, from per-sample losses (``reduction="none"``)."""
        return self(per_sample_loss.sum())

    def rescale_mean(self, mean_loss: torch.Tensor, count: int | torch.Tensor) -> torch.Tensor:
        """Turn a loss that is a *mean over this micro-batch's* ``count`` items into its share.

        Handy when the model returns a mean loss (e.g. ``model(**batch).loss``) and you know
        how many items it averaged over: ``mean * count`` is the sum, then scaled as usual.
        """
        return self(mean_loss * count)


def _distributed_world(group: Any = None) -> int | None:
    """The world size when a process group is initialised, else ``None``."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(group)
    return None


def _all_reduce_count(count: int, device: torch.device, group: Any) -> int:
    dist = torch.distributed
    # NCCL only reduces CUDA tensors; gloo reduces CPU ones.
    if dist.get_backend(group) == "nccl" and device.type != "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    t = torch.tensor([count], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return int(t.item())


def _finish(local: int, device: torch.device, grad_reduction: GradReduction, group: Any) -> LossNormaliser:
    if grad_reduction not in ("mean", "sum"):
        raise AutobatchError(
            f"grad_reduction must be 'mean' (DDP, FSDP, DeepSpeed average gradients) or 'sum', "
            f"but got {grad_reduction!r}"
        )
    world = _distributed_world(group)
    if world is None:
        return LossNormaliser(total=local, world_size=1)
    total = _all_reduce_count(local, device, group)
    return LossNormaliser(total=total, world_size=world if grad_reduction == "mean" else 1)


def count_loss_tokens(
    micro_batches: Iterable[torch.Tensor | Mapping[str, Any]],
    *,
    ignore_index: int = -100,
    shift: bool = False,
    label_key: str = "labels",
    grad_reduction: GradReduction = "mean",
    group: Any = None,
) -> LossNormaliser:
    """Count the non-ignored tokens of all GA micro-batches (all ranks) before the first backward.

    When a ``torch.distributed`` process group is initialised, the count is summed over the
    ranks with ``all_reduce`` (every rank must call this, collectively) and the normaliser
    carries ``world_size`` so that DDP's gradient *averaging* gives the big-batch mean.

    Args:
        micro_batches: This rank's GA micro-batches: label tensors, bool masks (True = counts),
            or mappings holding ``label_key``.
        ignore_index: The label value that does not count (-100 in PyTorch and HF).
        shift: Count ``labels[..., 1:]``, as a causal LM loss does after shifting (the first
            position is never a target).
        label_key: Where the labels are in a mapping batch.
        grad_reduction: How gradients are combined over ranks: ``"mean"`` (DDP, FSDP,
            DeepSpeed) or ``"sum"`` (your own ``all_reduce(SUM)``).
        group: The process group, ``None`` for the default one.

    Example:
        >>> labels = [torch.tensor([[5, 6, -100]]), torch.tensor([[7, 8, 9]])]
        >>> count_loss_tokens(labels).total
        5
    """
    local = 0
    device = torch.device("cpu")
    for i, mb in enumerate(micro_batches):
        labels = mb
        if isinstance(mb, Mapping):
            if label_key not in mb:
                raise AutobatchError(
                    f"micro-batch {i} has no {label_key!r} key (keys: {', '.join(map(str, mb))}); "
                    "pass label_key=… or the label tensors themselves"
                )
            labels = mb[label_key]
        if not isinstance(labels, torch.Tensor):
            raise AutobatchError(
                f"micro-batch {i} must be a label tensor, a bool mask or a mapping with {label_key!r}, "
                f"but got {type(labels).__name__}"
            )
        if shift:
            labels = labels[..., 1:]
        counted = labels if labels.dtype == torch.bool else labels != ignore_index
        local += int(counted.sum().item())
        device = labels.device
    return _finish(local, device, grad_reduction, group)


def _sample_count(item: Any, index: int) -> tuple[int, torch.device]:
    if isinstance(item, bool):
        raise AutobatchError(f"micro-batch {index} must be a batch or a sample count, but got {item!r}")
    if isinstance(item, int):
        return item, torch.device("cpu")
    if isinstance(item, torch.Tensor):
        return (int(item.shape[0]) if item.dim() else 1), item.device
    values = item.values() if isinstance(item, Mapping) else item if isinstance(item, Sequence) else ()
    for value in values:
        if isinstance(value, torch.Tensor) and value.dim():
            return int(value.shape[0]), value.device
    raise AutobatchError(
        f"cannot tell how many samples micro-batch {index} holds ({type(item).__name__}); "
        "pass sample counts (ints) or tensors with the batch on dim 0"
    )


def count_loss_samples(
    micro_batches: Iterable[Any],
    *,
    grad_reduction: GradReduction = "mean",
    group: Any = None,
) -> LossNormaliser:
    """Count the samples of all GA micro-batches (all ranks), for per-sample losses.

    Needed when micro-batches differ in size (the last batch of an epoch, packed or filtered
    data): a mean per micro-batch would weigh samples of small micro-batches more.

    Args:
        micro_batches: This rank's micro-batches: ints (sample counts), tensors, or
            mappings/tuples whose first tensor has the batch on dim 0.
        grad_reduction: ``"mean"`` when gradients are averaged over ranks (DDP), else ``"sum"``.
        group: The process group, ``None`` for the default one.

    Example:
        >>> norm = count_loss_samples([3, 1])
        >>> float(norm.sample_loss(torch.ones(3)) + norm.sample_loss(torch.ones(1)))
        1.0
    """
    local = 0
    device = torch.device("cpu")
    for i, mb in enumerate(micro_batches):
        n, device = _sample_count(mb, i)
        local += n
    return _finish(local, device, grad_reduction, group)


def token_cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    shift: bool = False,
    ignore_index: int = -100,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token cross-entropy and the mask of tokens that count, ready for :meth:`LossNormaliser.token_loss`.

    Args:
        logits: ``(batch, seq, vocab)``.
        labels: ``(batch, seq)`` with ``ignore_index`` where no loss is taken (padding).
        shift: Predict token ``t+1`` from position ``t`` (causal LM); the result has ``seq - 1`` columns.
        ignore_index: The label value that does not count.

    Returns:
        ``(losses, mask)``, both ``(batch, seq)`` (or ``seq - 1`` with ``shift``); losses are fp32.

    Example:
        >>> losses, mask = token_cross_entropy(torch.zeros(1, 3, 4), torch.tensor([[1, 2, -100]]), shift=True)
        >>> mask.tolist()
        [[True, False]]
    """
    if shift:
        logits, labels = logits[..., :-1, :], labels[..., 1:]
    # fp32 so that bf16/fp16 logits do not lose the loss's precision before summing.
    losses = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), ignore_index=ignore_index, reduction="none"
    ).view(labels.shape)
    return losses, labels != ignore_index

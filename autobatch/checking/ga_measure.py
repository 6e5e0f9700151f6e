"""Measuring a gradient two ways: one big batch, and micro-batches accumulated over simulated ranks.

Runs in exact fp32 with dropout quieted, so any difference comes from the loss arithmetic.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import AutobatchError
from ..probing.workload import step_loss
from .accumulation import LossNormaliser
from .ga_batches import LossFn, TokenLossFn, _batch_size, _mask_of

__all__ = ["ParamGradComparison"]


@dataclass(frozen=True)
class ParamGradComparison:
    """One parameter's accumulated gradient against its big-batch gradient."""

    name: str
    numel: int
    rel_error: float  # ||g_acc - g_big|| / ||g_big||
    cosine: float


@contextlib.contextmanager
def _exact_fp32() -> Iterator[None]:
    """TF32 off while comparing: its 10-bit mantissa would hide the error we measure."""
    precision = torch.get_float32_matmul_precision()
    cudnn_tf32 = torch.backends.cudnn.allow_tf32
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(precision)
        torch.backends.cudnn.allow_tf32 = cudnn_tf32


def _quiet_dropout(model: torch.nn.Module) -> int:
    """Turn off dropout on the copy; returns how many dropout layers were switched off."""
    n = 0
    for m in model.modules():
        if isinstance(m, torch.nn.modules.dropout._DropoutNd):
            m.p = 0.0
            m.eval()
            n += 1
        # Attention layers often keep a float and call F.dropout(…, p=self.attention_dropout).
        for attr in ("attention_dropout", "attn_dropout", "dropout", "dropout_p", "drop_prob"):
            if isinstance(getattr(m, attr, None), float):
                setattr(m, attr, 0.0)
    config = getattr(model, "config", None)
    for key in list(vars(config)) if config is not None and hasattr(config, "__dict__") else ():
        if ("dropout" in key or "pdrop" in key) and isinstance(getattr(config, key), float):
            setattr(config, key, 0.0)
    return n


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p, dtype=torch.float32)).float()
        for name, p in model.named_parameters()
        if p.requires_grad
    }


def _zero(model: torch.nn.Module) -> None:
    for p in model.parameters():
        p.grad = None


def _compare(acc: dict[str, torch.Tensor], big: dict[str, torch.Tensor]) -> tuple[float, float, float, tuple[ParamGradComparison, ...]]:
    rows = []
    diff_sq = big_sq = acc_sq = dot = 0.0
    for name, b in big.items():
        a = acc[name]
        d = float((a - b).double().norm()) ** 2
        nb, na = float(b.double().norm()), float(a.double().norm())
        ab = float((a.double() * b.double()).sum())
        diff_sq, big_sq, acc_sq, dot = diff_sq + d, big_sq + nb**2, acc_sq + na**2, dot + ab
        rel = math.sqrt(d) / nb if nb > 0 else (0.0 if na == 0 else math.inf)
        cos = ab / (na * nb) if na > 0 and nb > 0 else (1.0 if na == nb == 0 else 0.0)
        rows.append(ParamGradComparison(name=name, numel=b.numel(), rel_error=rel, cosine=cos))
    if big_sq == 0:
        raise AutobatchError("the big-batch gradient is zero everywhere; the loss does not depend on the parameters")
    rel = math.sqrt(diff_sq / big_sq)
    cosine = dot / math.sqrt(big_sq * acc_sq) if acc_sq > 0 else 0.0
    return rel, cosine, math.sqrt(acc_sq / big_sq), tuple(rows)


def _backward(loss: torch.Tensor) -> None:
    """The loss's backward (its own function: an error here is the user's loss or model, and says so)."""
    loss.backward()


@dataclass
class _Measured:
    rel: float
    cosine: float
    ratio: float
    rows: tuple[ParamGradComparison, ...]
    repro_error: float
    loss_big: float
    loss_acc: float
    counts: list[int]
    item_kind: str


@dataclass
class _Measure:
    """One big-batch run, a repeat with another seed, and the micro × GA × ranks run, on ``work``."""

    work: torch.nn.Module
    batch: Any
    micro: list[Any]
    ranks: list[list[Any]]
    grad_accum: int
    world_size: int
    loss_fn: LossFn | None
    token_loss_fn: TokenLossFn | None
    mode: str
    seed: int

    def _items(self, b: Any, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        torch.manual_seed(seed)  # the same RNG draw in every pass, whatever randomness is left
        losses, mask = self.token_loss_fn(self.work, b)  # type: ignore[misc]
        return losses, _mask_of(losses, mask)

    def _mean(self, b: Any, seed: int) -> torch.Tensor:
        """The loss as a mean over this batch's own items (the big-batch loss, or a naive micro-batch loss)."""
        if self.token_loss_fn is None:
            torch.manual_seed(seed)
            return step_loss(self.loss_fn, self.work, b)  # one scalar, or one line
        losses, mask = self._items(b, seed)
        return torch.where(mask, losses, torch.zeros_like(losses)).sum() / mask.sum()

    def run(self) -> _Measured:
        seed, work = self.seed, self.work
        # Item counts up front: the helper needs the whole accumulated batch's count before any backward.
        if self.token_loss_fn is not None:
            with torch.no_grad():
                masks = [self._items(b, seed)[1] for b in self.micro]
            counts = [int(m.sum()) for m in masks]
            item_kind = "tokens" if masks[0].dim() > 1 else "samples"
        elif self.mode == "naive" and all(isinstance(b, Mapping) and "labels" in b for b in self.micro):
            # Only to explain a failure: the labelled tokens a mean-reduced LM loss averages over.
            counts, item_kind = [int((b["labels"] != -100).sum()) for b in self.micro], "tokens"
        else:
            counts, item_kind = [_batch_size(b) for b in self.micro], "samples"

        # The reference, then again with another seed: a big batch that does not reproduce its
        # own gradient leaves nothing to judge GA against.
        _zero(work)
        loss = self._mean(self.batch, seed)
        _backward(loss)
        loss_big = float(loss.detach())
        big = _grads(work)
        _zero(work)
        _backward(self._mean(self.batch, seed + 1))
        repro_error = _compare(_grads(work), big)[0]

        acc = {k: torch.zeros_like(v) for k, v in big.items()}
        loss_acc = 0.0
        norm = LossNormaliser(total=sum(counts), world_size=self.world_size) if self.mode == "normalised" else None
        for rank_batches in self.ranks:
            _zero(work)  # every rank accumulates its own gradient; DDP then averages them
            for b in rank_batches:
                if norm is None:
                    loss = self._mean(b, seed) / self.grad_accum
                elif self.token_loss_fn is not None:
                    loss = norm.token_loss(*self._items(b, seed))
                else:
                    loss = norm.rescale_mean(self._mean(b, seed), _batch_size(b))
                _backward(loss)
                loss_acc += float(loss.detach()) / self.world_size
            for k, g in _grads(work).items():
                acc[k] += g / self.world_size
        _zero(work)
        rel, cosine, ratio, rows = _compare(acc, big)
        return _Measured(rel, cosine, ratio, rows, repro_error, loss_big, loss_acc, counts, item_kind)


def _batchnorm_in_training(work: torch.nn.Module, measure: _Measure) -> str:
    """What BatchNorm does to GA in training mode, measured: it differs by design, or fails outright."""
    for m in work.modules():
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
            m.train()
    try:
        rel = measure.run().rel
    except (ValueError, RuntimeError) as exc:  # "Expected more than 1 value per channel when training"
        return f"with BatchNorm in training mode the micro-batches fail outright: {str(exc).splitlines()[0]}"
    return (
        f"with BatchNorm in training mode (batch statistics) the gradient relative error is {rel:.2e}: "
        "each micro-batch is normalised with its own mean and variance, so GA cannot equal the big batch"
    )

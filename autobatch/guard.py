"""Keep training alive when one step runs out of memory on a rare long batch: split it, same update.

A batch size probed at the usual sequence length can still run out of memory on the one batch
in a thousand that is four times longer. :class:`OOMGuard` runs one optimizer step's forward and
backward; when that runs out of memory it throws the partial gradients away and runs the step
again as 2, 4, 8, … micro-batches. The loss of every micro-batch is its *summed* per-token (or
per-sample) loss divided by the count over the whole step (:class:`~autobatch.checking.accumulation.LossNormaliser`),
so the gradients equal those of the whole batch: splitting changes the memory, not the update.

Across ranks, every rank splits the same step the same way: after each micro-batch the ranks
share an out-of-memory flag, and if any rank ran out, all of them throw the step away and split
again. The micro-batches run under DDP's ``no_sync`` (a rank that runs out of memory in the
middle of a backward would otherwise leave the others waiting in the gradient all-reduce), and
the guard averages the gradients itself once the step has gone through everywhere.

It never loops forever: a step that still runs out of memory one sample per micro-batch, or
after ``max_splits``, raises the out-of-memory error, with a line that says so.

The integrations build on the two pieces underneath: :func:`split_until_it_fits` (the retry
loop, for a framework whose own step function does the backward, as the HF Trainer's does) and
:func:`set_aside_gradients` (a step inside a gradient-accumulation window, whose earlier
micro-batches' gradients must survive a failed attempt).

Example::

    guard = OOMGuard(model, lambda m, b: token_cross_entropy(m(b["input_ids"]), b["labels"], shift=True), shift=True)
    for batch in loader:
        guard.backward(batch)          # or guard.backward([mb1, mb2, mb3]) for gradient accumulation
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .checking.accumulation import LossNormaliser, count_loss_tokens
from .errors import AutobatchError
from .probing.oom import is_oom_error, oom_message

__all__ = [
    "OOMGuard", "GuardedStep", "split_batch", "batch_length", "any_rank", "split_until_it_fits", "set_aside_gradients",
]

log = logging.getLogger("autobatch.guard")

LossFn = Callable[[torch.nn.Module, Any], Any]


@dataclass(frozen=True)
class GuardedStep:
    """What one :meth:`OOMGuard.backward` did: how many micro-batches it took, and why."""

    step: int
    samples: int          # in all the step's batches, on this rank
    pieces: int           # micro-batches per batch in the attempt that went through (1: never split)
    attempts: int         # 1 when the first try fit
    count: int            # the normaliser's total: tokens or samples over the whole step, every rank


def batch_length(batch: Any) -> int:
    """Samples in a batch: the size of dim 0 of its first tensor (tensors, mappings, tuples)."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0])
    values = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (list, tuple)) else ()
    for value in values:
        if isinstance(value, torch.Tensor) and value.dim():
            return int(value.shape[0])
    raise AutobatchError(
        f"cannot tell how many samples a {type(batch).__name__} batch holds; "
        "pass tensors, mappings or tuples of tensors with the batch on dim 0, or split=… to OOMGuard"
    )


def split_batch(batch: Any, pieces: int) -> list[Any]:
    """``batch`` cut into ``pieces`` micro-batches along dim 0 (tensors of other shapes are shared)."""
    n = batch_length(batch)

    def cut(value: Any) -> list[Any]:
        if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == n:
            return list(torch.tensor_split(value, pieces))
        if isinstance(value, Mapping):
            parts = {k: cut(v) for k, v in value.items()}
            return [type(value)({k: p[i] for k, p in parts.items()}) if type(value) is not dict
                    else {k: p[i] for k, p in parts.items()} for i in range(pieces)]
        if isinstance(value, (list, tuple)):
            parts = [cut(v) for v in value]
            return [type(value)(p[i] for p in parts) for i in range(pieces)]
        return [value] * pieces

    return cut(batch)


def any_rank(flag: bool, device: torch.device | None = None) -> bool:
    """True on every rank when ``flag`` is true on any rank (collective); ``flag`` itself without a group."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return flag
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    t = torch.tensor([1.0 if flag else 0.0], device=device or torch.device("cpu"))
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def split_until_it_fits(
    attempt: Callable[[int], None],
    params: Sequence[torch.nn.Parameter],
    *,
    limit: int,
    step: int,
    device: torch.device | None = None,
) -> tuple[int, int]:
    """Run ``attempt(pieces)`` with 1, 2, 4, … pieces until it goes through on every rank: ``(pieces, attempts)``.

    ``attempt`` runs the whole step cut into ``pieces`` micro-batches per batch; an out-of-memory
    error from it asks for more pieces (any other error passes through). After a failed attempt
    the gradients of ``params`` are set to ``None`` (start each attempt from ``None``: see
    :func:`set_aside_gradients`). In a process group every rank must call it for the same step:
    the ranks share the out-of-memory flag after each attempt, so all of them split alike. Past
    ``limit`` pieces it raises the out-of-memory error with a line that says so.
    """
    pieces, attempts = 1, 0
    while True:
        attempts += 1
        failure = None
        try:
            attempt(pieces)
        except Exception as exc:
            if not is_oom_error(exc):
                raise
            failure = oom_message(exc, 200)  # its frames hold the failed attempt's activations
        if failure is not None:  # free the failed attempt's gradients before the flag's collective
            for p in params:
                p.grad = None
        if not any_rank(failure is not None, device):
            return pieces, attempts
        for p in params:
            p.grad = None
        error_line = failure or "out of memory on another rank"
        if pieces >= limit:
            raise torch.OutOfMemoryError(
                f"CUDA out of memory. OOMGuard: step {step} still runs out of memory cut into {pieces} "
                f"micro-batch(es) per batch (the most allowed: {limit}); {error_line}"
            )
        pieces = min(2 * pieces, limit)
        log.warning("step %d ran out of memory (%s); retrying it as %d micro-batches per batch", step, error_line, pieces)


@contextmanager
def set_aside_gradients(params: Sequence[torch.nn.Parameter]) -> Iterator[list[torch.Tensor | None]]:
    """Gradients already accumulated are set aside (``p.grad = None``) inside, and added back on a clean exit.

    A guarded step inside a gradient-accumulation window starts from ``None`` gradients (so a
    failed attempt can be thrown away) without losing the window's earlier micro-batches. Costs
    one more set of gradients while the step runs. Yields the set-aside list (``None`` where a
    parameter had none); on an error the earlier gradients are put back as they were.
    """
    saved = [p.grad for p in params]
    for p in params:
        p.grad = None
    try:
        yield saved
    except BaseException:
        for p, g in zip(params, saved):
            p.grad = g
        raise
    for p, g in zip(params, saved):
        if g is not None:
            p.grad = g if p.grad is None else g.add_(p.grad)


def _micro_batches(batches: Any) -> bool:
    """Whether ``batches`` is a list of micro-batches, not one batch that is a list (``[inputs, labels]``,
    as a DataLoader collates a TensorDataset's samples): a list whose items are not all tensors."""
    return isinstance(batches, list) and not all(isinstance(b, torch.Tensor) for b in batches)


def _labels_of(batch: Any, label_key: str) -> torch.Tensor:
    if isinstance(batch, Mapping) and label_key in batch:
        return batch[label_key]
    if isinstance(batch, (list, tuple)) and len(batch) == 2 and isinstance(batch[1], torch.Tensor):
        return batch[1]
    raise AutobatchError(
        f"OOMGuard counts the loss's tokens from the labels, but the batch has no {label_key!r} key and is no "
        "(inputs, labels) pair; pass label_key=… or count=… (a function batch -> labels tensor)"
    )


class OOMGuard:
    """Forward and backward of one optimizer step, split into micro-batches when it runs out of memory.

    Args:
        model: the model (a ``DistributedDataParallel`` wrapper is fine: the micro-batches run
            under its ``no_sync`` and the guard averages the gradients once the step went through).
        loss_fn: ``loss_fn(model, batch)`` returns the *unreduced* losses, either
            ``(per_token_losses, mask)`` as :func:`~autobatch.checking.accumulation.token_cross_entropy`
            returns them, or one loss per sample (a tensor of shape ``(batch,)``).
        labels: ``labels(batch)`` returns the label tensor whose non-ignored entries are the
            loss's items (tokens, or samples for per-sample labels); default the batch's
            ``label_key`` or the second item of an ``(inputs, labels)`` pair.
        label_key: where the labels are in a mapping batch.
        ignore_index: the label value that does not count.
        shift: count ``labels[..., 1:]`` (causal LM: the loss was shifted).
        max_splits: the most micro-batches one batch may be cut into; default one sample each.
        split: ``split(batch, pieces)`` cuts a batch; default :func:`split_batch` along dim 0.
        on_split: called with each :class:`GuardedStep` that needed a split (they are logged too).
        backward_fn: runs each micro-batch's backward; default ``loss.backward()``
            (``accelerator.backward`` under accelerate, for its loss scaling and accumulation).
        accumulate: add to gradients already there (earlier micro-batches of the same optimizer
            step, as under a framework's gradient accumulation): they are set aside while the step
            runs (:func:`set_aside_gradients`), costing one more set of gradients meanwhile.

    Without ``accumulate``, gradients must be ``None`` when :meth:`backward` starts
    (``optimizer.zero_grad(set_to_none=True)``): a failed attempt's partial gradients are thrown
    away by setting them to ``None`` again.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        loss_fn: LossFn,
        *,
        labels: Callable[[Any], torch.Tensor] | None = None,
        label_key: str = "labels",
        ignore_index: int = -100,
        shift: bool = False,
        max_splits: int | None = None,
        split: Callable[[Any, int], list[Any]] = split_batch,
        on_split: Callable[[GuardedStep], None] | None = None,
        backward_fn: Callable[[torch.Tensor], Any] | None = None,
        accumulate: bool = False,
    ):
        if not isinstance(model, torch.nn.Module):
            raise AutobatchError(f"model must be a torch.nn.Module, but got {type(model).__name__}")
        if not callable(loss_fn):
            raise AutobatchError("loss_fn must be a function (model, batch) -> unreduced losses")
        if max_splits is not None and (isinstance(max_splits, bool) or not isinstance(max_splits, int) or max_splits < 1):
            raise AutobatchError(f"max_splits must be a positive integer, but got max_splits={max_splits!r}")
        self.model, self.loss_fn, self.split = model, loss_fn, split
        self.labels = labels or (lambda batch: _labels_of(batch, label_key))
        self.ignore_index, self.shift, self.max_splits, self.on_split = ignore_index, shift, max_splits, on_split
        self.backward_fn = backward_fn or torch.Tensor.backward
        self.accumulate = bool(accumulate)
        self.steps = 0
        self.history: list[GuardedStep] = []  # the steps that were split

    # -- one step --------------------------------------------------------------------------------

    def backward(self, batches: Any) -> GuardedStep:
        """Accumulate the gradients of one optimizer step; ``batches`` is one batch or a list of GA micro-batches.

        A list of tensors is one batch: a DataLoader collates ``(inputs, labels)`` samples into
        ``[inputs, labels]``. Every rank must call it for the same step (it is collective in a process group).
        """
        batches = list(batches) if _micro_batches(batches) else [batches]
        params = [p for p in self.model.parameters() if p.requires_grad]
        if not self.accumulate and any(p.grad is not None for p in params):
            raise AutobatchError(
                "OOMGuard.backward needs the gradients cleared before the step (a failed attempt's partial "
                "gradients are thrown away by clearing them), but some are set; call "
                "optimizer.zero_grad(set_to_none=True) after each optimizer step and pass the step's micro-batches "
                "together, or pass accumulate=True to add to them"
            )
        self.steps += 1
        norm = count_loss_tokens([self.labels(b) for b in batches], ignore_index=self.ignore_index, shift=self.shift)
        local = sum(int(self._counted(self.labels(b)).sum().item()) for b in batches)
        device = next((p.device for p in params), torch.device("cpu"))
        smallest = min(batch_length(b) for b in batches)
        limit = smallest if self.max_splits is None else min(self.max_splits, smallest)
        with set_aside_gradients(params):
            pieces, attempts = split_until_it_fits(lambda k: self._attempt(batches, k, norm, local), params,
                                                   limit=limit, step=self.steps, device=device)
            self._average_gradients(params)
        done = GuardedStep(self.steps, sum(batch_length(b) for b in batches), pieces, attempts, norm.total)
        if pieces > 1:
            self.history.append(done)
            log.warning("step %d went through as %d micro-batches per batch after %d attempt(s); "
                        "the update equals the whole batch's (loss normalised over %d items)",
                        done.step, pieces, attempts, norm.total)
            if self.on_split is not None:
                self.on_split(done)
        return done

    def _counted(self, labels: torch.Tensor) -> torch.Tensor:
        if self.shift:
            labels = labels[..., 1:]
        return labels if labels.dtype == torch.bool else labels != self.ignore_index

    def _attempt(self, batches: list[Any], pieces: int, norm: LossNormaliser, local: int) -> None:
        """Every piece's forward and backward (an out-of-memory error passes to :func:`split_until_it_fits`)."""
        seen = 0
        with ExitStack() as stack:
            if isinstance(self.model, torch.nn.parallel.DistributedDataParallel):
                stack.enter_context(self.model.no_sync())
            for batch in batches:
                for piece in (self.split(batch, pieces) if pieces > 1 else [batch]):
                    seen += self._piece_backward(piece, norm)
        if seen != local:
            raise AutobatchError(
                f"the loss counted {seen} items but the labels hold {local} that are not ignore_index "
                f"({self.ignore_index}); make loss_fn's mask match the labels (shift={self.shift})"
            )

    def _piece_backward(self, piece: Any, norm: LossNormaliser) -> int:
        out = self.loss_fn(self.model, piece)
        if isinstance(out, (tuple, list)):
            losses, mask = out
            loss = norm.token_loss(losses, mask)
            count = int(mask.sum().item()) if mask is not None else losses.numel()
        elif isinstance(out, torch.Tensor) and out.dim() >= 1:
            loss, count = norm.sample_loss(out), out.numel()
        else:
            raise AutobatchError(
                "OOMGuard's loss_fn must return unreduced losses, (per_token_losses, mask) or one loss per "
                f"sample, but it returned {type(out).__name__}{' of shape ()' if isinstance(out, torch.Tensor) else ''}; "
                "a mean cannot be split into micro-batches exactly"
            )
        self.backward_fn(loss)
        return count

    def _average_gradients(self, params: Sequence[torch.nn.Parameter]) -> None:
        # Only a DDP model was kept from syncing (no_sync); anything else syncs its own way.
        if not isinstance(self.model, torch.nn.parallel.DistributedDataParallel):
            return
        world = dist.get_world_size()
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
            p.grad.div_(world)

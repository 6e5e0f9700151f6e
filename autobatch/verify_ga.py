"""Does micro-batch × gradient accumulation (× ranks) give the big batch's gradient?

:func:`verify_ga` runs one global batch twice on a *copy* of your model: once as one big
batch, once split into ``grad_accum`` micro-batches of ``micro_batch`` samples on each of
``world_size`` simulated ranks (gradients averaged over ranks, as DDP does). It compares the
two gradients per parameter and overall, and returns a :class:`GAVerification`: PASS, FAIL
(with the size of the error and the likely cause) or FLAGGED (BatchNorm, or randomness that
makes the comparison meaningless).

Two loss paths:

* ``mode="naive"``: your loss as written, per micro-batch, divided by ``grad_accum`` (what
  most loops and older HF Trainers do). With token losses and padding this is a mean of
  means and FAILS; that is field report 2.
* ``mode="normalised"``: autobatch's :mod:`~autobatch.accumulation` helper: per-item losses
  summed and divided by the item count of the whole accumulated batch.

Exit codes used by ``autobatch verify-ga``: 0 PASS, 1 FAIL, 3 FLAGGED (2 is a usage error).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch

from .accumulation import LossNormaliser, token_cross_entropy
from .errors import AutobatchError, ConfigError
from .modelinfo import has_batchnorm

__all__ = [
    "GAVerification",
    "ParamGradComparison",
    "verify_ga",
    "verify_model",
    "verify_model_source",
    "padded_lm_batch",
    "lm_token_loss",
    "split_batch",
    "EXIT_CODES",
]

LossFn = Callable[[torch.nn.Module, Any], torch.Tensor]
TokenLossFn = Callable[[torch.nn.Module, Any], "tuple[torch.Tensor, torch.Tensor | None]"]
Mode = Literal["naive", "normalised"]

EXIT_CODES = {"PASS": 0, "FAIL": 1, "FLAGGED": 3}
_WORST_SHOWN = 5


# --- result ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ParamGradComparison:
    """One parameter's accumulated gradient against its big-batch gradient."""

    name: str
    numel: int
    rel_error: float  # ||g_acc - g_big|| / ||g_big||
    cosine: float


@dataclass(frozen=True)
class GAVerification:
    """The answer of :func:`verify_ga`: is micro × GA × ranks the big batch?

    ``status`` is ``"PASS"`` (overall relative error ≤ tolerance), ``"FAIL"`` or ``"FLAGGED"``
    (the comparison cannot be a plain yes/no: BatchNorm, or a big batch that does not
    reproduce its own gradient). ``likely_cause`` explains a FAIL or a FLAG in one paragraph.
    """

    status: str
    mode: str
    micro_batch: int
    grad_accum: int
    world_size: int
    tolerance: float
    rel_error: float
    cosine: float
    min_cosine: float
    grad_norm_ratio: float  # ||g_acc|| / ||g_big||: far from 1 with cosine ≈ 1 means a scale bug
    repro_error: float  # big batch against itself, with another seed: the noise floor
    loss_big: float
    loss_accumulated: float
    item_kind: str  # "tokens" or "samples": what the loss averages over
    items_per_micro_batch: tuple[int, ...] | None
    parameters: tuple[ParamGradComparison, ...]
    likely_cause: str | None
    notes: tuple[str, ...]

    @property
    def passed(self) -> bool:
        return self.status == "PASS"

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.grad_accum * self.world_size

    @property
    def exit_code(self) -> int:
        """0 PASS, 1 FAIL, 3 FLAGGED."""
        return EXIT_CODES[self.status]

    def worst(self, n: int = _WORST_SHOWN) -> list[ParamGradComparison]:
        """The ``n`` parameters with the largest relative error."""
        return sorted(self.parameters, key=lambda p: -p.rel_error)[:n]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["passed"] = self.passed
        d["global_batch"] = self.global_batch
        d["exit_code"] = self.exit_code
        d["items_per_micro_batch"] = list(self.items_per_micro_batch) if self.items_per_micro_batch else None
        d["parameters"] = [asdict(p) for p in self.parameters]
        d["notes"] = list(self.notes)
        # JSON has no NaN/inf: an unbounded error (0/0 in a micro-batch) becomes null.
        for key in ("rel_error", "cosine", "min_cosine", "grad_norm_ratio", "repro_error", "loss_big",
                    "loss_accumulated"):
            d[key] = d[key] if math.isfinite(d[key]) else None
        for row in d["parameters"]:
            for key in ("rel_error", "cosine"):
                row[key] = row[key] if math.isfinite(row[key]) else None
        return d

    def __str__(self) -> str:
        how = {
            "naive": "naive: your loss per micro-batch / grad_accum",
            "normalised": f"normalised: summed loss / {self.item_kind} in the whole accumulated batch",
        }[self.mode]
        ranks = "rank" if self.world_size == 1 else "ranks"
        lines = [
            f"verify-ga: {self.status}  ({how})",
            f"# {self.micro_batch} micro batch * {self.grad_accum} grad accum * {self.world_size} {ranks} "
            f"= {self.global_batch} samples, against one batch of {self.global_batch}",
        ]
        if self.items_per_micro_batch:
            counts = self.items_per_micro_batch
            shown = ", ".join(map(str, counts[:16])) + (", …" if len(counts) > 16 else "")
            lines.append(f"{self.item_kind} per micro-batch: {shown} (min {min(counts)}, max {max(counts)})")
        lines.append(
            f"gradient relative error {self.rel_error:.2e} (tolerance {self.tolerance:.0e}); "
            f"cosine {self.cosine:.6f} overall, {self.min_cosine:.6f} worst parameter; "
            f"norm ratio {self.grad_norm_ratio:.4f}"
        )
        lines.append(f"loss: big batch {self.loss_big:.6f}, accumulated {self.loss_accumulated:.6f}")
        if self.status != "PASS" and self.parameters:
            lines.append("worst parameters:")
            width = max(len(p.name) for p in self.worst())
            for p in self.worst():
                lines.append(f"  {p.name:<{width}}  rel {p.rel_error:.2e}  cos {p.cosine:.6f}")
        lines.extend(f"note: {n}" for n in self.notes)
        if self.likely_cause:
            lines.append(f"likely cause: {self.likely_cause}")
        return "\n".join(lines)


# --- batches --------------------------------------------------------------------------------


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
) -> dict[str, torch.Tensor]:
    """A language-model batch of right-padded sequences whose lengths differ widely.

    Lengths are spread evenly from ``min_len`` to ``seq_len`` and shuffled, so micro-batches
    hold very different numbers of tokens and a mean of means is visible.

    Returns:
        ``{"input_ids", "attention_mask", "labels"}``, each ``(batch_size, seq_len)``; labels
        are the input ids with -100 on padding (HF convention; the loss shifts them).

    Example:
        >>> b = padded_lm_batch(4, 8, 50)
        >>> sorted(b["attention_mask"].sum(1).tolist())
        [2, 4, 6, 8]
    """
    if seq_len < min_len or min_len < 2:
        raise AutobatchError(f"seq_len must be at least min_len ≥ 2, but got seq_len={seq_len}, min_len={min_len}")
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.linspace(min_len, seq_len, batch_size).round().long()
    lengths = lengths[torch.randperm(batch_size, generator=gen)]
    ids = torch.randint(1 if pad_token_id == 0 else 0, vocab_size, (batch_size, seq_len), generator=gen)
    mask = torch.arange(seq_len)[None, :] < lengths[:, None]
    ids = torch.where(mask, ids, torch.full_like(ids, pad_token_id))
    labels = torch.where(mask, ids, torch.full_like(ids, -100))
    return {"input_ids": ids, "attention_mask": mask.long(), "labels": labels}


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


# --- the comparison -------------------------------------------------------------------------


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


def _validate(micro_batch: Any, grad_accum: Any, world_size: Any, tolerance: Any, mode: Any, *,
              has_loss: bool) -> None:
    problems = []
    for name, value in (("micro_batch", micro_batch), ("grad_accum", grad_accum), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            problems.append(f"{name} must be a positive integer, but got {name}={value!r}")
    if not isinstance(tolerance, (int, float)) or not tolerance > 0:
        problems.append(f"tolerance must be a positive number, but got tolerance={tolerance!r}")
    if mode not in ("naive", "normalised"):
        problems.append(f"mode must be 'naive' or 'normalised', but got mode={mode!r}")
    if not has_loss:
        problems.append("pass loss_fn(model, batch) -> loss or token_loss_fn(model, batch) -> (losses, mask)")
    if problems:
        raise ConfigError(problems)


def _mask_of(losses: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    return torch.ones_like(losses, dtype=torch.bool) if mask is None else mask.bool()


def verify_ga(
    model: torch.nn.Module,
    batch: Any,
    *,
    micro_batch: int,
    grad_accum: int,
    world_size: int = 1,
    loss_fn: LossFn | None = None,
    token_loss_fn: TokenLossFn | None = None,
    mode: Mode = "naive",
    tolerance: float = 1e-5,
    seed: int = 0,
) -> GAVerification:
    """Compare one global batch's gradient as one big batch and as micro × GA × ranks.

    Your model is never changed: everything runs on a deep copy, with dropout off and the
    RNG forked (your global RNG state is untouched).

    Args:
        model: The model, as you train it (the module itself, not its DDP/FSDP wrapper).
        batch: The global batch: ``micro_batch * grad_accum * world_size`` samples on dim 0
            (a tensor, or a dict/tuple of tensors).
        micro_batch: Samples per micro-batch per rank.
        grad_accum: Micro-batches accumulated per optimizer step.
        world_size: Data-parallel ranks, simulated in this process (gradients averaged, as DDP does).
        loss_fn: ``loss_fn(model, batch) -> scalar loss``, your loss as written. In
            ``"normalised"`` mode without ``token_loss_fn`` it is taken as a mean over samples.
        token_loss_fn: ``token_loss_fn(model, batch) -> (per_item_losses, mask)``: unreduced
            losses (per token, or per sample with ``mask=None``). Preferred: it allows both modes.
        mode: ``"naive"`` (mean per micro-batch, then ``/ grad_accum``) or ``"normalised"``
            (autobatch's :class:`~autobatch.accumulation.LossNormaliser`).
        tolerance: Largest overall relative gradient error that PASSES (1e-5 suits fp32).
        seed: RNG seed for every forward pass.

    Returns:
        A :class:`GAVerification`; ``str()`` it for a report, ``.to_dict()`` for JSON.

    Example:
        >>> model = torch.nn.Linear(4, 3)
        >>> x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
        >>> loss = lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1])
        >>> verify_ga(model, (x, y), micro_batch=2, grad_accum=4, loss_fn=loss).status
        'PASS'
    """
    _validate(micro_batch, grad_accum, world_size, tolerance, mode,
              has_loss=loss_fn is not None or token_loss_fn is not None)
    expected = micro_batch * grad_accum * world_size
    size = _batch_size(batch)
    if size != expected:
        raise AutobatchError(
            f"the batch must hold micro_batch * grad_accum * world_size = {micro_batch} * {grad_accum} * "
            f"{world_size} = {expected} samples, but it holds {size}"
        )

    work = copy.deepcopy(model)
    work.train()
    notes: list[str] = []
    dropped = _quiet_dropout(work)
    if dropped:
        notes.append(f"dropout switched off in {dropped} layer(s) of the copy, so both runs see the same network")
    batchnorm = has_batchnorm(work)
    if batchnorm:
        for m in work.modules():
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
                m.eval()  # running statistics: per-sample, so the rest of the step can be compared
        notes.append("BatchNorm layers compared on their running statistics (eval mode)")
    param = next(work.parameters(), None)
    if param is None:
        raise AutobatchError("the model has no parameters, so there is no gradient to compare")
    batch = _to_device(batch, param.device)
    micro = split_batch(batch, micro_batch)
    ranks = [micro[r * grad_accum:(r + 1) * grad_accum] for r in range(world_size)]

    measure = _Measure(work, batch, micro, ranks, grad_accum, world_size, loss_fn, token_loss_fn, mode, seed)
    devices = [param.device] if param.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), _exact_fp32():
        m = measure.run()
        if batchnorm:
            notes.append(_batchnorm_in_training(work, measure))

    if batchnorm or m.repro_error > tolerance:
        status = "FLAGGED"
    else:
        status = "PASS" if m.rel <= tolerance else "FAIL"
    cause = _likely_cause(
        status, mode, batchnorm, m, grad_accum, world_size, tolerance, token_form=token_loss_fn is not None
    )
    return GAVerification(
        status=status, mode=mode, micro_batch=micro_batch, grad_accum=grad_accum, world_size=world_size,
        tolerance=float(tolerance), rel_error=m.rel, cosine=m.cosine, min_cosine=min(r.cosine for r in m.rows),
        grad_norm_ratio=m.ratio, repro_error=m.repro_error, loss_big=m.loss_big, loss_accumulated=m.loss_acc,
        item_kind=m.item_kind, items_per_micro_batch=tuple(m.counts), parameters=m.rows, likely_cause=cause,
        notes=tuple(notes),
    )


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
            return self.loss_fn(self.work, b)  # type: ignore[misc]
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
        loss.backward()
        loss_big = float(loss.detach())
        big = _grads(work)
        _zero(work)
        self._mean(self.batch, seed + 1).backward()
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
                loss.backward()
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


def _scale_hint(ratio: float, grad_accum: int, world_size: int) -> str:
    for label, value in (("grad_accum", grad_accum), ("world_size", world_size),
                         ("grad_accum * world_size", grad_accum * world_size)):
        if value > 1:
            for word, target in (("too large", value), ("too small", 1 / value)):
                if abs(ratio / target - 1) < 0.05:
                    return f" (≈ {label} = {value} {word}: a division by {label} is missing or doubled)"
    return ""


def _likely_cause(status: str, mode: str, batchnorm: bool, m: _Measured, grad_accum: int, world_size: int,
                  tolerance: float, *, token_form: bool) -> str | None:
    if batchnorm:
        rest = (f"with BatchNorm on running statistics the rest of the step matches (relative error {m.rel:.2e})"
                if m.rel <= tolerance else
                f"even with BatchNorm on running statistics the relative error is {m.rel:.2e}, so check the loss too")
        return (
            "the model has BatchNorm: in training it normalises each micro-batch with that micro-batch's own "
            "statistics, so micro × GA differs from the big batch by design (and with one value per channel, as "
            "BatchNorm1d on a micro-batch of 1, it cannot train at all). "
            f"This is not a loss bug: {rest}. Use a per-device batch ≥ 2 and accept the difference, or "
            "GroupNorm/LayerNorm, or SyncBatchNorm across ranks."
        )
    if status == "FLAGGED":
        return (
            f"the big batch does not reproduce its own gradient: two runs with different seeds differ by "
            f"{m.repro_error:.2e} (> tolerance {tolerance:.0e}). Randomness is still on in training mode "
            "(functional dropout, stochastic depth, random augmentation in the loss) or kernels are "
            "non-deterministic, so GA cannot be told apart from noise; switch it off, or raise the tolerance."
        )
    if status == "PASS":
        return None
    if mode == "naive" and min(m.counts) == 0:
        return (
            f"a micro-batch holds no {m.item_kind} that count (all padding), so its mean is 0/0 (a NaN loss), and "
            "the other micro-batches are a mean of means. Normalise by the whole accumulated batch's count "
            "(count_loss_tokens + LossNormaliser.token_loss), which never divides by a micro-batch's own count."
        )
    if not math.isfinite(m.rel):
        return "the accumulated gradient is not finite (NaN or inf): check the loss for a division by zero."
    scale = m.cosine > 1 - 1e-6 and abs(m.ratio - 1) > 1e-3
    if scale:
        return (
            f"the gradient points the right way (cosine {m.cosine:.7f}) but its size is ×{m.ratio:.4g} the big "
            f"batch's{_scale_hint(m.ratio, grad_accum, world_size)}; the loss is summed or averaged with the wrong "
            "divisor."
        )
    varied = len(set(m.counts)) > 1
    if mode == "naive" and varied and m.item_kind == "tokens":
        return (
            f"your loss averages per micro-batch means (mean of means): micro-batches hold between {min(m.counts)} "
            f"and {max(m.counts)} tokens, so a token in a short micro-batch weighs up to "
            f"{max(m.counts) / max(min(m.counts), 1):.1f}× more than one in a long micro-batch. Use autobatch's "
            "token-normalised loss: sum the per-token losses and divide by the tokens of the whole accumulated "
            "batch (count_loss_tokens + LossNormaliser.token_loss); check it with mode=\"normalised\" (--normalised)."
        )
    if mode == "naive" and varied:
        return (
            f"your loss averages per micro-batch means, and micro-batches hold between {min(m.counts)} and "
            f"{max(m.counts)} items; normalise by the whole accumulated batch (count_loss_samples)."
        )
    if mode == "normalised" and not token_form:
        return (
            "the loss was taken as a mean over samples; if it averages over tokens (an LM loss), pass "
            "token_loss_fn(model, batch) -> (per_token_losses, mask) so the helper can weigh tokens, not samples."
        )
    return (
        "the micro-batches hold equal numbers of items, so a mean of means is not the cause: the forward pass "
        "couples samples within a batch (in-batch negatives, normalisation over the batch, padding to the "
        "longest sequence that changes results) or the loss is not a sum of per-item terms."
    )


def verify_model_source(
    source: Any,
    *,
    micro_batch: int,
    grad_accum: int,
    world_size: int = 1,
    mode: Mode = "naive",
    tolerance: float = 1e-5,
    seed: int = 0,
) -> GAVerification:
    """:func:`verify_ga` for a built-in model (``autobatch.models.load_model(...)``).

    Language models (``task`` ``"causal-lm"``/``"masked-lm"``) get a variable-length padded
    batch from :func:`padded_lm_batch` and a token-level loss, so that a mean of means shows;
    other models use their own ``make_batch`` and ``loss_fn``.

    Args:
        source: An object with ``.model``, ``.task``, and ``.vocab_size``/``.seq_len`` (LMs) or
            ``.make_batch(b)``/``.loss_fn(model, batch)`` (others).
        micro_batch, grad_accum, world_size, mode, tolerance, seed: As for :func:`verify_ga`.
    """
    # Before building a batch of micro_batch * grad_accum * world_size samples from bad numbers.
    _validate(micro_batch, grad_accum, world_size, tolerance, mode, has_loss=True)
    global_batch = micro_batch * grad_accum * world_size
    task = getattr(source, "task", None)
    vocab, seq_len = getattr(source, "vocab_size", None), getattr(source, "seq_len", None)
    if task in ("causal-lm", "masked-lm") and vocab and seq_len:
        batch = padded_lm_batch(global_batch, seq_len, vocab, seed=seed)
        return verify_ga(source.model, batch, micro_batch=micro_batch, grad_accum=grad_accum, world_size=world_size,
                         token_loss_fn=lm_token_loss(shift=task == "causal-lm"), mode=mode, tolerance=tolerance,
                         seed=seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        batch = source.make_batch(global_batch)
    return verify_ga(source.model, batch, micro_batch=micro_batch, grad_accum=grad_accum, world_size=world_size,
                     loss_fn=source.loss_fn, mode=mode, tolerance=tolerance, seed=seed)


def verify_model(
    spec: str,
    *,
    micro_batch: int,
    grad_accum: int,
    world_size: int = 1,
    seq_len: int | None = None,
    mode: Mode = "naive",
    tolerance: float = 1e-5,
    seed: int = 0,
) -> GAVerification:
    """:func:`verify_model_source` for a built-in model name; what ``autobatch verify-ga --model`` runs.

    Args:
        spec: A name that ``autobatch.models.load_model`` knows (``tiny-gpt2``, ``tiny-mlp``, …).
        seq_len: Sequence length for language models; ``None`` keeps the model's default.
        micro_batch, grad_accum, world_size, mode, tolerance, seed: As for :func:`verify_ga`.

    Example:
        >>> verify_model("tiny-gpt2", micro_batch=1, grad_accum=8, mode="normalised").status  # doctest: +SKIP
        'PASS'
    """
    try:  # lazily: the registry pulls in optional model code (transformers)
        from .models import load_model
    except ModuleNotFoundError as exc:
        if exc.name != f"{__package__}.models":
            raise
        raise AutobatchError("verify-ga --model needs autobatch.models, which this installation does not have") from None
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)  # the same random weights on every run with this seed
        source = load_model(spec, **({} if seq_len is None else {"seq_len": seq_len}))
    return verify_model_source(source, micro_batch=micro_batch, grad_accum=grad_accum, world_size=world_size,
                               mode=mode, tolerance=tolerance, seed=seed)

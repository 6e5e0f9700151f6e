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
* ``mode="normalised"``: autobatch's :mod:`~autobatch.checking.accumulation` helper: per-item losses
  summed and divided by the item count of the whole accumulated batch.

Exit codes used by ``autobatch verify-ga``: 0 PASS, 1 FAIL, 3 FLAGGED (2 is a usage error).
"""

from __future__ import annotations

import copy
import math
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch

from ..errors import AutobatchError, ConfigError
from ..modelinfo import has_batchnorm
from .ga_batches import LossFn, TokenLossFn, _batch_size, _to_device, split_batch
from .ga_measure import (
    ParamGradComparison,
    _batchnorm_in_training,
    _exact_fp32,
    _Measure,
    _Measured,
    _quiet_dropout,
)

__all__ = ["EXIT_CODES", "GAVerification", "verify_ga"]


Mode = Literal["naive", "normalised"]


EXIT_CODES = {"PASS": 0, "FAIL": 1, "FLAGGED": 3}


_WORST_SHOWN = 5


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


def _validate(micro_batch: Any, grad_accum: Any, world_size: Any, tolerance: Any, mode: Any, *,
              has_loss: bool) -> None:
    problems = []
    for name, value in (("micro_batch", micro_batch), ("grad_accum", grad_accum), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            problems.append(f"{name} must be a positive integer, but got {name}={value!r}")
    if not isinstance(tolerance, (int, float)) or not 0 < tolerance < float("inf"):
        problems.append(f"tolerance must be a positive finite number, but got tolerance={tolerance!r}")
    if mode not in ("naive", "normalised"):
        problems.append(f"mode must be 'naive' or 'normalised', but got mode={mode!r}")
    if not has_loss:
        problems.append("pass loss_fn(model, batch) -> loss or token_loss_fn(model, batch) -> (losses, mask)")
    if problems:
        raise ConfigError(problems)




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
            (autobatch's :class:`~autobatch.checking.accumulation.LossNormaliser`).
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
            f"the batch must hold micro_batch * grad_accum * ranks = {micro_batch} * {grad_accum} * "
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

    if batchnorm or m.repro_error > tolerance or (m.rel <= tolerance and _blind(mode, m)):
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


def _blind(mode: str, m: _Measured) -> bool:
    """Whether the naive loss was checked on micro-batches that all hold the same number of tokens, where a mean
    of means is the whole batch's mean and a pass says nothing about the loss."""
    return mode == "naive" and m.item_kind == "tokens" and len(m.counts) > 1 and len(set(m.counts)) == 1


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
    if status == "FLAGGED" and m.repro_error <= tolerance:
        return (
            f"every micro-batch held {m.counts[0]} {m.item_kind}, so a mean of means equals the whole batch's mean here "
            "and this check cannot tell a per-micro-batch loss from the right one; give the micro-batches different "
            "numbers of tokens (a --seq-len of 3 or more spreads the lengths from 2 up)"
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
            "batch (count_loss_tokens + LossNormaliser.token_loss); check it with the normalised mode (--normalised on the command line)."
        )
    if mode == "naive" and varied:
        return (
            f"your loss averages per micro-batch means, and micro-batches hold between {min(m.counts)} and "
            f"{max(m.counts)} items; normalise by the whole accumulated batch (count_loss_samples)."
        )
    if mode == "normalised" and not token_form:
        return (
            "the loss was taken as a mean over samples; if it averages over tokens (an LM loss), weigh tokens: "
            "from Python, autobatch.verify_ga(model, batch, token_loss_fn=...) with token_loss_fn(model, batch) -> "
            "(per_token_losses, mask), since the command line's --normalised weighs your own loss per sample (the "
            "built-in and hf: language models it weighs per token)."
        )
    return (
        "the micro-batches hold equal numbers of items, so a mean of means is not the cause: the forward pass "
        "couples samples within a batch (in-batch negatives, normalisation over the batch, padding to the "
        "longest sequence that changes results) or the loss is not a sum of per-item terms."
    )

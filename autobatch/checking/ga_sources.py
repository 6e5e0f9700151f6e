"""The accumulation check for a built-in or named model: the batch and loss each kind of model needs."""

from __future__ import annotations

from typing import Any

import torch

from ..errors import AutobatchError
from ..probing.oom import is_oom_error
from ..probing.samples import check_sample_count
from .ga_batches import lm_token_loss, padded_lm_batch
from .verify_ga import GAVerification, Mode, _validate, verify_ga

__all__ = ["verify_model_source", "verify_model"]


_HOST_OOM = "DefaultCPUAllocator: can't allocate memory"


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
    try:
        return _verify_source(source, global_batch, micro_batch=micro_batch, grad_accum=grad_accum,
                              world_size=world_size, mode=mode, tolerance=tolerance, seed=seed)
    except (MemoryError, RuntimeError) as exc:
        # The batch is built on the host: its RAM running out is the allocator's own message.
        if not (isinstance(exc, MemoryError) or is_oom_error(exc) or _HOST_OOM in str(exc)):
            raise
        raise AutobatchError(
            f"the big batch of micro_batch × grad_accum × ranks = {global_batch} samples must fit in host memory "
            "(verify-ga builds it on the CPU), but allocating it failed; use a smaller --micro-batch, --grad-accum "
            "or --world-size: the check needs the same arithmetic, not the training batch"
        ) from None


def _verify_source(source: Any, global_batch: int, *, micro_batch: int, grad_accum: int, world_size: int,
                   mode: Mode, tolerance: float, seed: int) -> GAVerification:
    task = getattr(source, "task", None)
    vocab, seq_len = getattr(source, "vocab_size", None), getattr(source, "seq_len", None)
    if task in ("causal-lm", "masked-lm") and vocab and seq_len:
        batch = padded_lm_batch(global_batch, seq_len, vocab, seed=seed, groups=global_batch // micro_batch)
        return verify_ga(source.model, batch, micro_batch=micro_batch, grad_accum=grad_accum, world_size=world_size,
                         token_loss_fn=lm_token_loss(shift=task == "causal-lm"), mode=mode, tolerance=tolerance,
                         seed=seed)
    batch = _global_batch(source.make_batch, global_batch, seed)
    return verify_ga(source.model, batch, micro_batch=micro_batch, grad_accum=grad_accum, world_size=world_size,
                     loss_fn=source.loss_fn, mode=mode, tolerance=tolerance, seed=seed)


def _global_batch(make_batch: Any, samples: int, seed: int) -> Any:
    """``make_batch(samples)`` under ``seed``, which must hold that many samples (the user's code runs here)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        batch = make_batch(samples)
    check_sample_count(batch, samples, make_batch)
    return batch


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
    **load: Any,
) -> GAVerification:
    """:func:`verify_model_source` for a built-in model name; what ``autobatch verify-ga --model`` runs.

    Args:
        spec: A name that ``autobatch.models.load_model`` knows (``tiny-gpt2``, ``tiny-mlp``, …).
        seq_len: Sequence length for language models; ``None`` keeps the model's default.
        load: Further options of ``load_model`` (``input_shape``, ``num_classes``, ``trust_remote_code``).
        micro_batch, grad_accum, world_size, mode, tolerance, seed: As for :func:`verify_ga`.

    Example:
        >>> verify_model("tiny-gpt2", micro_batch=1, grad_accum=8, mode="normalised").status  # doctest: +SKIP
        'PASS'
    """
    try:  # lazily: the registry pulls in optional model code (transformers)
        from ..models import load_model
    except ModuleNotFoundError as exc:
        if exc.name != "autobatch.models":
            raise
        raise AutobatchError("verify-ga --model needs autobatch.models, which this installation does not have") from None
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)  # the same random weights on every run with this seed
        source = load_model(spec, **({} if seq_len is None else {"seq_len": seq_len}), **load)
    return verify_model_source(source, micro_batch=micro_batch, grad_accum=grad_accum, world_size=world_size,
                               mode=mode, tolerance=tolerance, seed=seed)

"""``probe_lengths``: the exact max and safe batch at several sequence lengths, for training and
evaluation, with far fewer trials than one probe per length, and the token budget they imply."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from ..errors import AutobatchError
from ..planning.tokens import token_budget
from ..probing.backends import MemoryBackend
from ..probing.guided import search_lengths, summarise_length
from ..probing.lengthfit import LengthFit
from ..probing.probe import DEFAULT_HEADROOM, make_backend, resolve_headroom
from ..probing.samples import LongestSample, longest_sample, repeat_sample, takes_seq_len
from ..probing.trial import Trial
from ..probing.workload import Workload
from .table import LengthRow, LengthTable

__all__ = ["probe_lengths"]


def _lengths(seq_lens: Sequence[int | None]) -> list[int | None]:
    if list(seq_lens) == [None]:
        return [None]  # one row at the workload's own shape: make_batch(b, None)
    lengths: list[int | None] = []
    for s in seq_lens:
        if isinstance(s, bool) or not isinstance(s, int) or s < 1:
            raise AutobatchError(f"every sequence length must be a positive integer, but got {s!r}")
        if s not in lengths:
            lengths.append(s)
    if not lengths:
        raise AutobatchError("seq_lens must hold at least one length, but it is empty")
    return lengths


def _between(fit: LengthFit | None, safe: dict[int, int], memory_bound: set[int], limit: int
             ) -> Callable[[int], int] | None:
    """The safe batch the fit predicts between probed lengths, scaled down by its largest error there."""
    if fit is None or not memory_bound:
        return None

    def continuous(s: int) -> float:
        return max(0.0, (limit - fit.fixed_bytes) / fit.per_sample_bytes(s))

    # Where the fit promised more than the trials proved, trust it that much less everywhere.
    excess = max([1.0] + [continuous(s) / (safe[s] + 1) for s in memory_bound])
    return lambda s: int(continuous(s) / excess)


def _resolve_workload(work: Any, seq_lens: Sequence[int] | None, batches: Iterable[Any] | None
                      ) -> tuple[Workload, list[int], LongestSample | None]:
    longest = None
    if batches is not None:
        if seq_lens is not None:
            raise AutobatchError("pass seq_lens or batches, not both: with batches the probe runs at the "
                                 "longest sequence they hold")
        longest = longest_sample(batches)
        seq_lens = [longest.seq_len]
    if seq_lens is None:
        raise AutobatchError("probe_lengths needs seq_lens=[…] or batches= (a dataset sample); got neither")
    lengths = _lengths(seq_lens)
    if isinstance(work, Workload):
        if not takes_seq_len(work.make_batch):
            raise AutobatchError(
                "probe_lengths needs make_batch(b, seq_len), but the workload's make_batch takes the batch size "
                "only; add the length parameter (or pass the model alone with batches= to train on copies of "
                "the longest real sample)"
            )
        return work, lengths, longest
    if not (isinstance(work, torch.nn.Module) or callable(work)):
        raise AutobatchError(f"probe_lengths takes a Workload or a model, but got {type(work).__name__}")
    if longest is None:
        raise AutobatchError("a model alone needs batches= (a dataset sample) to train on; or pass a "
                             "Workload whose make_batch(b, seq_len) builds batches at any length")
    repeat = repeat_sample(longest)
    return Workload(work, lambda b, _seq_len: repeat(b)), lengths, longest


def probe_lengths(
    workload: Workload | torch.nn.Module | Callable[[], torch.nn.Module],
    seq_lens: Sequence[int] | None = None,
    backend: MemoryBackend | None = None,
    *,
    batches: Iterable[Any] | None = None,
    evaluation: bool = False,
    train_seq_len: int | None = None,
    headroom: float | int | str = DEFAULT_HEADROOM,
    max_batch: int | None = None,
    min_batch: int | None = None,
    gpu: Any = None,
    gpu_memory: int | str | None = None,
    overheads: Any = None,
    data_parallel: int = 1,
    on_trial: Callable[[Trial, int, str], None] | None = None,
) -> LengthTable:
    """Probe the exact max and safe batch at every length in ``seq_lens``, longest first.

    The first length is searched as :func:`~autobatch.probe` searches; each later one starts
    from the prediction of ``peak(b, s) = m0 + b·(c1·s + c2·s²)`` fitted to every trial so far,
    and ends, like the first, only when the max fits and max + 1 failed.

    Args:
        workload: a :class:`~autobatch.Workload` whose ``make_batch(b, seq_len)`` builds a batch
            at any length; or, with ``batches``, the model alone (trained on copies of the
            longest real sample, with :func:`~autobatch.default_loss`).
        seq_lens: the lengths; or give ``batches`` (a dataset sample: real batches or single
            samples) to probe the longest sequence they hold, reported in ``table.longest``.
            ``[None]`` probes one row at the workload's own shape (``make_batch(b, None)``),
            for models without a sequence length (the evaluation batch of a CNN).
        backend: where to probe (default the current CUDA device); ignored with ``gpu``.
        evaluation: also find the largest batch for a forward pass under ``torch.no_grad()``.
        train_seq_len: the length :meth:`LengthTable.plan` plans for (default the longest).
        headroom, max_batch, min_batch: as for :func:`~autobatch.probe`.
        gpu, gpu_memory, overheads: estimate for a named GPU on fake tensors instead (as
            :func:`~autobatch.estimate`); no device is used.
        data_parallel: with ``gpu``, the ranks DDP trains on: above one each trial holds DDP's
            gradient buckets, as the estimate's do. (A probe takes them off its limit when planned.)
        on_trial: called as ``on_trial(trial, seq_len, "train" | "eval")`` after each trial.

    Example:
        >>> import torch, autobatch
        >>> model = torch.nn.Sequential(torch.nn.Embedding(64, 16), torch.nn.Linear(16, 64))
        >>> work = autobatch.Workload(model, lambda b, s: torch.randint(0, 64, (b, s)))
        >>> table = autobatch.probe_lengths(work, [16, 32, 64], autobatch.SimulatedBackend("2MiB"), headroom=0)
        >>> [row.max_batch for row in table.rows], table.max_tokens
        ([329, 164, 82], 5274)
    """
    work, lengths, longest = _resolve_workload(workload, seq_lens, batches)
    if train_seq_len is None:
        train_seq_len = None if lengths == [None] else max(lengths)
    elif train_seq_len not in lengths:
        raise AutobatchError(f"train_seq_len must be one of the lengths probed ({', '.join(map(str, lengths))}), "
                             f"but got {train_seq_len}; add it to the lengths")
    for name, value in (("max_batch", max_batch), ("min_batch", min_batch)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise AutobatchError(f"{name} must be a positive integer, but got {name}={value!r}")
    if gpu is not None or gpu_memory is not None:
        from ..estimating.lengths import FakeLengthRunner

        runner: Any = FakeLengthRunner(work, gpu, gpu_memory=gpu_memory, overheads=overheads, min_batch=min_batch,
                                       data_parallel=data_parallel)
    else:
        from .runner import DeviceLengthRunner

        runner = DeviceLengthRunner(work, backend if backend is not None else make_backend(), min_batch=min_batch)
    try:
        capacity = runner.capacity
        headroom_bytes = resolve_headroom(headroom, capacity)
        limit = capacity - headroom_bytes
        if max_batch is not None and max_batch < runner.min_batch:
            raise AutobatchError(f"max_batch ({max_batch}) must be at least min_batch ({runner.min_batch})")

        def table_for(mode: str, trial_fn: Callable[[int, int], Trial], smallest: int):
            def run_at(b: int, s: int) -> Trial:
                trial = trial_fn(b, s)
                if on_trial is not None:
                    on_trial(trial, s, mode)
                return trial

            searched, fit = search_lengths(run_at, lengths, capacity, min_batch=smallest, max_batch=max_batch)
            results = []
            for row in searched:
                summary = summarise_length(row.outcome.trials, row.outcome.max_batch, limit, fit, row.seq_len)
                results.append((runner.result(mode, row.seq_len, row.outcome, summary, smallest, headroom_bytes),
                                row.predicted))
            return results, fit

        trained, fit = table_for("train", runner.train, runner.min_batch)
        evaluated, eval_fit = table_for("eval", runner.evaluate, 1) if evaluation else ([None] * len(lengths), None)
    finally:
        runner.close()
    rows = tuple(
        LengthRow(s, train, predicted, *(ev if ev is not None else (None, None)))
        for s, (train, predicted), ev in zip(lengths, trained, evaluated)
    )
    safe = {row.seq_len: row.safe_batch for row in rows}
    memory_bound = {row.seq_len for row in rows if row.train.limited_by == "memory" and row.max_batch > 0}
    tokens = None if lengths == [None] else token_budget(safe, _between(fit, safe, memory_bound, limit))
    return LengthTable(rows, train_seq_len, tokens, fit, eval_fit, device=runner.device_name,
                       estimated=runner.estimated, longest=longest)

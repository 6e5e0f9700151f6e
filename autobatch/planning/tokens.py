"""A token budget per micro-batch that is safe at every sequence length in a range.

Samplers that batch by tokens (fairseq's ``max_tokens``, token-budget and bucketing samplers)
put ``max_tokens // s`` sequences of padded length ``s`` in a micro-batch. That is safe at ``s``
when ``max_tokens // s`` is at most the safe batch there, i.e. ``max_tokens < (safe + 1)·s``.
The budget is the largest number of tokens for which this holds at every length.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["TokenBudget", "token_budget"]


@dataclass(frozen=True)
class TokenBudget:
    """``max_tokens``, the length that sets it, and the batch it implies at each probed length.

    ``max_tokens`` is ``None`` when some length does not fit even one sample safely.
    ``predicted_lengths`` counts the lengths between the probed ones whose safe batch came from
    the fit rather than from trials.

    Example:
        >>> budget = token_budget({256: 40, 512: 19, 1024: 8})
        >>> budget.max_tokens, budget.seq_len, budget.batch_at(256)
        (9215, 1024, 35)
    """

    max_tokens: int | None
    seq_len: int                      # the length that sets the budget
    safe_batch: int                   # the safe batch there
    safe_batches: tuple[tuple[int, int], ...]  # (seq_len, safe batch) of the probed lengths
    predicted_lengths: int = 0

    def batch_at(self, seq_len: int) -> int:
        return 0 if self.max_tokens is None else self.max_tokens // seq_len

    def to_dict(self) -> dict[str, Any]:
        return {
            "max_tokens": self.max_tokens,
            "set_by_seq_len": self.seq_len,
            "batch_at": {str(s): self.batch_at(s) for s, _ in self.safe_batches},
            "predicted_lengths": self.predicted_lengths,
        }

    def lines(self) -> list[str]:
        """The arithmetic, as printed by ``autobatch find`` with several lengths."""
        if self.max_tokens is None:
            return [f"no token budget: not even one sample of {self.seq_len} tokens is safe (safe batch 0)"]
        probed = {s for s, _ in self.safe_batches}
        where = "" if self.seq_len in probed else " (between the probed lengths; safe batch from the fit)"
        lines = [
            f"max_tokens {self.max_tokens:,} = min over lengths of (safe batch + 1) × seq_len − 1, "
            f"set by seq_len {self.seq_len}{where}: ({self.safe_batch} + 1) × {self.seq_len} − 1"
        ]
        lines += [f"  seq_len {s}: {self.max_tokens:,} // {s} = {self.batch_at(s)} per micro-batch (safe batch {b})"
                  for s, b in self.safe_batches]
        if self.predicted_lengths:
            lines.append(f"  the {self.predicted_lengths:,} lengths between the probed ones are bounded by the fit")
        return lines


def token_budget(safe: Mapping[int, int], between: Callable[[int], int] | None = None) -> TokenBudget:
    """The largest ``max_tokens`` with ``max_tokens // s ≤ safe batch at s`` for every length ``s``.

    Args:
        safe: the safe batch at each probed length.
        between: the safe batch predicted at an unprobed length (from the fit); when given,
            every length between the shortest and the longest probed one is held to it too.
    """
    if not safe:
        raise ValueError("token_budget needs at least one length")
    bound = {s: (b + 1) * s - 1 for s, b in safe.items()}
    batches = dict(safe)
    predicted = 0
    if between is not None:
        for s in range(min(safe) + 1, max(safe)):
            if s not in safe:
                batches[s] = between(s)
                bound[s] = (batches[s] + 1) * s - 1
                predicted += 1
    # Ties go to the longest length: the one a reader can check against the table.
    binding = min(bound, key=lambda s: (bound[s], -s))
    rows = tuple(sorted(safe.items()))
    if batches[binding] < 1:
        return TokenBudget(None, binding, batches[binding], rows, predicted)
    return TokenBudget(bound[binding], binding, batches[binding], rows, predicted)

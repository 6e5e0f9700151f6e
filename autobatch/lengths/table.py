"""The answer over sequence lengths: one row per length, the token budget, the evaluation batch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import AutobatchError
from ..planning.plan import Plan
from ..planning.tokens import TokenBudget
from ..probing.lengthfit import LengthFit
from ..probing.result import BatchResult
from ..probing.samples import LongestSample
from ..units import format_bytes

__all__ = ["LengthRow", "LengthTable"]


@dataclass(frozen=True)
class LengthRow:
    """One length: the training answer (exact max, safe batch, trials) and, if asked, evaluation's.

    ``predicted`` is the max batch the fit of the earlier lengths predicted before any trial at
    this one (``None`` for the first length searched).
    """

    seq_len: int | None             # None: the workload's own shape (a model without lengths)
    train: BatchResult
    predicted: int | None = None
    eval: BatchResult | None = None
    eval_predicted: int | None = None

    @property
    def max_batch(self) -> int:
        return self.train.max_batch

    @property
    def safe_batch(self) -> int:
        return self.train.safe_batch

    @property
    def trials(self) -> int:
        return len(self.train.trials) + (len(self.eval.trials) if self.eval is not None else 0)

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "seq_len": self.seq_len,
            "max_batch": self.train.max_batch,
            "safe_batch": self.train.safe_batch,
            "limited_by": self.train.limited_by,
            "predicted_max_batch": self.predicted,
            "safe_peak_bytes": self.train.safe_peak_bytes,
            "trials": [t.to_dict() for t in self.train.trials],
        }
        if self.eval is not None:
            data.update({
                "eval_max_batch": self.eval.max_batch,
                "eval_safe_batch": self.eval.safe_batch,
                "eval_predicted_max_batch": self.eval_predicted,
                "eval_trials": [t.to_dict() for t in self.eval.trials],
            })
        return data


def _fit_text(fit: LengthFit) -> str:
    pair = fit.per_token_pair_bytes if round(fit.per_token_pair_bytes, 2) != 0 else 0.0  # no "-0.00"
    return (f"peak ≈ {format_bytes(fit.fixed_bytes)} + b·({fit.per_token_bytes:,.0f} B·s "
            f"{'−' if pair < 0 else '+'} {abs(pair):,.2f} B·s²)")


@dataclass(frozen=True)
class LengthTable:
    """What :func:`~autobatch.probe_lengths` answers.

    ``rows`` are in the order the lengths were given; ``train_seq_len`` is the length the plan
    is made for (the longest unless told otherwise). ``fit``/``eval_fit`` are the memory models
    fitted to every trial; ``tokens`` the token budget safe at every length; ``longest`` where a
    dataset sample's longest sequence was, when the lengths came from one.
    """

    rows: tuple[LengthRow, ...]
    train_seq_len: int | None
    tokens: TokenBudget | None
    fit: LengthFit | None
    eval_fit: LengthFit | None = None
    device: str = ""
    estimated: bool = False
    longest: LongestSample | None = None

    @property
    def max_tokens(self) -> int | None:
        return None if self.tokens is None else self.tokens.max_tokens

    @property
    def trials(self) -> int:
        """Trials run for the whole table, training and evaluation."""
        return sum(row.trials for row in self.rows)

    def row(self, seq_len: int | None) -> LengthRow:
        for row in self.rows:
            if row.seq_len == seq_len:
                return row
        raise AutobatchError(f"seq_len {seq_len} is not in the table; its lengths are "
                             f"{', '.join(str(r.seq_len) for r in self.rows)}")

    @property
    def train_row(self) -> LengthRow:
        return self.row(self.train_seq_len)

    def plan(self, target: int | None = None, **planning: Any) -> Plan:
        """The plan at ``train_seq_len`` (see :func:`autobatch.pipeline.plan_from_probe` for ``planning``)."""
        from ..pipeline import plan_from_probe

        return plan_from_probe(self.train_row.train, target=target, **planning)

    def to_dict(self) -> dict[str, Any]:
        return {
            "lengths": [row.to_dict() for row in self.rows],
            "max_tokens": self.max_tokens,
            "token_budget": None if self.tokens is None else self.tokens.to_dict(),
            "train_seq_len": self.train_seq_len,
            "trials_total": self.trials,
            "fit": None if self.fit is None else self.fit.to_dict(),
            "eval_fit": None if self.eval_fit is None else self.eval_fit.to_dict(),
            "estimated": self.estimated,
            "longest": None if self.longest is None else self.longest.to_dict(),
        }

    def lines(self) -> list[str]:
        """The table and the arithmetic, as ``autobatch find`` prints them."""
        evals = any(row.eval is not None for row in self.rows)
        head = f"{'seq_len':>8} {'max batch':>10} {'safe batch':>11} {'predicted':>10} {'trials':>7}"
        if evals:
            head += f"   {'eval max':>9} {'eval safe':>10} {'predicted':>10} {'trials':>7}"
        what = "batch per sequence length" if self.rows[0].seq_len is not None else "batch"
        lines = [f"{'estimated ' if self.estimated else ''}{what} on {self.device}", head]
        for row in self.rows:
            predicted = "-" if row.predicted is None else str(row.predicted)
            line = (f"{'-' if row.seq_len is None else row.seq_len:>8} {row.max_batch:>10} {row.safe_batch:>11} {predicted:>10} "
                    f"{len(row.train.trials):>7}")
            if row.eval is not None:
                eval_predicted = "-" if row.eval_predicted is None else str(row.eval_predicted)
                line += (f"   {row.eval.max_batch:>9} {row.eval.safe_batch:>10} {eval_predicted:>10} "
                         f"{len(row.eval.trials):>7}")
            lines.append(line + ("  ← plan" if row.seq_len == self.train_seq_len and len(self.rows) > 1 else ""))
        evaluated = sum(len(r.eval.trials) for r in self.rows if r.eval is not None)
        if len(self.rows) == 1:
            lines.append(f"trials: {self.trials} in all ({len(self.rows[0].train.trials)} training"
                         + (f", {evaluated} evaluation)" if evaluated else ")"))
        else:
            order = sorted(self.rows, key=lambda r: -(r.seq_len or 0))
            counts = ", ".join(f"{len(r.train.trials)} at {r.seq_len}" for r in order)
            lines.append(f"trials: {self.trials} in all (training {counts}"
                         + (f"; evaluation {evaluated}" if evaluated else "")
                         + "): longest first, each later length from the fit's prediction")
        if self.fit is not None:
            lines.append(f"fit (training): {_fit_text(self.fit)}")
        if self.eval_fit is not None:
            lines.append(f"fit (evaluation): {_fit_text(self.eval_fit)}")
        if self.tokens is not None:
            lines += self.tokens.lines()
        if self.longest is not None:
            lines.append(f"{self.longest}: probed at seq_len {self.longest.seq_len}")
        return lines

    def __str__(self) -> str:
        return "\n".join(self.lines())

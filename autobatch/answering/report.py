"""``Report``: the frozen answer to a :class:`~autobatch.Request`, whose ``to_dict()`` is ``--json``.

It holds the rows (one per strategy, each with its probe or estimate, where each rank's memory
went and whether the trace led it), or the length table; the plan; what was cached; what was
written and merged; and the notes said on the way. The CLI draws its tables from it alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..lengths import LengthTable
from ..pipeline import Finding, plan_summary
from ..planning.plan import Plan
from .request import Request
from .rows import NoFit

__all__ = ["Report"]


@dataclass(frozen=True)
class Report:
    """What :func:`autobatch.answer` found.

    ``mode`` is the request's (``"solve"``, ``"estimate"``, ``"probe"``). ``rows`` holds one
    :class:`~autobatch.Finding` per strategy (or one unwrapped row), a ``NoFit`` where nothing fits
    under a compared strategy; it is empty for a plan alone and for a length table (``lengths``).
    ``gpu`` is the card an estimate was for. ``written`` maps each file kind to its path,
    ``changes`` says what merging changed in files that existed. ``main_rank`` is false on the
    launched ranks other than rank 0, which write and print nothing.
    """

    request: Request
    plan: Plan | None
    rows: tuple[Finding | NoFit, ...] = ()
    lengths: LengthTable | None = None
    gpu: Any = None
    device: Any = None
    written: dict[str, str] = field(default_factory=dict)
    changes: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    main_rank: bool = True
    uneven: Any = None   # the plan per rank (UnevenPlan) when the request asked for one
    cards: tuple[dict[str, Any], ...] = ()  # each card of a mixed --gpu list: count, max and safe batch

    @property
    def mode(self) -> str:
        return self.request.mode

    @property
    def fragmentation(self) -> float:
        """The reserved ÷ allocated ratio taken where requests are not booked (``--fragmentation``, or
        the length tables' default): ``--fragmentation`` where given, else the default."""
        from ..estimating.overheads import Overheads

        return Overheads(fragmentation=self.request.fragmentation).multiplier

    @property
    def beside_the_context(self) -> int:
        """What an estimate's card can allocate: its memory less the CUDA context (``--cuda-context``
        where given, else the card's), as the estimate took it."""
        from ..estimating.overheads import beside_the_context
        from .rows import estimate_overheads

        return beside_the_context(self.gpu, estimate_overheads(self.request))

    @property
    def estimated(self) -> bool:
        return self.mode == "estimate"

    @property
    def finding(self) -> Finding | None:
        """The one row, when there is exactly one and it fit."""
        return self.rows[0] if len(self.rows) == 1 and isinstance(self.rows[0], Finding) else None

    @property
    def cached(self) -> bool:
        return any(isinstance(row, Finding) and row.cached for row in self.rows)

    def training(self) -> dict[str, Any]:
        """What the micro batch was probed with and so must train with: ``precision`` (``"bf16"``,
        ``"fp16"``, ``"bf16-true"``, ``"fp16-true"`` or ``None`` for fp32) and ``grad_checkpointing``;
        none for a plan alone."""
        request = self.request
        if request.model is None:
            return {"precision": None, "grad_checkpointing": False}
        return {"precision": request.precision, "grad_checkpointing": bool(request.grad_checkpointing)}

    @property
    def strategy(self) -> Any:
        """How training shards: as the one row was probed (with the FSDP block it wrapped), else as asked."""
        if self.finding is not None:
            return self.finding.strategy
        return (self.request.strategies or (None,))[0]

    @property
    def probed_zero(self) -> dict[str, Any] | None:
        """The ``zero_optimization`` values the one row's ZeRO probe ran with, which every file and line trains with."""
        return None if self.finding is None else self.finding.probed_zero

    @property
    def eval_batch(self) -> int | None:
        """The safe evaluation batch at the length trained at, when ``evaluation`` was asked."""
        if self.lengths is None or self.lengths.train_row.eval is None:
            return None
        return self.lengths.train_row.eval.safe_batch

    def to_dict(self) -> dict[str, Any]:
        """The ``--json`` of every command that answers a request; the keys scripts read stay put:
        ``max_batch``, ``safe_batch``, ``plan``, ``probe``, ``trials``, ``strategies``; ``notes`` holds
        what was said on the way (on stderr), when anything was; ``per_rank`` and ``uneven`` the plan
        per rank, when one was asked; ``gpus`` the cards of a mixed list; ``trained_with`` the
        precision and checkpointing the batch was found with (every answer about a model)."""
        data = self._answer_dict()
        if self.mode != "solve" and self.request.model is not None:
            data["trained_with"] = self.training()
        if self.cards:
            data["gpus"] = list(self.cards)
        if self.uneven is not None:
            data["uneven"] = self.uneven.to_dict()
            data["per_rank"] = data["uneven"]["per_rank"]
        return data

    def _answer_dict(self) -> dict[str, Any]:
        tail = {**self.written, **({"changes": list(self.changes)} if self.changes else {}),
                **({"notes": list(self.notes)} if self.notes else {})}
        if self.mode == "solve":
            return {**self.plan.to_dict(), **tail}
        if self.lengths is not None:
            return {**self._lengths_dict(), **tail}
        estimated = {"estimated": True, "gpu": self.gpu.to_dict()} if self.estimated else {}
        if self.request.strategies is not None:
            if len(self.rows) > 1:
                # each row says what the answer says: traced for a named GPU, or probed
                return {**estimated, "strategies": [{**row.to_dict(), "estimated": self.estimated} for row in self.rows]}
            return {**self.rows[0].to_dict(), **estimated, **tail}
        finding = self.rows[0]
        if not self.estimated:
            return {**finding.to_dict(), **tail}
        plan = {} if self.plan is None else plan_summary(self.plan)
        return {**plan, **finding.probe.to_dict(), **({"plan": self.plan.to_dict()} if self.plan else {}), **tail}

    def _lengths_dict(self) -> dict[str, Any]:
        table, plan = self.lengths, self.plan
        if len(table.rows) > 1:  # the plan's numbers at the top too, as every other answer has them
            evaluation = {} if self.eval_batch is None else {"eval_safe_batch": self.eval_batch}
            return {**plan_summary(plan), **evaluation, **table.to_dict(), "plan": plan.to_dict()}
        row = table.train_row  # one length: the keys `find --json` always had, and the evaluation batch
        data = (Finding(row.train, plan).to_dict() if not table.estimated
                else {**plan_summary(plan), **row.train.to_dict(), "plan": plan.to_dict()})
        if row.eval is not None:
            data.update(eval_max_batch=row.eval.max_batch, eval_safe_batch=row.eval.safe_batch,
                        eval_trials=[t.to_dict() for t in row.eval.trials])
        return data

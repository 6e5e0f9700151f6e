"""What a config trains with: each setting as the caller gave it, else as the plan's micro batch was found.

A plan from :func:`~autobatch.find` or :func:`~autobatch.answer` carries
:class:`~autobatch.planning.plan.TrainedWith`: the precision, checkpointing, strategy and ZeRO
values of the probe. The batch fits only with them, so a config helper called with the plan alone
(``deepspeed_config(plan)``) writes them, as the CLI's files do.
"""

from __future__ import annotations

from typing import Any

from ..planning.plan import Plan, TrainedWith
from ..strategy import as_strategy

__all__ = ["trained_with"]


def trained_with(plan: Plan, *, strategy: Any = None, precision: str | None = None,
                 probed_zero: dict[str, Any] | None = None, grad_checkpointing: bool | None = None) -> TrainedWith:
    """The settings to write: each given one, else the plan's own (``plan.trained_with``), else none;
    the strategy as a :class:`~autobatch.Strategy` (a name such as ``"zero3"`` is one too).

    Example:
        >>> plan = Plan(7, 2, trained_with=TrainedWith(precision="bf16", strategy="zero3"))
        >>> found = trained_with(plan, strategy="zero2")
        >>> found.precision, found.strategy.name
        ('bf16', 'zero2')
    """
    found = plan.trained_with or TrainedWith()
    return TrainedWith(
        precision=precision if precision is not None else found.precision,
        grad_checkpointing=grad_checkpointing if grad_checkpointing is not None else found.grad_checkpointing,
        strategy=as_strategy(strategy if strategy is not None else found.strategy),
        probed_zero=probed_zero if probed_zero is not None else found.probed_zero,
    )

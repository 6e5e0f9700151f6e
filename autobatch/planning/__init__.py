"""Planning: micro batch × gradient accumulation × world size = the global batch, exactly.

:mod:`.plan` is the frozen :class:`Plan` value that prints its arithmetic; :mod:`.solver`
finds the plans that reach a target or says why none does. Config writers live one stage up,
in :mod:`autobatch.configs`: they take a Plan, the Plan knows nothing of them.
"""

from __future__ import annotations

from .plan import LRAdvice, Plan
from .solver import NoExactPlanError, exact_plans, solve

__all__ = ["LRAdvice", "NoExactPlanError", "Plan", "exact_plans", "solve"]

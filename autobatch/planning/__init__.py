"""Planning: micro batch × gradient accumulation × world size = the global batch, exactly.

:mod:`.plan` is the frozen :class:`Plan` value that prints its arithmetic; :mod:`.solver`
finds the plans that reach a target or says why none does; :mod:`.uneven` plans each rank of
mixed GPUs (:mod:`.per_rank` holds its values). Config writers live one stage up,
in :mod:`autobatch.configs`: they take a Plan, the Plan knows nothing of them.
"""

from __future__ import annotations

from .per_rank import RankLimit, RankPlan, UnevenPlan
from .plan import LRAdvice, Plan
from .solver import NoExactPlanError, exact_plans, solve
from .uneven import solve_uneven

__all__ = ["LRAdvice", "NoExactPlanError", "Plan", "RankLimit", "RankPlan", "UnevenPlan", "exact_plans", "solve",
           "solve_uneven"]

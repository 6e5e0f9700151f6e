"""One request, one pipeline, one report: :class:`Request` → :func:`answer` → :class:`Report`.

Every command of the CLI is one function here: ``find``/``estimate``/``solve`` are
:func:`answer`, ``check`` is :func:`check`, ``tune`` is :func:`tune_plans`.
"""

from __future__ import annotations

from .answer import answer, find
from .commands import cache_listing, check, clear_cache, tune_plans
from .report import Report
from .request import Request
from .rows import NoFit

__all__ = ["Request", "Report", "NoFit", "answer", "find", "check", "tune_plans", "cache_listing", "clear_cache"]

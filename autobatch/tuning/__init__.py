"""Tuning and reuse: the fastest exact plan, the on-disk cache of probes, and plots.

:mod:`.tune` times candidate plans with optuna; :mod:`.cache` keeps probe results keyed by
:mod:`.fingerprint`; :mod:`.plot` draws probes and tuning studies.
"""

from __future__ import annotations

from .cache import cached_probe
from .tune import TuneResult, tune

__all__ = ["TuneResult", "cached_probe", "tune"]

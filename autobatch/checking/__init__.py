"""Checking: a setup before launch, and gradient accumulation against the big batch.

:mod:`.setup` collects every batch-size problem in flags, DeepSpeed files and accelerate
configs; :mod:`.accumulation` holds the loss normalisation that makes accumulation equal the
big batch; :mod:`.verify_ga` measures whether a model's accumulated step does.
"""

from __future__ import annotations

from .accumulation import (
    LossNormaliser,
    count_loss_samples,
    count_loss_tokens,
    token_cross_entropy,
)
from .problems import CheckResult, Problem
from .setup import check_setup
from .verify_ga import GAVerification, verify_ga

__all__ = [
    "CheckResult", "GAVerification", "LossNormaliser", "Problem", "check_setup", "count_loss_samples",
    "count_loss_tokens", "token_cross_entropy", "verify_ga",
]

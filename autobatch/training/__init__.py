"""Helpers for the training loop that runs a plan: :mod:`.sampler` feeds each rank its share of an
uneven plan from one global order, and scales the loss so that the step equals the big batch."""

from __future__ import annotations

from .sampler import UnevenBatchSampler, per_rank_pairs

__all__ = ["UnevenBatchSampler", "per_rank_pairs"]

"""Shared by the tests that spawn several ranks: gather every rank's answer, and the slow-test gate."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch.distributed as dist

__all__ = ["gathered", "slow"]


def gathered(mine: Any) -> list[Any]:
    """Every rank's ``mine``, in rank order, on every rank (spawn_local returns rank 0's)."""
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


def slow(why: str) -> pytest.MarkDecorator:
    """Skip unless AUTOBATCH_SLOW_TESTS is set: multi-process runs that would take the default run
    over its time budget."""
    return pytest.mark.skipif(not os.environ.get("AUTOBATCH_SLOW_TESTS"),
                              reason=f"{why}; set AUTOBATCH_SLOW_TESTS=1 to include it")

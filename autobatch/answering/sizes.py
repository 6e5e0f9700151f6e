"""The sizes a request may name: a simulated budget runs real steps in this machine's memory, and no
GPU holds more than :data:`MAX_GPU_MEMORY`. Beyond them a run would exhaust the host or search
batches no device holds (``--memory 99999999999999999999GiB`` hung)."""

from __future__ import annotations

import os
from typing import Any

from ..errors import AutobatchError, option
from ..units import format_bytes, parse_bytes

__all__ = ["MAX_GPU_MEMORY", "host_memory", "size_problems"]

MAX_GPU_MEMORY = 4 << 40


def host_memory() -> int | None:
    """This machine's physical memory in bytes, where the OS says."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _size(value: Any) -> int | None:
    try:
        return None if value is None else parse_bytes(value)
    except (AutobatchError, ValueError, TypeError):
        return None  # a malformed size is said by the request's own check


def size_problems(memory: Any, gpu_memory: Any) -> list[str]:
    """One line per size past what a run can use (empty when both are fine)."""
    problems = []
    budget, card, host = _size(memory), _size(gpu_memory), host_memory()
    if budget is not None and host is not None and budget > host:
        problems.append(f"{option('memory')} is a budget the probe's real steps run in on this machine, so it must "
                        f"be at most its {format_bytes(host)} of RAM, but got {memory}; pass a smaller budget, "
                        f"or estimate a larger GPU with `autobatch estimate --gpu-memory`")
    if card is not None and card > MAX_GPU_MEMORY:
        problems.append(f"{option('gpu_memory')} must be at most {format_bytes(MAX_GPU_MEMORY)} (no GPU holds more), "
                        f"but got {gpu_memory}; pass one GPU's memory, e.g. 80GiB")
    return problems

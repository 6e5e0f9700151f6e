"""The sizes a request may name: a simulated budget runs real steps in this machine's memory, and no
GPU holds more than :data:`MAX_GPU_MEMORY`. Beyond them a run would exhaust the host or search
batches no device holds (``--memory 99999999999999999999GiB`` hung)."""

from __future__ import annotations

import os
from typing import Any

from ..errors import AutobatchError, option
from ..units import format_bytes, parse_bytes

__all__ = ["MAX_GPU_MEMORY", "host_memory", "size_problems", "unit_problems", "budgets_of", "per_rank_problems"]

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


def budgets_of(memory: Any) -> tuple[Any, ...] | None:
    """The simulated budgets ``memory`` gives: one for every rank, or one per rank (``"60MiB,40MiB"``).

    Example:
        >>> budgets_of("60MiB, 40MiB")
        ('60MiB', '40MiB')
    """
    if memory is None:
        return None
    if isinstance(memory, str):
        return tuple(part.strip() for part in memory.split(","))
    if isinstance(memory, (list, tuple)):
        return tuple(memory)
    return (memory,)


def per_rank_problems(memory: Any, count: int, launched: bool) -> list[str]:
    """One line where a budget per rank cannot apply: no launcher, or not one per launched rank."""
    spelt = memory if isinstance(memory, str) else ",".join(str(m) for m in memory)
    if not launched:
        return [f"{option('memory')} {spelt} gives one budget per rank, which needs a launcher (torchrun, srun, …) "
                f"to start the ranks; pass one budget, or launch {count} ranks"]
    from ..distributed.environment import rank_env

    world = rank_env().world_size
    if count != world:
        return [f"{option('memory')} {spelt} gives {count} budgets, but the launcher started {world} ranks; "
                "give one budget for all, or one per rank"]
    return []


# Overheads that may be none: a size of 0 is one (no workspace; a context already taken off --gpu-memory).
_MAY_BE_ZERO = ("workspace", "cuda_context")


def unit_problems(named: list[tuple[str, Any]]) -> list[str]:
    """Each ``(option, value)`` that is no size: a number as a string (no unit), or unreadable."""
    problems = []
    for name, value in named:
        zero = name in _MAY_BE_ZERO
        bare = isinstance(value, str) and value.strip().replace(".", "", 1).isdigit()
        if bare and float(value) == 0:
            if not zero:
                problems.append(f"{option(name)} must be a positive size (2GiB, 512MiB), but got {value!r}")
        elif bare:
            problems.append(f"{option(name)} needs a unit as a string ({value!r} would be {value} bytes); write "
                            f"e.g. '{value.strip()}GiB', or pass a number of bytes as an int")
        elif value is not None:
            try:
                parse_bytes(value, zero=zero)
            except (AutobatchError, ValueError, TypeError):
                kind = "a size of 0B or more" if zero else "a positive size"
                problems.append(f"{option(name)} must be {kind} (2GiB, 512MiB), but got {value!r}")
    return problems

"""What makes a cached probe result fit to be served: types, ranges, and its own trial log.

A cache file is data anyone can edit or damage. Before :mod:`.cache` serves an entry, every
figure is checked for its type and range, and the answers are checked against the trials that
are supposed to prove them: ``max_batch`` fitted and ``max_batch + 1`` did not, and the safe
batch is what the trials give under the recorded headroom. An entry that fails is a miss.
"""

from __future__ import annotations

import math
from numbers import Real
from typing import Any

from ..probing.probe import summarise
from ..probing.result import ProbeResult

__all__ = ["entry_problem"]

_LIMITS = ("memory", "max_batch")


def _is_int(value: Any, *, low: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _is_bytes_or_none(value: Any) -> bool:
    return value is None or _is_int(value)


def _is_real_or_none(value: Any) -> bool:
    return value is None or (isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value))


def _types(result: ProbeResult) -> str | None:
    for name in ("max_batch", "min_batch", "capacity_bytes"):
        if not _is_int(getattr(result, name), low=1):
            return f"{name}={getattr(result, name)!r} is not a positive integer"
    for name in ("safe_batch", "headroom_bytes"):
        if not _is_int(getattr(result, name)):
            return f"{name}={getattr(result, name)!r} is not a non-negative integer"
    if result.limited_by not in _LIMITS:
        return f"limited_by={result.limited_by!r} is not one of {', '.join(_LIMITS)}"
    if not (_is_real_or_none(result.bytes_per_sample) and _is_real_or_none(result.fixed_bytes)
            and _is_bytes_or_none(result.safe_peak_bytes) and isinstance(result.safe_peak_measured, bool)):
        return "the memory line or the safe peak is not a number"
    device = result.device
    if not (isinstance(device.name, str) and isinstance(device.kind, str) and _is_bytes_or_none(device.total_bytes)
            and _is_int(device.capacity_bytes)):
        return "the device record is malformed"
    if not isinstance(result.trials, tuple) or not result.trials:
        return "trials are missing"
    for t in result.trials:
        if not (_is_int(t.batch, low=1) and isinstance(t.fits, bool) and _is_int(t.peak_bytes)
                and _is_int(t.reserved_bytes) and _is_int(t.forward_backward_bytes) and _is_int(t.optimizer_bytes)
                and _is_int(t.forward_bytes) and _is_bytes_or_none(t.resident_bytes)
                and _is_real_or_none(t.seconds_per_step)):
            return f"trials hold a malformed trial ({t.batch!r})"
    return None


def _consistency(result: ProbeResult) -> str | None:
    if not result.safe_batch <= result.max_batch:
        return f"safe_batch={result.safe_batch} is above max_batch={result.max_batch}"
    if result.headroom_bytes >= result.capacity_bytes:
        return "headroom_bytes is not below capacity_bytes"
    fits = {t.batch for t in result.trials if t.fits}
    fails = {t.batch for t in result.trials if not t.fits}
    if result.max_batch not in fits:
        return f"trials do not show max_batch={result.max_batch} fitting"
    if any(b > result.max_batch for b in fits):
        return f"trials show a batch above max_batch={result.max_batch} fitting"
    if result.limited_by == "memory" and result.max_batch + 1 not in fails:
        return f"trials do not show max_batch + 1 = {result.max_batch + 1} running out of memory"
    expected = summarise(result.trials, result.max_batch, result.capacity_bytes - result.headroom_bytes).safe_batch
    if result.safe_batch != expected:
        return f"safe_batch={result.safe_batch}, but its trials and headroom give {expected}"
    return None


def entry_problem(result: ProbeResult) -> str | None:
    """Why ``result`` (read from a cache file) must not be served, or ``None`` when it may be.

    Example:
        >>> import torch
        >>> from dataclasses import replace
        >>> from autobatch import SimulatedBackend, Workload, probe
        >>> work = Workload(torch.nn.Linear(8, 2), lambda b: (torch.randn(b, 8), torch.zeros(b, dtype=torch.long)))
        >>> result = probe(work, SimulatedBackend("64KiB"), headroom=0)
        >>> entry_problem(result) is None
        True
        >>> entry_problem(replace(result, safe_batch=9999))
        'safe_batch=9999 is above max_batch=...'
    """
    return _types(result) or _consistency(result)

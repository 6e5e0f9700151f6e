"""Probing: the largest batch that trains on one device, measured with real training steps.

:mod:`.workload` (what trains) → :mod:`.trial` (one trial: two full steps, peaks per phase) →
:mod:`.search` (which batches to try) → :mod:`.probe` (the answer, :class:`ProbeResult`).
:mod:`.backends` hold the memory contract and its CUDA and simulated implementations;
:mod:`.oom` recognises out-of-memory errors; :mod:`.preserve` lends the user's model and gives
it back bit for bit; :mod:`.memtrack` counts tensor storage for the simulated budget; :mod:`.heap`
keeps the trials' garbage collections to the probe's own objects.
"""

from __future__ import annotations

from .backends import CudaBackend, DeviceInfo, MemoryBackend, Peak, SimulatedBackend
from .memtrack import MemoryTracker
from .oom import is_oom_error
from .preserve import borrowed_model
from .probe import DEFAULT_HEADROOM, make_backend, probe
from .result import BatchResult, ProbeResult
from .search import SearchOutcome, search_max
from .trial import Trial, run_trial
from .workload import Workload, default_loss

__all__ = [
    "BatchResult", "CudaBackend", "DEFAULT_HEADROOM", "DeviceInfo", "MemoryBackend", "MemoryTracker", "Peak",
    "ProbeResult", "SearchOutcome", "SimulatedBackend", "Trial", "Workload", "borrowed_model",
    "default_loss", "is_oom_error", "make_backend", "probe", "run_trial", "search_max",
]

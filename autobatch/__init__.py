"""autobatch: the largest per-device batch that trains, and a plan that reaches your global batch.

Public names are re-exported here; see ``__all__``.
"""

from __future__ import annotations

from .errors import AutobatchError, ConfigError, MinimumBatchError, MissingDependencyError, NoBatchFitsError
from .oom import is_oom_error
from .units import format_bytes, parse_bytes
from .backends import CudaBackend, DeviceInfo, MemoryBackend, SimulatedBackend
from .memtrack import MemoryTracker
from .probe import ProbeResult, make_backend, probe
from .search import SearchOutcome, search_max
from .trial import Trial, run_trial
from .workload import Workload, default_loss

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "AutobatchError",
    "ConfigError",
    "MinimumBatchError",
    "MissingDependencyError",
    "NoBatchFitsError",
    "is_oom_error",
    "format_bytes",
    "parse_bytes",
    "CudaBackend",
    "DeviceInfo",
    "MemoryBackend",
    "SimulatedBackend",
    "MemoryTracker",
    "ProbeResult",
    "make_backend",
    "probe",
    "SearchOutcome",
    "search_max",
    "Trial",
    "run_trial",
    "Workload",
    "default_loss",
]

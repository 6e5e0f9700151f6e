"""autobatch: the largest per-device batch that trains, and a plan that reaches your global batch.

>>> import autobatch
>>> print(autobatch.solve(224, gpus_per_node=16, max_micro=9))
7 per GPU × 2 accumulation × 16 GPUs (16 per node × 1 node) = 224
"""

from __future__ import annotations

from .errors import AutobatchError, ConfigError, MinimumBatchError, MissingDependencyError, NoBatchFitsError
from .oom import is_oom_error
from .units import format_bytes, parse_bytes
from .backends import CudaBackend, DeviceInfo, MemoryBackend, SimulatedBackend
from .memtrack import MemoryTracker
from .workload import Workload, default_loss
from .trial import Trial, run_trial
from .search import SearchOutcome, search_max
from .probe import ProbeResult, make_backend, probe
from .plan import Plan
from .solver import NoExactPlanError, solve
from .check import CheckResult, check_setup
from .models import load_model
from .find import Finding, find, find_plan

__version__ = "0.1.0"

__all__ = [
    "__version__",
    # errors
    "AutobatchError",
    "ConfigError",
    "MinimumBatchError",
    "MissingDependencyError",
    "NoBatchFitsError",
    "NoExactPlanError",
    # probing
    "is_oom_error",
    "CudaBackend",
    "DeviceInfo",
    "MemoryBackend",
    "SimulatedBackend",
    "MemoryTracker",
    "Workload",
    "default_loss",
    "Trial",
    "run_trial",
    "SearchOutcome",
    "search_max",
    "ProbeResult",
    "make_backend",
    "probe",
    # planning and checking
    "Plan",
    "solve",
    "CheckResult",
    "check_setup",
    # end to end
    "load_model",
    "Finding",
    "find",
    "find_plan",
    # units
    "format_bytes",
    "parse_bytes",
]

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
from .plan import LRAdvice, Plan
from .solver import NoExactPlanError, exact_plans, solve
from .check import CheckResult, Problem, check_setup
from .models import load_model
from .find import Finding, find, find_plan
from .accumulation import LossNormaliser, count_loss_samples, count_loss_tokens, token_cross_entropy
from .verify_ga import GAVerification, verify_ga
from .distributed import is_launched, process_group, rank_env, spawn_local
from .lockstep import DistributedProbeResult, probe_distributed
from .gpus import GPUS, GpuSpec, lookup_gpu
from .overheads import Overheads
from .estimate import Estimate, estimate
from .cache import cached_probe
from .tune import TuneResult, tune

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
    "LRAdvice",
    "solve",
    "exact_plans",
    "CheckResult",
    "Problem",
    "check_setup",
    # end to end
    "load_model",
    "Finding",
    "find",
    "find_plan",
    # gradient accumulation
    "LossNormaliser",
    "count_loss_samples",
    "count_loss_tokens",
    "token_cross_entropy",
    "GAVerification",
    "verify_ga",
    # every rank
    "is_launched",
    "process_group",
    "rank_env",
    "spawn_local",
    "DistributedProbeResult",
    "probe_distributed",
    # without a GPU
    "GPUS",
    "GpuSpec",
    "lookup_gpu",
    "Overheads",
    "Estimate",
    "estimate",
    # speed and reuse
    "cached_probe",
    "TuneResult",
    "tune",
    # units
    "format_bytes",
    "parse_bytes",
]

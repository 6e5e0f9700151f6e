"""autobatch: the largest per-device batch that trains, and a plan that reaches your global batch.

>>> import autobatch
>>> print(autobatch.solve(224, gpus_per_node=16, max_micro=9))
7 per GPU × 2 accumulation × 16 GPUs (16 per node × 1 node) = 224
"""

from __future__ import annotations

from .checking.accumulation import (
    LossNormaliser,
    count_loss_samples,
    count_loss_tokens,
    token_cross_entropy,
)
from .checking.problems import CheckResult, Problem
from .checking.setup import check_setup
from .checking.ga_sources import verify_model as verify_ga_model
from .checking.verify_ga import GAVerification, verify_ga
from .configs import (
    accelerate_command,
    accelerate_config,
    deepspeed_config,
    hf_flags,
    hf_training_args,
    lightning_settings,
    torchrun_command,
)
from .answering import (
    NoFit,
    Report,
    Request,
    answer,
    cache_listing,
    check,
    clear_cache,
    find,
    tune_plans,
)
from .distributed.launch import exit_rank, is_launched, process_group, rank_env, spawn_local
from .distributed.lockstep import probe_distributed
from .distributed.result import DistributedProbeResult
from .distributed.simulated_world import probe_sharded
from .errors import (
    AutobatchError,
    ConfigError,
    MinimumBatchError,
    MissingDependencyError,
    NoBatchFitsError,
    RequestError,
)
from .estimating.estimate import Estimate, estimate
from .estimating.gpus import DEFAULT_GPU, GPUS, GpuSpec, lookup_gpu
from .estimating.overheads import Overheads
from .estimating.prior import trace_prior
from .lengths import LengthRow, LengthTable, probe_lengths
from .models import list_models, load_model
from .guard import GuardedStep, OOMGuard
from .pipeline import Finding, find_plan
from .planning.plan import LRAdvice, Plan
from .planning.solver import NoExactPlanError, exact_plans, solve
from .probing.backends import CudaBackend, DeviceInfo, MemoryBackend, SimulatedBackend
from .probing.memtrack import MemoryTracker
from .probing.oom import is_oom_error
from .probing.probe import make_backend, probe
from .probing.result import BatchResult, ProbeResult
from .probing.samples import LongestSample, longest_sample
from .probing.search import SearchOutcome, search_max
from .probing.trial import Trial, run_trial
from .probing.workload import Workload, default_loss
from .tuning.cache import cached_probe
from .tuning.tune import TuneResult, tune
from .strategy import STRATEGIES, Strategy, parse_strategy
from .units import format_bytes, parse_bytes

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
    "RequestError",
    # one request, one pipeline, one report: every command of the CLI
    "Request",
    "Report",
    "NoFit",
    "answer",
    "check",
    "tune_plans",
    "cache_listing",
    "clear_cache",
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
    "BatchResult",
    "ProbeResult",
    "make_backend",
    "probe",
    # memory that depends on the data: lengths, tokens, evaluation
    "LengthRow",
    "LengthTable",
    "LongestSample",
    "longest_sample",
    "probe_lengths",
    # planning and checking
    "Plan",
    "LRAdvice",
    "solve",
    "exact_plans",
    "CheckResult",
    "Problem",
    "check_setup",
    # writing configs: each writer takes a Plan
    "deepspeed_config",
    "accelerate_config",
    "hf_training_args",
    "hf_flags",
    "lightning_settings",
    "torchrun_command",
    "accelerate_command",
    # end to end
    "load_model",
    "list_models",
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
    "verify_ga_model",
    "OOMGuard",
    "GuardedStep",
    # every rank
    "is_launched",
    "exit_rank",
    "process_group",
    "rank_env",
    "spawn_local",
    "DistributedProbeResult",
    "probe_distributed",
    # sharded training: DDP, FSDP, ZeRO on W ranks
    "STRATEGIES",
    "Strategy",
    "parse_strategy",
    "probe_sharded",
    # without a GPU
    "GPUS",
    "DEFAULT_GPU",
    "GpuSpec",
    "lookup_gpu",
    "Overheads",
    "Estimate",
    "estimate",
    "trace_prior",
    # speed and reuse
    "cached_probe",
    "TuneResult",
    "tune",
    # units
    "format_bytes",
    "parse_bytes",
]

"""autobatch: the largest per-device batch that trains, and a plan that reaches your global batch.

>>> import autobatch
>>> print(autobatch.solve(224, gpus_per_node=16, max_micro=9))
7 per GPU × 2 accumulation × 16 GPUs (16 per node × 1 node) = 224
"""

from __future__ import annotations

import importlib
from typing import Any

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
    "RankFailedError",
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
    "TrainedWith",
    "solve",
    "exact_plans",
    # mixed GPUs: a plan per rank, and the sampler that trains it
    "RankLimit",
    "RankPlan",
    "UnevenPlan",
    "solve_uneven",
    "UnevenBatchSampler",
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
    "launcher_command",
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

# Where each public name lives. They are imported on first use (PEP 562), so that `autobatch --help`
# and a mistyped flag answer without importing torch; `from autobatch import X` works as ever.
_WHERE: dict[str, tuple[str, str]] = {
    "AutobatchError": ("errors", "AutobatchError"),
    "ConfigError": ("errors", "ConfigError"),
    "MinimumBatchError": ("errors", "MinimumBatchError"),
    "MissingDependencyError": ("errors", "MissingDependencyError"),
    "NoBatchFitsError": ("errors", "NoBatchFitsError"),
    "NoExactPlanError": ("planning.solver", "NoExactPlanError"),
    "RankFailedError": ("distributed.result", "RankFailedError"),
    "RequestError": ("errors", "RequestError"),
    "Request": ("answering", "Request"),
    "Report": ("answering", "Report"),
    "NoFit": ("answering", "NoFit"),
    "answer": ("answering", "answer"),
    "check": ("answering", "check"),
    "tune_plans": ("answering", "tune_plans"),
    "cache_listing": ("answering", "cache_listing"),
    "clear_cache": ("answering", "clear_cache"),
    "is_oom_error": ("probing.oom", "is_oom_error"),
    "CudaBackend": ("probing.backends", "CudaBackend"),
    "DeviceInfo": ("probing.backends", "DeviceInfo"),
    "MemoryBackend": ("probing.backends", "MemoryBackend"),
    "SimulatedBackend": ("probing.backends", "SimulatedBackend"),
    "MemoryTracker": ("probing.memtrack", "MemoryTracker"),
    "Workload": ("probing.workload", "Workload"),
    "default_loss": ("probing.workload", "default_loss"),
    "Trial": ("probing.trial", "Trial"),
    "run_trial": ("probing.trial", "run_trial"),
    "SearchOutcome": ("probing.search", "SearchOutcome"),
    "search_max": ("probing.search", "search_max"),
    "BatchResult": ("probing.result", "BatchResult"),
    "ProbeResult": ("probing.result", "ProbeResult"),
    "make_backend": ("probing.probe", "make_backend"),
    "probe": ("probing.probe", "probe"),
    "LengthRow": ("lengths", "LengthRow"),
    "LengthTable": ("lengths", "LengthTable"),
    "LongestSample": ("probing.samples", "LongestSample"),
    "longest_sample": ("probing.samples", "longest_sample"),
    "probe_lengths": ("lengths", "probe_lengths"),
    "Plan": ("planning.plan", "Plan"),
    "LRAdvice": ("planning.plan", "LRAdvice"),
    "TrainedWith": ("planning.plan", "TrainedWith"),
    "solve": ("planning.solver", "solve"),
    "exact_plans": ("planning.solver", "exact_plans"),
    "RankLimit": ("planning.per_rank", "RankLimit"),
    "RankPlan": ("planning.per_rank", "RankPlan"),
    "UnevenPlan": ("planning.per_rank", "UnevenPlan"),
    "solve_uneven": ("planning.uneven", "solve_uneven"),
    "UnevenBatchSampler": ("training.sampler", "UnevenBatchSampler"),
    "CheckResult": ("checking.problems", "CheckResult"),
    "Problem": ("checking.problems", "Problem"),
    "check_setup": ("checking.setup", "check_setup"),
    "deepspeed_config": ("configs", "deepspeed_config"),
    "accelerate_config": ("configs", "accelerate_config"),
    "hf_training_args": ("configs", "hf_training_args"),
    "hf_flags": ("configs", "hf_flags"),
    "lightning_settings": ("configs", "lightning_settings"),
    "torchrun_command": ("configs", "torchrun_command"),
    "launcher_command": ("configs", "launcher_command"),
    "accelerate_command": ("configs", "accelerate_command"),
    "load_model": ("models", "load_model"),
    "list_models": ("models", "list_models"),
    "Finding": ("pipeline", "Finding"),
    "find": ("answering", "find"),
    "find_plan": ("pipeline", "find_plan"),
    "LossNormaliser": ("checking.accumulation", "LossNormaliser"),
    "count_loss_samples": ("checking.accumulation", "count_loss_samples"),
    "count_loss_tokens": ("checking.accumulation", "count_loss_tokens"),
    "token_cross_entropy": ("checking.accumulation", "token_cross_entropy"),
    "GAVerification": ("checking.verify_ga", "GAVerification"),
    "verify_ga": ("checking.verify_ga", "verify_ga"),
    "verify_ga_model": ("checking.ga_sources", "verify_model"),
    "OOMGuard": ("guard", "OOMGuard"),
    "GuardedStep": ("guard", "GuardedStep"),
    "is_launched": ("distributed.environment", "is_launched"),
    "exit_rank": ("distributed.environment", "exit_rank"),
    "process_group": ("distributed.launch", "process_group"),
    "rank_env": ("distributed.environment", "rank_env"),
    "spawn_local": ("distributed.launch", "spawn_local"),
    "DistributedProbeResult": ("distributed.result", "DistributedProbeResult"),
    "probe_distributed": ("distributed.lockstep", "probe_distributed"),
    "STRATEGIES": ("strategy", "STRATEGIES"),
    "Strategy": ("strategy", "Strategy"),
    "parse_strategy": ("strategy", "parse_strategy"),
    "probe_sharded": ("distributed.simulated_world", "probe_sharded"),
    "GPUS": ("estimating.gpus", "GPUS"),
    "DEFAULT_GPU": ("estimating.gpus", "DEFAULT_GPU"),
    "GpuSpec": ("estimating.gpus", "GpuSpec"),
    "lookup_gpu": ("estimating.gpus", "lookup_gpu"),
    "Overheads": ("estimating.overheads", "Overheads"),
    "Estimate": ("estimating.estimate", "Estimate"),
    "estimate": ("estimating.estimate", "estimate"),
    "trace_prior": ("estimating.prior", "trace_prior"),
    "cached_probe": ("tuning.cache", "cached_probe"),
    "TuneResult": ("tuning.tune", "TuneResult"),
    "tune": ("tuning.tune", "tune"),
    "format_bytes": ("units", "format_bytes"),
    "parse_bytes": ("units", "parse_bytes"),
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        module, attr = _WHERE[name]
        value = getattr(importlib.import_module(f".{module}", __name__), attr)
        globals()[name] = value  # imported once
        return value
    try:  # a subpackage: autobatch.probing, autobatch.distributed, …
        return importlib.import_module(f".{name}", __name__)
    except ModuleNotFoundError as exc:
        if exc.name != f"{__name__}.{name}":
            raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})

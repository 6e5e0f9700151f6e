"""Every rank: probing under torch.distributed with the ranks agreeing after every trial.

:mod:`.launch` knows launchers (torchrun, accelerate launch), process groups and spawning one
worker per local GPU; :mod:`.lockstep` runs the search on every rank at once; :mod:`.ddp`
wraps the model as DistributedDataParallel for the trials; :mod:`.result` holds the agreed
answer and the per-rank report.
"""

from __future__ import annotations

from .launch import is_launched, is_main_process, process_group, rank_env, spawn_local
from .lockstep import probe_distributed
from .result import DistributedProbeResult, RankFailedError, RankReport

__all__ = [
    "DistributedProbeResult", "RankFailedError", "RankReport", "is_launched", "is_main_process",
    "probe_distributed", "process_group", "rank_env", "spawn_local",
]

"""Every rank: probing under torch.distributed with the ranks agreeing after every trial.

:mod:`.environment` reads where this process sits in a launched job (without torch); :mod:`.launch` knows launchers (torchrun, accelerate launch), process groups and spawning one
worker per local GPU; :mod:`.lockstep` runs the search on every rank at once; :mod:`.ddp`
wraps the model as DistributedDataParallel for the trials; :mod:`.result` holds the agreed
answer and the per-rank report.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "DistributedProbeResult", "RankFailedError", "RankReport", "is_launched", "is_main_process",
    "probe_distributed", "process_group", "rank_env", "spawn_local",
]

_WHERE = {"DistributedProbeResult": "result", "RankFailedError": "result", "RankReport": "result",
          "is_launched": "environment", "rank_env": "environment", "is_main_process": "launch",
          "process_group": "launch", "spawn_local": "launch", "probe_distributed": "lockstep"}


def __getattr__(name: str) -> Any:
    # Imported on first use: the launcher's environment is read before torch is (see .environment).
    if name in _WHERE:
        return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

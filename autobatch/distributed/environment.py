"""Where this process sits in a launched job, read from the launcher's environment, without torch.

Torch-free on purpose: the command line asks whether it runs under a launcher before anything
else, and ``autobatch --help`` must not wait for torch to import.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import NoReturn

from ..errors import ConfigError

__all__ = ["RankEnv", "rank_env", "is_launched", "exit_rank"]


@dataclass(frozen=True)
class RankEnv:
    """Where this process sits in the job, as the launcher described it."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str | None
    master_port: int | None

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def is_launched(environ: dict[str, str] | None = None) -> bool:
    """Whether a launcher (torchrun, accelerate launch) started this process as one rank of a job."""
    env = os.environ if environ is None else environ
    return "RANK" in env and "WORLD_SIZE" in env


def rank_env(environ: dict[str, str] | None = None) -> RankEnv:
    """This process's rank, world size and local rank from the launcher's variables.

    Without a launcher it is rank 0 of a world of 1. Every malformed variable is reported at once.

    Example:
        >>> rank_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "n0", "MASTER_PORT": "29500"})
        RankEnv(rank=3, world_size=4, local_rank=1, local_world_size=4, master_addr='n0', master_port=29500)
    """
    env = os.environ if environ is None else environ
    problems: list[str] = []

    def number(name: str, default: int | None) -> int | None:
        raw = env.get(name)
        if raw is None:
            return default
        try:
            value = int(raw)
        except ValueError:
            problems.append(f"{name} must be a whole number, but got {name}={raw!r}")
            return default
        if value < 0:
            problems.append(f"{name} must not be negative, but got {name}={value}")
        return value

    world = number("WORLD_SIZE", 1)
    rank = number("RANK", 0)
    local_rank = number("LOCAL_RANK", rank)
    local_world = number("LOCAL_WORLD_SIZE", world)
    port = number("MASTER_PORT", None)
    if world is not None and world < 1:
        problems.append(f"WORLD_SIZE must be at least 1, but got WORLD_SIZE={world}")
    elif rank is not None and world is not None and rank >= world:
        problems.append(f"RANK must be below WORLD_SIZE ({world}), but got RANK={rank}; check the launcher's arguments")
    if problems:
        raise ConfigError(problems)
    return RankEnv(rank or 0, world or 1, local_rank or 0, local_world or 1, env.get("MASTER_ADDR"), port)


def exit_rank(code: int = 0) -> NoReturn:
    """End a launched rank after its work is done, printed, written and flushed.

    Torch's C++ teardown at interpreter exit, after a clean ``destroy_process_group``, can abort
    a finished process now and then ("terminate called without an active exception"), and the
    launcher then reports the whole job as failed. Nothing is left to do at that point, so the
    rank skips that teardown and exits with its own code.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

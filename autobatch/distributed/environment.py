"""Where this process sits in a launched job, read from the launcher's environment, without torch.

Torch-free on purpose: the command line asks whether it runs under a launcher before anything
else, and ``autobatch --help`` must not wait for torch to import.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NoReturn

from ..errors import ConfigError

__all__ = ["RankEnv", "rank_env", "is_launched", "launcher_of", "exit_rank"]


# Each launcher's names for: rank, world size, local rank, local world size, node rank, nodes.
# torchrun (and accelerate launch, which runs it) and the DeepSpeed launcher set RANK/WORLD_SIZE;
# the DeepSpeed launcher says LOCAL_SIZE, CROSS_RANK and CROSS_SIZE where torchrun says
# LOCAL_WORLD_SIZE, GROUP_RANK and (nothing: nodes follow from the two world sizes).
_TORCHRUN = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", None)
_DEEPSPEED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE")
_SLURM = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", None, "SLURM_NODEID", "SLURM_NNODES")
_MPIRUN = ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
           "OMPI_COMM_WORLD_LOCAL_SIZE", "OMPI_COMM_WORLD_NODE_RANK", None)
# ``srun --job-name=bash`` (or ``interactive``) is an interactive allocation, not a job's tasks
# (Lightning's rule too): its shell and what it starts are one process each.
_SLURM_SHELLS = ("bash", "interactive")
# Without MASTER_PORT, every task of a SLURM job derives the same port from the job's id.
_SLURM_PORT_BASE = 15000


@dataclass(frozen=True)
class RankEnv:
    """Where this process sits in the job, as the launcher described it."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str | None
    master_port: int | None
    node_rank: int = 0
    nodes: int = 1
    launcher: str | None = None     # "torchrun", "deepspeed", "slurm", "mpirun", or None: no launcher

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def device_index(self, visible: int) -> int:
        """This rank's GPU among the ``visible`` ones: its local rank, or 0 where the launcher left
        each rank one GPU (SLURM's ``--gpus-per-task=1``, ``CUDA_VISIBLE_DEVICES`` set per rank).

        Example:
            >>> rank_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"}).device_index(visible=1)
            0
        """
        if visible == 1:
            return 0
        if self.local_rank >= visible:
            raise ConfigError([
                f"this rank's local rank is {self.local_rank} but only {visible} GPUs are visible to it; start at "
                f"most {visible} processes per node, or leave each process one GPU (CUDA_VISIBLE_DEVICES)"
            ])
        return self.local_rank


def launcher_of(environ: Mapping[str, str] | None = None) -> str | None:
    """Which launcher started this process as one rank of a job: ``"torchrun"`` (also ``accelerate
    launch``), ``"deepspeed"``, ``"slurm"`` (``srun`` with more than one task), ``"mpirun"`` (Open
    MPI with more than one process), or ``None``.

    Example:
        >>> launcher_of({"SLURM_PROCID": "1", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1"})
        'slurm'
    """
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return "deepspeed" if "LOCAL_SIZE" in env and "LOCAL_WORLD_SIZE" not in env else "torchrun"
    if ("SLURM_PROCID" in env and _more_than_one(env.get("SLURM_NTASKS"))
            and env.get("SLURM_JOB_NAME") not in _SLURM_SHELLS):
        return "slurm"
    if "OMPI_COMM_WORLD_RANK" in env and _more_than_one(env.get("OMPI_COMM_WORLD_SIZE")):
        return "mpirun"
    return None


def _more_than_one(raw: str | None) -> bool:
    return raw is not None and raw.strip().isdigit() and int(raw) > 1


def is_launched(environ: Mapping[str, str] | None = None) -> bool:
    """Whether a launcher (torchrun, accelerate launch, the DeepSpeed launcher, srun, mpirun) started this process as one rank of a job."""
    return launcher_of(environ) is not None


def rank_env(environ: Mapping[str, str] | None = None) -> RankEnv:
    """This process's rank, world size, local rank and node from the launcher's variables.

    torchrun and ``accelerate launch``, the DeepSpeed launcher, ``srun`` and ``mpirun`` each name
    them their own way (see the table in docs/distributed.md). The rendezvous is ``MASTER_ADDR``
    and ``MASTER_PORT`` where set; under ``srun`` without them, the first node of the job's node
    list and 15000 + the last four digits of the job id, the same on every task. Without a
    launcher it is rank 0 of a world of 1. Every malformed variable is reported at once.

    Example:
        >>> rank_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "n0", "MASTER_PORT": "29500"})
        RankEnv(rank=3, world_size=4, local_rank=1, local_world_size=4, master_addr='n0', master_port=29500, node_rank=0, nodes=1, launcher='torchrun')
    """
    env = os.environ if environ is None else environ
    launcher = launcher_of(env)
    names = {"torchrun": _TORCHRUN, "deepspeed": _DEEPSPEED, "slurm": _SLURM, "mpirun": _MPIRUN}.get(launcher, _TORCHRUN)
    problems: list[str] = []

    def number(name: str | None, default: int | None) -> int | None:
        raw = env.get(name) if name else None
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

    rank_name, world_name, local_name, local_world_name, node_name, nodes_name = names
    world = number(world_name, 1)
    rank = number(rank_name, 0)
    local_rank = number(local_name, rank)
    nodes = number(nodes_name, None)
    local_world = number(local_world_name, None)
    if local_world is None and launcher == "slurm":
        local_world = _slurm_tasks_here(env, problems)
    if local_world is None:
        local_world = world if nodes is None or not world else -(-world // max(1, nodes))
    if nodes is None:
        nodes = -(-(world or 1) // max(1, local_world or 1))
    node_rank = number(node_name, None)
    if node_rank is None:
        node_rank = (rank or 0) // max(1, local_world or 1)
    port = number("MASTER_PORT", None)
    addr = env.get("MASTER_ADDR")
    if launcher == "slurm":
        addr = addr or _first_host(env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
                                   or env.get("SLURM_NODELIST"))
        job = env.get("SLURM_JOB_ID", "")
        if port is None and job.isdigit():
            port = _SLURM_PORT_BASE + int(job[-4:])
    if port is not None and not 0 < port < 65536:
        problems.append(f"MASTER_PORT must be a TCP port, from 1 to 65535, but got MASTER_PORT={port}; "
                        "export a free port, the same on every rank")
    if world is not None and world < 1:
        problems.append(f"{world_name} must be at least 1, but got {world_name}={world}")
    elif rank is not None and world is not None and rank >= world:
        problems.append(f"{rank_name} must be below {world_name} ({world}), but got {rank_name}={rank}; "
                        "check the launcher's arguments")
    if problems:
        raise ConfigError(problems)
    return RankEnv(rank or 0, world or 1, local_rank or 0, local_world or 1, addr, port,
                   node_rank=node_rank or 0, nodes=max(1, nodes or 1), launcher=launcher)


def _slurm_tasks_here(env: Mapping[str, str], problems: list[str]) -> int | None:
    """Tasks on this node from ``SLURM_STEP_TASKS_PER_NODE``/``SLURM_TASKS_PER_NODE`` ("4(x2),3": this
    node's entry by ``SLURM_NODEID``), else ``SLURM_NTASKS_PER_NODE``; ``None`` when none is set."""
    raw = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if raw:
        counts: list[int] = []
        for part in raw.split(","):
            match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
            if match is None:
                problems.append(f"SLURM_TASKS_PER_NODE must read like 4(x2),3, but got {raw!r}")
                return None
            counts += [int(match.group(1))] * int(match.group(2) or 1)
        node = env.get("SLURM_NODEID", "0")
        index = int(node) if node.isdigit() else 0
        return counts[min(index, len(counts) - 1)]
    per_node = env.get("SLURM_NTASKS_PER_NODE")
    return int(per_node) if per_node and per_node.isdigit() else None


def _first_host(nodelist: str | None) -> str | None:
    """The first host of a SLURM node list: ``node[03-05,07],gpu1`` → ``node03``.

    Example:
        >>> _first_host("node[03-05,07],gpu1")
        'node03'
    """
    if not nodelist:
        return None
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if match is None:
        return None
    prefix, ranges = match.group(1), match.group(2)
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


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

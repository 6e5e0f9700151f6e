"""Launch command lines for a plan: ``torchrun`` and ``accelerate launch``.

Multi-node lines carry shell placeholders (``$NODE_RANK``, ``$MASTER_ADDR``, and ``${MASTER_PORT:-29500}``:
the job's port where it sets one, else torch's default) that each node's shell or scheduler fills in;
they are left unquoted on purpose so the shell expands them.
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Sequence
from typing import TYPE_CHECKING

from .accelerate import GRAD_ACCUM_ENV

if TYPE_CHECKING:
    from ..planning.plan import Plan

__all__ = ["torchrun_command", "accelerate_command", "launcher_command"]

_SHELL_VARIABLE = re.compile(r"^\$(\w+|\{\w+(:-\w*)?\})$")
#: The rendezvous port of a multi-node line: the job's ``MASTER_PORT`` where its shell sets one, else torch's default.
PORT = "${MASTER_PORT:-29500}"


def _join(words: Sequence[object]) -> str:
    return " ".join(str(w) if _SHELL_VARIABLE.match(str(w)) else shlex.quote(str(w)) for w in words)


def torchrun_command(
    plan: Plan,
    script: str | os.PathLike[str],
    script_args: Sequence[str] = (),
    *,
    node_rank: str | int = "$NODE_RANK",
    master_addr: str = "$MASTER_ADDR",
    master_port: int | str = PORT,
) -> str:
    """The ``torchrun`` line that starts ``gpus_per_node`` processes on each of ``nodes`` nodes.

    Args:
        plan: The plan.
        script: Training script.
        script_args: Arguments for the script, e.g. ``plan.hf_flags()``.
        node_rank, master_addr, master_port: Rendezvous for multi-node jobs (ignored on one node,
            where ``--standalone`` picks a free port).

    Example:
        >>> from autobatch.planning.plan import Plan
        >>> torchrun_command(Plan(7, 2, gpus_per_node=16), "train.py")
        'torchrun --standalone --nproc_per_node 16 train.py'
    """
    words: list[object] = ["torchrun"]
    if plan.nodes == 1:
        words += ["--standalone", "--nproc_per_node", plan.gpus_per_node]
    else:
        words += [
            "--nnodes", plan.nodes, "--nproc_per_node", plan.gpus_per_node, "--node_rank", node_rank,
            "--master_addr", master_addr, "--master_port", master_port,
        ]
    return _join([*words, os.fspath(script), *script_args])


def accelerate_command(
    plan: Plan,
    script: str | os.PathLike[str],
    script_args: Sequence[str] = (),
    *,
    config_file: str | os.PathLike[str] | None = None,
    deepspeed_config_file: str | os.PathLike[str] | None = None,
    machine_rank: str | int = "$NODE_RANK",
    main_process_ip: str = "$MASTER_ADDR",
    main_process_port: int | str = PORT,
) -> str:
    """The ``accelerate launch`` line for the plan.

    Args:
        plan: The plan.
        script: Training script.
        script_args: Arguments for the script.
        config_file: An accelerate YAML (e.g. from :func:`~autobatch.configs.accelerate.write_accelerate_config`);
            without it the line carries the process counts itself.
        deepspeed_config_file: The DeepSpeed JSON, when the job uses DeepSpeed. Then accumulation
            comes from that file; otherwise the line sets ``ACCELERATE_GRADIENT_ACCUMULATION_STEPS``,
            because ``accelerate launch --gradient_accumulation_steps`` only reaches DeepSpeed.
        machine_rank, main_process_ip, main_process_port: Rendezvous for multi-node jobs.

    Example:
        >>> from autobatch.planning.plan import Plan
        >>> accelerate_command(Plan(7, 2, gpus_per_node=16), "train.py")
        'ACCELERATE_GRADIENT_ACCUMULATION_STEPS=2 accelerate launch --num_processes 16 --num_machines 1 --multi_gpu train.py'
    """
    words: list[object] = []
    if deepspeed_config_file is None:
        words.append(f"{GRAD_ACCUM_ENV}={plan.grad_accum}")
    words += ["accelerate", "launch"]
    if config_file is not None:
        words += ["--config_file", os.fspath(config_file)]
    else:
        words += ["--num_processes", plan.num_processes, "--num_machines", plan.nodes]
        if deepspeed_config_file is not None:
            words += ["--use_deepspeed", "--deepspeed_config_file", os.fspath(deepspeed_config_file)]
        elif plan.num_processes > 1:
            words.append("--multi_gpu")
    if plan.nodes > 1:
        words += [
            "--machine_rank", machine_rank, "--main_process_ip", main_process_ip, "--main_process_port", main_process_port,
        ]
    return _join([*words, os.fspath(script), *script_args])


def launcher_command(plan: Plan, script: str | os.PathLike[str], launcher: str, script_args: Sequence[str] = ()) -> str | None:
    """The line that starts the plan's processes under ``launcher`` (``"deepspeed"``, ``"slurm"``, ``"mpirun"``:
    :func:`~autobatch.rank_env`'s ``launcher``); ``None`` for torchrun's (:func:`torchrun_command`) or another.

    Example:
        >>> from autobatch.planning.plan import Plan
        >>> launcher_command(Plan(7, 2, gpus_per_node=8, nodes=2), "train.py", "slurm")
        'srun --nodes 2 --ntasks-per-node 8 python train.py'
    """
    words: list[object]
    if launcher == "deepspeed":
        words = ["deepspeed", *(["--hostfile", "hostfile", "--num_nodes", plan.nodes] if plan.nodes > 1 else []),
                 "--num_gpus", plan.gpus_per_node]
    elif launcher == "slurm":
        words = ["srun", "--nodes", plan.nodes, "--ntasks-per-node", plan.gpus_per_node, "python"]
    elif launcher == "mpirun":
        words = ["mpirun", "-np", plan.num_processes, "--npernode", plan.gpus_per_node, "-x", "MASTER_ADDR", "-x",
                 "MASTER_PORT", "python"]
    else:
        return None
    return _join([*words, os.fspath(script), *script_args])

"""One rank of a launched job, started with only the variables its launcher sets, on emulated GPUs.

``python -m tests.launched_rank OUT GPUS [STRATEGY|uneven]`` emulates a machine with GPUS GPUs (of which
``CUDA_VISIBLE_DEVICES``, if set, leaves this process some), runs ``find`` as a user would under
that launcher (no ``--device``: each rank probes its own GPU, NCCL asked for), and writes what it
saw to ``OUT/rank<R>.json``: where it sits in the job, the device it probed, the machine's GPU
that device is, and the plan (per rank with `uneven`: GPUs of 64 and 40 MiB, and --uneven), which accumulates.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def main(out: str, machine_gpus: int, strategy: str | None = None) -> None:
    from autobatch import Request, answer, rank_env
    from tests.emulated_cuda import EmulatedGpu, emulated

    env = rank_env()
    uneven = strategy == "uneven"  # mixed GPUs: GPU i holds 24 MiB less than GPU i - 1, and --uneven
    strategy = None if uneven else strategy
    gpus = [EmulatedGpu(i, total_bytes=(64 - 24 * i if uneven else 256) << 20, context_bytes=0)
            for i in range(machine_gpus)]
    with emulated(gpus) as emu:
        visible = len(emu.gpus)
        # 16 a rank at most 8 a step: the plan accumulates, so every rank probes again with the gradients held
        limits = {"target": 1000, "uneven": True} if uneven else {"target": 16 * env.world_size, "max_micro": 8}
        notes: list[str] = []
        report = answer(Request(model="tiny-mlp", trace_prior=False, headroom=0, timeout=60, strategy=strategy,
                                **limits), on_note=notes.append)
        used = [gpu.index for gpu in gpus if gpu.allocator.peak_allocated > 0]
    plan = report.plan
    Path(out, f"rank{env.rank}.json").write_text(json.dumps({
        "rank": env.rank, "world_size": env.world_size, "local_rank": env.local_rank,
        "local_world_size": env.local_world_size, "nodes": env.nodes, "node_rank": env.node_rank,
        "launcher": env.launcher, "visible": visible,
        "machine_gpus_used": used, "plan_nodes": plan.nodes, "plan_gpus_per_node": plan.gpus_per_node,
        "plan_world": plan.world_size, "micro_batch": plan.micro_batch, "grad_accum": plan.grad_accum,
        "max_batch": report.finding.probe.max_batch, "grads_held": report.request.grads_held, "notes": notes,
        "per_rank": None if report.uneven is None else report.uneven.to_dict()["per_rank"],
    }))
    sys.stdout.flush()
    os._exit(0)  # as a launched rank ends (exit_rank): torch's teardown after a finished group can abort


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else None)

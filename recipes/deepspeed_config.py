"""Write a DeepSpeed JSON for 16 GPUs from an autobatch Plan, merged into your template, checked by DeepSpeed.

Run (CPU, a simulated 4 MiB GPU, a few seconds):
    python recipes/deepspeed_config.py --device cpu --memory 4MiB --gpus 16 --target 224 --out ds_config.json
On a GPU, drop --device and --memory: the probe measures this card, and the plan assumes every
GPU of the job is alike. With --max-micro N the probe is skipped and N is the micro-batch limit.

What it shows: the probe finds the largest micro batch one GPU trains (9 for tiny-gpt2 in 4 MiB) and keeps
8 with headroom;
``autobatch.find_plan`` solves micro batch × gradient accumulation × 16 GPUs = 224 (7 × 2 × 16,
field report 5); ``autobatch.deepspeed_config(plan, template)`` writes the three batch keys over the template's
``"auto"`` and keeps every other key (ZeRO stage 2, bf16, optimizer); then DeepSpeed's own config
parser, told the data-parallel world size, accepts the file: its start-up assertion
``train_batch_size == micro × accumulation × world_size`` holds before any GPU is booked.
Then launch with the same numbers, e.g. ``deepspeed --num_gpus 16 train.py --deepspeed ds_config.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any
from unittest import mock

import autobatch

TEMPLATE = Path(__file__).with_name("ds_config_template.json")


def deepspeed_accepts(config: dict[str, Any], world_size: int) -> Any:
    """Parse ``config`` with DeepSpeed's ``DeepSpeedConfig`` as rank 0 of ``world_size`` data-parallel ranks.

    DeepSpeedConfig asks torch.distributed for the rank first; with no process group (here, before
    launch) it falls back to world size 1 even when an mpu says otherwise. Reporting rank 0 while
    it parses lets it take the world size from the mpu, as under Megatron-style parallelism.
    """
    from deepspeed.runtime import config as ds_config

    class DataParallel:
        def get_data_parallel_world_size(self) -> int:
            return world_size

    with mock.patch.object(ds_config.dist, "get_rank", return_value=0):
        return ds_config.DeepSpeedConfig(config, mpu=DataParallel())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-gpt2", help="an autobatch model name (autobatch models lists them)")
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    parser.add_argument("--memory", default=None, help="simulated memory budget per GPU on --device cpu, e.g. 4MiB")
    parser.add_argument("--max-micro", type=int, default=None, help="skip the probe: the largest micro batch allowed")
    parser.add_argument("--gpus", type=int, default=16, help="GPUs per node, as autobatch --gpus")
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--target", type=int, default=224, help="global batch per optimizer step")
    parser.add_argument("--template", default=str(TEMPLATE), help="the DeepSpeed config to merge into")
    parser.add_argument("--out", default="ds_config.json")
    args = parser.parse_args()

    try:
        if args.max_micro is not None:
            plan = autobatch.solve(args.target, args.gpus, args.nodes, args.max_micro)
        else:
            source = autobatch.load_model(args.model, seq_len=args.seq_len)
            finding = autobatch.find_plan(source.to_workload(), target=args.target, gpus_per_node=args.gpus,
                                          nodes=args.nodes, backend=autobatch.make_backend(args.device, args.memory))
            print(finding.probe)
            plan = finding.plan
    except autobatch.AutobatchError as exc:
        sys.exit(f"autobatch: {exc}")
    print(plan.describe())

    template = json.loads(Path(args.template).read_text())
    config = autobatch.deepspeed_config(plan, template)  # "auto" becomes the plan's numbers; every other key is kept
    Path(args.out).write_text(json.dumps(config, indent=2) + "\n")
    print(f"wrote {args.out}: " + ", ".join(f"{k}={config[k]}" for k in
          ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")))

    parsed = deepspeed_accepts(json.loads(Path(args.out).read_text()), plan.world_size)
    print(f"deepspeed accepts it on {plan.world_size} ranks: {parsed.train_micro_batch_size_per_gpu} micro × "
          f"{parsed.gradient_accumulation_steps} accumulation × {plan.world_size} = {parsed.train_batch_size}, "
          f"ZeRO stage {parsed.zero_optimization_stage}")


if __name__ == "__main__":
    main()

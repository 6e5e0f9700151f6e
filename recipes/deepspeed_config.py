"""Write a DeepSpeed JSON for 16 GPUs from an autobatch plan, merged into your template, checked by DeepSpeed.

Run (no GPU: estimated for an A100-80GB on fake tensors, under half a minute):
    python recipes/deepspeed_config.py --gpu a100-80gb --gpus 16 --target 224 --max-micro 8 --out ds_config.json
On a GPU, drop --gpu: the probe trains on this card, and the plan assumes every GPU of the job is alike
(``--device cpu --memory 8GiB`` probes the CPU against a simulated budget instead). --max-micro caps the
micro batch (8 here, as a card that fits 8 would, so that the plan accumulates); with --model none nothing
is probed and it is the micro-batch limit.

What it shows: the batch is found training as the template will, with its ZeRO stage (2), its bf16 and
its bucket sizes (500M elements: 1.9 GiB per rank whatever the model, which a probe of plain DDP would
leave out); ``autobatch.answer`` solves micro batch × gradient accumulation × 16 GPUs = 224 (7 × 2 × 16,
field report 5) and merges the
three batch keys into a copy of the template, over its ``"auto"``, keeping every other key (optimizer,
clipping); then DeepSpeed's own config parser, told the data-parallel world size, accepts the file: its
start-up assertion ``train_batch_size == micro × accumulation × world_size`` holds before any GPU is
booked. Then launch with the same numbers, e.g. ``deepspeed --num_gpus 16 train.py --deepspeed ds_config.json``.
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
    parser.add_argument("--model", default="tiny-gpt2", help="an autobatch model name (autobatch models lists them), "
                        "or none to plan from --max-micro alone")
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--gpu", default=None, help="estimate for this card on fake tensors (autobatch gpus lists them)")
    parser.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    parser.add_argument("--memory", default=None, help="simulated memory budget per GPU on --device cpu, e.g. 8GiB")
    parser.add_argument("--max-micro", type=int, default=None, help="the largest micro batch allowed")
    parser.add_argument("--gpus", type=int, default=16, help="GPUs per node, as autobatch --gpus")
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--target", type=int, default=224, help="global batch per optimizer step")
    parser.add_argument("--template", default=str(TEMPLATE), help="the DeepSpeed config a new --out starts from")
    parser.add_argument("--out", default="ds_config.json", help="written from the template, or merged into if it exists")
    args = parser.parse_args()

    out = Path(args.out)
    if not out.exists():  # a copy of the template, which the plan is merged into (an existing file is merged into)
        out.write_text(Path(args.template).read_text())
    config = json.loads(out.read_text())
    stage = config.get("zero_optimization", {}).get("stage", 0)
    precision = "bf16" if config.get("bf16", {}).get("enabled") else "fp16" if config.get("fp16", {}).get("enabled") else "fp32"
    try:
        # The trials train as the file will: its ZeRO stage, its precision, its bucket sizes (read from it).
        report = autobatch.answer(autobatch.Request(
            model=None if args.model == "none" else args.model, seq_len=args.seq_len, target=args.target,
            gpus_per_node=args.gpus, nodes=args.nodes, max_micro=args.max_micro, gpu=args.gpu, device=args.device,
            memory=args.memory, strategy=f"zero{stage}" if stage else "ddp", dtype=precision, deepspeed=str(out)))
    except autobatch.AutobatchError as exc:
        sys.exit(f"autobatch: {exc}")
    if report.finding is not None:
        print(report.finding.probe)
    print(report.plan.describe())
    config = json.loads(out.read_text())
    print(f"wrote {args.out}: " + ", ".join(f"{k}={config[k]}" for k in
          ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")))

    parsed = deepspeed_accepts(config, report.plan.world_size)
    print(f"deepspeed accepts it on {report.plan.world_size} ranks: {parsed.train_micro_batch_size_per_gpu} micro × "
          f"{parsed.gradient_accumulation_steps} accumulation × {report.plan.world_size} = {parsed.train_batch_size}, "
          f"ZeRO stage {parsed.zero_optimization_stage}")


if __name__ == "__main__":
    main()

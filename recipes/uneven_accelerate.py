# A plan per rank for mixed GPUs, trained with accelerate.
#
# Run (two processes on the CPU, each with its own simulated budget, as a large and a small GPU):
#     torchrun --standalone --nproc-per-node 2 recipes/uneven_accelerate.py --memory 48KiB,36KiB --target 100 --check
# On GPUs: accelerate launch --multi_gpu --num_processes 2 recipes/uneven_accelerate.py --target 100 --check
# (accelerate launch starts several CPU processes only through MPI; the Accelerator works under torchrun too).
#
# What it shows: as recipes/uneven_plain.py, with the Accelerator. Its gradient_accumulation_steps
# is one number for every rank, so it stays 1: each rank runs its own k_r micro-steps, under
# accelerator.no_sync(model) until its last, and steps the optimizer itself. The DataLoader is not
# passed to accelerator.prepare, which would shard it evenly: UnevenBatchSampler already gives each
# rank its own share of one global order. accelerator.backward scales nothing with accumulation 1;
# the loss is the rank's sum ÷ target × world (sampler.normaliser()).
from __future__ import annotations

import contextlib

import torch
from accelerate import Accelerator
from _uneven_common import check, dataset, make_model, optimizer_for, parser, per_rank_plan, sample_losses, SEED

import autobatch


def main() -> None:
    args = parser("A plan per rank, trained with accelerate.").parse_args()
    # cpu=True on a machine without GPUs: only then does accelerate run several CPU processes as one job
    accelerator = Accelerator(cpu=not torch.cuda.is_available())  # joins the launcher's group; the probe uses it
    plan = per_rank_plan(args)

    data = dataset()
    sampler = autobatch.UnevenBatchSampler(data, plan, seed=SEED)
    loader = torch.utils.data.DataLoader(data, batch_sampler=sampler)  # not prepared: the sampler shards it
    model = make_model()
    net, optimizer = accelerator.prepare(model, optimizer_for(model))
    norm = sampler.normaliser()
    micro = iter(loader)
    for step in range(1, args.steps + 1):
        for j in range(sampler.grad_accum):
            x, y = (t.to(accelerator.device) for t in next(micro))
            last = j == sampler.grad_accum - 1
            with contextlib.nullcontext() if last else accelerator.no_sync(net):
                accelerator.backward(norm.sample_loss(sample_losses(net, x, y)))
        optimizer.step()
        optimizer.zero_grad()
        print(f"rank {accelerator.process_index} step {step}: {sampler.micro_batch} × {sampler.grad_accum} samples",
              flush=True)  # one write: the ranks print at once
    if args.check:
        check(accelerator.unwrap_model(net), plan, args.steps)
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()

# A plan per rank for mixed GPUs, trained in a plain PyTorch loop under DDP.
#
# Run (two processes on the CPU, each with its own simulated budget, as a large and a small GPU):
#     torchrun --standalone --nproc-per-node 2 recipes/uneven_plain.py --memory 48KiB,36KiB --target 100 --check
# On GPUs drop --memory: every rank probes its own card.
#
# What it shows: every rank probes its own largest batch (autobatch.answer with uneven=True, the
# same as `autobatch find --uneven`), and gets its own micro batch m_r and accumulation k_r, with
# Σ m_r × k_r = --target. autobatch.UnevenBatchSampler hands rank r its m_r samples per micro-step
# from one global order; DDP syncs once per step (no_sync until the rank's last micro-step); each
# rank's loss is its sum ÷ target × world (sampler.normaliser()), because DDP averages over ranks.
# --check: the weights equal one process trained on each whole step, within 1e-5.
from __future__ import annotations

import contextlib
import gc

import torch
import torch.distributed as dist
from _uneven_common import check, dataset, make_model, optimizer_for, parser, per_rank_plan, sample_losses, SEED

import autobatch


def main() -> None:
    args = parser("A plan per rank, trained in a plain loop under DDP.").parse_args()
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    plan = per_rank_plan(args)

    data = dataset()
    sampler = autobatch.UnevenBatchSampler(data, plan, seed=SEED)  # this rank's micro-batches, k_r per step
    loader = torch.utils.data.DataLoader(data, batch_sampler=sampler)
    model = make_model()
    net = torch.nn.parallel.DistributedDataParallel(model)
    optimizer, norm = optimizer_for(model), sampler.normaliser()
    micro = iter(loader)
    for step in range(1, args.steps + 1):
        for j in range(sampler.grad_accum):
            x, y = next(micro)
            last = j == sampler.grad_accum - 1
            with contextlib.nullcontext() if last else net.no_sync():
                norm.sample_loss(sample_losses(net, x, y)).backward()
        optimizer.step()
        optimizer.zero_grad()
        print(f"rank {dist.get_rank()} step {step}: {sampler.micro_batch} × {sampler.grad_accum} samples",
              flush=True)  # one write: the ranks print at once
    if args.check:
        check(model, plan, args.steps)
    del net
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

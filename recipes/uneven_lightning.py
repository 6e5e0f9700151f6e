# A plan per rank for mixed GPUs, trained with Lightning.
#
# Run (two processes on the CPU, each with its own simulated budget, as a large and a small GPU):
#     torchrun --standalone --nproc-per-node 2 recipes/uneven_lightning.py --memory 48KiB,36KiB --target 100 --check
# On GPUs drop --memory: every rank probes its own card.
#
# What it shows: as recipes/uneven_plain.py, in a LightningModule. Trainer(accumulate_grad_batches=…)
# is one number for every rank, and Lightning runs a collective per batch, so each batch is one
# optimizer step (sampler.by_step: this rank's k_r micro-batches) and the module optimizes manually:
# under optimizer.toggle_model(sync_grad=False) until its last micro-batch (DDP syncs once per step),
# then the optimizer steps. use_distributed_sampler=False keeps UnevenBatchSampler, which gives each
# rank its share of one global order; the loss is the rank's sum ÷ target × world.
from __future__ import annotations

import torch
import torch.distributed as dist
from _uneven_common import check, dataset, make_model, optimizer_for, parser, per_rank_plan, sample_losses, SEED

import autobatch


def main() -> None:
    import lightning.pytorch as pl

    args = parser("A plan per rank, trained with Lightning.").parse_args()
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")  # Lightning joins it as it is
    plan = per_rank_plan(args)
    data = dataset()
    sampler = autobatch.UnevenBatchSampler(data, plan, seed=SEED)

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_model()
            self.automatic_optimization = False
            self.norm = sampler.normaliser()

        def training_step(self, step, batch_idx):  # one optimizer step: this rank's k_r micro-batches
            opt = self.optimizers()
            for j, (x, y) in enumerate(step):
                with opt.toggle_model(sync_grad=j == len(step) - 1):  # DDP syncs in the last one only
                    self.manual_backward(self.norm.sample_loss(sample_losses(self.net, x, y)))
            opt.step()
            opt.zero_grad()

        def configure_optimizers(self):
            return optimizer_for(self.net)

    module = Module()
    trainer = pl.Trainer(accelerator="gpu" if torch.cuda.is_available() else "cpu", devices=dist.get_world_size(),
                         strategy="ddp", use_distributed_sampler=False, max_steps=args.steps, max_epochs=1,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    # Lightning runs a collective per batch, so every rank must yield as many: one batch per optimizer
    # step, holding this rank's k_r micro-batches.
    trainer.fit(module, sampler.by_step(torch.utils.data.DataLoader(data, batch_sampler=sampler)))
    print(f"rank {dist.get_rank()}: {args.steps} steps of {sampler.micro_batch} × {sampler.grad_accum} samples",
          flush=True)
    if args.check:
        check(module.net, plan, args.steps)


if __name__ == "__main__":
    main()

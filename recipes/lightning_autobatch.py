"""Lightning with the AutoBatch callback: the probe runs inside ``Trainer.fit`` and sets batch size and accumulation.

Run (CPU, a simulated 240 KiB device for the probe, a few seconds):
    python recipes/lightning_autobatch.py --device cpu --memory 240KiB --target 256 --steps 3
On GPUs, drop --device and --memory (and add --gpus N for DDP: every rank probes, the ranks agree).

What it shows: ``AutoBatch(target=256)`` probes the module's own ``training_step`` and the optimizer
``configure_optimizers`` returns at ``on_fit_start``, sets the datamodule's ``batch_size`` (where
Lightning's BatchSizeFinder sets it) and ``trainer.accumulate_grad_batches`` so that batch size ×
accumulation × devices = 256, logs the plan, and leaves the weights and optimizer state as they were.
"""

from __future__ import annotations

import argparse
import logging
import sys

import torch

import autobatch
from autobatch.integrations.lightning import AutoBatch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    parser.add_argument("--memory", default=None, help="simulated memory budget on --device cpu, e.g. 240KiB")
    parser.add_argument("--gpus", type=int, default=1, help="GPUs (ranks) to train on, as autobatch --gpus")
    parser.add_argument("--target", type=int, default=256, help="global batch per optimizer step")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps to train")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    import lightning as L

    class Data(L.LightningDataModule):
        def __init__(self) -> None:
            super().__init__()
            self.batch_size = 8  # AutoBatch replaces it
            g = torch.Generator().manual_seed(0)
            self.x, self.y = torch.randn(4096, 32, generator=g), torch.randint(0, 4, (4096,), generator=g)

        def train_dataloader(self) -> torch.utils.data.DataLoader:
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(self.x, self.y), batch_size=self.batch_size)

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 4))

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.cross_entropy(self.net(x), y)
            self.log("loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    data, callback = Data(), AutoBatch(target=args.target, memory=args.memory, headroom=0)
    trainer = L.Trainer(accelerator="cpu" if args.device == "cpu" else "auto", devices=args.gpus,
                        max_steps=args.steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[callback])
    try:
        trainer.fit(Net(), datamodule=data)
    except autobatch.AutobatchError as exc:
        sys.exit(f"autobatch: {exc}")
    if trainer.is_global_zero:
        print(callback.result)
        print(f"# {data.batch_size} batch size * {trainer.accumulate_grad_batches} accumulate_grad_batches * "
              f"{trainer.world_size} devices = {callback.plan.global_batch} samples per step")
        print(f"done: {trainer.global_step} optimizer steps")


if __name__ == "__main__":
    main()

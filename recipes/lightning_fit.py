"""Lightning ``Trainer.fit`` with the batch size and gradient accumulation of an autobatch Plan.

Run (CPU, a simulated 2 MiB GPU, a few seconds):
    python recipes/lightning_fit.py --device cpu --memory 2MiB --target 512 --steps 3
On GPUs, drop --device and --memory: the probe measures the real card and the plan spans the
GPUs of this node.

What it shows: ``autobatch.find_plan`` probes the largest micro batch that trains and solves
micro batch × gradient accumulation × devices × nodes = --target; ``autobatch.lightning_settings(plan)`` gives
the ``Trainer`` arguments (``accumulate_grad_batches``, ``devices``, ``num_nodes``) and the
``DataLoader`` batch size, so Lightning's global batch is the planned one.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch

import autobatch


class Rows(torch.utils.data.Dataset):
    """The samples of one big batch (a dict of tensors or an (inputs, labels) pair), one per index."""

    def __init__(self, batch: Any):
        self.batch = batch

    def __len__(self) -> int:
        first = next(iter(self.batch.values())) if isinstance(self.batch, dict) else self.batch[0]
        return len(first)

    def __getitem__(self, i: int) -> Any:
        if isinstance(self.batch, dict):
            return {k: v[i] for k, v in self.batch.items()}
        return tuple(t[i] for t in self.batch)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-mlp", help="an autobatch model name (autobatch models lists them)")
    parser.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    parser.add_argument("--memory", default=None, help="simulated memory budget on --device cpu, e.g. 2MiB")
    parser.add_argument("--target", type=int, default=512, help="global batch per optimizer step")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps to train")
    args = parser.parse_args()

    import lightning as L

    source = autobatch.load_model(args.model)
    try:
        finding = autobatch.find_plan(source.to_workload(), target=args.target,
                                      backend=autobatch.make_backend(args.device, args.memory))
    except autobatch.AutobatchError as exc:
        sys.exit(f"autobatch: {exc}")
    plan = finding.plan
    print(finding)

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = source.model

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = source.loss_fn(self.model, batch)
            self.log("loss", loss, prog_bar=False)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    class Report(L.Callback):
        step_loss = 0.0

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            # Lightning hands back each micro batch's loss already divided by accumulate_grad_batches,
            # so their sum over one accumulation is the loss of the whole step.
            self.step_loss += float(outputs["loss"])
            if (batch_idx + 1) % trainer.accumulate_grad_batches == 0:
                print(f"step {trainer.global_step}  loss {self.step_loss:.4f}")
                self.step_loss = 0.0

    settings = autobatch.lightning_settings(plan)
    torch.manual_seed(0)
    loader = torch.utils.data.DataLoader(Rows(source.make_batch(plan.global_batch * args.steps)), shuffle=True,
                                         **settings["dataloader"])
    trainer = L.Trainer(
        **settings["trainer"],
        accelerator="cpu" if args.device == "cpu" else "auto",
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Report()],
    )
    trainer.fit(Module(), loader)
    if trainer.is_global_zero:
        print(f"# {loader.batch_size} batch size * {trainer.accumulate_grad_batches} accumulate_grad_batches * "
              f"{trainer.num_devices} devices * {trainer.num_nodes} nodes = {plan.global_batch} samples per step")
        print(f"done: {trainer.global_step} optimizer steps")


if __name__ == "__main__":
    main()

"""An accelerate training loop whose micro batch and gradient accumulation come from an autobatch Plan.

Run (CPU, one process, a simulated 2 MiB GPU, a few seconds):
    python recipes/accelerate_loop.py --device cpu --memory 2MiB --target 512 --steps 3
On GPUs, drop --device and --memory and start it with
``accelerate launch --num_processes N recipes/accelerate_loop.py --target 512``.

What it shows: ``autobatch.find_plan`` probes the largest micro batch that trains and solves
micro batch × gradient accumulation × processes = --target; the DataLoader yields
``plan.micro_batch`` samples and ``Accelerator(gradient_accumulation_steps=plan.grad_accum)``
steps the optimizer once per ``plan.grad_accum`` of them. Every micro batch here has the same
number of samples, so the mean loss that ``accelerator.backward`` divides by the accumulation
steps is the big-batch mean; for padded tokens use ``autobatch.checking.accumulation.count_loss_tokens``
(see recipes/plain_loop_ga.py).
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

    from accelerate import Accelerator

    source = autobatch.load_model(args.model)
    # Probe before the Accelerator exists: the probe lends the model and gives it back unchanged.
    # Under `accelerate launch` every process probes its own GPU; all GPUs must be alike.
    try:
        finding = autobatch.find_plan(source.to_workload(), target=args.target,
                                      backend=autobatch.make_backend(args.device, args.memory))
    except autobatch.AutobatchError as exc:
        sys.exit(f"autobatch: {exc}")
    plan = finding.plan

    accelerator = Accelerator(gradient_accumulation_steps=plan.grad_accum, cpu=(args.device == "cpu"))
    if plan.num_processes != accelerator.num_processes:
        sys.exit(f"the plan is for {plan.num_processes} processes but accelerate started {accelerator.num_processes}; "
                 f"launch with --num_processes {plan.num_processes}")
    accelerator.print(finding)

    torch.manual_seed(0)
    samples = plan.global_batch * args.steps
    loader = torch.utils.data.DataLoader(Rows(source.make_batch(samples)), batch_size=plan.micro_batch, shuffle=True)
    model = source.model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    model.train()
    steps, step_loss = 0, 0.0
    for batch in loader:
        with accelerator.accumulate(model):
            loss = source.loss_fn(model, batch)
            accelerator.backward(loss)  # divides by gradient_accumulation_steps itself
            optimizer.step()            # a no-op until the last micro batch of the accumulation
            optimizer.zero_grad()
        step_loss += loss.item() / plan.grad_accum
        if accelerator.sync_gradients:
            steps += 1
            accelerator.print(f"step {steps}  loss {step_loss:.4f}")
            step_loss = 0.0
    accelerator.print(f"# {plan.micro_batch} micro batch * {accelerator.gradient_accumulation_steps} grad accum * "
                      f"{accelerator.num_processes} process(es) = {plan.global_batch} samples per step")
    accelerator.print(f"done: {steps} optimizer steps")


if __name__ == "__main__":
    main()

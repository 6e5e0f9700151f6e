"""accelerate's ``find_executable_batch_size`` pattern with autobatch's drop-in: the exact largest batch, and a target kept.

Run (CPU, one process, a simulated 2 MiB device, a few seconds):
    python recipes/accelerate_find.py --memory 2MiB --starting-batch-size 4096 --target 1024 --steps 3
On GPUs, drop --memory and start it with ``accelerate launch --num_processes N recipes/accelerate_find.py``:
the ranks agree after every trial.

What it shows: the training function is written exactly as for accelerate's decorator (model,
optimizer and DataLoader built inside from ``batch_size``). With a target of 1024 the first run is
at 1024 (the plan's micro batch within 4096), and runs out of memory; autobatch then runs 2-step
trials of the same function below it to find the exact largest batch (accelerate would retry at
921, 828, … and stop up to 10 % under it), picks the largest micro
batch that divides the target, and sets the Accelerator's gradient accumulation so that micro
batch × accumulation × processes = --target; ``accelerator.accumulate`` then steps once per target.
(``recipes/guard_loop.py`` shows how to survive a rare longer batch later in training.)
"""

from __future__ import annotations

import argparse
import logging

import torch

import autobatch
from autobatch.integrations.accelerate import find_executable_batch_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--memory", default=None, help="simulated memory budget on the CPU, e.g. 2MiB")
    parser.add_argument("--starting-batch-size", type=int, default=4096)
    parser.add_argument("--target", type=int, default=1024, help="global batch per optimizer step")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps to train")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    from accelerate import Accelerator

    accelerator = Accelerator(cpu=args.memory is not None)
    backend = autobatch.SimulatedBackend(args.memory) if args.memory else None

    @find_executable_batch_size(starting_batch_size=args.starting_batch_size, backend=backend,
                                target=args.target, accelerator=accelerator)
    def train(batch_size: int) -> int:
        accelerator.free_memory()
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, optimizer = accelerator.prepare(model, optimizer)
        steps = 0
        for _ in range(args.steps * accelerator.gradient_accumulation_steps):
            x, y = torch.randn(batch_size, 64), torch.randint(0, 10, (batch_size,))  # your DataLoader's batch
            with accelerator.accumulate(model):
                accelerator.backward(torch.nn.functional.cross_entropy(model(x), y))
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            steps += accelerator.sync_gradients
        return steps

    steps = train()
    plan = train.plan
    if accelerator.is_main_process:
        print(f"batch sizes the function was called with: {train.batch_sizes}")
        print(f"# {plan.micro_batch} micro batch * {accelerator.gradient_accumulation_steps} grad accum * "
              f"{accelerator.num_processes} process(es) = {plan.global_batch} samples per step")
        print(f"done: {steps} optimizer steps")


if __name__ == "__main__":
    main()

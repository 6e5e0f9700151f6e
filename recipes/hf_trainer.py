"""HF Trainer with the batch size and gradient accumulation that autobatch probed and planned.

Run (CPU, a simulated 4 MiB GPU, a few seconds):
    python recipes/hf_trainer.py --device cpu --memory 4MiB --target 32 --steps 3
On a GPU, drop --device and --memory: the probe measures the real card.

What it shows: ``autobatch.find_plan`` probes the largest micro batch that trains (real steps,
real memory), solves micro batch × gradient accumulation × GPUs = --target, and
``TrainingArguments(**autobatch.hf_training_args(plan), ...)`` takes exactly those numbers, so the Trainer's global
batch is the planned one. The sequences are right-padded to random lengths; the loss is the
summed token loss over the tokens of the *whole* accumulated batch (``compute_loss_func`` with
autobatch's ``LossNormaliser``), so accumulation trains like the big batch (field report 2).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch

import autobatch
from autobatch.checking.accumulation import LossNormaliser, token_cross_entropy


class Rows(torch.utils.data.Dataset):
    """The rows of a dict of tensors, as the Trainer's DataLoader wants them."""

    def __init__(self, batch: dict[str, torch.Tensor]):
        self.batch = batch

    def __len__(self) -> int:
        return len(next(iter(self.batch.values())))

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {k: v[i] for k, v in self.batch.items()}


def padded(batch: dict[str, torch.Tensor], seed: int = 0) -> dict[str, torch.Tensor]:
    """Right-pad each sequence to a random length: labels -100 and attention 0 past its end."""
    gen = torch.Generator().manual_seed(seed)
    n, seq = batch["input_ids"].shape
    keep = torch.arange(seq) < torch.randint(2, seq + 1, (n, 1), generator=gen)
    return {**batch, "attention_mask": keep.long(), "labels": batch["labels"].masked_fill(~keep, -100)}


def compute_loss_func(outputs: Any, labels: torch.Tensor, num_items_in_batch: Any = None) -> torch.Tensor:
    """Trainer counts the target tokens of all GA micro-batches (and devices) up front: divide by that.

    Trainer multiplies by the process count itself, so the normaliser's world_size stays 1.
    """
    norm = LossNormaliser(total=int(num_items_in_batch))
    return norm.token_loss(*token_cross_entropy(outputs.logits, labels, shift=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-gpt2", help="an autobatch model name (autobatch models lists them)")
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    parser.add_argument("--memory", default=None, help="simulated memory budget on --device cpu, e.g. 4MiB")
    parser.add_argument("--target", type=int, default=32, help="global batch per optimizer step")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps to train")
    parser.add_argument("--output-dir", default="hf_trainer_out")
    args = parser.parse_args()

    import transformers

    source = autobatch.load_model(args.model, seq_len=args.seq_len)
    try:
        finding = autobatch.find_plan(source.to_workload(), target=args.target,
                                      backend=autobatch.make_backend(args.device, args.memory))
    except autobatch.AutobatchError as exc:
        sys.exit(f"autobatch: {exc}")
    plan = finding.plan
    print(finding)

    model = source.model
    # Trainer counts num_items_in_batch from the labels; only with a causal loss_type does it
    # skip each sequence's first position, as the shifted loss does (GPT-2 has none by default).
    model.loss_type = "ForCausalLM"
    data = Rows(padded(source.make_batch(plan.global_batch * args.steps)))
    training_args = transformers.TrainingArguments(
        **autobatch.hf_training_args(plan),
        output_dir=args.output_dir,
        max_steps=args.steps,
        learning_rate=1e-3,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=(args.device == "cpu"),
        disable_tqdm=True,
    )
    trainer = transformers.Trainer(model=model, args=training_args, train_dataset=data,
                                   compute_loss_func=compute_loss_func)
    result = trainer.train()
    total = training_args.per_device_train_batch_size * training_args.gradient_accumulation_steps * training_args.world_size
    print(f"# {training_args.per_device_train_batch_size} per device * {training_args.gradient_accumulation_steps} "
          f"grad accum * {training_args.world_size} devices = {total} sequences per step (plan: {plan.global_batch})")
    print(f"done: {result.global_step} optimizer steps, train loss {result.training_loss:.4f}")


if __name__ == "__main__":
    main()

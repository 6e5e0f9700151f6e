"""HF Trainer with arguments from ``fit_training_args``: probed batch sizes, the same global batch.

Run (CPU, a simulated 3 MiB device for the probe, a few seconds):
    python recipes/hf_autobatch.py --device cpu --memory 3MiB --steps 2
On a GPU, drop --device and --memory: the probe measures the real card.

What it shows: ``TrainingArguments`` asking for 32 sequences per device and step do not fit the
device; ``fit_training_args`` probes the model's real training step (the Trainer's optimizer and
precision) and returns new arguments with ``per_device_train_batch_size × gradient_accumulation_steps
× devices`` still 32, and ``per_device_eval_batch_size`` from a forward-only probe. ``Trainer.train()``
then runs with them. (For a Trainer already built: ``AutoBatchCallback().attach(trainer)``.)
"""

from __future__ import annotations

import argparse
import logging
import sys

import torch

import autobatch

SEQ = 32


class Rows(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.ids = torch.randint(0, 128, (n, SEQ), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    parser.add_argument("--memory", default=None, help="simulated memory budget on --device cpu, e.g. 3MiB")
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps to train")
    parser.add_argument("--output-dir", default="hf_autobatch_out")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    import transformers

    from autobatch.integrations.hf import fit_training_args

    transformers.logging.set_verbosity_error()
    config = transformers.GPT2Config(vocab_size=128, n_positions=SEQ, n_embd=32, n_layer=1, n_head=2,
                                     bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    data = Rows(32 * args.steps)
    asked = transformers.TrainingArguments(
        output_dir=args.output_dir, per_device_train_batch_size=32, max_steps=args.steps, learning_rate=1e-3,
        report_to=[], save_strategy="no", use_cpu=(args.device == "cpu"), disable_tqdm=True, optim="adamw_torch",
    )
    try:
        training_args = fit_training_args(asked, model, sample=data[0], memory=args.memory, headroom=0)
    except autobatch.AutobatchError as exc:
        sys.exit(f"autobatch: {exc}")
    print(training_args.autobatch_probe)
    trainer = transformers.Trainer(model=model, args=training_args, train_dataset=data)
    result = trainer.train()
    a = training_args
    print(f"# {a.per_device_train_batch_size} per device * {a.gradient_accumulation_steps} grad accum * {a.world_size} "
          f"devices = {a.per_device_train_batch_size * a.gradient_accumulation_steps * a.world_size} sequences per step "
          f"(asked: {asked.per_device_train_batch_size * asked.gradient_accumulation_steps * asked.world_size}); "
          f"eval batch {a.per_device_eval_batch_size}")
    print(f"done: {result.global_step} optimizer steps")


if __name__ == "__main__":
    main()

"""The HF Trainer's own auto_find_batch_size scenarios against the drop-in: models returning tuples,
a loss of the user's, an out-of-memory error raised outside the forward (a callback at a step's end,
as the Trainer's tests raise it), and a resumed run."""

from __future__ import annotations

import pytest
import torch

from tests.extras import need

transformers = need("transformers", "accelerate")

from autobatch.integrations.hf import AutoBatchCallback, fit_training_args  # noqa: E402

SEQ = 16


def gpt2() -> torch.nn.Module:
    config = transformers.GPT2Config(vocab_size=64, n_positions=SEQ, n_embd=16, n_layer=1, n_head=2)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


class Rows(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 256

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.arange(SEQ) % 64
        return {"input_ids": ids, "labels": ids}


def arguments(tmp_path, **overrides):
    settings = dict(output_dir=str(tmp_path), per_device_train_batch_size=16, gradient_accumulation_steps=1,
                    max_steps=2, learning_rate=1e-3, report_to=[], save_strategy="no", use_cpu=True,
                    disable_tqdm=True, optim="adamw_torch")
    return transformers.TrainingArguments(**{**settings, **overrides})


class TupleLM(torch.nn.Module):
    """Returns ``(loss, logits)``, which the Trainer accepts (it takes the first item as the loss)."""

    def __init__(self):
        super().__init__()
        self.emb, self.head = torch.nn.Embedding(64, 16), torch.nn.Linear(16, 64)

    def forward(self, input_ids, labels=None):
        logits = self.head(self.emb(input_ids))
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return loss, logits


def test_a_model_returning_a_tuple_with_the_loss_first_is_probed(tmp_path):
    model = TupleLM()
    new = fit_training_args(arguments(tmp_path), model, sample=Rows()[0], memory="4MiB", headroom=0)
    assert new.per_device_train_batch_size * new.gradient_accumulation_steps == 16


def test_loss_fn_is_taken_as_the_error_message_says(tmp_path):
    model = gpt2()
    seen = []

    def loss_fn(model, batch):
        seen.append(len(batch["input_ids"]))
        logits = model(input_ids=batch["input_ids"]).logits
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())

    new = fit_training_args(arguments(tmp_path), model, sample=Rows()[0], memory="4MiB", headroom=0, loss_fn=loss_fn)
    assert seen and new.per_device_train_batch_size * new.gradient_accumulation_steps == 16


class OutOfMemoryAtStepEnd(transformers.TrainerCallback):
    """As the Trainer's own tests do (MockCudaOOMCallback): out of memory raised at a step's end, above a batch."""

    def __init__(self, above: int):
        self.above, self.seen = above, []

    def on_step_end(self, args, state, control, **kwargs):
        self.seen.append(args.per_device_train_batch_size)
        if args.per_device_train_batch_size > self.above:
            raise RuntimeError("CUDA out of memory.")


def test_an_out_of_memory_error_anywhere_in_a_step_trains_again_smaller_keeping_the_global_batch(tmp_path):
    model = gpt2()
    oom = OutOfMemoryAtStepEnd(above=3)
    trainer = transformers.Trainer(model=model, args=arguments(tmp_path), train_dataset=Rows(), callbacks=[oom])
    callback = AutoBatchCallback(memory="4MiB", headroom=0)
    callback.attach(trainer)
    probed = callback.plan.micro_batch
    assert probed > 3
    trainer.train()
    assert callback.plan.micro_batch <= 3 and callback.plan.global_batch == 16  # the Trainer's own halves the batch
    assert trainer.args.per_device_train_batch_size * trainer.args.gradient_accumulation_steps == 16
    assert oom.seen[0] == probed and oom.seen[-1] == callback.plan.micro_batch


def test_a_resumed_run_keeps_the_batch_its_checkpoint_trained_with(tmp_path):
    model = gpt2()
    args = arguments(tmp_path, save_strategy="steps", save_steps=1, max_steps=1)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Rows())
    first = AutoBatchCallback(memory="4MiB", headroom=0)
    first.attach(trainer)
    trainer.train()
    checkpoint = str(tmp_path / "checkpoint-1")
    again = transformers.Trainer(model=gpt2(), args=arguments(tmp_path, max_steps=2), train_dataset=Rows())
    resumed = AutoBatchCallback(memory="1MiB")  # a budget that would fit less, were it probed
    resumed.attach(again, resume_from_checkpoint=checkpoint)
    assert resumed.result is None  # nothing probed: the checkpoint's batch is kept
    assert resumed.plan.micro_batch == first.plan.micro_batch and resumed.plan.global_batch == 16
    again.train(resume_from_checkpoint=checkpoint)
    assert again.state.global_step == 2

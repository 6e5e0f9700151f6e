"""HF Trainer: fit_training_args probes a tiny GPT-2 (built from a config) on a simulated budget and returns
arguments a real ``Trainer.train()`` then trains with; the callback form does the same on a built Trainer."""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch

from tests.extras import need
from tests.ranks import gathered, slow
transformers = need("transformers", "accelerate")  # the Trainer needs accelerate too

from autobatch.errors import AutobatchError
from autobatch.integrations.hf import (
    AutoBatchCallback,
    deepspeed_batch_config,
    fit_training_args,
)
from autobatch.planning.plan import Plan

SEQ = 32
MAX, TRIALS = 13, [1, 7, 14, 10, 13]  # the probe on 3 MiB (use_cache off, as the Trainer sets it): exact, 14 ran out


@pytest.fixture(scope="module")
def gpt2() -> torch.nn.Module:
    config = transformers.GPT2Config(vocab_size=128, n_positions=SEQ, n_embd=32, n_layer=1, n_head=2,
                                    bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


class Rows(torch.utils.data.Dataset):
    def __init__(self, n: int = 512):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, 128, (n, SEQ), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def arguments(tmp_path, **overrides) -> transformers.TrainingArguments:
    settings = dict(output_dir=str(tmp_path), per_device_train_batch_size=32, gradient_accumulation_steps=1,
                    per_device_eval_batch_size=8, max_steps=1, learning_rate=1e-3, report_to=[], save_strategy="no",
                    use_cpu=True, disable_tqdm=True, optim="adamw_torch")
    return transformers.TrainingArguments(**{**settings, **overrides})


def recording_collator(seen: list[int]):
    def collate(features):
        seen.append(len(features))
        return transformers.default_data_collator(features)
    return collate


def test_returned_arguments_keep_the_global_batch_and_train(gpt2, tmp_path, caplog) -> None:
    args = arguments(tmp_path)
    before = {k: v.clone() for k, v in gpt2.state_dict().items()}
    with caplog.at_level(logging.INFO, logger="autobatch.integrations.hf"):
        new = fit_training_args(args, gpt2, sample=Rows()[0], memory="3MiB", headroom=0)
    assert all(torch.equal(before[k], v) for k, v in gpt2.state_dict().items())  # probing changed nothing
    assert args.per_device_train_batch_size == 32  # the arguments passed in are untouched
    result = new.autobatch_probe
    assert result.max_batch == MAX and [t.batch for t in result.trials] == TRIALS
    micro, accum = new.per_device_train_batch_size, new.gradient_accumulation_steps
    assert micro * accum * new.world_size == 32 and micro <= result.max_batch < 2 * micro
    assert new.per_device_eval_batch_size > result.max_batch  # forward only, no gradients or optimizer state
    assert f"# {micro} per device * {accum} grad accum * 1 devices = 32 sequences per step" in caplog.text
    seen: list[int] = []
    trainer = transformers.Trainer(model=gpt2, args=new, train_dataset=Rows(), data_collator=recording_collator(seen))
    out = trainer.train()
    assert out.global_step == 1 and set(seen) == {micro} and len(seen) >= accum  # (+1 batch fetched ahead)


def test_the_callback_form_sets_a_built_trainer(gpt2, tmp_path) -> None:
    seen: list[int] = []
    trainer = transformers.Trainer(model=gpt2, args=arguments(tmp_path), train_dataset=Rows(),
                                   data_collator=recording_collator(seen))
    callback = AutoBatchCallback(target=24, memory="3MiB", headroom=0, eval_batch=False).attach(trainer).callback_handler
    plan = next(c for c in callback.callbacks if isinstance(c, AutoBatchCallback)).plan
    seen.clear()  # the probe's batches went through the collator too
    out = trainer.train()
    assert plan.global_batch == 24 and trainer.args.per_device_eval_batch_size == plan.micro_batch
    assert out.global_step == 1 and set(seen) == {plan.micro_batch} and len(seen) >= plan.grad_accum


def test_deepspeed_explicit_values_follow_the_plan_and_auto_stays() -> None:
    config = {"train_micro_batch_size_per_gpu": 64, "gradient_accumulation_steps": "auto", "train_batch_size": 64,
              "zero_optimization": {"stage": 3}}
    changed = deepspeed_batch_config(config, Plan(16, 4))
    assert changed == {"train_micro_batch_size_per_gpu": 16, "gradient_accumulation_steps": "auto",
                       "train_batch_size": 64, "zero_optimization": {"stage": 3}}
    assert config["train_micro_batch_size_per_gpu"] == 64  # a copy; the user's config is untouched
    assert deepspeed_batch_config({"gradient_accumulation_steps": "auto"}, Plan(16, 4)) is None


def test_needs_something_to_build_batches_from(gpt2, tmp_path) -> None:
    with pytest.raises(AutobatchError, match="needs a sample"):
        fit_training_args(arguments(tmp_path), gpt2, memory="3MiB")


# -- guard=True: a rare long batch is split inside the Trainer's own training_step --------------------

SHORT, LONG = 16, 64


class Varying(torch.utils.data.Dataset):
    """80 sequences read in order: the 4th batch of 8 in each ten is 4× longer (one length per batch)."""

    def __init__(self):
        g = torch.Generator().manual_seed(1)
        self.rows = [torch.randint(0, 128, (LONG if (i // 8) % 10 == 3 else SHORT,), generator=g) for i in range(80)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def train_varying(tmp_path, budget: str | None, guard: str | None, items_kwarg: bool):
    """2 optimizer steps of 8 × 2 accumulation on the simulated ``budget``.

    ``guard``: ``"callback"`` (AutoBatchCallback probes at the short length, plans 8 × 2 for 16 and guards),
    ``"trainer"`` (guard_trainer on arguments set to 8 × 2), or ``None``.
    """
    from autobatch import SimulatedBackend
    from autobatch.integrations.hf import guard_trainer

    config = transformers.GPT2Config(vocab_size=128, n_positions=LONG, n_embd=32, n_layer=1, n_head=2, bos_token_id=0,
                                     eos_token_id=0, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    # SGD: the attention's key bias has a zero gradient up to rounding, which Adam would blow up to lr-sized steps.
    args = arguments(tmp_path, per_device_train_batch_size=4 if guard == "callback" else 8,
                     gradient_accumulation_steps=1 if guard == "callback" else 2, max_steps=2, learning_rate=0.1,
                     optim="sgd", train_sampling_strategy="sequential", logging_strategy="no")
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Varying())
    trainer.model_accepts_loss_kwargs = items_kwarg  # False: the Trainer averages per batch; the guard weighs pieces
    step = None
    if guard == "callback":
        short = {"input_ids": torch.zeros(SHORT, dtype=torch.long), "labels": torch.zeros(SHORT, dtype=torch.long)}
        callback = AutoBatchCallback(target=16, sample=short, memory="64MiB", max_batch=8, eval_batch=False, guard=True)
        callback.attach(trainer)
        assert (callback.plan.micro_batch, callback.plan.grad_accum) == (8, 2)
        step = callback.guard
    elif guard == "trainer":
        step = guard_trainer(trainer)
    # The training itself runs on the simulated device (no budget: the reference, where every batch fits).
    with SimulatedBackend(budget).track(list(model.parameters())) if budget else contextlib.nullcontext():
        trainer.train()
    assert trainer.state.global_step == 2
    return model, step


@pytest.mark.parametrize("items_kwarg, guard", [(True, "callback"), (False, "trainer")],
                         ids=["num_items_in_batch-callback", "mean_per_batch-guard_trainer"])
def test_guard_splits_the_long_batch_and_trains_to_the_same_weights(tmp_path, items_kwarg, guard, caplog) -> None:
    reference, _ = train_varying(tmp_path, None, None, items_kwarg)  # every batch fits whole
    with caplog.at_level(logging.WARNING, logger="autobatch"):
        model, step = train_varying(tmp_path, "1MiB", guard, items_kwarg)
    # the long batch (4th, the 2nd of its accumulation window) ran out of memory whole and in 2 pieces
    assert [(s.step, s.pieces, s.attempts) for s in step.history] == [(4, 4, 3)] and step.steps == 4
    assert "training step 4 went through as 4 micro-batches after 3 attempt(s)" in caplog.text
    for (name, a), b in zip(reference.named_parameters(), model.parameters()):
        assert ((a - b).norm() / a.norm()).item() <= 1e-5, name


def test_guard_refuses_deepspeed(gpt2, tmp_path) -> None:
    from autobatch.integrations.hf import guard_trainer

    trainer = transformers.Trainer(model=gpt2, args=arguments(tmp_path), train_dataset=Rows())
    trainer.is_deepspeed_enabled = True  # what the Trainer sets from args.deepspeed, without starting DeepSpeed
    with pytest.raises(AutobatchError, match="DeepSpeed keeps them inside its engine"):
        guard_trainer(trainer)
    with pytest.raises(AutobatchError, match="DeepSpeed keeps them inside its engine"):  # before probing anything
        AutoBatchCallback(memory="1KiB", guard=True).attach(trainer)
    assert trainer.args.per_device_train_batch_size == 32 and trainer.training_step.__self__ is trainer


# -- DeepSpeed: transformers' own consistency processing accepts the returned arguments ---------------

AUTO = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
        "zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}
EXPLICIT = {"train_micro_batch_size_per_gpu": 32, "gradient_accumulation_steps": 1, "train_batch_size": 32,
            "zero_optimization": {"stage": 2}}


def accepted_by_transformers(args, model) -> dict:
    """transformers' own DeepSpeed processing of ``args`` (the Trainer runs both stages); raises on a mismatch.

    ``trainer_config_process`` ran when the arguments were built (it fills "auto" values and records
    explicit ones that differ); ``trainer_config_finalize`` raises for those. No DeepSpeed engine, no op built.
    """
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    ds = HfTrainerDeepSpeedConfig(args.deepspeed)  # fresh: what a Trainer built from these arguments reads
    ds.trainer_config_process(args)
    ds.trainer_config_finalize(args, model, num_training_steps=10)
    return ds.config


@pytest.mark.parametrize("source", ["auto dict", "auto file", "explicit file"])
def test_deepspeed_config_stays_consistent_with_the_returned_arguments(gpt2, tmp_path, source) -> None:
    import dataclasses
    import json

    config = AUTO if source.startswith("auto") else EXPLICIT
    given: object = config
    if source.endswith("file"):
        given = tmp_path / "ds_config.json"
        given.write_text(json.dumps(config))
        written = given.read_bytes()
    args = arguments(tmp_path, deepspeed=str(given) if source.endswith("file") else given)
    accepted_by_transformers(args, gpt2)  # the user's setup is consistent to begin with: 32 × 1
    new = fit_training_args(args, gpt2, sample=Rows()[0], memory="64MiB", max_batch=8, eval_batch=False)
    plan = new.autobatch_plan
    assert (plan.micro_batch, plan.grad_accum) == (8, 4)
    filled = accepted_by_transformers(new, gpt2)
    assert (filled["train_micro_batch_size_per_gpu"], filled["gradient_accumulation_steps"], filled["train_batch_size"]) == (8, 4, 32)
    if source.endswith("file"):
        assert given.read_bytes() == written  # the user's file is never rewritten
    if source.startswith("auto"):
        assert new.deepspeed == args.deepspeed  # nothing to change: "auto" is filled by transformers from the new values
    else:
        assert isinstance(new.deepspeed, dict) and new.deepspeed["zero_optimization"] == {"stage": 2}
        # the arguments alone, with the old explicit values, are what transformers rejects
        stale = dataclasses.replace(args, per_device_train_batch_size=8, gradient_accumulation_steps=4)
        with pytest.raises(ValueError, match="train_micro_batch_size_per_gpu=32 vs hf per_device_train_batch_size=8"):
            accepted_by_transformers(stale, gpt2)


def _two_rank_fit(budgets: tuple[str, str]) -> list:
    """One rank of two (inside spawn_local's gloo group): fit_training_args on this rank's own budget."""
    import tempfile

    import torch.distributed as dist

    rank = dist.get_rank()
    config = transformers.GPT2Config(vocab_size=128, n_positions=SEQ, n_embd=32, n_layer=1, n_head=2,
                                     bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(output_dir=out, per_device_train_batch_size=32, gradient_accumulation_steps=1,
                                              report_to=[], use_cpu=True, optim="adamw_torch")
        new = fit_training_args(args, model, sample=Rows()[0], memory=budgets[rank], headroom=0)
    mine = (new.world_size, new.per_device_train_batch_size, new.gradient_accumulation_steps,
            new.per_device_eval_batch_size, new.autobatch_probe.max_batch)
    return gathered(mine)


@slow("two-process gloo run")
def test_two_gloo_ranks_with_different_budgets_get_the_same_arguments() -> None:
    from autobatch.distributed import spawn_local

    ranks = spawn_local(_two_rank_fit, (("8MiB", "3MiB"),), nprocs=2, backend="gloo", timeout_s=120)
    assert ranks[0] == ranks[1]  # train and eval batches, accumulation: the same on both ranks
    # The 3 MiB rank limits both: its max 13 (two 8 MiB ranks agree on 38, and on an eval batch of 87), and the
    # global batch 32 × 1 × 2 ranks = 64 is kept as 8 × 4 accumulation × 2 ranks; eval 32: the smaller rank's.
    assert ranks[0] == (2, 8, 4, 32, MAX)


def _two_rank_guard(budgets: tuple[str, str]) -> list:
    """One rank of two: the Trainer (DDP over gloo) with guard_trainer on this rank's budget, and without a budget."""
    import tempfile

    import torch.distributed as dist

    from autobatch import SimulatedBackend
    from autobatch.integrations.hf import guard_trainer

    def run(budget: str | None):
        config = transformers.GPT2Config(vocab_size=128, n_positions=LONG, n_embd=32, n_layer=1, n_head=2,
                                         bos_token_id=0, eos_token_id=0, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(config)
        with tempfile.TemporaryDirectory() as out:
            args = transformers.TrainingArguments(
                output_dir=out, per_device_train_batch_size=8, gradient_accumulation_steps=2, max_steps=2,
                learning_rate=0.1, optim="sgd", report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True,
                train_sampling_strategy="sequential", logging_strategy="no")
            trainer = transformers.Trainer(model=model, args=args, train_dataset=Varying())
            step = guard_trainer(trainer) if budget else None
            with SimulatedBackend(budget).track(list(model.parameters())) if budget else contextlib.nullcontext():
                trainer.train()
        return model, step

    reference, _ = run(None)  # every batch fits
    model, step = run(budgets[dist.get_rank()])
    worst = max(((a - b).norm() / a.norm()).item() for a, b in zip(reference.parameters(), model.parameters()))
    mine = ([(s.step, s.pieces, s.attempts) for s in step.history], worst, [p.detach().clone() for p in model.parameters()])
    return gathered(mine)


@slow("two-process gloo run")
def test_guard_under_ddp_splits_the_same_step_on_every_rank_and_trains_to_the_same_weights() -> None:
    from autobatch.distributed import spawn_local

    # Batches alternate between the ranks: the long 4th batch is rank 1's 2nd, the last of its accumulation
    # window (where DDP would average); only rank 1's device is too small for it, yet rank 0 splits that step too.
    (history0, worst0, weights0), (history1, worst1, weights1) = spawn_local(
        _two_rank_guard, (("64MiB", "1MiB"),), nprocs=2, backend="gloo", timeout_s=120)
    assert history0 == history1 == [(2, 4, 3)]  # each rank's 2nd step: whole and 2 pieces ran out of memory, 4 fit
    assert worst0 <= 1e-5 and worst1 <= 1e-5
    assert all(torch.equal(a, b) for a, b in zip(weights0, weights1))  # the ranks stay in step


def test_evaluation_is_probed_with_the_cache_the_trainer_sets(gpt2, tmp_path) -> None:
    """The Trainer sets ``model.config.use_cache`` from ``args.use_cache`` (off by default): a model whose config
    caches keys and values is probed as the Trainer will evaluate it, and its config comes back as it was."""
    gpt2.config.use_cache = True
    try:
        answers = {}
        for cached in (False, True):
            new = fit_training_args(arguments(tmp_path, use_cache=cached), gpt2, sample=Rows()[0], memory="3MiB",
                                    headroom=0)
            answers[cached] = new.per_device_eval_batch_size
            assert gpt2.config.use_cache is True
        trainer = transformers.Trainer(model=gpt2, args=arguments(tmp_path), train_dataset=Rows())
        assert gpt2.config.use_cache is False  # what the Trainer does, and what the first probe took
        attached = AutoBatchCallback(memory="3MiB", headroom=0).attach(trainer).args.per_device_eval_batch_size
    finally:
        gpt2.config.use_cache = True
    assert answers[False] == attached > answers[True]  # every layer's keys and values kept: fewer fit

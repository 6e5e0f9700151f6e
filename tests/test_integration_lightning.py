"""Lightning: AutoBatch probes the module's own training_step at fit start; a real Trainer.fit then trains
with the planned batch size and accumulation. CPU, a simulated memory budget for the probe."""

from __future__ import annotations

import contextlib
import logging
import os

import pytest
import torch

from tests.extras import need
from tests.ranks import gathered
pl = need("lightning.pytorch")

from autobatch.errors import AutobatchError  # noqa: E402
from autobatch.integrations.lightning import AutoBatch  # noqa: E402

# Two processes that each import torch and Lightning: ~20 s alone, over a minute on a shared CPU.
DDP_REASON = "two-process gloo DDP run; set AUTOBATCH_SLOW_TESTS=1 to include it"
SLOW = not os.environ.get("AUTOBATCH_SLOW_TESTS")


class Data(pl.LightningDataModule):
    def __init__(self, batch_size: int = 4):
        super().__init__()
        self.batch_size = batch_size
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(512, 32, generator=g), torch.randint(0, 4, (512,), generator=g)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(self.x, self.y), batch_size=self.batch_size)


class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 4))
        self.seen: list[int] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        self.log("loss", loss)  # ignored while probing, logged while training
        return loss

    def on_train_batch_start(self, batch, batch_idx):  # the fit loop's batches, not the probe's
        self.seen.append(len(batch[0]))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3, weight_decay=0.1)


class Snapshot(pl.Callback):
    """Weights and optimizer state at fit start, around AutoBatch's probe."""

    def __init__(self):
        self.states = []

    def on_fit_start(self, trainer, pl_module):
        self.states.append(({k: v.clone() for k, v in pl_module.state_dict().items()},
                            repr(trainer.optimizers[0].state_dict())))


def fit(callback: AutoBatch, model: Net, data: Data, **trainer_args) -> pl.Trainer:
    before, after = Snapshot(), Snapshot()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=3, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[before, callback, after], **trainer_args)
    trainer.fit(model, datamodule=data)
    (w0, o0), (w1, o1) = before.states[0], after.states[0]
    assert all(torch.equal(w0[k], w1[k]) for k in w0) and o0 == o1  # the probe changed nothing
    return trainer


def test_fit_trains_with_the_planned_batch_and_accumulation(caplog) -> None:
    model, data = Net(), Data(batch_size=4)
    callback = AutoBatch(target=256, memory="240KiB", headroom=0)
    with caplog.at_level(logging.INFO, logger="autobatch.integrations.lightning"):
        trainer = fit(callback, model, data)
    plan, result = callback.plan, callback.result
    assert result.max_batch == 111 and [t.batch for t in result.trials] == [1, 9, 127, 51, 87, 111, 112]  # exact: 112 ran out
    assert (plan.micro_batch, plan.grad_accum) == (64, 4)  # the largest divisor of 256 within 111
    assert data.batch_size == 64 and trainer.accumulate_grad_batches == 4
    assert model.seen == [64] * 12 and trainer.global_step == 3  # 3 optimizer steps of 4 batches of 64
    assert "64 batch size * 4 accumulate_grad_batches * 1 ranks = 256" in caplog.text


def test_without_a_target_the_trainers_global_batch_is_kept() -> None:
    model, data = Net(), Data(batch_size=32)
    callback = AutoBatch(memory="160KiB", headroom=0)
    trainer = fit(callback, model, data, accumulate_grad_batches=3)  # 32 × 3 = 96
    assert (data.batch_size, trainer.accumulate_grad_batches) == (48, 2)
    assert model.seen == [48] * 6


def test_refuses_what_it_cannot_set() -> None:
    class NoBatchSize(Net):
        def train_dataloader(self):
            return Data().train_dataloader()

    trainer = pl.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_progress_bar=False,
                         callbacks=[AutoBatch(memory="1MiB")])
    with pytest.raises(AutobatchError, match="neither the model, its hparams nor the datamodule has it"):
        trainer.fit(NoBatchSize())
    with pytest.raises(AutobatchError, match="target must be a positive integer"):
        AutoBatch(target=0)


def _ddp_fit(budgets: tuple[str, str]) -> list:
    """One rank of two under Lightning's ddp strategy (inside spawn_local's gloo group); a smaller budget on rank 1."""
    import torch.distributed as dist

    rank = dist.get_rank()
    model, data = Net(), Data(batch_size=4)
    callback = AutoBatch(target=256, memory=budgets[rank], headroom=0)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[callback])
    trainer.fit(model, datamodule=data)
    mine = (callback.result.max_batch, [(t.batch, t.fits) for t in callback.result.trials], callback.plan.micro_batch,
            callback.plan.grad_accum, model.seen, trainer.global_step)
    return gathered(mine)


@pytest.mark.skipif(SLOW, reason=DDP_REASON)
def test_ddp_ranks_agree_on_the_smaller_device() -> None:
    from autobatch.distributed import spawn_local

    ranks = spawn_local(_ddp_fit, (("1MiB", "240KiB"),), nprocs=2, backend="gloo", timeout_s=60)
    assert ranks[0] == ranks[1]
    max_batch, trials, micro, accumulation, seen, steps = ranks[0]
    # rank 1's 240 KiB (plus DDP's gradient buckets) limits both: exact at 100 (101 ran out of memory
    # there); 64 per rank × 2 accumulation × 2 ranks = 256
    assert max_batch == 100 and (100, True) in trials and (101, False) in trials
    assert (micro, accumulation, steps) == (64, 2, 2) and seen == [64] * 4


@pytest.mark.skipif(SLOW, reason="13 Lightning fit loops (half a minute on a shared CPU) for the docs' comparison "
                    "table; set AUTOBATCH_SLOW_TESTS=1 to include it")
def test_lightnings_own_finder_on_the_same_model_and_budget() -> None:
    """The figures docs/integrations.md puts beside AutoBatch's (7 trials, exact 111 above)."""
    tools = need("benchmarks.tools")
    from autobatch import Workload

    work = Workload(lambda: torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 4)),
                    lambda b: (torch.randn(b, 32), torch.randint(0, 4, (b,))),
                    optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1))
    run = tools.run_lightning(work, "240KiB", "binsearch")
    assert [b for b, _ in run.tried] == [2, 4, 8, 16, 32, 64, 128, 96, 112, 120, 116, 114, 113]
    assert (run.returned, run.trials, run.steps) == (106, 13, 29)  # 5 % under the 112 it saw train


# -- guard=True: a rare long batch is split inside its training step -------------------------------

VOCAB, SHORT, LONG = 64, 16, 64


class Tokens(pl.LightningDataModule):
    """Sequences in groups of ``group`` rows: the 4th group of each ten is 4× longer (one length per batch, no padding).

    ``group=8``: batches of 8 on one device; ``group=16``: two ranks' batches of 8 (the distributed sampler
    deals the rows out in turn), so the 4th batch on every rank is the long one.
    """

    def __init__(self, group: int = 8):
        super().__init__()
        self.batch_size = 2
        g = torch.Generator().manual_seed(1)
        self.rows = [torch.randint(0, VOCAB, (LONG if (i // group) % 10 == 3 else SHORT,), generator=g)
                     for i in range(10 * group)]

    def train_dataloader(self):
        sampler = None
        if torch.distributed.is_initialized():  # in order (Lightning's own distributed sampler would shuffle)
            sampler = torch.utils.data.DistributedSampler(self.rows, shuffle=False)
        return torch.utils.data.DataLoader(self.rows, batch_size=self.batch_size, sampler=sampler)


class TinyLM(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, 32)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.GELU(), torch.nn.Linear(128, 32))
        self.head = torch.nn.Linear(32, VOCAB)

    def training_step(self, ids, batch_idx):  # the mean over the batch's tokens: every row has the same length
        h = self.emb(ids[:, :-1])
        logits = self.head(h + self.mlp(h))
        return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def fit_tokens(budget: str | None, guard: bool) -> tuple[TinyLM, AutoBatch, pl.Trainer]:
    """Probe at the usual (short) length, then train 2 steps of 8 × 2 accumulation, all on ``budget``."""
    from autobatch import SimulatedBackend

    torch.manual_seed(0)
    model = TinyLM()
    callback = AutoBatch(target=16, memory="8MiB", max_micro=8, guard=guard,
                         make_batch=lambda b: torch.randint(0, VOCAB, (b, SHORT)))
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[callback])
    # The fit itself runs on the simulated device (no budget: the reference, where every batch fits).
    with SimulatedBackend(budget).track(list(model.parameters())) if budget else contextlib.nullcontext():
        trainer.fit(model, datamodule=Tokens())
    return model, callback, trainer


def test_guard_splits_the_long_batch_and_trains_to_the_same_weights(caplog) -> None:
    reference, _, _ = fit_tokens(None, guard=False)  # every batch fits whole
    with caplog.at_level(logging.WARNING, logger="autobatch.guard"):
        model, callback, trainer = fit_tokens("600KiB", guard=True)
    assert (callback.plan.micro_batch, callback.plan.grad_accum) == (8, 2)
    # batch 4 (the long one, 2nd of its accumulation window) ran out of memory whole and at 2 pieces; 4 went through
    assert [(s.step, s.pieces, s.attempts) for s in callback.guard.history] == [(4, 4, 3)]
    assert callback.guard.steps == 4 and trainer.global_step == 2
    assert "step 4 went through as 4 micro-batches per batch after 3 attempt(s)" in caplog.text
    for (name, a), b in zip(reference.named_parameters(), model.parameters()):
        assert ((a - b).norm() / a.norm()).item() <= 1e-5, name
    assert "training_step" not in model.__dict__ and "backward" not in model.__dict__  # removed after fit



def _ddp_guard_fit(budgets: tuple[str, str]) -> list:
    """One rank of two under Lightning's ddp strategy: 3 steps of 8 × 2 × 2 ranks, with and without this rank's budget."""
    import torch.distributed as dist

    from autobatch import SimulatedBackend

    def fit(budget: str | None):
        torch.manual_seed(0)
        model = TinyLM()
        callback = AutoBatch(target=32, memory="8MiB", max_micro=8, guard=budget is not None,
                             make_batch=lambda b: torch.randint(0, VOCAB, (b, SHORT)))
        trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=3, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             callbacks=[callback], use_distributed_sampler=False)
        with SimulatedBackend(budget).track(list(model.parameters())) if budget else contextlib.nullcontext():
            trainer.fit(model, datamodule=Tokens(group=16))
        return model, callback

    reference, _ = fit(None)  # every batch fits
    model, callback = fit(budgets[dist.get_rank()])
    worst = max(((a - b).norm() / a.norm()).item() for a, b in zip(reference.parameters(), model.parameters()))
    mine = ((callback.plan.micro_batch, callback.plan.grad_accum), [(s.step, s.pieces, s.attempts) for s in callback.guard.history],
            worst, [p.detach().clone() for p in model.parameters()])
    return gathered(mine)


@pytest.mark.skipif(SLOW, reason=DDP_REASON)
def test_guard_under_ddp_splits_the_same_step_on_every_rank_and_trains_to_the_same_weights() -> None:
    from autobatch.distributed import spawn_local

    # The 4th batch is long on both ranks and the last of its accumulation window (where DDP would average);
    # only rank 1's device is too small for it, yet rank 0 splits that step too.
    ranks = spawn_local(_ddp_guard_fit, (("64MiB", "600KiB"),), nprocs=2, backend="gloo", timeout_s=120)
    (plan0, history0, worst0, weights0), (plan1, history1, worst1, weights1) = ranks
    assert plan0 == plan1 == (8, 2) and history0 == history1 == [(4, 4, 3)]  # 8 × 2 × 2 ranks = 32; step 4 in 4 pieces
    assert worst0 <= 1e-5 and worst1 <= 1e-5, (worst0, worst1)
    assert all(torch.equal(a, b) for a, b in zip(weights0, weights1))  # the ranks stay in step


def test_guard_takes_a_batch_lightning_collates_as_a_list():
    # guard=True read the [x, y] list of a TensorDataset's loader as two micro-batches and crashed in training_step
    from autobatch.integrations.lightning import AutoBatch

    torch.manual_seed(0)
    callback = AutoBatch(target=256, memory="240KiB", headroom=0, guard=True)
    trainer = pl.Trainer(accelerator="cpu", max_steps=3, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[callback])
    trainer.fit(Net(), datamodule=Data(8))  # a TensorDataset's loader: each batch [x, y]
    assert trainer.global_step == 3 and callback.guard.steps == 3 * callback.plan.grad_accum

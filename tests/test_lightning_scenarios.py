"""Lightning's own BatchSizeFinder scenarios (tests/tests_pytorch/tuner/test_scale_batch_size.py), adapted
to AutoBatch: the largest batch on request, validate/test/predict scaled, the warning for a batch size held
twice, the trial steps; and where AutoBatch differs on purpose (it keeps the global batch by default)."""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.extras import need

pl = need("lightning.pytorch")

from autobatch.errors import AutobatchError  # noqa: E402
from autobatch.integrations.lightning import AutoBatch  # noqa: E402
from tests.test_integration_lightning import Data as TrainingData  # noqa: E402


class Data(TrainingData):
    """The training data module of tests/test_integration_lightning.py, with a loader for every stage."""

    val_dataloader = test_dataloader = predict_dataloader = TrainingData.train_dataloader


class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 4))
        self.sizes: dict[str, list[int]] = {"train": [], "val": [], "test": [], "predict": []}
        self.steps = 0

    def training_step(self, batch, batch_idx):
        self.steps += 1
        return torch.nn.functional.cross_entropy(self.net(batch[0]), batch[1])

    def on_train_batch_start(self, batch, batch_idx):
        self.sizes["train"].append(len(batch[0]))

    def validation_step(self, batch, batch_idx):
        self.sizes["val"].append(len(batch[0]))
        self.log("val_loss", torch.nn.functional.cross_entropy(self.net(batch[0]), batch[1]))

    def test_step(self, batch, batch_idx):
        self.sizes["test"].append(len(batch[0]))
        return torch.nn.functional.cross_entropy(self.net(batch[0]), batch[1])

    def predict_step(self, batch, batch_idx):
        self.sizes["predict"].append(len(batch[0]))
        return self.net(batch[0])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def trainer(callback, **args):
    settings = dict(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                    limit_val_batches=1, limit_test_batches=1, limit_predict_batches=1, callbacks=[callback])
    return pl.Trainer(**{**settings, **args})


def test_mode_max_sets_the_largest_batch_as_batch_size_finder_does():
    model, data = Net(), Data(batch_size=4)
    callback = AutoBatch(mode="max", memory="240KiB", headroom=0)
    fitted = trainer(callback, accumulate_grad_batches=3)
    fitted.fit(model, datamodule=data)
    assert data.batch_size == callback.result.safe_batch == callback.plan.micro_batch  # the largest that fits
    assert fitted.accumulate_grad_batches == 3  # left as it was: the global batch follows the batch size
    keep = AutoBatch(memory="240KiB", headroom=0)  # the default keeps the global batch: 4 × 3 = 12
    trainer(keep, accumulate_grad_batches=3).fit(Net(), datamodule=(other := Data(batch_size=4)))
    assert other.batch_size * keep.plan.grad_accum == 12


@pytest.mark.parametrize("stage", ["validate", "test", "predict"])
def test_validate_test_and_predict_are_scaled_with_the_evaluation_search(stage):
    model, data = Net(), Data(batch_size=4)
    callback = AutoBatch(memory="240KiB", headroom=0)
    getattr(trainer(callback), stage)(model, datamodule=data)
    assert callback.eval_batch is not None and callback.plan is None  # no training probe outside fit
    assert data.batch_size == callback.eval_batch
    ran = model.sizes["val" if stage == "validate" else stage]
    assert ran[-1] == callback.eval_batch  # the stage's loop ran at the batch found, not at 4
    # forward only under no_grad: larger than training's exact max on this budget (111, test_integration_lightning)
    assert callback.eval_batch > 111
    assert ran[-3:-1] == [callback.eval_batch, callback.eval_batch + 1]  # exact: the search's last two trials


def test_a_batch_size_on_the_model_and_in_its_hparams_warns_as_lightning_does():
    class Both(Net):
        def __init__(self):
            super().__init__()
            self.save_hyperparameters({"batch_size": 8})
            self.batch_size = 8

        def train_dataloader(self):
            return Data(batch_size=self.batch_size).train_dataloader()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(AutoBatch(memory="240KiB", headroom=0)).fit(Both())
    assert any("Field `model.batch_size` and `model.hparams.batch_size` are mutually exclusive!" in str(w.message)
               for w in caught)


def test_steps_per_trial_is_the_number_of_training_steps_each_trial_runs():
    model, data = Net(), Data(batch_size=4)
    callback = AutoBatch(memory="240KiB", headroom=0, steps_per_trial=3, max_micro=16)
    trainer(callback, max_steps=1).fit(model, datamodule=data)
    assert model.steps == 3 * len(callback.result.trials) + 1  # three per trial, then the fit's one step
    with pytest.raises(AutobatchError, match="steps_per_trial must be an integer ≥ 2"):
        AutoBatch(steps_per_trial=1)
    with pytest.raises(AutobatchError, match="mode must be one of keep, max"):
        AutoBatch(mode="power")

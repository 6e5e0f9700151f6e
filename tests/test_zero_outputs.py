"""Every file and line written for a ZeRO plan trains with the DeepSpeed config the probe ran.

The probe wraps the model with ``zero_config`` (``autobatch/distributed/zero.py``): bucket sizes from the
model's hidden size, as the HF Trainer fills ``"auto"``. Left to themselves the frameworks take other
sizes: DeepSpeed's own (a 500,000,000-element gradient bucket, 954 MiB a GPU in fp16) where a config
names none, Lightning's ``"deepspeed_stage_N"`` two buckets of 200,000,000 (``overlap_comm``). Each output
is read here by its own library, and DeepSpeed resolves what it holds.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from autobatch.configs import deepspeed_config, hf_training_args, lightning_settings
from autobatch.planning.solver import solve
from autobatch.strategy import parse_strategy
from tests.extras import need

CASES = [("zero1", None), ("zero2", None), ("zero3", None), ("zero2", "optimizer"), ("zero3", "optimizer"),
         ("zero3", "params")]


def _resolved(zero: dict) -> dict:
    """DeepSpeed's own reading of a ``zero_optimization`` section, defaults filled (pinned host memory aside)."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    resolved = DeepSpeedZeroConfig(**zero).model_dump()
    for key in ("offload_optimizer", "offload_param"):
        if isinstance(resolved.get(key), dict):
            resolved[key].pop("pin_memory", None)
    return resolved


@pytest.mark.parametrize("name, offload", CASES)
def test_hf_lightning_and_the_deepspeed_file_train_with_the_buckets_the_probe_ran(name, offload, tmp_path):
    need("deepspeed")
    need("lightning")
    need("transformers")
    from lightning.pytorch.strategies import StrategyRegistry
    from transformers import TrainingArguments

    from autobatch.distributed.zero import zero_config

    strategy = parse_strategy(name, offload)
    model = torch.nn.Sequential(torch.nn.Linear(96, 96), torch.nn.Linear(96, 8))  # hidden size 96
    ran = zero_config(model, strategy, batch=2, world_size=8, dtype="bf16")["zero_optimization"]
    assert ran["reduce_bucket_size"] == 96 * 96
    plan = solve(32, 8, 1, max_micro=2)

    hf = hf_training_args(plan, strategy=strategy, probed_zero=ran)["deepspeed"]
    args = TrainingArguments(output_dir=str(tmp_path), deepspeed=hf, report_to=[])
    hf_zero = args.hf_deepspeed_config.config["zero_optimization"]  # as the Trainer hands it to DeepSpeed
    setting = lightning_settings(plan, strategy=strategy, precision="bf16", probed_zero=ran)["trainer"]["strategy"]
    lightning_zero = setting.build().config["zero_optimization"]
    file_zero = deepspeed_config(plan, strategy=strategy, probed_zero=ran)["zero_optimization"]
    for written in (hf_zero, lightning_zero, file_zero):
        assert _resolved(written) == _resolved(ran)

    # Without the probed values each framework takes sizes the probe never held (what was written before).
    bare_hf = hf_training_args(plan, strategy=strategy)["deepspeed"]["zero_optimization"]
    bare = lightning_settings(plan, strategy=strategy, precision="bf16")["trainer"]["strategy"]
    bare_lightning = (bare.build() if not isinstance(bare, str) else StrategyRegistry.get(bare)).config
    assert _resolved(bare_hf)["reduce_bucket_size"] == 500_000_000
    assert _resolved(bare_lightning["zero_optimization"]) != _resolved(ran)


def test_an_accelerate_file_without_a_deepspeed_file_says_its_plugin_takes_deepspeeds_buckets(tmp_path):
    """accelerate's DeepSpeed plugin has no key for a bucket size: the answer says so and how to carry them."""
    need("deepspeed")
    import yaml

    from autobatch import Request, answer

    common = dict(model="tiny-mlp", gpu_memory="600MiB", gpus_per_node=4, strategy="zero2", estimate=True, target=64)
    alone = answer(Request(**common, accelerate=tmp_path / "alone.yaml"))
    said = [n for n in alone.notes if "DeepSpeed plugin" in n]
    size = alone.finding.probed_zero["reduce_bucket_size"]
    assert len(said) == 1 and f"the probe held reduce_bucket_size={size}" in said[0] and "--deepspeed ds.json" in said[0]
    assert yaml.safe_load((tmp_path / "alone.yaml").read_text())["deepspeed_config"]["zero_stage"] == 2
    # With a DeepSpeed file beside it the accelerate config names that file, which holds them: no note.
    both = answer(Request(**common, accelerate=tmp_path / "acc.yaml", deepspeed=tmp_path / "ds.json"))
    assert not [n for n in both.notes if "DeepSpeed plugin" in n]
    named = yaml.safe_load((tmp_path / "acc.yaml").read_text())["deepspeed_config"]["deepspeed_config_file"]
    assert json.loads(Path(named).read_text())["zero_optimization"]["reduce_bucket_size"] == size


@pytest.mark.parametrize("strategy", [None, "fsdp2"])
def test_an_estimate_reports_each_trial_as_a_probe_does(strategy):
    """answer(on_trial=...) hears every trial of an estimate too, sharded or not, in the order they ran:
    the published benchmark reads the peak of a batch that does not fit from it."""
    from autobatch import Request, answer

    seen = []
    report = answer(Request(model="tiny-mlp", gpu_memory="600MiB", gpus_per_node=2, strategy=strategy,
                            estimate=True, max_micro=64), on_trial=seen.append)
    assert seen and [t.batch for t in seen] == [t.batch for t in report.finding.probe.trials]


def test_no_plugin_note_where_the_probe_ran_deepspeeds_own_buckets(tmp_path):
    """A model with no hidden size (no config, no Linear) is probed with DeepSpeed's own bucket sizes, which
    accelerate's plugin trains with too: nothing to say."""
    need("deepspeed")
    from autobatch import Request, answer

    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Conv2d(8, 2, 3),
                                torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten())

    def make_batch(b):
        return torch.randn(b, 3, 16, 16), torch.randint(0, 2, (b,))

    report = answer(Request(model=model, make_batch=make_batch, gpu_memory="4GiB", gpus_per_node=4, strategy="zero2",
                            estimate=True, target=64, accelerate=tmp_path / "acc.yaml"))
    assert report.probed_zero and not [key for key in report.probed_zero if key.endswith("_size")]
    assert not [n for n in report.notes if "DeepSpeed plugin" in n]

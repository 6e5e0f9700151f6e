"""A plan carries what its batch was found under, and every config helper trains with it.

``autobatch.find(model, make_batch, dtype="bf16")`` then ``autobatch.deepspeed_config(plan)`` (the
README's pattern) wrote an fp32 config, and ``strategy="zero3"`` a stage-0 one: the batch fits only
as it was found. The helpers now read ``plan.trained_with`` for whatever they are not given, and
write what the command line's files hold.
"""

from __future__ import annotations

import json

import pytest
import torch

import autobatch
from autobatch.configs import read_config, write_accelerate_config, write_deepspeed_config


def model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))


def make_batch(b: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(b, 64), torch.randint(0, 4, (b,))


@pytest.fixture(scope="module")
def bf16_plan() -> autobatch.Plan:
    return autobatch.find(model(), make_batch, target=96, device="cpu", memory="512KiB", dtype="bf16")


@pytest.fixture(scope="module")
def zero3_plan() -> autobatch.Plan:
    return autobatch.find(model(), make_batch, target=96, device="cpu", memory="1MiB", strategy="zero3",
                          gpus_per_node=4)


def test_a_plan_found_in_bf16_configures_bf16_in_every_helper(bf16_plan, tmp_path) -> None:
    assert bf16_plan.trained_with.precision == "bf16"
    assert autobatch.hf_training_args(bf16_plan)["bf16"] is True
    assert "--bf16" in autobatch.hf_flags(bf16_plan)
    assert autobatch.accelerate_config(bf16_plan)["mixed_precision"] == "bf16"
    assert autobatch.lightning_settings(bf16_plan)["trainer"]["precision"] == "bf16-mixed"
    write_accelerate_config(bf16_plan, tmp_path / "acc.yaml")
    assert read_config(tmp_path / "acc.yaml")["mixed_precision"] == "bf16"


def test_a_plan_found_under_autocast_is_no_deepspeed_config_unless_its_precision_is_passed(bf16_plan, tmp_path) -> None:
    # DeepSpeed trains bf16 in its own engine (bf16 weights beside an fp32 master copy), not as the probe ran
    for write in (autobatch.deepspeed_config, lambda plan: write_deepspeed_config(plan, tmp_path / "ds.json")):
        with pytest.raises(autobatch.AutobatchError, match="found unsharded with fp32 weights under bf16 autocast"):
            write(bf16_plan)
    assert not (tmp_path / "ds.json").exists()
    assert autobatch.deepspeed_config(bf16_plan, precision="bf16")["bf16"] == {"enabled": True}  # asked for: written
    pure = autobatch.find(model().to(torch.bfloat16), make_batch, target=96, device="cpu", memory="512KiB", dtype="bf16-true")
    with pytest.raises(autobatch.AutobatchError, match="found unsharded with pure bf16 weights"):
        autobatch.deepspeed_config(pure)  # it was written as fp32: no precision section at all


def test_a_plan_found_under_zero3_configures_zero3_with_the_probed_buckets(zero3_plan) -> None:
    found = zero3_plan.trained_with
    assert found.strategy.name == "zero3" and found.probed_zero["stage"] == 3
    zero = autobatch.deepspeed_config(zero3_plan)["zero_optimization"]
    assert zero == found.probed_zero  # the stage and the bucket sizes the probe held
    assert autobatch.hf_training_args(zero3_plan)["deepspeed"]["zero_optimization"] == zero
    acc = autobatch.accelerate_config(zero3_plan)
    assert acc["distributed_type"] == "DEEPSPEED" and acc["deepspeed_config"]["zero_stage"] == 3
    lightning = autobatch.lightning_settings(zero3_plan)["trainer"]["strategy"]
    assert lightning.name == "DeepSpeedStrategy" and dict(lightning.kwargs)["config"]["zero_optimization"] == zero


def test_what_the_caller_gives_wins_over_the_plan(bf16_plan, zero3_plan) -> None:
    assert autobatch.deepspeed_config(bf16_plan, precision="fp16")["fp16"] == {"enabled": True}
    assert autobatch.accelerate_config(bf16_plan, mixed_precision="no")["mixed_precision"] == "no"
    assert autobatch.deepspeed_config(zero3_plan, strategy="zero2")["zero_optimization"]["stage"] == 2
    plain = autobatch.Plan(7, 2, gpus_per_node=16)  # a plan built by hand: nothing found, nothing added
    assert plain.trained_with is None and "bf16" not in autobatch.deepspeed_config(plain)
    assert plain == autobatch.Plan(7, 2, gpus_per_node=16, trained_with=bf16_plan.trained_with)  # not part of the answer


def test_the_helpers_write_what_the_command_writes_from_the_same_plan(tmp_path) -> None:
    files = {"deepspeed": tmp_path / "ds.json", "accelerate": tmp_path / "acc.yaml", "hf": tmp_path / "args.json"}
    report = autobatch.answer(autobatch.Request(model=model(), make_batch=make_batch, target=96, device="cpu",
                                                memory="1MiB", dtype="bf16", strategy="zero2", gpus_per_node=4,
                                                **files))
    plan = report.plan
    assert plan.trained_with.precision == "bf16" and plan.trained_with.strategy.name == "zero2"
    assert read_config(files["deepspeed"]) == autobatch.deepspeed_config(plan)
    assert read_config(files["hf"]) == autobatch.hf_training_args(plan, files["deepspeed"])
    assert read_config(files["accelerate"]) == autobatch.accelerate_config(plan, files["deepspeed"])

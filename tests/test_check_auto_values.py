"""`check` with DeepSpeed "auto" values: every mix of given and "auto" keys meets the batch identity."""

from __future__ import annotations

import itertools

import pytest

from autobatch import check_setup

AUTO = "auto"


def codes(result):
    return [p.code for p in result.problems]


@pytest.mark.parametrize("ds", [
    {"train_batch_size": 224, "train_micro_batch_size_per_gpu": AUTO, "gradient_accumulation_steps": AUTO},
    {"train_batch_size": 224, "train_micro_batch_size_per_gpu": 7, "gradient_accumulation_steps": AUTO},
    {"train_batch_size": 224, "train_micro_batch_size_per_gpu": AUTO, "gradient_accumulation_steps": 2},
    {"train_batch_size": 224, "train_micro_batch_size_per_gpu": AUTO},
    {"train_batch_size": 224, "gradient_accumulation_steps": AUTO},
])
def test_auto_values_that_cannot_work_on_three_gpus_are_reported(ds):
    result = check_setup(deepspeed={**ds, "zero_optimization": {"stage": 0}}, gpus_per_node=3)
    assert not result.ok, result.report()
    assert codes(result) == ["deepspeed-auto"]
    assert "224" in result.problems[0].message and "3" in result.problems[0].message


def test_the_fix_names_plans_that_reach_the_target():
    ds = {"train_batch_size": 224, "train_micro_batch_size_per_gpu": 7, "gradient_accumulation_steps": AUTO}
    result = check_setup(deepspeed=ds, gpus_per_node=3)
    # 222 or 225, proposed before, fail too with the file's 7 per GPU: the target must be a multiple of 7 × 3
    assert result.problems[0].fix.startswith("use a global batch of 210 or 231 (a multiple of 7 × 3 GPUs = 21)")


def test_every_combination_is_checked_against_the_identity():
    # For each key: a value that works (224 = 7 × 2 × 16), "auto", or absent. A mix is OK exactly
    # when some whole numbers for the open keys satisfy the identity on 16 GPUs; on 3 GPUs none does.
    values = {"train_batch_size": 224, "train_micro_batch_size_per_gpu": 7, "gradient_accumulation_steps": 2}
    for choice in itertools.product(("value", AUTO, None), repeat=3):
        ds = {"zero_optimization": {"stage": 0}}
        for (key, value), how in zip(values.items(), choice):
            if how == "value":
                ds[key] = value
            elif how == AUTO:
                ds[key] = AUTO
        if "train_batch_size" not in ds and "train_micro_batch_size_per_gpu" not in ds:
            continue  # DeepSpeed refuses that on its own; covered elsewhere
        if "value" not in choice:  # every key left to the launcher and no numbers given: nothing was checked
            for gpus in (16, 3):
                assert [p.code for p in check_setup(deepspeed=ds, gpus_per_node=gpus).problems] == ["deepspeed-unchecked"]
            continue
        assert check_setup(deepspeed=ds, gpus_per_node=16).ok, (ds, check_setup(deepspeed=ds, gpus_per_node=16).report())
        on_three = check_setup(deepspeed=ds, gpus_per_node=3)
        fixed_target = ds.get("train_batch_size") == 224
        assert on_three.ok is (not fixed_target), (ds, on_three.report())


def test_auto_filled_from_arguments_is_still_checked_once():
    ds = {"train_batch_size": 224, "train_micro_batch_size_per_gpu": AUTO, "gradient_accumulation_steps": AUTO}
    result = check_setup(deepspeed=ds, gpus_per_node=3, target=224)
    assert codes(result) == ["not-divisible"]

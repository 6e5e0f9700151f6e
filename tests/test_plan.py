"""Plan: the identity by construction, the printed arithmetic, JSON, and the writer delegates."""

from __future__ import annotations

import dataclasses
import doctest
import importlib
import json

import pytest

from autobatch.configs import (
    accelerate_command,
    accelerate_config,
    deepspeed_config,
    hf_flags,
    hf_training_args,
    lightning_settings,
    torchrun_command,
)
from autobatch.errors import AutobatchError
from autobatch.planning.plan import LRAdvice, Plan, require_positive_int
from autobatch.planning.solver import solve


@pytest.mark.parametrize(
    ("plan", "text"),
    [
        (Plan(7, 2, gpus_per_node=16, nodes=1), "7 per GPU × 2 accumulation × 16 GPUs (16 per node × 1 node) = 224"),
        (Plan(1, 1), "1 per GPU × 1 accumulation × 1 GPU (1 per node × 1 node) = 1"),
        (Plan(4, 8, gpus_per_node=8, nodes=2), "4 per GPU × 8 accumulation × 16 GPUs (8 per node × 2 nodes) = 512"),
        (Plan(2, 3, gpus_per_node=1, nodes=3), "2 per GPU × 3 accumulation × 3 GPUs (1 per node × 3 nodes) = 18"),
        (
            Plan(2, 1, gpus_per_node=2, nodes=1, model_parallel=2),
            "2 per GPU × 1 accumulation × 1 data-parallel rank (2 GPUs: 2 per node × 1 node ÷ 2 model-parallel) = 2",
        ),
    ],
)
def test_str_prints_the_arithmetic_with_singular_and_plural(plan, text):
    assert str(plan) == text


def test_world_size_and_global_batch_are_computed_so_the_identity_cannot_break():
    plan = Plan(7, 2, gpus_per_node=8, nodes=2)
    assert (plan.world_size, plan.global_batch, plan.num_processes) == (16, 224, 16)
    bigger = dataclasses.replace(plan, micro_batch=8)
    assert bigger.global_batch == 256
    with pytest.raises(TypeError):
        Plan(7, 2, world_size=3)  # type: ignore[call-arg]
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.micro_batch = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"micro_batch": 0, "grad_accum": 1}, "micro_batch must be a positive integer, but got micro_batch=0"),
        ({"micro_batch": 2, "grad_accum": 1.5}, "grad_accum must be a positive integer, but got grad_accum=1.5"),
        ({"micro_batch": 2, "grad_accum": 1, "gpus_per_node": 3, "model_parallel": 2}, "model_parallel must divide"),
    ],
)
def test_invalid_plans_raise_autobatch_errors(kwargs, pattern):
    with pytest.raises(AutobatchError, match=pattern):
        Plan(**kwargs)


def test_require_positive_int_refuses_bools_and_whole_floats():
    assert require_positive_int("n", 3) == 3
    for bad in (True, 3.0, 0, "3"):
        with pytest.raises(AutobatchError, match=rf"n must be a positive integer, but got n={bad!r}"):
            require_positive_int("n", bad)


def test_to_dict_is_json_ready_and_has_the_documented_keys():
    plan = solve(224, 16, 1, max_micro=9, base_lr=3e-4, base_batch=256)
    data = json.loads(json.dumps(plan.to_dict()))
    for key in ("global_batch", "micro_batch", "grad_accum", "world_size", "gpus_per_node", "nodes", "model_parallel"):
        assert key in data
    assert (data["global_batch"], data["micro_batch"], data["grad_accum"], data["world_size"]) == (224, 7, 2, 16)
    assert data["arithmetic"] == str(plan)
    assert data["lr_advice"]["linear"] == pytest.approx(3e-4 * 224 / 256)
    assert data["max_micro"] == 9 and data["reason"] == plan.reason


def test_describe_shows_reason_and_learning_rate_advice():
    plan = solve(224, 16, 1, max_micro=9, base_lr=3e-4, base_batch=256)
    lines = plan.describe().splitlines()
    assert lines[0] == str(plan)
    assert lines[1].startswith("chosen: largest micro batch")
    assert "linear 0.0002625" in lines[2] and "square-root 0.0002806" in lines[2]


def test_lr_advice_scales_linearly_and_by_square_root():
    advice = LRAdvice(base_lr=1e-3, base_batch=256, global_batch=1024)
    assert advice.linear == pytest.approx(4e-3)
    assert advice.sqrt == pytest.approx(2e-3)


def test_writer_methods_delegate_to_the_config_modules():
    plan = Plan(7, 2, gpus_per_node=16)
    assert deepspeed_config(plan, {"bf16": {"enabled": True}}) == {
        "bf16": {"enabled": True}, "train_batch_size": 224, "train_micro_batch_size_per_gpu": 7,
        "gradient_accumulation_steps": 2,
    }
    assert hf_training_args(plan) == {"per_device_train_batch_size": 7, "gradient_accumulation_steps": 2}
    assert hf_flags(plan) == ["--per_device_train_batch_size", "7", "--gradient_accumulation_steps", "2"]
    assert lightning_settings(plan)["trainer"] == {"accumulate_grad_batches": 2, "devices": 16, "num_nodes": 1}
    assert accelerate_config(plan)["num_processes"] == 16
    assert torchrun_command(plan, "train.py") == "torchrun --standalone --nproc_per_node 16 train.py"
    assert accelerate_command(plan, "train.py").startswith("ACCELERATE_GRADIENT_ACCUMULATION_STEPS=2 accelerate launch")


@pytest.mark.parametrize(
    "module",
    [
        "autobatch.planning.plan",
        "autobatch.planning.solver",
        "autobatch.checking.setup",
        "autobatch.configs.deepspeed",
        "autobatch.configs.accelerate",
        "autobatch.configs.hf",
        "autobatch.configs.lightning",
        "autobatch.configs.launch",
        "autobatch.configs.trained",
        "autobatch.strategy",
        "autobatch.modelinfo",
        "autobatch.estimating.gpus",
        "autobatch.probing.samples",
    ],
)
def test_docstring_examples_run(module):
    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0

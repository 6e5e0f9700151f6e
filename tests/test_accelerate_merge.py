"""`solve --accelerate existing.yaml` merges into the user's file, as the DeepSpeed writer does, and says what changed."""

from __future__ import annotations

import json

import yaml
from typer.testing import CliRunner

from autobatch.cli import app
from autobatch.configs.accelerate import merge_accelerate_config
from autobatch.planning.plan import Plan

runner = CliRunner()

USER = {
    "compute_environment": "LOCAL_MACHINE",
    "distributed_type": "MULTI_GPU",
    "mixed_precision": "bf16",
    "gpu_ids": "0,1,2",
    "main_process_port": 29555,
    "num_machines": 1,
    "num_processes": 8,
    "use_cpu": False,
}


def test_solve_keeps_the_users_keys_and_says_what_changed(tmp_path):
    path = tmp_path / "accelerate.yaml"
    path.write_text(yaml.safe_dump(USER))
    result = runner.invoke(app, ["solve", "--target", "24", "--gpus", "3", "--accelerate", str(path)])
    assert result.exit_code == 0, result.output
    written = yaml.safe_load(path.read_text())
    assert written == {**USER, "num_processes": 3}
    assert f"updated {path}: num_processes 8 → 3; kept 7 keys as they were" in result.stdout


def test_solve_json_lists_the_changes(tmp_path):
    path = tmp_path / "accelerate.yaml"
    path.write_text(yaml.safe_dump(USER))
    result = runner.invoke(app, ["solve", "--target", "24", "--gpus", "3", "--accelerate", str(path), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["changes"] == [f"{path}: num_processes 8 → 3; kept 7 keys as they were"]


def test_with_a_deepspeed_file_only_what_accelerate_refuses_goes():
    merged = merge_accelerate_config(Plan(4, 2, gpus_per_node=3), {**USER, "deepspeed_config": {"zero_stage": 2}},
                                     "ds.json")
    assert merged["distributed_type"] == "DEEPSPEED" and "mixed_precision" not in merged
    assert merged["deepspeed_config"] == {"deepspeed_config_file": "ds.json"}
    assert merged["gpu_ids"] == "0,1,2" and merged["main_process_port"] == 29555


def test_a_single_process_file_becomes_multi_gpu_for_several():
    merged = merge_accelerate_config(Plan(4, 1, gpus_per_node=2), {"distributed_type": "NO", "mixed_precision": "fp16"})
    assert merged == {"distributed_type": "MULTI_GPU", "mixed_precision": "fp16", "num_processes": 2, "num_machines": 1}

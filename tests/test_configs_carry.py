"""The configs train as the batch was probed: its precision and gradient checkpointing go into every
file and launch line, an accelerate file's precision moves into the DeepSpeed JSON instead of being
dropped, one way of sharding replaces the other in an HF file, and a merged accelerate file does not
contradict itself."""

from __future__ import annotations

import json

import yaml
from typer.testing import CliRunner

from autobatch.cli import app


def invoke(*args: str):
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0, result.output
    return result


def test_a_batch_probed_with_bf16_and_checkpointing_is_written_with_them(tmp_path):
    hf, ds = tmp_path / "hf.json", tmp_path / "ds.json"
    out = invoke("find", "--model", "tiny-gpt2", "--device", "cpu", "--memory", "8MiB", "--grad-checkpointing",
                 "--dtype", "bf16", "--target", "64", "--hf", str(hf), "--deepspeed", str(ds), "--no-cache").stdout
    args = json.loads(hf.read_text())
    assert args["bf16"] is True and args["gradient_checkpointing"] is True
    assert json.loads(ds.read_text())["bf16"] == {"enabled": True}
    assert "--bf16 --gradient_checkpointing" in out and "precision='bf16-mixed'" in out


def test_an_accelerate_files_precision_moves_into_the_deepspeed_json(tmp_path):
    acc, ds = tmp_path / "acc.yaml", tmp_path / "ds.json"
    acc.write_text("mixed_precision: bf16\nnum_processes: 8\n")
    ds.write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    invoke("solve", "--target", "64", "--gpus", "8", "--max-micro", "4", "--deepspeed", str(ds), "--accelerate", str(acc))
    assert "mixed_precision" not in yaml.safe_load(acc.read_text())  # accelerate refuses it beside a DeepSpeed file
    assert json.loads(ds.read_text())["bf16"] == {"enabled": True}  # so it trains in bf16 still


def test_fsdp_replaces_deepspeed_in_an_hf_file_and_back(tmp_path):
    hf = tmp_path / "hf.json"
    hf.write_text(json.dumps({"learning_rate": 0.001, "deepspeed": "other.json"}))
    invoke("solve", "--target", "64", "--gpus", "8", "--max-micro", "4", "--strategy", "fsdp2", "--hf", str(hf))
    args = json.loads(hf.read_text())
    assert "deepspeed" not in args and args["fsdp"] is True and args["learning_rate"] == 0.001
    invoke("solve", "--target", "64", "--gpus", "8", "--max-micro", "4", "--strategy", "zero3", "--hf", str(hf))
    args = json.loads(hf.read_text())
    assert "fsdp" not in args and "fsdp_config" not in args and args["deepspeed"]["zero_optimization"]["stage"] == 3


def test_gpu_ids_that_contradict_the_plans_processes_become_all(tmp_path):
    acc = tmp_path / "acc.yaml"
    acc.write_text("gpu_ids: 0,1,2,3\nnum_processes: 4\n")
    invoke("solve", "--target", "64", "--gpus", "8", "--max-micro", "8", "--accelerate", str(acc))
    merged = yaml.safe_load(acc.read_text())
    assert merged["num_processes"] == 8 and merged["gpu_ids"] == "all"
    acc.write_text("gpu_ids: 0,1,2,3,4,5,6,7\nnum_processes: 8\n")
    invoke("solve", "--target", "64", "--gpus", "8", "--max-micro", "8", "--accelerate", str(acc))
    assert yaml.safe_load(acc.read_text())["gpu_ids"] == "0,1,2,3,4,5,6,7"  # consistent: kept as the user set it


def test_existing_files_in_the_other_precision_are_switched_not_left_contradicting(tmp_path):
    ds, hf, acc = tmp_path / "ds.json", tmp_path / "hf.json", tmp_path / "a.yaml"
    ds.write_text(json.dumps({"fp16": {"enabled": True}, "bf16": {"enabled": False}, "zero_optimization": {"stage": 0}}))
    hf.write_text(json.dumps({"fp16": True, "learning_rate": 0.001}))
    acc.write_text("mixed_precision: fp16\n")
    common = ["find", "--model", "tiny-gpt2", "--target", "64", "--device", "cpu", "--memory", "8MiB", "--dtype", "bf16",
              "--no-cache"]
    invoke(*common, "--deepspeed", str(ds), "--hf", str(hf))
    written = json.loads(ds.read_text())
    assert written["bf16"] == {"enabled": True} and written["fp16"] == {"enabled": False}
    args = json.loads(hf.read_text())
    assert args["bf16"] is True and "fp16" not in args and args["learning_rate"] == 0.001
    invoke(*common, "--gpus", "2", "--accelerate", str(acc))
    assert yaml.safe_load(acc.read_text())["mixed_precision"] == "bf16"

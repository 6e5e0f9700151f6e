"""The configs train as the batch was probed: its precision and gradient checkpointing go into every
file and launch line, an accelerate file's precision moves into the DeepSpeed JSON instead of being
dropped, one way of sharding replaces the other in an HF file, and a merged accelerate file does not
contradict itself."""

from __future__ import annotations

import json

import pytest
import yaml
from typer.testing import CliRunner

import autobatch
from autobatch.cli import app


def invoke(*args: str):
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0, result.output
    return result


def test_a_batch_probed_with_bf16_and_checkpointing_is_written_with_them(tmp_path):
    hf, ds = tmp_path / "hf.json", tmp_path / "ds.json"
    out = invoke("find", "--model", "tiny-gpt2", "--device", "cpu", "--memory", "8MiB", "--grad-checkpointing",
                 "--dtype", "bf16", "--strategy", "zero1", "--target", "64", "--hf", str(hf), "--deepspeed", str(ds),
                 "--no-cache").stdout
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
    invoke(*common, "--strategy", "zero1", "--deepspeed", str(ds), "--hf", str(hf))
    written = json.loads(ds.read_text())
    assert written["bf16"] == {"enabled": True} and written["fp16"] == {"enabled": False}
    args = json.loads(hf.read_text())
    assert args["bf16"] is True and "fp16" not in args and args["learning_rate"] == 0.001
    invoke(*common, "--gpus", "2", "--accelerate", str(acc))
    assert yaml.safe_load(acc.read_text())["mixed_precision"] == "bf16"


# A file the batch is merged into keeps its strategy and precision, so a probe that says neither would find the
# batch under another step than the file trains: each kind of file, each way it says so.
TRAINS_OTHERWISE = [
    ("--deepspeed", "ds.json", {"zero_optimization": {"stage": 2}}, "trains with zero2 (zero_optimization.stage)",
     ["--strategy", "zero2"]),
    ("--deepspeed", "ds.json", {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}},
     "trains with zero3+offload-optimizer", ["--strategy", "zero3", "--offload", "optimizer"]),
    ("--deepspeed", "ds.json", {"zero_optimization": {"stage": 1}, "bf16": {"enabled": True}},
     "trains with zero1 (zero_optimization.stage) in bf16, but its batch would be found unsharded in fp32",
     ["--strategy", "zero1", "--dtype", "bf16"]),
    ("--accelerate", "acc.yaml", "distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2\n", "trains with fsdp2",
     ["--strategy", "fsdp2"]),
    ("--accelerate", "acc.yaml", "distributed_type: MULTI_GPU\nmixed_precision: fp16\n", "trains in fp16",
     ["--dtype", "fp16"]),
    ("--hf", "hf.json", {"fsdp": "full_shard auto_wrap", "fsdp_config": {"version": 2}}, "trains with fsdp2 (fsdp)",
     ["--strategy", "fsdp2"]),
    ("--hf", "hf.json", {"deepspeed": {"zero_optimization": {"stage": 3}}}, "trains with zero3 (deepspeed)",
     ["--strategy", "zero3"]),
    ("--hf", "hf.json", {"bf16": True}, "trains in bf16", ["--dtype", "bf16"]),
    ("--hf", "hf.json", {"gradient_checkpointing": True}, "trains with gradient checkpointing", ["--grad-checkpointing"]),
    ("--accelerate", "acc.yaml", "distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2\n"
     "  fsdp_activation_checkpointing: true\n", "trains with fsdp2 (fsdp_config) with gradient checkpointing",
     ["--strategy", "fsdp2", "--grad-checkpointing"]),
]


@pytest.mark.parametrize("flag, name, content, said, fix", TRAINS_OTHERWISE,
                         ids=["ds-zero2", "ds-offload", "ds-bf16", "acc-fsdp2", "acc-fp16", "hf-fsdp2", "hf-zero3", "hf-bf16",
                              "hf-checkpointing", "acc-fsdp2-checkpointing"])
def test_a_file_that_trains_otherwise_than_the_probe_is_named_before_the_first_trial(tmp_path, flag, name, content,
                                                                                    said, fix):
    path = tmp_path / name
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    before = path.read_text()
    result = CliRunner().invoke(app, ["find", "--model", "tiny-gpt2", "--device", "cpu", "--memory", "64MiB",
                                      "--target", "64", flag, str(path)])
    assert result.exit_code == 2 and said in result.output, result.output
    assert f"add {' '.join(fix)}" in result.output.replace("\n", " ")
    assert "max batch" not in result.output and path.read_text() == before  # refused before the first trial
    # given as the file trains, the request is taken (written into the file after the probe)
    options, rest = {}, list(fix)
    while rest:  # "--flag value", or a bare "--flag" that turns it on
        flag_name = rest.pop(0)[2:].replace("-", "_")
        options[flag_name] = rest.pop(0) if rest and not rest[0].startswith("--") else True
    try:
        autobatch.Request(model="tiny-gpt2", device="cpu", memory="64MiB", target=64, **{flag[2:]: str(path)}, **options)
    except autobatch.RequestError as exc:  # an offload is no simulated budget's: that line only
        assert "trains" not in str(exc) and "offload" in options, exc
    # where the fix leads to that line, the first says so and names the estimate that answers it
    assert ("estimate it (`autobatch estimate`)" in result.output.replace("\n", " ")) == ("offload" in options)


def test_a_file_that_leaves_both_to_the_launcher_or_plans_alone_is_taken(tmp_path):
    auto = tmp_path / "auto.json"
    auto.write_text(json.dumps({"bf16": {"enabled": "auto"}, "zero_optimization": {"stage": "auto"}}))
    autobatch.Request(model="tiny-gpt2", device="cpu", memory="64MiB", target=64, deepspeed=str(auto))
    sharded = tmp_path / "ds.json"
    sharded.write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    invoke("solve", "--target", "64", "--max-micro", "8", "--deepspeed", str(sharded))  # no probe: nothing differs
    assert json.loads(sharded.read_text())["zero_optimization"] == {"stage": 2}


def test_a_strategy_written_into_an_accelerate_plugin_section_keeps_the_users_other_keys(tmp_path):
    # --strategy replaced the whole deepspeed_config section: gradient_clipping and zero3_save_16bit_model were lost
    acc = tmp_path / "acc.yaml"
    acc.write_text("distributed_type: DEEPSPEED\nnum_processes: 8\ndeepspeed_config:\n  gradient_clipping: 1.0\n"
                   "  zero3_save_16bit_model: true\n  zero_stage: 3\n")
    invoke("solve", "--target", "512", "--gpus", "8", "--max-micro", "16", "--accelerate", str(acc), "--strategy", "zero3")
    section = yaml.safe_load(acc.read_text())["deepspeed_config"]
    assert section["gradient_clipping"] == 1.0 and section["zero3_save_16bit_model"] is True
    assert section["zero_stage"] == 3 and section["gradient_accumulation_steps"] == 4
    # without --strategy the file keeps its engine and its whole section, and its header says where accumulation is
    acc.write_text("distributed_type: DEEPSPEED\nnum_processes: 8\ndeepspeed_config:\n  gradient_clipping: 1.0\n"
                   "  zero_stage: 3\n  gradient_accumulation_steps: 1\n")
    invoke("solve", "--target", "512", "--gpus", "8", "--max-micro", "16", "--accelerate", str(acc))
    assert yaml.safe_load(acc.read_text())["deepspeed_config"] == {"gradient_clipping": 1.0, "zero_stage": 3,
                                                                   "gradient_accumulation_steps": 4}
    assert "gradient accumulation (4) is in deepspeed_config" in acc.read_text()
    # another engine: its section trains nothing now, and goes; the new one is the plan's
    fsdp = tmp_path / "fsdp.yaml"
    fsdp.write_text("distributed_type: FSDP\nnum_processes: 2\nfsdp_config:\n  fsdp_version: 2\n")
    invoke("solve", "--target", "64", "--gpus", "2", "--max-micro", "8", "--accelerate", str(fsdp), "--strategy", "zero2")
    written = yaml.safe_load(fsdp.read_text())
    assert written["distributed_type"] == "DEEPSPEED" and "fsdp_config" not in written
    assert written["deepspeed_config"]["zero_stage"] == 2


@pytest.mark.parametrize("flag, name, text", [
    ("--accelerate", "acc.yaml", "distributed_type: DEEPSPEED\nnum_processes: 2\ndeepspeed_config:\n"
                                 "  deepspeed_config_file: {ds}\n"),
    ("--hf", "hf.json", '{{"deepspeed": "{ds}", "per_device_train_batch_size": 4}}'),
], ids=["accelerate", "hf"])
def test_a_file_that_trains_from_a_deepspeed_file_needs_that_file_written_too(tmp_path, flag, name, text):
    # the accelerate file was "written" (nothing changed) and the DeepSpeed file it trains from kept its batch of 32
    ds, path = tmp_path / "team_ds.json", tmp_path / name
    ds.write_text(json.dumps({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
                              "gradient_accumulation_steps": 4, "zero_optimization": {"stage": 2}}))
    path.write_text(text.format(ds=ds))
    solve = ["solve", "--target", "64", "--gpus", "2", "--max-micro", "8", flag, str(path)]
    refused = CliRunner().invoke(app, solve)
    assert refused.exit_code == 2 and f"trains from the DeepSpeed file {ds}" in refused.output
    assert f"add --deepspeed {ds}" in refused.output.replace("\n", " ")
    invoke(*solve, "--deepspeed", str(ds))  # the fix, as the line gives it
    assert json.loads(ds.read_text())["train_batch_size"] == 64

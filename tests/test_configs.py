"""Config writers: one Plan, and each emitted file or line is accepted by the real library that reads it.

Optional libraries are skipped cleanly when absent (CI installs them all).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

import pytest
import torch
import yaml

from autobatch.configs import (
    BATCH_KEYS,
    accelerate_command,
    accelerate_config,
    deepspeed_config,
    derive_batch_keys,
    hf_flags,
    hf_training_args,
    lightning_settings,
    read_config,
    torchrun_command,
    write_accelerate_config,
    write_config,
    write_deepspeed_config,
)
from autobatch.configs.files import ConfigFileError
from autobatch.errors import AutobatchError
from autobatch.planning.plan import Plan
from autobatch.planning.solver import solve
from tests.deepspeed_parse import deepspeed_parse
from tests.extras import need

PLANS = [
    pytest.param(solve(224, 16, 1, max_micro=9), id="224-on-16"),
    pytest.param(solve(512, 8, 2, max_micro=16), id="512-on-8x2"),
    pytest.param(solve(14, 1, 1, max_micro=7), id="14-on-1"),
    pytest.param(solve(224, 8, 2, max_micro=7, model_parallel=2), id="224-on-16-mp2"),
]
EXISTING = {
    "fp16": {"enabled": True},
    "train_batch_size": "auto",
    "zero_optimization": {"stage": 2, "overlap_comm": True},
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}},
    "gradient_clipping": 1.0,
}


# --- DeepSpeed -------------------------------------------------------------------------------


def test_deepspeed_merge_changes_only_the_batch_keys_and_keeps_order():
    plan = Plan(7, 2, gpus_per_node=16)
    before = json.loads(json.dumps(EXISTING))
    merged = deepspeed_config(plan, EXISTING)
    assert EXISTING == before, "the existing config must not be modified"
    assert list(merged)[: len(EXISTING)] == list(EXISTING)
    assert {k: v for k, v in merged.items() if k in EXISTING and not k.startswith("train_")} == {
        k: v for k, v in EXISTING.items() if not k.startswith("train_")
    }
    assert (merged["train_batch_size"], merged["train_micro_batch_size_per_gpu"], merged["gradient_accumulation_steps"]) == (
        224, 7, 2,
    )


def test_deepspeed_auto_is_replaced_by_default_and_kept_on_request():
    plan = Plan(7, 2, gpus_per_node=16)
    auto = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 4}
    assert deepspeed_config(plan, auto)["train_batch_size"] == 224
    kept = deepspeed_config(plan, auto, keep_auto=True)
    assert kept == {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 2}


def test_write_deepspeed_config_updates_a_file_in_place_and_leaves_a_template_alone(tmp_path):
    plan = Plan(7, 2, gpus_per_node=16)
    target = tmp_path / "ds.json"
    target.write_text(json.dumps(EXISTING))
    write_deepspeed_config(plan, target)
    written = json.loads(target.read_text())
    assert written["optimizer"] == EXISTING["optimizer"] and written["train_batch_size"] == 224

    template = tmp_path / "template.json"
    template.write_text(json.dumps({"bf16": {"enabled": True}}))
    out = tmp_path / "sub" / "out.json"
    write_deepspeed_config(plan, out, base=template)
    assert json.loads(template.read_text()) == {"bf16": {"enabled": True}}
    assert json.loads(out.read_text()) == {"bf16": {"enabled": True}, **deepspeed_config(plan, {})}
    # a new file gets DeepSpeed's default ZeRO section, which HF and accelerate insist on
    fresh = tmp_path / "fresh.json"
    write_deepspeed_config(plan, fresh)
    assert json.loads(fresh.read_text())["zero_optimization"] == {"stage": 0}
    # an existing file gains it only when it is meant for accelerate, and a ZeRO section is never replaced
    write_deepspeed_config(plan, template, for_accelerate=True)
    assert json.loads(template.read_text())["zero_optimization"] == {"stage": 0}
    write_deepspeed_config(plan, target, for_accelerate=True)
    assert json.loads(target.read_text())["zero_optimization"] == EXISTING["zero_optimization"]


def test_read_config_errors_are_one_line(tmp_path):
    cases = {
        "missing.json": None,
        "broken.json": '{"train_batch_size": 8,',
        "list.json": "[1, 2]",
        "dupe.json": '{"train_batch_size": 8, "train_batch_size": 16}',
        "broken.yaml": "num_processes: [1,\n",
    }
    for name, text in cases.items():
        path = tmp_path / name
        if text is not None:
            path.write_text(text)
        with pytest.raises(ConfigFileError) as info:
            read_config(path)
        assert "\n" not in str(info.value) and name in str(info.value)
    assert "duplicate key 'train_batch_size'" in str(pytest.raises(ConfigFileError, read_config, tmp_path / "dupe.json").value)
    with pytest.raises(ConfigFileError, match="name must end in .json, .yaml or .yml"):
        write_config(tmp_path / "cfg.toml", {})


def test_read_config_accepts_hjson_comments_like_deepspeed(tmp_path):
    need("hjson")
    path = tmp_path / "ds.json"
    path.write_text('{\n  // per-GPU batch\n  "train_micro_batch_size_per_gpu": 4\n}\n')
    assert read_config(path) == {"train_micro_batch_size_per_gpu": 4}


@pytest.mark.parametrize("plan", PLANS)
def test_deepspeed_parser_accepts_the_plan_for_its_world_size(plan, tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(EXISTING))
    write_deepspeed_config(plan, path)
    parsed = deepspeed_parse(str(path), plan.world_size)
    assert parsed.world_size == plan.world_size
    assert (parsed.train_batch_size, parsed.train_micro_batch_size_per_gpu, parsed.gradient_accumulation_steps) == (
        plan.global_batch, plan.micro_batch, plan.grad_accum,
    )
    assert parsed.zero_optimization_stage == 2  # the rest of the file survived the merge
    # the parser really checks: the same file on one more rank fails DeepSpeed's batch assertion
    with pytest.raises(AssertionError, match="train_batch_size is not equal"):
        deepspeed_parse(str(path), plan.world_size + 1)


@pytest.mark.parametrize(
    ("keys", "world"),
    [((224, None, None), 16), ((224, None, None), 3), ((225, 7, None), 16), ((224, None, 3), 16),
     ((None, 7, 2), 16), ((None, 7, None), 4), ((8, None, 1), 16), ((224, 7, 2), 16)],
)
def test_derive_batch_keys_matches_deepspeed(keys, world):
    ds = {k: v for k, v in zip(BATCH_KEYS, keys) if v is not None}
    derived = derive_batch_keys(*keys, world_size=world)
    try:
        parsed = deepspeed_parse(ds, world)
    except AssertionError:
        assert not derived.consistent
        return
    assert derived.consistent
    assert (derived.train_batch_size, derived.micro_batch, derived.grad_accum) == (
        parsed.train_batch_size, parsed.train_micro_batch_size_per_gpu, parsed.gradient_accumulation_steps,
    )


def test_derive_batch_keys_needs_a_batch_key():
    assert derive_batch_keys(None, None, 4, world_size=2) is None


# --- accelerate -----------------------------------------------------------------------------


@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("use_deepspeed", [False, True], ids=["ddp", "deepspeed"])
def test_accelerate_loader_reads_the_yaml(plan, use_deepspeed, tmp_path):
    config_args = need("accelerate.commands.config.config_args")
    ds_path = tmp_path / "ds.json" if use_deepspeed else None
    if ds_path is not None:
        write_deepspeed_config(plan, ds_path)
    yaml_path = tmp_path / "accelerate.yaml"
    write_accelerate_config(plan, yaml_path, ds_path, main_process_ip="10.0.0.1")
    assert yaml_path.read_text().startswith(f"# written by autobatch: {plan}\n")

    loaded = config_args.load_config_from_file(str(yaml_path))
    assert type(loaded).__name__ == "ClusterConfig"
    assert (loaded.num_processes, loaded.num_machines) == (plan.num_processes, plan.nodes)
    expected = "DEEPSPEED" if use_deepspeed else ("MULTI_GPU" if plan.num_processes > 1 else "NO")
    assert loaded.distributed_type.value == expected
    if use_deepspeed:
        assert loaded.deepspeed_config["deepspeed_config_file"] == str(ds_path)
        assert "gradient_accumulation_steps" not in loaded.deepspeed_config
    else:
        assert f"gradient_accumulation_steps={plan.grad_accum}" in yaml_path.read_text()


def test_accelerate_launch_with_the_deepspeed_file_accepts_it_and_reads_the_accumulation(tmp_path, monkeypatch):
    """Runs accelerate's own launch-argument validation and DeepSpeed plugin on the written files."""
    launch = need("accelerate.commands.launch")
    utils = need("accelerate.utils")
    validate = getattr(launch, "_validate_launch_command", None)
    if validate is None:
        pytest.skip("this accelerate version has no _validate_launch_command")
    plan = solve(224, 16, 1, max_micro=9)
    ds_path, yaml_path = tmp_path / "ds.json", tmp_path / "accelerate.yaml"
    write_deepspeed_config(plan, ds_path)
    write_accelerate_config(plan, yaml_path, ds_path)
    words = shlex.split(accelerate_command(plan, "train.py", config_file=yaml_path, deepspeed_config_file=ds_path))
    assert words[:2] == ["accelerate", "launch"]
    args, defaults, mixed_precision_from_config = validate(launch.launch_command_parser().parse_args(words[2:]))
    assert args.use_deepspeed and args.num_processes == 16
    # what `accelerate launch` hands the training process; the plugin raises on forbidden fields
    fields = list(defaults.deepspeed_config) + (["mixed_precision"] if mixed_precision_from_config else [])
    monkeypatch.setenv("ACCELERATE_CONFIG_DS_FIELDS", ",".join(fields))
    plugin = utils.DeepSpeedPlugin(hf_ds_config=str(ds_path))
    assert plugin.gradient_accumulation_steps == plan.grad_accum
    assert plugin.hf_ds_config.config["train_micro_batch_size_per_gpu"] == plan.micro_batch


@pytest.mark.parametrize("nodes", [1, 2])
def test_accelerate_command_parses_with_accelerates_own_parser(nodes):
    launch = need("accelerate.commands.launch")
    plan = solve(256, 8, nodes, max_micro=16)
    line = accelerate_command(plan, "train.py", ["--lr", "3e-4"])
    for port in (None, "12345"):  # the job's MASTER_PORT where its shell sets one, else torch's default
        env, *words = shell_words(line, NODE_RANK="1", MASTER_ADDR="10.0.0.1", MASTER_PORT=port)
        assert env == f"ACCELERATE_GRADIENT_ACCUMULATION_STEPS={plan.grad_accum}"
        args = launch.launch_command_parser().parse_args(words[2:])
        assert (int(args.num_processes), int(args.num_machines), args.multi_gpu) == (plan.num_processes, nodes, True)
        assert args.training_script == "train.py" and args.training_script_args == ["--lr", "3e-4"]
        if nodes > 1:
            assert (int(args.machine_rank), args.main_process_ip, int(args.main_process_port)) == (
                1, "10.0.0.1", int(port or 29500))


def shell_words(line: str, **variables: str | None) -> list[str]:
    """``line``'s words as a POSIX shell splits and expands them with ``variables`` set (``None``: unset)."""
    env = {k: v for k, v in os.environ.items() if k not in variables}
    env.update({k: v for k, v in variables.items() if v is not None})
    out = subprocess.run(["sh", "-c", f'for word in {line}; do printf "%s\\n" "$word"; done'], env=env,
                         capture_output=True, text=True, check=True)
    return out.stdout.splitlines()


def test_accelerator_reads_the_accumulation_from_the_launch_environment():
    """The variable accelerate_command sets is what Accelerator uses (fresh process: Accelerator is a singleton)."""
    need("accelerate")
    code = "from accelerate import Accelerator; print(Accelerator(cpu=True).gradient_accumulation_steps)"
    env = {**os.environ, "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "3"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "3"


# --- HF, Lightning, torchrun ------------------------------------------------------------------


@pytest.mark.parametrize("plan", PLANS)
def test_training_arguments_accept_the_values_and_the_flags(plan, tmp_path):
    transformers = need("transformers", "accelerate")
    args = transformers.TrainingArguments(**hf_training_args(plan), output_dir=str(tmp_path))
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (plan.micro_batch, plan.grad_accum)
    parser = transformers.HfArgumentParser(transformers.TrainingArguments)
    (parsed,) = parser.parse_args_into_dataclasses(args=[*hf_flags(plan), "--output_dir", str(tmp_path)])
    assert (parsed.per_device_train_batch_size, parsed.gradient_accumulation_steps) == (plan.micro_batch, plan.grad_accum)


def test_training_arguments_with_the_deepspeed_file_find_no_mismatch(tmp_path):
    """HF compares every concrete DeepSpeed batch value with TrainingArguments (world size 1 here, on CPU)."""
    transformers = need("transformers", "accelerate")
    need("deepspeed")
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    plan = solve(14, 1, 1, max_micro=7)
    good, bad = tmp_path / "ds.json", tmp_path / "bad.json"
    write_deepspeed_config(plan, good)
    bad.write_text(json.dumps({**deepspeed_config(plan), "train_micro_batch_size_per_gpu": 2}))
    try:
        args = transformers.TrainingArguments(**hf_training_args(plan, good), output_dir=str(tmp_path))
        assert args.hf_deepspeed_config.mismatches == []
        args = transformers.TrainingArguments(**hf_training_args(plan, bad), output_dir=str(tmp_path))
        assert any("train_micro_batch_size_per_gpu=2" in m for m in args.hf_deepspeed_config.mismatches)
    finally:
        unset_hf_deepspeed_config()


@pytest.mark.parametrize("plan", PLANS[:2])
def test_lightning_trainer_takes_the_settings(plan):
    lightning = need("lightning")
    settings = lightning_settings(plan)
    trainer = lightning.Trainer(
        accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, **settings["trainer"],
    )
    assert trainer.accumulate_grad_batches == plan.grad_accum
    assert (trainer.num_devices, trainer.num_nodes, trainer.world_size) == (plan.gpus_per_node, plan.nodes, plan.num_processes)
    assert settings["dataloader"]["batch_size"] * trainer.accumulate_grad_batches * trainer.world_size == plan.global_batch


@pytest.mark.parametrize("plan", PLANS)
def test_torchrun_command_parses_with_torchruns_own_parser(plan):
    run = need("torch.distributed.run")
    line = torchrun_command(plan, "train.py", hf_flags(plan))
    for port in (None, "12345"):
        words = shell_words(line, NODE_RANK="0", MASTER_ADDR="10.0.0.1", MASTER_PORT=port)
        assert words[0] == "torchrun"
        args = run.get_args_parser().parse_args(words[1:])
        assert int(args.nproc_per_node) == plan.gpus_per_node
        assert args.standalone == (plan.nodes == 1)
        if plan.nodes > 1:
            assert (args.nnodes, args.node_rank, args.master_addr, int(args.master_port)) == (
                str(plan.nodes), 0, "10.0.0.1", int(port or 29500))
        assert args.training_script == "train.py" and args.training_script_args == hf_flags(plan)


def test_shell_placeholders_stay_unquoted_and_paths_are_quoted():
    plan = Plan(4, 2, gpus_per_node=8, nodes=2)
    line = torchrun_command(plan, "my train.py")
    assert "--node_rank $NODE_RANK" in line and "--master_addr $MASTER_ADDR" in line
    assert "'my train.py'" in line


def test_hf_and_accelerate_values_for_deepspeed_point_at_the_same_file():
    plan = Plan(7, 2, gpus_per_node=16)
    assert hf_training_args(plan, "ds.json")["deepspeed"] == "ds.json"
    assert accelerate_config(plan, "ds.json")["deepspeed_config"]["deepspeed_config_file"] == "ds.json"
    assert "mixed_precision" not in accelerate_config(plan, "ds.json")
    line = accelerate_command(plan, "train.py", deepspeed_config_file="ds.json")
    assert line.startswith("accelerate launch") and "--deepspeed_config_file ds.json" in line
    assert yaml.safe_load(yaml.safe_dump(accelerate_config(plan))) == accelerate_config(plan)


@pytest.mark.parametrize("name, offload, kind, stage", [
    ("ddp", None, "DDPStrategy", None), ("fsdp1", None, "FSDPStrategy", None),
    ("fsdp2", None, "ModelParallelStrategy", None), ("zero1", None, "DeepSpeedStrategy", 1),
    ("zero2", None, "DeepSpeedStrategy", 2), ("zero3", None, "DeepSpeedStrategy", 3),
    ("zero1", "optimizer", "DeepSpeedStrategy", 1), ("zero2", "optimizer", "DeepSpeedStrategy", 2),
    ("zero3", "optimizer", "DeepSpeedStrategy", 3), ("zero3", "params", "DeepSpeedStrategy", 3),
])
def test_every_strategy_is_the_lightning_strategy_that_trains_as_probed(name, offload, kind, stage):
    """Lightning's "fsdp" is FSDP1: FSDP2 (fully_shard) is its ModelParallelStrategy, every rank data parallel.
    A name resolves through Lightning's own registry (FSDP1 and DeepSpeed need a GPU for a whole Trainer)."""
    need("lightning")
    from lightning.pytorch.strategies import StrategyRegistry

    from autobatch.configs.lightning import LightningStrategy
    from autobatch.strategy import parse_strategy

    plan = solve(224, 8, 2, max_micro=7)
    setting = lightning_settings(plan, strategy=parse_strategy(name, offload))["trainer"]["strategy"]
    if kind == "DeepSpeedStrategy":
        need("deepspeed")
    built = setting.build() if isinstance(setting, LightningStrategy) else StrategyRegistry.get(setting)
    assert type(built).__name__ == kind
    if name == "fsdp1":  # with no block the probe wrapped by size; with one, that block is Lightning's unit
        class Block(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.inner = torch.nn.Linear(4, 4)

        blocked = lightning_settings(plan, strategy=parse_strategy(name, unit="Block"))["trainer"]["strategy"]
        assert repr(blocked) == "FSDPStrategy(auto_wrap_policy={Block})"
        policy = blocked.build(torch.nn.Sequential(Block(), Block())).kwargs["auto_wrap_policy"]
        assert policy._module_classes == {Block}
        with pytest.raises(AutobatchError, match="names the module classes {Block}"):
            blocked.build(torch.nn.Linear(2, 2))
        offloaded = lightning_settings(plan, strategy=parse_strategy(name, "params", unit="Block"))["trainer"]["strategy"]
        assert repr(offloaded) == "FSDPStrategy(auto_wrap_policy={Block}, cpu_offload=True)"
        assert offloaded.build(torch.nn.Sequential(Block())).cpu_offload.offload_params
        by_size = lightning_settings(plan, strategy=parse_strategy(name, "params"))["trainer"]["strategy"]
        assert StrategyRegistry.get(by_size).cpu_offload.offload_params
    if stage is not None:
        zero = built.config["zero_optimization"]
        assert zero["stage"] == stage
        assert zero.get("offload_optimizer", {}).get("device") == ("cpu" if offload else None)
        assert zero.get("offload_param", {}).get("device") == ("cpu" if offload == "params" else None)
    if name == "fsdp2":  # a whole Trainer on the CPU, where its sizes must make the world
        lightning = need("lightning")
        trainer = lightning.Trainer(accelerator="cpu", devices=plan.gpus_per_node, num_nodes=plan.nodes,
                                    strategy=built, logger=False, enable_checkpointing=False,
                                    enable_progress_bar=False, enable_model_summary=False)
        assert repr(setting) == "ModelParallelStrategy(data_parallel_size=16, tensor_parallel_size=1)"
        told = {dtype: lightning_settings(plan, strategy=parse_strategy(name, offload, unit="GPT2Block"),
                                          precision=dtype) for dtype in ("bf16", "fp16", None)}
        assert told[None]["configure_model"] == ("fully_shard(each GPT2Block, then the module, "
                                                 "mesh=self.device_mesh['data_parallel'])")
        assert told["bf16"]["trainer"]["precision"] == "bf16-mixed" and "mp_policy=MixedPrecisionPolicy(param_dtype=" \
            "torch.bfloat16, reduce_dtype=torch.bfloat16, output_dtype=torch.bfloat16)" in told["bf16"]["configure_model"]
        # ModelParallelStrategy refuses "16-mixed" (its own check): none is written, the autocast is said instead
        assert "precision" not in told["fp16"]["trainer"] and "torch.autocast('cuda', torch.float16)" in \
            told["fp16"]["configure_model"]
        with pytest.raises(ValueError, match="16-mixed"):
            need("lightning").Trainer(accelerator="cpu", devices=2, strategy=setting.build(), precision="16-mixed",
                                      logger=False)
        sizes = dict(setting.kwargs)
        assert sizes["data_parallel_size"] * sizes["tensor_parallel_size"] == trainer.world_size == plan.num_processes


@pytest.mark.parametrize("strategy", [None, "ddp", "fsdp2", "zero2", "fsdp1"])
def test_a_model_parallel_plan_groups_lightnings_ranks_or_says_no_line_does(strategy):
    """16 GPUs, model parallel 2: 8 data-parallel ranks. Lightning's ModelParallelStrategy groups them (plain
    data parallelism and FSDP2); where a strategy cannot (ZeRO, FSDP1), nor can any line, and the lines say so.
    Before, the Lightning line launched 16 data-parallel ranks: twice the planned global batch."""
    from autobatch.cli.output import plan_lines

    plan = solve(256, 8, 2, max_micro=16, model_parallel=2)
    assert (plan.micro_batch, plan.grad_accum, plan.world_size) == (16, 2, 8)
    trainer = lightning_settings(plan, strategy=strategy)["trainer"]
    grouped = strategy in (None, "ddp", "fsdp2")
    if grouped:
        assert repr(trainer["strategy"]) == "ModelParallelStrategy(data_parallel_size=8, tensor_parallel_size=2)"
        need("lightning")
        built = trainer["strategy"].build()
        assert (built._data_parallel_size, built._tensor_parallel_size) == (8, 2)
    said = [line for line in plan_lines(plan, strategy=strategy) if line.startswith("model parallel:")]
    assert len(said) == 1 and "8 of the 16 processes are data-parallel" in said[0]
    assert ("the HF, torchrun and accelerate lines" in said[0]) == grouped
    # One model per GPU: no note, and Lightning's line is as it was.
    single = solve(256, 8, 2, max_micro=16)
    assert not [line for line in plan_lines(single, strategy=strategy) if line.startswith("model parallel:")]
    assert "strategy" not in lightning_settings(single, strategy=None)["trainer"]

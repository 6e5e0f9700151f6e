"""Strategies as values, and the configs that carry them: DeepSpeed's parser and accelerate's loader read the stage."""

from __future__ import annotations

import json

import pytest

from autobatch.configs import write_plan_configs
from autobatch.configs.accelerate import accelerate_config
from autobatch.configs.deepspeed import deepspeed_config, zero_section
from autobatch.configs.hf import hf_flags, hf_training_args
from autobatch.errors import AutobatchError
from autobatch.planning.plan import Plan
from autobatch.strategy import (
    Strategy,
    parse_strategies,
    parse_strategy,
    strategy_from_accelerate,
    strategy_from_deepspeed,
)
from tests.deepspeed_parse import deepspeed_parse
from tests.extras import need

PLAN = Plan(6, 2, gpus_per_node=4)


@pytest.mark.parametrize("bad, match", [
    (lambda: parse_strategy("zero4"), "strategy must be one of ddp, fsdp2, fsdp1, zero1, zero2, zero3, but got 'zero4'"),
    (lambda: parse_strategy("fsdp2", offload="optimizer"), "use offload='params'$"),
    (lambda: parse_strategy("ddp", offload="params"), "ddp shards nothing; use zero3, fsdp2 or fsdp1 with --offload"),
    (lambda: parse_strategy("ddp", offload="optimizer"), "ddp shards nothing; use zero1, zero2 or zero3 with --offload"),
    (lambda: parse_strategy("fsdp1", offload="optimizer"), "FSDP's CPU offload .CPUOffload. moves the parameters with "
                                                           "their gradients and the optimizer step to the host, but got "
                                                           "offload='optimizer'; use offload='params'"),
    (lambda: parse_strategy("zero2", offload="params"), "offload='params' needs ZeRO-3"),
    (lambda: parse_strategy("zero3", offload="disk"), "offload must be 'optimizer' or 'params'"),
    (lambda: parse_strategy("zero3", unit="GPT2Block"), "the FSDP unit names the block FSDP wraps"),
    (lambda: parse_strategies(" , "), "strategy must name at least one"),
])
def test_bad_strategies_are_one_line_errors(bad, match):
    with pytest.raises(AutobatchError, match=match):
        bad()


def test_strategy_lists_and_spellings():
    assert [s.label for s in parse_strategies("ddp,ZeRO-3,fsdp,zero3", offload="optimizer")] == [
        "ddp", "zero3+offload-optimizer", "fsdp2"]  # FSDP2 offloads its parameters or nothing
    assert [s.label for s in parse_strategies("ddp,ZeRO-3,fsdp", offload="params")] == [
        "ddp", "zero3+offload-params", "fsdp2+offload-params"]
    # a list: each strategy that takes the offload takes it, the others are compared without it
    assert [s.label for s in parse_strategies("zero2,fsdp2,fsdp1", offload="params")] == [
        "zero2", "fsdp2+offload-params", "fsdp1+offload-params"]
    assert [s.label for s in parse_strategies("zero1,zero3", offload="params")] == ["zero1", "zero3+offload-params"]
    with pytest.raises(AutobatchError, match=r"^offload='params' applies to none of ddp, zero2; add zero3, fsdp2 or "
                                             r"fsdp1 to the strategies, or drop offload$"):
        parse_strategies("ddp,zero2", offload="params")
    assert (Strategy("zero2").shards_gradients, Strategy("zero2").shards_parameters) == (True, False)


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "zero3", "zero3+optimizer", "zero3+params"])
def test_deepspeed_file_carries_the_stage_and_deepspeeds_parser_reads_it(strategy, tmp_path):
    name, _, offload = strategy.partition("+")
    chosen = parse_strategy(name, offload=offload or None)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 1, "overlap_comm": True}, "gradient_clipping": 1.0}))
    write_plan_configs(PLAN, deepspeed=path, strategy=chosen, probed_zero={"reduce_bucket_size": 4096})
    written = json.loads(path.read_text())
    assert written["gradient_clipping"] == 1.0 and written["zero_optimization"]["overlap_comm"] is True
    assert written["zero_optimization"]["reduce_bucket_size"] == 4096
    parsed = deepspeed_parse(str(path), world_size=PLAN.world_size)
    assert parsed.zero_optimization_stage == (chosen.zero_stage or 0)
    assert parsed.train_micro_batch_size_per_gpu == 6 and parsed.gradient_accumulation_steps == 2
    assert (parsed.zero_config.offload_optimizer is not None) == (chosen.offload is not None)
    assert strategy_from_deepspeed(written) == chosen


@pytest.mark.parametrize("strategy", ["fsdp2", "fsdp2+params", "fsdp1", "fsdp1+params", "zero2", "zero3+optimizer"])
def test_accelerate_loader_reads_the_strategy(strategy, tmp_path):
    config_args = need("accelerate.commands.config.config_args")
    name, _, offload = strategy.partition("+")
    chosen = parse_strategy(name, offload=offload or None, unit="GPT2Block" if name.startswith("fsdp") else None)
    yaml_path = tmp_path / "accelerate.yaml"
    write_plan_configs(PLAN, accelerate=yaml_path, strategy=chosen)
    loaded = config_args.load_config_from_file(str(yaml_path))
    if chosen.is_fsdp:
        assert loaded.distributed_type.value == "FSDP"
        assert loaded.fsdp_config["fsdp_version"] == (2 if name == "fsdp2" else 1)
        assert loaded.fsdp_config["fsdp_transformer_layer_cls_to_wrap"] == "GPT2Block"
        assert loaded.fsdp_config["fsdp_offload_params"] is (offload == "params")
        if offload:  # accelerate's own plugin, from the environment its launcher sets from the file
            from accelerate.utils import FullyShardedDataParallelPlugin
            from torch.distributed.fsdp import CPUOffloadPolicy

            from torch.distributed.fsdp import CPUOffload

            version = 2 if name == "fsdp2" else 1
            env = {"ACCELERATE_USE_FSDP": "true", "FSDP_OFFLOAD_PARAMS": "true", "FSDP_VERSION": str(version)}
            with pytest.MonkeyPatch.context() as patch:
                for key, value in env.items():
                    patch.setenv(key, value)
                offload = FullyShardedDataParallelPlugin().cpu_offload
                assert isinstance(offload, CPUOffloadPolicy) if version == 2 else offload.offload_params
    else:
        assert loaded.distributed_type.value == "DEEPSPEED"
        assert loaded.deepspeed_config["zero_stage"] == chosen.zero_stage
        assert loaded.deepspeed_config["gradient_accumulation_steps"] == PLAN.grad_accum
    assert strategy_from_accelerate(accelerate_config(PLAN, strategy=chosen)) == chosen
    assert f"probed under strategy {chosen.label}" in yaml_path.read_text()


def test_accelerate_with_a_deepspeed_file_reads_the_stage_from_the_file(tmp_path):
    config = accelerate_config(PLAN, "ds.json", strategy=Strategy("zero3"))
    assert "zero_stage" not in config["deepspeed_config"]  # accelerate refuses it next to the file
    assert strategy_from_accelerate(config, deepspeed=deepspeed_config(PLAN, strategy=Strategy("zero3"))).name == "zero3"


def test_hf_arguments_carry_fsdp_or_deepspeed():
    transformers = need("transformers")
    fsdp = hf_training_args(PLAN, strategy=Strategy("fsdp2", unit="GPT2Block"))
    # transformers' current form: fsdp=True, the sharding in fsdp_config ("full_shard auto_wrap" is deprecated)
    assert fsdp["fsdp"] is True
    assert fsdp["fsdp_config"] == {"version": 2, "transformer_layer_cls_to_wrap": ["GPT2Block"], "reshard_after_forward": True}
    fsdp1 = hf_training_args(PLAN, strategy=Strategy("fsdp1"))["fsdp_config"]
    assert fsdp1 == {"version": 1, "min_num_params": 10**8, "reshard_after_forward": "full_shard"}  # no block: by size
    zero = hf_training_args(PLAN, strategy=Strategy("zero3"))
    assert zero["deepspeed"]["zero_optimization"] == {"stage": 3}
    assert "--fsdp_config" in hf_flags(PLAN, strategy=Strategy("fsdp2"))
    # Trainer's own argument parser accepts the FSDP values (it builds accelerate's plugin from them)
    parser = transformers.HfArgumentParser(transformers.TrainingArguments)
    (args,) = parser.parse_dict({"output_dir": "out", "use_cpu": True, **fsdp}, allow_extra_keys=False)
    assert args.fsdp is True and args.fsdp_config["version"] == 2
    assert args.fsdp_config["transformer_layer_cls_to_wrap"] == ["GPT2Block"]
    flags = hf_flags(PLAN, strategy=Strategy("fsdp2", unit="GPT2Block"))
    (parsed,) = parser.parse_args_into_dataclasses(["--output_dir", "out", "--use_cpu", *flags])
    assert parsed.fsdp is True and parsed.fsdp_config["transformer_layer_cls_to_wrap"] == ["GPT2Block"]
    assert "cpu_offload" not in parsed.fsdp_plugin_args
    flags = hf_flags(PLAN, strategy=Strategy("fsdp2", offload="params", unit="GPT2Block"))
    (parsed,) = parser.parse_args_into_dataclasses(["--output_dir", "out", "--use_cpu", *flags])
    assert parsed.fsdp_plugin_args["cpu_offload"] is True  # accelerate's plugin makes it a CPUOffloadPolicy


def test_a_deepspeed_file_cannot_carry_fsdp():
    with pytest.raises(AutobatchError, match="the plan is for fsdp2"):
        zero_section(Strategy("fsdp2"))


def test_importing_deepspeed_for_a_probe_prints_nothing_on_stdout() -> None:
    """`find --json` keeps stdout for its one object: DeepSpeed's import-time log goes to stderr."""
    import subprocess
    import sys

    need("deepspeed")
    code = ("import logging, sys; from autobatch.distributed.zero import _deepspeed; _deepspeed(); "
            "h = [h for h in logging.getLogger('DeepSpeed').handlers if hasattr(h, 'stream')]; "
            "print(all(x.stream is sys.stdout for x in h), file=sys.stderr)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout == ""
    assert "Setting accelerator" not in done.stderr  # the CPU fallback is on purpose here: not said at all
    assert done.stderr.strip().endswith("True")  # and its handler writes to stdout again afterwards


def test_fsdp_units_are_blocks_or_by_size_as_users_wrap():
    import torch

    from autobatch.distributed.sharding import fsdp_units

    mlp = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    assert fsdp_units(mlp) == []  # a plain MLP: no blocks, under 10**8 parameters: the root alone
    model = torch.nn.Module()
    model.emb, model.head = torch.nn.Embedding(4, 8), torch.nn.Linear(8, 2)
    model.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()) for _ in range(3))
    assert fsdp_units(model) == list(model.blocks)  # the repeated blocks, not the embedding or the head
    with torch.device("meta"):  # by size: a layer of 10**8 parameters is a unit of its own
        big = torch.nn.Sequential(torch.nn.Linear(10_000, 10_000), torch.nn.Linear(10, 2))
    assert fsdp_units(big) == [big[0]]


@pytest.mark.parametrize("name", ["ddp", "fsdp1", "fsdp2", "zero1", "zero3"])
def test_every_config_writer_takes_a_strategys_name_as_find_does(name, tmp_path):
    from autobatch.configs import accelerate_config, deepspeed_config, hf_flags, lightning_settings
    from autobatch.configs.bundle import write_plan_configs

    strategy = parse_strategy(name)
    assert accelerate_config(PLAN, strategy=name) == accelerate_config(PLAN, strategy=strategy)
    assert hf_training_args(PLAN, strategy=name) == hf_training_args(PLAN, strategy=strategy)
    assert hf_flags(PLAN, strategy=name) == hf_flags(PLAN, strategy=strategy)
    assert repr(lightning_settings(PLAN, strategy=name)) == repr(lightning_settings(PLAN, strategy=strategy))
    if strategy.is_deepspeed:
        assert deepspeed_config(PLAN, strategy=name) == deepspeed_config(PLAN, strategy=strategy)
        assert zero_section(name) == zero_section(strategy)
    written = write_plan_configs(PLAN, accelerate=tmp_path / "a.yaml", strategy=name)
    assert f"probed under strategy {strategy.label}" in (tmp_path / "a.yaml").read_text() and written

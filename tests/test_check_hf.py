"""``check --hf``: the HF TrainingArguments find and solve write, read back as the Trainer reads them.

check read DeepSpeed files and accelerate configs, but not the third file ``find --hf`` writes.
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from autobatch import check_setup
from autobatch.cli import app

STRATEGIES = ["ddp", "fsdp1", "fsdp2", "zero1", "zero2", "zero3"]


def invoke(*args: str):
    return CliRunner().invoke(app, list(args))


def codes(result) -> list[str]:
    return [p.code for p in result.problems]


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("with_file", [False, True])
def test_the_hf_arguments_solve_writes_pass_check_under_their_strategy_and_fail_under_another(strategy, with_file,
                                                                                              tmp_path):
    args = tmp_path / "args.json"
    files = ["--hf", str(args)] + (["--deepspeed", str(tmp_path / "ds.json")] if with_file and "zero" in strategy else [])
    solved = invoke("solve", "--target", "256", "--gpus", "8", "--max-micro", "16", "--strategy", strategy, *files)
    assert solved.exit_code == 0, solved.output
    same = invoke("check", "--hf", str(args), "--gpus", "8", "--strategy", strategy, "--target", "256", "--json")
    assert same.exit_code == 0, same.output
    data = json.loads(same.stdout)
    assert (data["micro_batch"], data["grad_accum"]) == (16, 2)
    other = {"ddp": "zero3", "fsdp1": "ddp", "fsdp2": "ddp", "zero1": "zero3", "zero2": "zero3", "zero3": "ddp"}[strategy]
    wrong = invoke("check", "--hf", str(args), "--gpus", "8", "--strategy", other, "--json")
    if strategy == "ddp":  # the Trainer's arguments alone do not say DDP: plain data parallelism is what is left
        assert wrong.exit_code == 0 and "do not say how training shards" in " ".join(json.loads(wrong.stdout)["notes"])
    else:
        assert wrong.exit_code == 1 and [p["code"] for p in json.loads(wrong.stdout)["problems"]] == ["strategy-mismatch"]


def test_the_batch_comes_from_the_arguments_with_the_trainers_defaults_and_must_agree_with_the_flags():
    taken = check_setup(gpus_per_node=4, hf={"per_device_train_batch_size": 6})
    assert taken.ok and (taken.micro_batch, taken.grad_accum, taken.global_batch) == (6, 1, 24)
    assert any("gradient_accumulation_steps=1 from the HF TrainingArguments (the Trainer's default" in n
               for n in taken.notes)
    assert check_setup(gpus_per_node=4, hf={}).micro_batch == 8  # TrainingArguments' own default
    wrong = check_setup(gpus_per_node=4, micro_batch=4, grad_accum=2, hf={"per_device_train_batch_size": 6,
                                                                          "gradient_accumulation_steps": 2})
    assert codes(wrong) == ["hf-mismatch"] and "per_device_train_batch_size=6 but 4 given" in wrong.problems[0].message


@pytest.mark.parametrize("args, said", [
    ({"fp16": True, "bf16": True}, "At most one of fp16 and bf16 can be True, but not both"),
    ({"fsdp": "full_shard auto_wrap", "deepspeed": {"zero_optimization": {"stage": 2}}},
     "Using --fsdp xxx together with --deepspeed is not possible"),
    ({"fsdp": True, "deepspeed": "ds.json"}, "Using --fsdp xxx together with --deepspeed is not possible"),
])
def test_what_the_trainer_refuses_at_start_up(args, said):
    result = check_setup(gpus_per_node=2, hf={"per_device_train_batch_size": 4, **args})
    assert "hf-refuses" in codes(result) and any(said in p.message for p in result.problems), result.problems


def test_the_deepspeed_config_the_arguments_name_is_checked_inline_or_as_a_file(tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3,
                              "zero_optimization": {"stage": 3}}))
    named = check_setup(gpus_per_node=2, hf={"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2,
                                             "deepspeed": str(ds)}, probed_strategy="zero2")
    assert sorted(codes(named)) == ["deepspeed-mismatch", "strategy-mismatch"], named.problems
    assert any(f"checked the DeepSpeed config {ds} named in" in n for n in named.notes)
    inline = check_setup(gpus_per_node=2, hf={"per_device_train_batch_size": 4, "deepspeed": {
        "train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 2}}}, probed_strategy="zero2")
    assert inline.ok, inline.problems
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2}}))
    apart = check_setup(gpus_per_node=2, deepspeed=str(other), hf={"per_device_train_batch_size": 4,
                                                                   "deepspeed": str(ds)})
    assert "hf-mismatch" in codes(apart) and f"names {ds}" in apart.problems[0].message


@pytest.mark.parametrize("args, probed, said", [
    ({"fsdp": "shard_grad_op auto_wrap"}, "fsdp1", "fsdp: 'shard_grad_op auto_wrap' (SHARD_GRAD_OP)"),
    ({"fsdp": True, "fsdp_config": {"version": 2, "reshard_after_forward": False}}, "fsdp2",
     "fsdp_config.reshard_after_forward: false (SHARD_GRAD_OP)"),
    ({"fsdp": True, "fsdp_config": {"version": 1, "reshard_after_forward": "no_shard"}}, "fsdp1",
     "fsdp_config.reshard_after_forward: no_shard (NO_SHARD)"),
])
def test_fsdp_in_the_arguments_that_does_not_shard_fully_is_a_mismatch(args, probed, said):
    result = check_setup(gpus_per_node=2, hf={"per_device_train_batch_size": 4, **args}, probed_strategy=probed)
    [problem] = result.problems
    assert problem.code == "strategy-mismatch" and said in problem.message, problem.message


@pytest.mark.parametrize("args, code, said", [
    ({"bogus_key": 1, "per_gpu_train_batch_size": 4}, "hf-refuses", "has 'bogus_key', 'per_gpu_train_batch_size'"),
    ({"fsdp": "nonsense"}, "hf-refuses", "Unknown `fsdp` option: nonsense"),
    # the Trainer stops where a DeepSpeed value it fills from its arguments is set otherwise
    ({"bf16": True, "deepspeed": {"fp16": {"enabled": True}, "zero_optimization": {"stage": 2}}}, "hf-mismatch",
     "sets it true and the HF TrainingArguments has fp16=false"),
    ({"deepspeed": {"bf16": {"enabled": True}, "zero_optimization": {"stage": 2}}}, "hf-mismatch",
     "bf16.enabled from its arguments"),
])
def test_the_trainer_refuses_what_check_now_refuses(args, code, said):
    result = check_setup(gpus_per_node=2, hf={"per_device_train_batch_size": 4, **args})
    assert code in codes(result) and any(said in p.message for p in result.problems), result.problems


def test_a_deepspeed_value_left_to_the_trainer_or_set_alike_passes():
    for ds in ({"bf16": {"enabled": "auto"}}, {"bf16": {"enabled": True}}):
        result = check_setup(gpus_per_node=2, hf={"per_device_train_batch_size": 4, "bf16": True, "deepspeed": {
            **ds, "train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 2}}})
        assert result.ok, result.problems


def test_the_arguments_and_the_other_configs_shard_one_way(tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 1}}))
    fsdp = {"per_device_train_batch_size": 4, "fsdp": True, "fsdp_config": {"version": 2}}
    unused = check_setup(gpus_per_node=2, deepspeed=str(ds), hf=fsdp)
    assert "hf-mismatch" in codes(unused) and any("goes unused" in p.message for p in unused.problems)
    plain = check_setup(gpus_per_node=2, deepspeed=str(ds), hf={"per_device_train_batch_size": 4})
    assert any("names none (it trains with neither FSDP nor DeepSpeed)" in p.message for p in plain.problems)
    acc = {"distributed_type": "DEEPSPEED", "num_processes": 2, "deepspeed_config": {"zero_stage": 1}}
    crossed = check_setup(hf=fsdp, accelerate=acc)
    assert any("trains with FSDP and the accelerate config with DeepSpeed" in p.message for p in crossed.problems)
    # arguments that name neither train with accelerate's plugin, as the Trainer does under accelerate launch
    assert check_setup(hf={"per_device_train_batch_size": 4}, accelerate=acc).ok


def test_fsdp_without_a_version_is_read_as_the_installed_transformers_reads_it():
    from tests.extras import need

    need("transformers")
    import transformers

    default = "fsdp2" if int(transformers.__version__.split(".")[0]) >= 5 else "fsdp1"
    for fsdp in ("full_shard auto_wrap", True):
        assert check_setup(gpus_per_node=2, hf={"fsdp": fsdp}, probed_strategy=default).ok


@pytest.mark.parametrize("strategy, offload", [("zero1", "optimizer"), ("zero2", "optimizer"), ("zero3", "optimizer"),
                                               ("zero3", "params"), ("fsdp1", "params"), ("fsdp2", "params")])
def test_every_file_solve_writes_with_offload_passes_check_with_it(strategy, offload, tmp_path):
    # the files of `solve --offload` failed every check: check took no --offload, and the label it printed
    # (zero2+offload-optimizer) was refused as a --strategy
    files = {"--hf": tmp_path / "args.json", "--accelerate": tmp_path / "acc.yaml"}
    if "zero" in strategy:
        files["--deepspeed"] = tmp_path / "ds.json"
    flags = [part for flag, path in files.items() for part in (flag, str(path))]
    topology = ["--target", "96", "--gpus", "4", "--nodes", "2"]
    solved = invoke("solve", *topology, "--max-micro", "5", "--strategy", strategy, "--offload", offload, *flags)
    assert solved.exit_code == 0, solved.output
    for flag, path in files.items():
        for said in (["--strategy", strategy, "--offload", offload], ["--strategy", f"{strategy}+offload-{offload}"]):
            same = invoke("check", *topology, *said, flag, str(path), "--json")
            assert same.exit_code == 0, (flag, said, same.output)
        # probed without the offload, the file keeps less on each GPU: it fits, which a note says
        less = invoke("check", *topology, "--strategy", strategy, flag, str(path), "--json")
        assert less.exit_code == 0, (flag, less.output)
        assert any("keeps less state on each GPU" in n for n in json.loads(less.stdout)["notes"]), flag
    lone = invoke("check", "--offload", "optimizer", "--target", "96")
    assert lone.exit_code == 2 and "--offload on check says how the micro batch was probed, with --strategy" in lone.stderr

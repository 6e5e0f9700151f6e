"""check_setup: every problem at once, each with its rule, values and fix; field reports as named tests."""

from __future__ import annotations

import json

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from autobatch.checking.problems import CheckResult, Problem
from autobatch.checking.setup import check_setup
from autobatch.configs import accelerate_config, deepspeed_config
from autobatch.errors import ConfigError
from autobatch.planning.plan import Plan
from autobatch.planning.solver import solve
from autobatch.strategy import Strategy
from tests.deepspeed_parse import deepspeed_parse
from tests.tiny import cnn, mlp
from tests.extras import need


def codes(result: CheckResult) -> list[str]:
    return [p.code for p in result.problems]


def write_json(path, data):
    path.write_text(json.dumps(data))
    return path


# --- field reports --------------------------------------------------------------------------


def test_field_report_5_the_224_on_16_gpus_setup_passes_and_resolves_to_the_plan():
    result = check_setup(target=224, micro_batch=7, grad_accum=2, gpus_per_node=16, nodes=1)
    assert result.ok and result.problems == ()
    assert result.plan == Plan(7, 2, gpus_per_node=16)
    assert result.report() == "OK: 7 per GPU × 2 accumulation × 16 GPUs (16 per node × 1 node) = 224"


def test_field_report_1_per_device_batch_below_one_is_reported_with_the_numbers():
    result = check_setup(target=8, grad_accum=4, gpus_per_node=4)
    assert codes(result) == ["per-device-batch"]
    problem = result.problems[0]
    assert "8 / (4 × 4) = 0.5" in problem.message and "divide by zero" in problem.message
    assert problem.values["per_device"] == 0.5
    assert "2 × 1" in problem.fix


def test_field_report_1_fractional_per_device_batch_lists_the_valid_pairs():
    result = check_setup(target=224, grad_accum=3, gpus_per_node=16)
    assert codes(result) == ["per-device-batch"]
    assert "224 / (16 × 3) = 4.667" in result.problems[0].message
    assert result.problems[0].fix.endswith("14 × 1, 7 × 2, 2 × 7, 1 × 14")


def test_field_report_3_deepspeed_file_disagreeing_with_the_flags(tmp_path):
    ds = write_json(tmp_path / "ds.json", {
        "train_batch_size": 256, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2,
        "zero_optimization": {"stage": 2},
    })
    result = check_setup(target=224, micro_batch=7, grad_accum=2, gpus_per_node=8, nodes=2, deepspeed=ds)
    assert codes(result) == ["deepspeed-mismatch"]  # the file is consistent in itself, just not with the flags
    message = result.problems[0].message
    assert "train_batch_size=256 but 224 given" in message
    assert "train_micro_batch_size_per_gpu=8 but 7 given" in message
    assert "gradient_accumulation_steps" not in message  # 2 == 2: only real differences are listed


def test_field_report_3_implied_values_are_compared_too():
    ds = {"train_micro_batch_size_per_gpu": 8, "zero_optimization": {}}
    result = check_setup(target=224, grad_accum=2, gpus_per_node=16, deepspeed=ds)
    assert "deepspeed-mismatch" in codes(result)
    assert "train_micro_batch_size_per_gpu=8 but 7 implied by the arguments" in str(result)


def test_arguments_that_leave_numbers_open_take_them_from_the_deepspeed_file():
    ds = {"train_micro_batch_size_per_gpu": 16, "gradient_accumulation_steps": 2, "zero_optimization": {}}
    result = check_setup(target=512, gpus_per_node=16, deepspeed=ds)
    assert result.ok and (result.global_batch, result.micro_batch, result.grad_accum) == (512, 16, 2)
    assert "took train_micro_batch_size_per_gpu=16 from the DeepSpeed config" in result.notes
    wrong = check_setup(target=500, gpus_per_node=16, deepspeed=ds)
    assert codes(wrong) == ["batch-identity"]
    assert "500 != 16 × 2 × 16 = 512" in wrong.problems[0].message


def test_field_report_4_batchnorm_model_with_one_sample_per_gpu():
    result = check_setup(target=224, micro_batch=1, grad_accum=14, gpus_per_node=16, model=cnn())
    assert codes(result) == ["batchnorm"]
    problem = result.problems[0]
    assert "Expected more than 1 value per channel" in problem.message
    assert "1 × 14" not in problem.fix and "7 × 2" in problem.fix
    # the same setup without BatchNorm is fine
    assert check_setup(target=224, micro_batch=1, grad_accum=14, gpus_per_node=16, model=mlp()).ok


def test_field_report_4_total_not_divisible_by_the_gpu_count():
    result = check_setup(target=10, gpus_per_node=4, batchnorm=True)
    assert codes(result) == ["not-divisible"]
    problem = result.problems[0]
    assert "target=10 over world_size=4 is 2.5 per GPU" in problem.message
    assert "BatchNorm" in problem.message
    assert "8 or 12" in problem.fix


def test_field_report_4_batchnorm_micro_batch_derived_from_deepspeed():
    result = check_setup(gpus_per_node=16, deepspeed={"train_batch_size": 16, "zero_optimization": {}}, batchnorm=True)
    assert codes(result) == ["batchnorm"]
    assert result.micro_batch == 1


# --- DeepSpeed semantics ------------------------------------------------------------------


def test_deepspeed_floor_with_only_train_batch_size_is_caught():
    result = check_setup(gpus_per_node=3, deepspeed={"train_batch_size": 224, "zero_optimization": {}})
    assert codes(result) == ["deepspeed-assertion"]
    message = result.problems[0].message
    assert "224 != 74 × 1 × 3 = 222" in message and "224 // 3 = 74" in message
    assert "222 or 225" in result.problems[0].fix


def test_deepspeed_floor_of_accumulation_is_caught():
    ds = {"train_batch_size": 225, "train_micro_batch_size_per_gpu": 7, "zero_optimization": {}}
    result = check_setup(gpus_per_node=16, deepspeed=ds)
    assert codes(result) == ["deepspeed-assertion"]
    assert "gradient_accumulation_steps = 225 // 7 // 16 = 2" in result.problems[0].message


def test_deepspeed_micro_batch_flooring_to_zero_is_caught():
    ds = {"train_batch_size": 8, "gradient_accumulation_steps": 1, "zero_optimization": {}}
    result = check_setup(gpus_per_node=16, deepspeed=ds)
    assert codes(result) == ["per-device-batch"]
    assert "train_micro_batch_size_per_gpu=0" in result.problems[0].message


@pytest.mark.parametrize(
    ("ds", "resolved"),
    [
        ({"train_batch_size": 224}, (224, 14, 1)),
        ({"train_micro_batch_size_per_gpu": 7}, (112, 7, 1)),
        ({"train_micro_batch_size_per_gpu": 7, "gradient_accumulation_steps": 2}, (224, 7, 2)),
        ({"train_batch_size": 224, "gradient_accumulation_steps": 2}, (224, 7, 2)),
        ({"train_batch_size": 224, "train_micro_batch_size_per_gpu": 7}, (224, 7, 2)),
    ],
)
def test_partial_deepspeed_configs_resolve_like_deepspeed(ds, resolved):
    result = check_setup(gpus_per_node=16, deepspeed={**ds, "zero_optimization": {}})
    assert result.ok, result.report()
    assert (result.global_batch, result.micro_batch, result.grad_accum) == resolved


@settings(max_examples=60, deadline=None)
@given(
    st.one_of(st.none(), st.integers(1, 300)),
    st.one_of(st.none(), st.integers(1, 20)),
    st.one_of(st.none(), st.integers(1, 8)),
    st.integers(1, 16),
)
def test_deepspeed_view_agrees_with_deepspeeds_own_parser(train, micro, accum, world):
    """Whatever subset of the three keys a file gives, the check fails exactly when DeepSpeed would."""
    need("deepspeed")
    ds = {k: v for k, v in zip(("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"),
                               (train, micro, accum)) if v is not None}
    ds["zero_optimization"] = {"stage": 0}
    result = check_setup(gpus_per_node=world, deepspeed=ds)
    try:
        parsed = deepspeed_parse(dict(ds), world)
    except AssertionError:
        assert not result.ok, f"DeepSpeed rejects {ds} on {world} ranks, the check did not"
        return
    assert result.ok, result.report()
    assert (result.global_batch, result.micro_batch, result.grad_accum) == (
        parsed.train_batch_size, parsed.train_micro_batch_size_per_gpu, parsed.gradient_accumulation_steps,
    )


def test_deepspeed_auto_is_filled_from_the_flags_like_hf_does():
    auto = {key: "auto" for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")}
    result = check_setup(micro_batch=7, grad_accum=2, gpus_per_node=16, deepspeed={**auto, "zero_optimization": {}})
    assert result.ok and result.global_batch == 224
    assert any("checked as 224" in note for note in result.notes)
    # with nothing to fill it from, each auto is a note (the launcher fills it), and the file as a whole
    # is not "OK": nothing about its batch was checked
    open_result = check_setup(gpus_per_node=16, deepspeed={**auto, "zero_optimization": {}})
    assert codes(open_result) == ["deepspeed-unchecked"] and open_result.global_batch is None
    assert sum("no argument gives it" in note for note in open_result.notes) == 3


def test_deepspeed_auto_mixed_with_numbers_is_checked():
    ds = {"train_batch_size": 256, "train_micro_batch_size_per_gpu": "auto", "zero_optimization": {}}
    result = check_setup(micro_batch=7, grad_accum=2, gpus_per_node=16, deepspeed=ds)
    assert codes(result) == ["deepspeed-mismatch", "deepspeed-assertion"]
    assert "256 != 7 × 2 × 16 = 224" in result.problems[1].message


def test_deepspeed_invalid_values_and_missing_keys():
    result = check_setup(gpus_per_node=2, deepspeed={"train_batch_size": 0, "gradient_accumulation_steps": "2"})
    assert codes(result) == ["invalid-value", "invalid-value"]
    assert "train_batch_size must be a positive integer, but got train_batch_size=0 in the DeepSpeed config" in str(result)
    neither = check_setup(gpus_per_node=2, deepspeed={"gradient_accumulation_steps": 2})
    assert codes(neither) == ["deepspeed-assertion"]
    assert "needs train_batch_size or train_micro_batch_size_per_gpu" in str(neither)


def test_missing_zero_section_is_a_note_for_plain_deepspeed():
    result = check_setup(micro_batch=4, gpus_per_node=2, deepspeed={"train_micro_batch_size_per_gpu": 4})
    assert result.ok
    assert any("no zero_optimization section" in note for note in result.notes)


# --- accelerate ----------------------------------------------------------------------------


def write_yaml(path, data):
    path.write_text(yaml.safe_dump(data))
    return path


def test_accelerate_topology_is_used_and_compared(tmp_path):
    acc = write_yaml(tmp_path / "acc.yaml", {"distributed_type": "MULTI_GPU", "num_processes": 16, "num_machines": 2})
    result = check_setup(target=256, micro_batch=8, grad_accum=2, accelerate=acc)
    assert result.ok and (result.gpus_per_node, result.nodes, result.world_size) == (8, 2, 16)
    mismatch = check_setup(target=256, micro_batch=8, grad_accum=2, gpus_per_node=16, nodes=1, accelerate=acc)
    assert codes(mismatch)[:2] == ["accelerate-mismatch", "accelerate-mismatch"]
    assert "gives 8 GPUs per node" in mismatch.problems[0].message


def test_accelerate_processes_must_split_over_machines():
    result = check_setup(micro_batch=2, accelerate={"distributed_type": "MULTI_GPU", "num_processes": 6, "num_machines": 4})
    assert "accelerate-topology" in codes(result)


def test_accelerate_points_at_a_deepspeed_file_that_is_then_checked(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_json(tmp_path / "ds.json", {"train_batch_size": 224, "train_micro_batch_size_per_gpu": 8})
    acc = write_yaml(tmp_path / "acc.yaml", {
        "distributed_type": "DEEPSPEED", "num_processes": 16, "num_machines": 1,
        "deepspeed_config": {"deepspeed_config_file": "ds.json", "gradient_accumulation_steps": 4},
    })
    result = check_setup(accelerate=acc)
    assert any("checked the DeepSpeed config ds.json named in" in note for note in result.notes)
    assert set(codes(result)) == {"accelerate-refuses", "deepspeed-assertion", "accelerate-mismatch"}
    assert "224 != 8 × 1 × 16 = 128" in str(result)  # DeepSpeed derives accumulation 224 // 8 // 16 = 1
    # a different DeepSpeed file on the command line than the one accelerate names
    other = write_json(tmp_path / "other.json", {"train_batch_size": 224, "zero_optimization": {}})
    assert "names ds.json and the DeepSpeed file given is" in str(check_setup(accelerate=acc, deepspeed=other))


def test_accelerate_refusals_match_accelerate_itself(tmp_path, monkeypatch):
    """The check's rule for fields next to deepspeed_config_file is the one accelerate enforces."""
    launch = need("accelerate.commands.launch")
    utils = need("accelerate.utils")
    if not hasattr(launch, "_validate_launch_command"):
        pytest.skip("this accelerate version has no _validate_launch_command")
    plan = solve(224, 16, 1, max_micro=9)
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps(deepspeed_config(plan)))
    acc = write_yaml(tmp_path / "acc.yaml", {**accelerate_config(plan, ds), "mixed_precision": "bf16"})

    assert [p.code for p in check_setup(accelerate=acc).problems] == ["accelerate-refuses"]
    args, defaults, mp_from_config = launch._validate_launch_command(
        launch.launch_command_parser().parse_args(["--config_file", str(acc), "train.py"])
    )
    fields = list(defaults.deepspeed_config) + (["mixed_precision"] if mp_from_config else [])
    monkeypatch.setenv("ACCELERATE_CONFIG_DS_FIELDS", ",".join(fields))
    with pytest.raises(ValueError, match="will be ignored"):
        utils.DeepSpeedPlugin(hf_ds_config=str(ds))


def test_accelerate_needs_a_zero_section_in_the_deepspeed_file(tmp_path):
    ds = write_json(tmp_path / "ds.json", {"train_batch_size": 224})
    acc = {"distributed_type": "DEEPSPEED", "num_processes": 16, "deepspeed_config": {"deepspeed_config_file": str(ds)}}
    result = check_setup(accelerate=acc)
    assert codes(result) == ["accelerate-refuses"]
    assert "zero_optimization" in result.problems[0].message


# --- collecting everything, files, results ------------------------------------------------


def test_every_problem_is_reported_together(tmp_path):
    bad_yaml = tmp_path / "acc.yaml"
    bad_yaml.write_text("num_processes: [16,\n")
    result = check_setup(
        target=0, micro_batch=-1, grad_accum=2.5, gpus_per_node=0,
        deepspeed=tmp_path / "missing.json", accelerate=bad_yaml,
    )
    assert codes(result) == ["invalid-value"] * 4 + ["unreadable-file"] * 2
    for problem in result.problems:
        assert "\n" not in str(problem) and ". Fix: " in str(problem)
    assert "missing.json' was not found" in str(result) and "failed to parse" in str(result)
    with pytest.raises(ConfigError) as info:
        result.raise_for_problems()
    assert len(info.value.problems) == 6


def test_several_independent_problems_in_one_setup(tmp_path):
    ds = write_json(tmp_path / "ds.json", {"train_batch_size": 100, "train_micro_batch_size_per_gpu": 1,
                                           "gradient_accumulation_steps": 1, "zero_optimization": {}})
    result = check_setup(target=224, micro_batch=7, grad_accum=3, gpus_per_node=16, deepspeed=ds, batchnorm=True)
    assert codes(result) == ["batch-identity", "deepspeed-mismatch", "deepspeed-assertion", "batchnorm"]
    assert "micro batch is 1 in " in result.problems[-1].message  # DeepSpeed would use the file's 1 per GPU


def test_model_parallel_must_divide_the_gpus():
    result = check_setup(target=224, gpus_per_node=6, model_parallel=4)
    assert codes(result) == ["model-parallel"]
    ok = check_setup(target=224, micro_batch=7, grad_accum=4, gpus_per_node=8, nodes=2, model_parallel=2)
    assert ok.ok and ok.world_size == 8


def test_nothing_to_check_is_a_problem():
    result = check_setup(grad_accum=2)
    assert codes(result) == ["missing-batch"]
    assert any("assumed 1 GPU per node" in note for note in result.notes)


def test_result_to_dict_is_json_ready():
    result = check_setup(target=224, micro_batch=7, grad_accum=3, gpus_per_node=16)
    data = json.loads(json.dumps(result.to_dict()))
    assert data["ok"] is False and data["problems"][0]["code"] == "batch-identity"
    assert set(data["problems"][0]) == {"code", "message", "fix", "values"}
    assert data["problems"][0]["values"] == {"target": 224, "micro_batch": 7, "grad_accum": 3, "world_size": 16}
    good = check_setup(target=224, micro_batch=7, grad_accum=2, gpus_per_node=16).to_dict()
    assert good["ok"] and good["arithmetic"].endswith("= 224")


def test_problem_str_joins_rule_and_fix():
    assert str(Problem("x", "the rule", "the fix")) == "the rule. Fix: the fix"


def test_a_zero_stage_deepspeed_refuses_is_a_problem(tmp_path):
    from autobatch import check_setup

    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_batch_size": 16, "zero_optimization": {"stage": 7}}))
    result = check_setup(deepspeed=ds)
    assert [p.code for p in result.problems] == ["deepspeed-zero-stage"] and "got 7" in result.problems[0].message
    try:  # DeepSpeed's own config agrees: stage 7 does not load
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    except ImportError:
        return
    with pytest.raises(ValueError):
        DeepSpeedZeroConfig(stage=7)
    for stage in (0, 1, 2, 3):
        ds.write_text(json.dumps({"train_batch_size": 16, "zero_optimization": {"stage": stage}}))
        assert check_setup(deepspeed=ds).ok and DeepSpeedZeroConfig(stage=stage).stage == stage


def test_a_file_that_leaves_every_batch_key_to_the_launcher_is_not_ok_without_numbers(tmp_path):
    from autobatch import check_setup

    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({key: "auto" for key in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                                      "gradient_accumulation_steps")}))
    result = check_setup(deepspeed=ds)
    assert [p.code for p in result.problems] == ["deepspeed-unchecked"]
    assert check_setup(deepspeed=ds, micro_batch=4, grad_accum=2, gpus_per_node=2).ok  # the numbers fill them


def test_a_deepspeed_file_written_for_16_gpus_says_so_when_checked_without_the_count(tmp_path):
    from autobatch import check_setup, deepspeed_config, solve

    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps(deepspeed_config(solve(224, gpus_per_node=16, max_micro=9))))
    result = check_setup(deepspeed=ds)
    assert [p.code for p in result.problems] == ["deepspeed-assertion"]
    assert result.problems[0].fix.startswith("the file holds together on 16 data-parallel ranks: if that is the job, "
                                             "pass the GPUs (--gpus 16")
    assert "on 1 GPU use" in result.problems[0].fix
    assert check_setup(deepspeed=ds, gpus_per_node=16).ok


def test_configs_solve_wrote_for_model_parallelism_say_which_degree_when_checked_without_it(tmp_path):
    from typer.testing import CliRunner

    from autobatch.cli import app

    ds, acc = tmp_path / "mp.json", tmp_path / "mp.yaml"
    CliRunner().invoke(app, ["solve", "--target", "96", "--gpus", "4", "--nodes", "3", "--model-parallel", "2",
                             "--max-micro", "5", "--deepspeed", str(ds), "--accelerate", str(acc)])
    result = check_setup(accelerate=acc)
    assert "pass --model-parallel 2" in result.problems[0].fix
    assert check_setup(accelerate=acc, model_parallel=2).ok


def _suggested(fix: str) -> tuple[list[int], list[int]]:
    """The global batches and world sizes a fix proposes."""
    import re

    batches = re.search(r"use a global batch of (\d+)(?: or (\d+))?", fix)
    worlds = re.search(r"on a world size of ([\d, ]+)", fix)
    return ([int(b) for b in batches.groups() if b] if batches else [],
            [int(w) for w in worlds.group(1).split(",") if w.strip()] if worlds else [])


@pytest.mark.parametrize("micro", [4, 8, "auto", None])
@pytest.mark.parametrize("accum", [3, "auto", None])
def test_every_global_batch_and_world_size_a_deepspeed_fix_proposes_passes_the_check(micro, accum):
    # `check --deepspeed` proposed 63 or 66 for micro 4 on 3 GPUs, where the file's micro batch needs a multiple of 12
    tried = 0
    for target in (64, 96, 100, 256):  # 96: micro 4 × accumulation 4 or 3 divides it
        for gpus in (3, 5, 6):
            ds = {k: v for k, v in (("train_batch_size", target), ("train_micro_batch_size_per_gpu", micro),
                                    ("gradient_accumulation_steps", accum)) if v is not None}
            result = check_setup(gpus_per_node=gpus, deepspeed=ds)
            for problem in result.problems:
                if problem.code not in ("deepspeed-assertion", "deepspeed-auto"):
                    continue
                batches, worlds = _suggested(problem.fix)
                assert batches, problem.fix
                for batch in batches:
                    again = check_setup(gpus_per_node=gpus, deepspeed={**ds, "train_batch_size": batch})
                    assert problem.code not in codes(again), (ds, gpus, problem.fix, again.problems)
                    tried += 1
                for world in worlds:
                    again = check_setup(gpus_per_node=world, deepspeed=ds)
                    assert problem.code not in codes(again), (ds, world, problem.fix, again.problems)
                    tried += 1
    if micro is not None and micro != "auto" or accum == 3:
        assert tried > 0  # the grid holds files that fail


def _plugin(stage, offload="none", **more):
    return {"distributed_type": "DEEPSPEED", "num_processes": 8, "num_machines": 1,
            "deepspeed_config": {"zero_stage": stage, "offload_optimizer_device": offload,
                                 "offload_param_device": "none", **more}}


def _fsdp(**config):
    return {"distributed_type": "FSDP", "num_processes": 8, "num_machines": 1, "fsdp_config": config}


@pytest.mark.parametrize("acc, probed, said", [
    # accelerate's DeepSpeed plugin says its stage itself: it was never read
    (_plugin(2), "zero3", "trains with zero2, which keeps more state on each GPU: the micro batch may run out"),
    (_plugin(3), "zero3", None),
    (_plugin(3), Strategy("zero3", offload="optimizer"), "trains with zero3, which keeps more state on each GPU"),
    (_plugin(3, "cpu"), "zero3", None),  # the same wrapper with more on the host: it fits, which a note says
    # FSDP that does not shard fully, in every spelling accelerate reads
    (_fsdp(fsdp_sharding_strategy="NO_SHARD"), "fsdp1", "fsdp_sharding_strategy: NO_SHARD, which keeps every "
                                                        "parameter, gradient and optimizer state whole, as DDP"),
    (_fsdp(fsdp_reshard_after_forward="SHARD_GRAD_OP"), "fsdp1", "fsdp_reshard_after_forward: SHARD_GRAD_OP, which "
                                                                 "keeps the parameters gathered from forward to backward"),
    (_fsdp(fsdp_sharding_strategy=4), "fsdp1", "fsdp_sharding_strategy: 4 (HYBRID_SHARD), which keeps every state "
                                               "sharded within a node only"),
    (_fsdp(fsdp_version=2, fsdp_reshard_after_forward=False), "fsdp2", "fsdp_reshard_after_forward: false "
                                                                       "(SHARD_GRAD_OP)"),
    (_fsdp(fsdp_version=2, fsdp_reshard_after_forward=True), "fsdp2", None),
    (_fsdp(fsdp_reshard_after_forward="FULL_SHARD"), "fsdp1", None),
    # as much sharded, another layout: neither more nor less
    (_fsdp(fsdp_version=2), "fsdp1", "trains with fsdp2, which shards as much but holds it otherwise"),
])
def test_check_reads_how_an_accelerate_config_shards(acc, probed, said):
    result = check_setup(target=256, micro_batch=8, grad_accum=4, accelerate=acc, probed_strategy=probed)
    mismatches = [p for p in result.problems if p.code == "strategy-mismatch"]
    if said is None:
        assert mismatches == [] and result.ok, result.problems
    else:
        [problem] = mismatches
        assert said in problem.message, problem.message


def test_fsdp_without_sharding_holds_what_ddp_holds_as_probed():
    result = check_setup(target=256, micro_batch=8, grad_accum=4, accelerate=_fsdp(fsdp_sharding_strategy=3),
                         probed_strategy="ddp")
    assert result.ok and any("fsdp_sharding_strategy: 3 (NO_SHARD), which holds on each GPU about what ddp holds"
                             in note for note in result.notes), result.notes
    assert not any("do not say how training shards" in note for note in result.notes)


def test_the_accumulation_of_accelerates_deepspeed_plugin_fills_the_one_not_given():
    # it was taken as 1 and the file's 4 flagged as a mismatch
    result = check_setup(micro_batch=8, accelerate=_plugin(2, gradient_accumulation_steps=4))
    assert result.ok, result.problems
    assert (result.global_batch, result.grad_accum) == (256, 4)
    assert "took gradient_accumulation_steps=4 from the accelerate config" in result.notes
    wrong = check_setup(micro_batch=8, target=128, accelerate=_plugin(2, gradient_accumulation_steps=4))
    assert codes(wrong) == ["accelerate-mismatch"]


@pytest.mark.parametrize("fp16, bf16, key, bad", [
    (True, True, "bf16", True), (True, True, "bfloat16", True), ("true", 1, "bf16", True),
    (True, False, "bf16", False), ("auto", "auto", "bf16", False), (False, True, "bf16", False),
])
def test_fp16_and_bf16_both_enabled_is_deepspeeds_start_up_assertion(fp16, bf16, key, bad):
    ds = {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 0},
          "fp16": {"enabled": fp16}, key: {"enabled": bf16}}
    result = check_setup(gpus_per_node=4, deepspeed=ds)
    assert ("deepspeed-precision" in codes(result)) is bad
    if bad:
        assert "'bfloat16 and fp16 modes cannot be simultaneously enabled'" in result.problems[0].message


def test_an_accelerate_topology_that_does_not_add_up_gives_no_world_to_check_the_batch_on():
    # num_processes 7 on 2 machines: check then assumed 1 GPU per node and proposed a global batch for 2 GPUs
    acc = {"num_processes": 7, "num_machines": 2}
    alone = check_setup(target=96, micro_batch=4, grad_accum=3, accelerate=acc)
    assert codes(alone) == ["accelerate-topology"] and not any("assumed 1 GPU" in n for n in alone.notes)
    flagged = check_setup(target=96, micro_batch=4, grad_accum=3, gpus_per_node=4, accelerate=acc)
    assert codes(flagged) == ["accelerate-topology"]  # 4 per node × 2 machines: 96 = 4 × 3 × 8 holds
    wrong = check_setup(target=96, micro_batch=4, grad_accum=4, gpus_per_node=4, accelerate=acc)
    assert codes(wrong) == ["accelerate-topology", "batch-identity"]


def test_a_whole_float_deepspeed_reads_as_its_number_is_a_note_but_a_float_micro_batch_is_a_problem(tmp_path):
    need("deepspeed")
    whole = {"train_batch_size": 64.0, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1.0}
    parsed = deepspeed_parse(whole, 8)  # DeepSpeed's own parser takes it, as 64
    assert parsed.train_batch_size == 64
    result = check_setup(gpus_per_node=8, deepspeed=str(write_json(tmp_path / "ds.json", whole)))
    assert result.ok, result.problems
    assert any("train_batch_size is 64.0 in" in n and "reads it as 64" in n for n in result.notes)
    floated = {**whole, "train_micro_batch_size_per_gpu": 8.0}  # a DataLoader refuses batch_size=8.0
    result = check_setup(gpus_per_node=8, deepspeed=str(write_json(tmp_path / "micro.json", floated)))
    assert codes(result) == ["invalid-value"] and "train_micro_batch_size_per_gpu" in result.problems[0].message
    assert check_setup(gpus_per_node=8, deepspeed=str(write_json(tmp_path / "half.json", {**whole, "train_batch_size": 64.5}))).problems


def test_a_model_parallel_fix_counts_data_parallel_ranks_not_gpus():
    result = check_setup(target=224, micro_batch=7, grad_accum=2, gpus_per_node=16, model_parallel=2)
    assert "for a global batch of 224 on 8 data-parallel ranks (16 GPUs ÷ 2 model-parallel)" in result.problems[0].fix


def test_a_refused_key_is_to_move_into_the_deepspeed_file_being_checked(tmp_path):
    # the fix named the file accelerate's config pointed at, which the mismatch above it says to replace
    ds = write_json(tmp_path / "ds_auto.json", {"train_batch_size": "auto", "zero_optimization": {"stage": 2}})
    acc = tmp_path / "acc.yaml"
    acc.write_text(yaml.safe_dump({"distributed_type": "DEEPSPEED", "num_processes": 2, "mixed_precision": "bf16",
                                   "deepspeed_config": {"deepspeed_config_file": "ds_old.json",
                                                        "gradient_accumulation_steps": 4}}))
    result = check_setup(accelerate=str(acc), deepspeed=str(ds))
    refused = next(p for p in result.problems if p.code == "accelerate-refuses")
    assert refused.fix.endswith(f"and set them in {ds}") and "ds_old.json" not in refused.fix

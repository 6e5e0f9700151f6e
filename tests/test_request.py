"""One request, one pipeline, one report: a Request checks itself whole, answer() makes every
decision, and each CLI command's --json is the Python call's to_dict()."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch
from typer.testing import CliRunner

import autobatch
from autobatch import Request, RequestError, answer
from autobatch.cli import app

from .tiny import mlp

# Wall-clock figures differ between two runs of the same request; everything else must not.
_CLOCK = {"seconds", "seconds_per_step", "samples_per_second", "probed_at", "created", "elapsed", "spread"}  # spread: how far timed steps swung


def steady(value):
    if isinstance(value, dict):
        # A trace lent time between the trials gets as far as the trials' seconds let it, and says so.
        clock = _CLOCK | ({"reason", "traced_batches", "waited"} if value.get("between") else set())
        return {k: steady(v) for k, v in value.items() if k not in clock}
    if isinstance(value, list):
        return [steady(v) for v in value]
    return value


def cli_json(*args: str) -> dict:
    result = CliRunner().invoke(app, [*args, "--json"])
    assert result.exit_code in (0, 1), result.output
    return json.loads(result.stdout)


# -- 1. the request --------------------------------------------------------------------------------

def test_every_problem_is_found_on_construction_in_python_names():
    with pytest.raises(RequestError) as caught:
        Request(model="tiny-mlp", target=0, max_micro=2, min_micro=4, headroom="lots", dtype="fp8",
                device="cpu", memory="8MiB", gpu="h100-80gb", offload="optimizer", deepspeed="ds.txt")
    message = str(caught.value)
    for said in ("target must be a positive integer, but got 0",
                 "max_micro (2) must be at least min_micro (4)",
                 "headroom must be a fraction", "dtype must be one of fp32, bf16, fp16, bf16-true, fp16-true, but got 'fp8'",
                 "gpu names a GPU to estimate for, but find probes device cpu",
                 "offload describes a sharded strategy, but no strategy was given; add strategy zero3",
                 "--deepspeed must end in .json"):
        assert said in message, message
    assert len(caught.value.problems) == 7


@pytest.mark.parametrize("field, value, said", [
    ("memory", 1.5, "memory must be a positive size (2GiB, 512MiB), but got 1.5"),  # it was taken as 1 byte
    ("headroom", "2", "headroom must be a fraction in [0, 1) (0.05), a percentage (5%) or a size (2GiB), but got '2'"),
])
def test_python_refuses_what_the_command_line_refuses(field, value, said):
    # the command line refused --headroom 2 and needs a unit on --memory; Python took both as bytes
    with pytest.raises(RequestError, match=re.escape(said)):
        Request(**{"model": "tiny-mlp", "device": "cpu", "memory": "8MiB", field: value})
    assert Request(model="tiny-mlp", device="cpu", memory=4096.0, headroom=0.05).memory == 4096.0  # whole bytes


def test_the_cli_names_the_same_problems_by_their_flags():
    result = CliRunner().invoke(app, ["find", "--model", "tiny-mlp", "--device", "cpu", "--memory", "8MiB",
                                      "--max-micro", "2", "--min-micro", "4", "--gpu", "h100-80gb"])
    assert result.exit_code == 2
    line = result.stderr.strip()
    assert len(line.splitlines()) == 1 and "Traceback" not in line
    assert "--max-micro (2) must be at least --min-micro (4)" in line
    assert "--gpu names a GPU to estimate for, but find probes --device cpu" in line
    assert "max_micro" not in line


def test_a_request_is_frozen_and_knows_its_mode():
    request = Request(target=224, gpus_per_node=16, max_micro=9)
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.target = 8
    assert request.mode == "solve"
    assert Request(model="tiny-mlp", device="cpu", memory="1MiB").mode == "probe"
    assert Request(model="tiny-mlp", gpu="t4", estimate=True).mode == "estimate"
    if not torch.cuda.is_available():
        assert Request(model="tiny-mlp").mode == "estimate"  # no GPU to probe: the estimate, as find does


def test_two_outputs_on_one_path_are_refused_before_anything_runs(tmp_path):
    same = tmp_path / "same.json"
    with pytest.raises(RequestError, match="deepspeed and hf name the same file"):
        Request(target=16, max_micro=4, deepspeed=same, hf=same)
    assert not same.exists()


def test_a_target_no_micro_batch_reaches_is_known_before_the_probe():
    with pytest.raises(autobatch.NoExactPlanError):
        Request(model="tiny-mlp", device="cpu", memory="1MiB", target=7, gpus_per_node=2)


# -- 2. one pipeline ---------------------------------------------------------------------------------

def batch(b: int):
    return torch.randn(b, 64), torch.randint(0, 10, (b,))


def test_find_is_the_short_form_of_answer():
    model = mlp()
    plan = autobatch.find(model, batch, target=64, device="cpu", memory="8MiB", headroom=0)
    report = answer(Request(model=model, make_batch=batch, target=64, device="cpu", memory="8MiB",
                            headroom=0, estimate=False))
    assert plan == report.plan and report.finding.probe.max_batch >= plan.micro_batch


def test_find_names_the_field_an_options_flag_spelling_meant_before_anything_runs():
    """Every flag spelt from Python as on the command line (gpus= for --gpus) gets one line with the field."""
    from autobatch.cli.options import FLAGS

    fields = {f.name for f in dataclasses.fields(Request)}
    differing = {flag[2:].replace("-", "_"): name for name, flag in FLAGS.items()
                 if name in fields and flag[2:].replace("-", "_") not in fields}
    assert {"gpus", "eval", "no_cache", "no_trace_prior"} <= differing.keys()
    for spelt, name in differing.items():
        with pytest.raises(RequestError) as caught:
            autobatch.find(mlp(), lambda b: 1 / 0, target=64, device="cpu", memory="8MiB", **{spelt: True})
        value = "False" if spelt.startswith("no_") else "True"
        assert str(caught.value) == f"find() takes no option {spelt!r}; use {name}={value}"
    for peer, field in [("n_gpus", "gpus_per_node"), ("devices", "gpus_per_node"), ("world_size", "gpus_per_node"),
                        ("num_nodes", "nodes"), ("precision", "dtype"), ("max_micro_batch", "max_micro"),
                        ("gradient_checkpointing", "grad_checkpointing"), ("global_batch_size", "target")]:
        with pytest.raises(RequestError, match=f"'{peer}'; use {field}=2$"):  # the other tools' names
            autobatch.find(mlp(), batch, target=64, **{peer: 2})
    with pytest.raises(RequestError, match="'batch_size'; use target=8 for the global batch, or micro_batch=8 for a "
                                           "fixed batch per GPU$"):
        autobatch.find(mlp(), batch, batch_size=8)
    if not torch.cuda.is_available():  # find probes; a GPU named to estimate for is refused, saying there is none
        with pytest.raises(RequestError, match=r"find probes a CUDA GPU \(there is none here\) with real steps; drop "
                                               r"gpu, or estimate \(`autobatch estimate`; from Python, "
                                               r"Request\(\.\.\., estimate=True\)\)$"):
            autobatch.find(mlp(), batch, target=64, gpu="h100-80gb")
    with pytest.raises(RequestError, match="'stratgy'; use strategy='zero3'$"):
        autobatch.find(mlp(), batch, target=64, stratgy="zero3")
    with pytest.raises(RequestError, match="'zzz'; use one of the Request fields: accelerate, .*, workspace$"):
        autobatch.find(mlp(), batch, target=64, zzz=1)


def test_answer_draws_a_strategy_table_from_python():
    report = answer(Request(model="tiny-mlp", device="cpu", memory="1MiB", gpus_per_node=4, strategy="ddp,fsdp2",
                            max_micro=2))
    assert [row.strategy.name for row in report.rows] == ["ddp", "fsdp2"]
    assert isinstance(report.rows[0], autobatch.NoFit) and report.rows[1].probe.max_batch == 2
    assert report.plan is None and [r["strategy"]["name"] for r in report.to_dict()["strategies"]] == ["ddp", "fsdp2"]


def test_answer_estimates_for_a_named_gpu_and_writes_configs(tmp_path):
    report = answer(Request(model="tiny-gpt2", gpu="t4", estimate=True, target=64, deepspeed=tmp_path / "ds.json"))
    assert report.estimated and report.gpu.name.startswith("t4")
    assert report.written == {"deepspeed_config": str(tmp_path / "ds.json")}
    written = json.loads((tmp_path / "ds.json").read_text())
    assert written["train_batch_size"] == 64 == report.to_dict()["global_batch"]


def test_answer_draws_a_length_table_from_python():
    report = answer(Request(model="tiny-gpt2", device="cpu", memory="8MiB", seq_len=(32, 64), evaluation=True,
                            max_micro=16, target=32))
    assert [row.seq_len for row in report.lengths.rows] == [32, 64]
    assert report.eval_batch == report.lengths.train_row.eval.safe_batch
    assert report.to_dict()["plan"]["global_batch"] == 32


# -- 4. each command's --json is the Python call's to_dict() ------------------------------------------

def test_find_json_is_the_reports(monkeypatch, tmp_path):
    monkeypatch.setenv("AUTOBATCH_CACHE_DIR", str(tmp_path))
    # the trials alone: a trace run beside them leads a search as far as it got by then, which load decides
    flags = ["find", "--model", "tiny-mlp", "--device", "cpu", "--memory", "8MiB", "--target", "32", "--no-cache",
             "--max-micro", "16", "--no-trace-prior"]
    report = answer(Request(model="tiny-mlp", device="cpu", memory="8MiB", target=32, cache=False, max_micro=16,
                            trace_prior=False))
    assert steady(cli_json(*flags)) == steady(report.to_dict())


def test_find_strategies_json_is_the_reports():
    flags = ["find", "--model", "tiny-mlp", "--device", "cpu", "--memory", "1MiB", "--gpus", "4",
             "--strategy", "ddp,fsdp2", "--max-micro", "2"]
    report = answer(Request(model="tiny-mlp", device="cpu", memory="1MiB", gpus_per_node=4, strategy="ddp,fsdp2",
                            max_micro=2))
    assert steady(cli_json(*flags)) == steady(report.to_dict())


def test_estimate_json_is_the_reports():
    report = answer(Request(model="tiny-gpt2", gpu="t4", estimate=True, target=16, gpus_per_node=2))
    assert steady(cli_json("estimate", "--model", "tiny-gpt2", "--gpu", "t4", "--target", "16", "--gpus", "2")) \
        == steady(report.to_dict())


def test_solve_json_is_the_reports():
    report = answer(Request(target=224, gpus_per_node=16, max_micro=9, strategy="zero3"))
    assert cli_json("solve", "--target", "224", "--gpus", "16", "--max-micro", "9", "--strategy", "zero3") \
        == report.to_dict()


def test_check_json_is_the_calls():
    result = autobatch.check(target=224, micro_batch=8, grad_accum=2, gpus_per_node=16)
    assert cli_json("check", "--target", "224", "--micro-batch", "8", "--grad-accum", "2", "--gpus", "16") \
        == result.to_dict()


def test_verify_ga_json_is_the_calls():
    result = autobatch.verify_ga_model("tiny-gpt2", micro_batch=2, grad_accum=2, mode="normalised")
    assert steady(cli_json("verify-ga", "--model", "tiny-gpt2", "--micro-batch", "2", "--grad-accum", "2",
                           "--normalised")) == steady(result.to_dict())


def test_tune_json_is_the_calls(monkeypatch, tmp_path):
    # One exact plan (4 × 1), so the fastest is the same whichever run times it.
    request = Request(model="tiny-mlp", target=4, device="cpu", memory="2MiB", min_micro=4, max_micro=4,
                      estimate=False)
    monkeypatch.setenv("AUTOBATCH_CACHE_DIR", str(tmp_path / "python"))
    result = autobatch.tune_plans(request, trials=1, checkpointing=[False])
    monkeypatch.setenv("AUTOBATCH_CACHE_DIR", str(tmp_path / "cli"))
    shown = cli_json("tune", "--model", "tiny-mlp", "--target", "4", "--device", "cpu", "--memory", "2MiB",
                     "--min-micro", "4", "--max-micro", "4", "--trials", "1", "--no-grad-checkpointing", "--no-cache")
    called = result.to_dict()
    for data in (shown, called):
        data.pop("storage")  # each run's own study file
    assert steady(shown) == steady(called)


def test_cache_gpus_and_models_json_are_the_calls(monkeypatch, tmp_path):
    monkeypatch.setenv("AUTOBATCH_CACHE_DIR", str(tmp_path))
    assert cli_json("cache", "list") == autobatch.cache_listing().to_dict()
    assert cli_json("gpus")["gpus"] == [g.to_dict() for g in autobatch.GPUS.values()]
    assert cli_json("models") == autobatch.list_models()


def test_a_length_table_json_has_the_plans_numbers_at_the_top_as_every_answer_does():
    data = cli_json("find", "--model", "tiny-gpt2", "--device", "cpu", "--memory", "8MiB", "--seq-len", "32,64",
                    "--max-micro", "16", "--target", "32")
    assert data["global_batch"] == 32 and data["micro_batch"] * data["grad_accum"] == 32 and "lengths" in data


def test_an_estimate_in_bf16_for_a_card_without_it_says_so():
    report = answer(Request(model="tiny-gpt2", gpu="t4", dtype="bf16", estimate=True, max_micro=4))
    assert any("t4 has no bf16" in note for note in report.notes)

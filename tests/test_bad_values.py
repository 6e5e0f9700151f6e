"""Values no run can use are refused in one line before anything runs: numbers past the bounds torch
and the OS take, sizes no machine holds, flags that describe nothing in this run; and a line that
shows a figure agrees with the table beside it."""

from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

from autobatch.cli import app
from autobatch.units import format_bytes

HUGE = "99999999999999999999"  # 20 digits: past 2**64


def one_line(result, code: int = 2) -> str:
    assert result.exit_code == code, result.output
    line = result.stderr.strip()
    assert len(line.splitlines()) == 1 and "Traceback" not in line and "frame #" not in line, line
    return line


def invoke(*args: str):
    return CliRunner().invoke(app, list(args))


# Every whole-number flag of every command, at 20 digits.
INT_FLAGS = [
    ("solve", ["--target", "16"], "--max-micro"), ("solve", [], "--target"), ("solve", ["--target", "16"], "--gpus"),
    ("solve", ["--target", "16"], "--nodes"), ("solve", ["--target", "16"], "--min-micro"),
    ("solve", ["--target", "16"], "--multiple-of"), ("solve", ["--target", "16"], "--model-parallel"),
    ("solve", ["--target", "16", "--base-lr", "1e-3"], "--base-batch"),
    ("check", [], "--micro-batch"), ("check", [], "--grad-accum"), ("check", [], "--target"),
    ("verify-ga", ["--model", "tiny-mlp", "--grad-accum", "2"], "--micro-batch"),
    ("verify-ga", ["--model", "tiny-mlp", "--micro-batch", "2"], "--grad-accum"),
    ("verify-ga", ["--model", "tiny-mlp", "--micro-batch", "2", "--grad-accum", "2"], "--seed"),
    ("verify-ga", ["--model", "tiny-mlp", "--micro-batch", "2", "--grad-accum", "2"], "--gpus"),
    ("find", ["--model", "tiny-mlp", "--device", "cpu", "--memory", "1MiB"], "--max-micro"),
    ("find", ["--model", "tiny-mlp", "--device", "cpu", "--memory", "1MiB"], "--target"),
    ("find", ["--model", "tiny-gpt2", "--device", "cpu", "--memory", "1MiB"], "--seq-len"),
    ("estimate", ["--model", "tiny-mlp"], "--gpus"),
    ("tune", ["--model", "tiny-mlp", "--target", "8", "--device", "cpu", "--memory", "1MiB"], "--trials"),
    ("tune", ["--model", "tiny-mlp", "--target", "8", "--device", "cpu", "--memory", "1MiB"], "--seed"),
]


@pytest.mark.parametrize("command, given, flag", INT_FLAGS, ids=[f"{c}{f}" for c, _, f in INT_FLAGS])
def test_a_twenty_digit_number_is_one_line_naming_the_flag_and_its_bound(command, given, flag):
    line = one_line(invoke(command, *given, flag, HUGE))
    assert line.startswith(f"Error: {flag} ") and ("must be ≤" in line or "must be" in line), line


def test_numbers_at_the_bound_still_answer():
    result = invoke("solve", "--target", "16", "--max-micro", str(2**64 - 1))
    assert result.exit_code == 0 and result.stdout.startswith("16 per GPU × 1 accumulation")
    result = invoke("verify-ga", "--model", "tiny-mlp", "--micro-batch", "2", "--grad-accum", "2", "--seed", str(2**63 - 1))
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("args, said", [
    (["find", "--model", "tiny-mlp", "--device", "cpu", "--memory", f"{HUGE}GiB"], "--memory is a budget the probe's real steps run in"),
    (["estimate", "--model", "tiny-mlp", "--gpu-memory", f"{HUGE}GiB"], "--gpu-memory must be at most 4.00 TiB"),
    (["find", "--model", "tests/data/user_errors.py:linear", "--input-shape", HUGE, "--device", "cpu", "--memory", "1MiB"],
     "--input-shape must hold at most 2**40 elements per sample"),
    (["find", "--model", "tiny-mlp", "--input-shape", "3,x", "--device", "cpu", "--memory", "1MiB"],
     "--input-shape describes the samples of a --model function that returns an nn.Module, but tiny-mlp builds"),
    (["find", "--model", "tiny-mlp", "--seq-len", "64", "--device", "cpu", "--memory", "1MiB"],
     "--seq-len is the tokens per sample of a language model, but tiny-mlp takes no sequence length"),
    (["find", "--model", "tiny-gpt2", "--train-seq-len", "64", "--device", "cpu", "--memory", "8MiB"],
     "--train-seq-len must be one of the --seq-len values (none given)"),
    (["find", "--model", "tiny-mlp", "--strategy", "zero2", "--fsdp-unit", "Linear", "--device", "cpu", "--memory", "1MiB"],
     "the FSDP unit names the block FSDP wraps, but the strategy is zero2"),
    (["solve", "--target", "16", "--strategy", "ddp,zero2", "--fsdp-unit", "Linear"],
     "the FSDP unit names the block FSDP wraps, but the strategy is ddp"),    (["find", "--model", "tiny-mlp", "--device", "cpu", "--memory", "2MiB", "--plot", "x.txt"],
     "--plot writes a PNG, so its name must end in .png, but got 'x.txt'"),
    (["verify-ga", "--model", "tiny-mlp", "--micro-batch", "2", "--grad-accum", "2", "--tolerance", "inf"],
     "--tolerance must be a positive finite number, but got --tolerance inf"),
    (["tune", "--model", "tiny-mlp", "--target", "8", "--device", "cpu", "--memory", "1MiB", "--seed", "-1"],
     "--seed must be ≥ 0"),
    # a count that would plan 10**14 ranks one by one (it took the host's memory)
    (["estimate", "--model", "tiny-mlp", "--gpu", "a100-80gb:99999999999999"],
     "names 99,999,999,999,999 GPUs, but a mixed list plans each rank and takes at most 1,048,576"),
    # past the largest batch a probe tries: torch's overflow traceback, or the host's RAM blamed on --memory
    (["find", "--model", "tiny-mlp", "--device", "cpu", "--memory", "4MiB", "--min-micro", str(2**64 - 1)],
     "--min-micro must be at most 1,048,576 (the largest batch a probe tries)"),
    (["find", "--model", "tiny-mlp", "--device", "cpu", "--memory", "4MiB", "--min-micro", "100000000"],
     "--min-micro must be at most 1,048,576"),
    # an empty length between commas was dropped silently
    (["find", "--model", "tiny-gpt2", "--seq-len", "32,,64", "--device", "cpu", "--memory", "8MiB"],
     "--seq-len must be one positive integer or several separated by commas, but got '32,,64'"),
    # a missing local folder was read as a hub name: "Repo id must use alphanumeric chars"
    (["find", "--model", "hf:./no-such-dir", "--device", "cpu", "--memory", "1GiB"],
     "hf:./no-such-dir names a local directory, which must hold a transformers config.json, but './no-such-dir' is no"),
])
def test_values_that_describe_nothing_here_are_refused(args, said):
    assert said in one_line(invoke(*args))


def test_the_safe_batch_line_shows_the_peak_the_trial_table_measured():
    flags = ["find", "--model", "tiny-gpt2", "--device", "cpu", "--memory", "8MiB", "--max-micro", "10", "--gpus", "2",
             "--no-cache"]
    data = json.loads(invoke(*flags, "--json").stdout)
    text = invoke(*flags).stdout
    trial = next(t for t in data["trials"] if t["batch"] == data["safe_batch"] and t["fits"])
    line = next(line for line in text.splitlines() if line.startswith("safe batch"))
    assert f"{format_bytes(trial['peak_bytes'])} measured + " in line and "DDP's gradient buckets" in line
    assert "predicted" not in line
    buckets = data["probe"]["ddp_buckets_bytes"]
    assert re.search(rf"peak {re.escape(format_bytes(trial['peak_bytes'] + buckets))}:", line)


@pytest.mark.parametrize("args, said, not_said", [
    (["find", "--model", "tiny-mlp", "--device", "cpu"], "pass --memory 8GiB with --device cpu", "memory="),
    (["find", "--model", "tests/data/user_errors.py:linear", "--input-shape", "3,0", "--device", "cpu", "--memory", "1MiB"],
     "--input-shape must be positive integers", "input_shape"),
    (["solve", "--target", "224", "--base-lr", "1e-3"], "--base-lr and --base-batch go together", "base_lr="),
])
def test_cli_errors_speak_in_flags_not_python(args, said, not_said):
    line = one_line(invoke(*args))
    assert said in line and not_said not in line, line


def test_check_with_nothing_to_check_names_the_flags():
    result = invoke("check")
    assert result.exit_code == 1 and "--target, --micro-batch" in result.stdout


def test_a_deepspeed_file_the_hf_line_names_gets_the_section_hf_and_accelerate_need(tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text('{"x": 1}')
    result = invoke("solve", "--target", "64", "--gpus", "8", "--max-micro", "8", "--deepspeed", str(ds))
    assert result.exit_code == 0 and f"--deepspeed {ds}" in result.stdout
    assert json.loads(ds.read_text())["zero_optimization"] == {"stage": 0} and json.loads(ds.read_text())["x"] == 1


def test_what_flags_and_keywords_are_told_names_only_what_was_given():
    from autobatch import Request, RequestError

    with pytest.raises(RequestError, match="memory needs a unit as a string .'8' would be 8 bytes."):
        Request(model="tiny-mlp", device="cpu", memory="8")
    line = one_line(invoke("find", "--model", "tiny-mlp", "--device", "cpu", "--memory", "1MiB", "--offload", "optimizer"))
    assert "--offload describes a sharded strategy" in line and "--fsdp-unit" not in line
    line = one_line(invoke("find", "--model", "tiny-gpt2", "--device", "cpu", "--memory", "8MiB", "--seq-len", "32,64",
                           "--strategy", "zero2"))
    assert "pass one --seq-len" in line and "--eval" not in line


def test_a_fraction_below_one_per_gpu_is_not_shown_as_one():
    line = one_line(invoke("solve", "--target", "18446744073709551600", "--gpus", "18446744073709551615"))
    assert "= 0.9999… per GPU, and DeepSpeed would floor that to 0" in line


# Every size flag at a bare 0: nothing is nothing in any unit, so no unit is asked for; where a size
# must be positive the line says so (it said "needs a unit, write e.g. 2GiB" for --memory 0).
ZERO_SIZES = [
    (["find", "--model", "tiny-mlp", "--device", "cpu", "--memory", "0"], "--memory must be a positive size"),
    (["find", "--model", "tiny-mlp", "--device", "cpu", "--memory", "4MiB,0.0"], "--memory must be a positive size"),
    (["estimate", "--model", "tiny-mlp", "--gpu-memory", "0"], "--gpu-memory must be a positive size"),
    (["estimate", "--model", "tiny-mlp", "--workspace", "0"], None),
    (["estimate", "--model", "tiny-mlp", "--cuda-context", "0"], None),
]


@pytest.mark.parametrize("args, said", ZERO_SIZES,
                         ids=["memory", "memory-per-rank", "gpu-memory", "workspace", "cuda-context"])
def test_a_bare_zero_size_is_refused_as_not_positive_or_taken_as_none(args, said):
    if said is None:
        result = invoke(*args, "--json")
        assert result.exit_code == 0, result.output
        assert json.loads(result.stdout)["max_batch"] > 0
    else:
        line = one_line(invoke(*args))
        assert said in line and "needs a unit" not in line, line


@pytest.mark.parametrize("kw, said", [({"memory": "0"}, "memory must be a positive size"),
                                      ({"memory": "4MiB", "workspace": "0"}, None)])
def test_python_reads_a_bare_zero_size_as_the_command_line_does(kw, said):
    from autobatch import Request, RequestError

    if said is None:
        assert Request(model="tiny-mlp", device="cpu", **kw).workspace == "0"
    else:
        with pytest.raises(RequestError, match=said):
            Request(model="tiny-mlp", device="cpu", **kw)

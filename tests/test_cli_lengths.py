"""``find``/``estimate`` with several ``--seq-len`` values, ``--eval``, and ``check --seq-len`` (issue 17)."""

from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

from autobatch.cli import app

MODEL = "docs/examples/causal_lm.py:workload"
DEVICE = ["--device", "cpu", "--memory", "2MiB"]


def run(*args: str):
    return CliRunner().invoke(app, list(args))


@pytest.fixture(scope="module")
def table_json(tmp_path_factory):
    hf = tmp_path_factory.mktemp("hf") / "args.json"
    result = run("find", "--model", MODEL, "--seq-len", "64,128", *DEVICE, "--eval", "--hf", str(hf), "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout), json.loads(hf.read_text())


def test_several_lengths_give_one_row_each_and_the_token_budget_in_json(table_json):
    data, _ = table_json
    rows = data["lengths"]
    assert [r["seq_len"] for r in rows] == [64, 128]
    for row in rows:
        assert set(row) >= {"seq_len", "max_batch", "safe_batch", "trials"}
        tried = {t["batch"]: t["fits"] for t in row["trials"]}
        assert tried[row["max_batch"]] and tried[row["max_batch"] + 1] is False
    assert data["max_tokens"] // 128 <= rows[1]["safe_batch"] and data["max_tokens"] // 64 <= rows[0]["safe_batch"]
    assert data["plan"]["micro_batch"] == rows[1]["safe_batch"]  # the longest, with no target


def test_eval_column_and_per_device_eval_batch_size_in_the_hf_arguments(table_json):
    data, written = table_json
    rows = data["lengths"]
    for row in rows:
        assert row["eval_max_batch"] >= row["max_batch"]
        tried = {t["batch"]: t["fits"] for t in row["eval_trials"]}
        assert tried[row["eval_max_batch"]] and tried[row["eval_max_batch"] + 1] is False
    assert written["per_device_eval_batch_size"] == rows[1]["eval_safe_batch"]
    assert written["per_device_train_batch_size"] == rows[1]["safe_batch"]


def test_one_length_keeps_the_json_it_always_had_and_eval_adds_to_it():
    plain = json.loads(run("find", "--model", MODEL, "--seq-len", "128", *DEVICE, "--json").stdout)
    data = json.loads(run("find", "--model", MODEL, "--seq-len", "128", *DEVICE, "--eval", "--json").stdout)
    assert "lengths" not in plain and "max_tokens" not in plain and "lengths" not in data
    assert set(plain) - {"cached"} <= set(data)
    assert data["probe"]["max_batch"] == plain["probe"]["max_batch"] and data["micro_batch"] == plain["micro_batch"]
    assert data["eval_max_batch"] >= data["probe"]["max_batch"] and "eval_trials" in data


def test_estimate_takes_the_same_lengths_without_a_gpu():
    result = run("estimate", "--model", MODEL, "--seq-len", "64,128", "--gpu-memory", "1GiB", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["estimated"] is True and [r["seq_len"] for r in data["lengths"]] == [64, 128]
    assert data["lengths"][0]["max_batch"] > data["lengths"][1]["max_batch"]


def test_an_estimated_table_for_several_gpus_books_ddps_buckets_in_every_trial():
    import autobatch

    # It raised AttributeError: the plan took DDP's buckets off a probe's limit, and an estimate has no probe.
    result = run("estimate", "--model", MODEL, "--seq-len", "64,128", "--gpu-memory", "1GiB", "--gpus", "4",
                 "--target", "64", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["plan"]["world_size"] == 4

    def rows(gpus):
        request = autobatch.Request(model=MODEL, seq_len=(64, 128), gpu_memory="1GiB", gpus_per_node=gpus, target=64,
                                    estimate=True)
        return autobatch.answer(request).lengths.rows

    one, four = rows(1), rows(4)
    [grads] = {row.train.extra["ddp_buckets_bytes"] for row in four}
    assert grads > 0 and all("ddp_buckets_bytes" not in row.train.extra for row in one)
    for a, b in zip(one, four):  # the same trial on four GPUs holds the buckets more
        alike = {t.batch: t.peak_bytes for t in a.train.trials}
        assert all(t.peak_bytes - alike[t.batch] == grads for t in b.train.trials if t.batch in alike)
        assert b.train.max_batch <= a.train.max_batch


def test_check_says_the_micro_batch_was_never_probed_at_a_longer_length():
    found = run("find", "--model", MODEL, "--seq-len", "64,128", *DEVICE, "--train-seq-len", "64", "--target", "32")
    assert found.exit_code == 0, found.output
    out = found.stdout
    assert "batch per sequence length" in out and "plan at seq_len 64:" in out
    assert re.search(r"trials: \d+ in all \(training \d+ at 128, \d+ at 64\)", out)
    assert "min over lengths of (safe batch + 1) × seq_len − 1" in out
    never = run("check", "--model", MODEL, "--micro-batch", "4", "--seq-len", "512")
    assert never.exit_code == 1
    assert "[unprobed-length] micro batch 4 was never probed at seq_len 512" in never.stdout
    over = run("check", "--model", MODEL, "--micro-batch", "64", "--seq-len", "128", "--json")
    assert over.exit_code == 1 and [p["code"] for p in json.loads(over.stdout)["problems"]] == ["over-probed-max"]
    shorter = run("check", "--model", MODEL, "--micro-batch", "4", "--seq-len", "96")
    assert shorter.exit_code == 0 and "longer lengths were" in shorter.stdout
    alone = run("check", "--micro-batch", "4", "--seq-len", "96")
    assert alone.exit_code == 2 and "needs --model" in alone.stderr


def test_bad_lengths_are_one_line_before_any_trial():
    for model, args, message in (
        (MODEL, ["--seq-len", "64,abc"], "--seq-len must be one positive integer or several separated by commas"),
        (MODEL, ["--seq-len", "64,128", "--train-seq-len", "96"], "--train-seq-len must be one of the --seq-len values"),
        ("tiny-mlp", ["--seq-len", "64,128"], "--seq-len is the tokens per sample of a language model, but tiny-mlp takes no sequence length"),
    ):
        result = run("find", "--model", model, *args, *DEVICE)
        assert result.exit_code == 2 and message in result.stderr, result.output
        assert len(result.stderr.strip().splitlines()) == 1


def test_planning_flags_and_plot_are_refused_before_any_trial(monkeypatch):
    import autobatch.lengths.probe as lengths_probe

    def no_trials(*_args, **_kwargs):
        raise AssertionError("a trial ran before the flags were checked")

    monkeypatch.setattr(lengths_probe, "search_lengths", no_trials)
    for args, message in (
        (["--target", "0"], "--target must be"),
        (["--gpus", "0"], "--gpus must be"),
        (["--plot", "memory.png"], "--plot draws one probe's memory curve"),
    ):
        result = run("find", "--model", MODEL, "--seq-len", "64,128", *DEVICE, *args)
        assert result.exit_code == 2 and message in result.stderr, result.output


def test_each_row_of_an_estimated_table_answers_as_the_one_length_estimate_at_its_length():
    # the table multiplied its traced peaks by 1.10 where one length books them through the caching allocator's
    # model: tiny-gpt2 on a t4 gave 9,732 at 128 tokens where `--seq-len 128` gives 10,432
    import autobatch

    def asked(seq_len):
        return autobatch.answer(autobatch.Request(model=MODEL, seq_len=seq_len, gpu_memory="1GiB", estimate=True))

    table = asked((64, 128)).lengths
    for row in table.rows:
        alone = asked(row.seq_len).finding.probe
        assert (row.train.max_batch, row.train.safe_batch) == (alone.max_batch, alone.safe_batch), row.seq_len


def test_an_estimated_table_names_its_dtype_as_the_one_length_estimate_does():
    # The table's estimate called pure bf16 weights "fp32": it named the dtype its own way
    result = run("estimate", "--model", MODEL, "--seq-len", "64,128", "--gpu-memory", "1GiB", "--dtype", "bf16-true",
                 "--json")
    assert result.exit_code == 0, result.output
    import autobatch

    request = autobatch.Request(model=MODEL, seq_len=(64, 128), gpu_memory="1GiB", dtype="bf16-true", estimate=True)
    assert {row.train.dtype for row in autobatch.answer(request).lengths.rows} == {"bf16-true"}


def test_check_with_a_model_and_no_length_compares_at_the_length_find_took():
    # `check --model tiny-gpt2` without --seq-len said OK to a micro batch of 32 where find fitted 8 at its own 64 tokens
    other = run("find", "--model", "tiny-gpt2", "--seq-len", "32", "--device", "cpu", "--memory", "8MiB")
    assert other.exit_code == 0, other.output
    # probed at another length only: the job may train there, so that is a note, not a problem
    elsewhere = run("check", "--model", "tiny-gpt2", "--micro-batch", "1000")
    assert elsewhere.exit_code == 0, elsewhere.output
    assert "no --seq-len given: compared at the model's own length 64, where no probe is cached" in elsewhere.stdout
    found = run("find", "--model", "tiny-gpt2", "--device", "cpu", "--memory", "8MiB", "--json")
    assert found.exit_code == 0, found.output
    fitted = json.loads(found.stdout)["max_batch"]
    stated = run("check", "--model", "tiny-gpt2", "--seq-len", "64", "--micro-batch", str(fitted + 1), "--json")
    unstated = run("check", "--model", "tiny-gpt2", "--micro-batch", str(fitted + 1), "--json")
    for result in (stated, unstated):
        assert result.exit_code == 1 and [p["code"] for p in json.loads(result.stdout)["problems"]] == ["over-probed-max"]
    assert run("check", "--model", "tiny-gpt2", "--micro-batch", str(fitted)).exit_code == 0
    bare = run("check", "--model", "tiny-cnn", "--micro-batch", "4")
    assert bare.exit_code == 0 and "probe" not in bare.stdout  # a model with no length: nothing to compare, nothing said


def test_a_length_where_nothing_fits_is_nothing_fits_and_is_not_cached():
    import os

    import autobatch

    # with --eval (a one-length table) or several lengths, "nothing fits" read as "lower --headroom", and a
    # max_batch=0 entry was cached, which check then listed as a probe
    for args in (["--eval"], ["--seq-len", "32,64"]):
        result = run("find", "--model", "tiny-gpt2", "--device", "cpu", "--memory", "600KiB", "--target", "64", *args)
        assert result.exit_code == 2, result.output  # as the one-length probe's error exits
        assert "even a batch of 1 runs out of memory on cpu (simulated 600 KiB)" in result.stderr
        assert "headroom" not in result.stderr
    cache = os.environ["AUTOBATCH_CACHE_DIR"]
    assert not any(name.endswith(".json") for _, _, names in os.walk(cache) for name in names)
    with pytest.raises(autobatch.NoBatchFitsError):
        autobatch.answer(autobatch.Request(model="tiny-gpt2", device="cpu", memory="600KiB", evaluation=True))

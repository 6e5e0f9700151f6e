"""`autobatch solve` and `autobatch check` from the command line, and the examples in docs/solve-and-check.md."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from autobatch.cli import app

DOC = Path(__file__).resolve().parents[1] / "docs" / "solve-and-check.md"
runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, list(args))


# --- solve ---------------------------------------------------------------------------------


def test_solve_prints_the_arithmetic_first():
    result = invoke("solve", "--target", "224", "--gpus", "16", "--nodes", "1", "--max-micro", "9")
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[0] == "7 per GPU × 2 accumulation × 16 GPUs (16 per node × 1 node) = 224"


def test_solve_json_has_the_documented_keys():
    result = invoke("solve", "--target", "224", "--gpus", "16", "--nodes", "1", "--max-micro", "9", "--json")
    data = json.loads(result.stdout)
    expected = {"global_batch": 224, "micro_batch": 7, "grad_accum": 2, "world_size": 16, "gpus_per_node": 16, "nodes": 1}
    assert {k: data[k] for k in expected} == expected


def test_solve_merges_into_an_existing_deepspeed_file_and_writes_accelerate(tmp_path):
    ds, acc = tmp_path / "ds.json", tmp_path / "acc.yaml"
    ds.write_text(json.dumps({"optimizer": {"type": "AdamW"}, "gradient_accumulation_steps": 8}))
    result = invoke("solve", "--target", "512", "--gpus", "8", "--nodes", "2", "--max-micro", "16",
                    "--deepspeed", str(ds), "--accelerate", str(acc), "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["deepspeed_config"] == str(ds) and data["accelerate_config"] == str(acc)
    written = json.loads(ds.read_text())
    assert written["optimizer"] == {"type": "AdamW"}
    assert (written["train_batch_size"], written["train_micro_batch_size_per_gpu"], written["gradient_accumulation_steps"]) == (
        512, 16, 2,
    )
    assert "num_processes: 16" in acc.read_text() and "num_machines: 2" in acc.read_text()
    # the two files agree with each other, by check's reading
    checked = invoke("check", "--accelerate", str(acc), "--deepspeed", str(ds), "--target", "512")
    assert checked.exit_code == 0, checked.output


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--target", "0"], "--target must be ≥ 1, but got '0'"),
        (["--target", "-4"], "--target must be ≥ 1, but got '-4'"),
        (["--target", "224", "--gpus", "0"], "--gpus must be ≥ 1, but got '0'"),
        (["--target", "224", "--nodes", "-1"], "--nodes must be ≥ 1, but got '-1'"),
        (["--target", "224", "--max-micro", "0"], "--max-micro must be ≥ 1, but got '0'"),
        (["--target", "224", "--gpus", "3"], "no exact plan: global batch 224 is not divisible"),
        (["--target", "16", "--gpus", "16", "--min-micro", "2"], "no micro batch (≥ 2) divides 1"),
        (["--target", "224", "--base-lr", "1e-3"], "--base-lr and --base-batch go together"),
        (["--target", "224", "--gpus", "6", "--model-parallel", "4"], "--model-parallel must divide the GPU count"),
    ],
)
def test_solve_bad_input_is_one_line_on_stderr(args, expected):
    result = invoke("solve", *args)
    assert result.exit_code == 2
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and expected in lines[0]
    assert "Traceback" not in result.output


@pytest.mark.parametrize("command", ["solve", "check"])
def test_help_says_gpus_is_per_node(command):
    result = invoke(command, "--help")
    assert result.exit_code == 0
    assert "GPUs per node" in " ".join(result.stdout.split())


# --- check ---------------------------------------------------------------------------------


def test_check_passes_a_consistent_setup():
    result = invoke("check", "--target", "224", "--micro-batch", "7", "--grad-accum", "2", "--gpus", "16")
    assert result.exit_code == 0
    assert result.stdout.startswith("OK: 7 per GPU × 2 accumulation × 16 GPUs")


def test_check_reports_every_problem_and_exits_1(tmp_path):
    broken = tmp_path / "ds.json"
    broken.write_text("{not json")
    result = invoke("check", "--target", "224", "--micro-batch", "7", "--grad-accum", "3", "--gpus", "16",
                    "--deepspeed", str(broken), "--accelerate", str(tmp_path / "missing.yaml"), "--json")
    assert result.exit_code == 1
    data = json.loads(result.stdout)
    assert not data["ok"]
    assert [p["code"] for p in data["problems"]] == ["unreadable-file", "unreadable-file", "batch-identity"]
    assert all(p["fix"] for p in data["problems"])
    assert "Traceback" not in result.output


def test_check_batchnorm_flag():
    result = invoke("check", "--target", "32", "--micro-batch", "1", "--grad-accum", "2", "--gpus", "16", "--batchnorm")
    assert result.exit_code == 1
    assert "[batchnorm]" in result.stdout


# --- a real process ------------------------------------------------------------------------


def test_python_dash_m_autobatch_solve_bad_input_is_one_line_without_traceback():
    # one real process (starting one costs seconds); the good path is covered through CliRunner above
    bad = subprocess.run(
        [sys.executable, "-m", "autobatch", "solve", "--target", "224", "--gpus", "3"],
        capture_output=True, text=True, timeout=300,
    )
    assert bad.returncode == 2 and bad.stdout == ""
    assert len(bad.stderr.strip().splitlines()) == 1 and "Traceback" not in bad.stderr
    assert "222 below or 225 above" in bad.stderr


# --- the documentation's examples ----------------------------------------------------------


def doc_steps(text: str) -> list[tuple[str, object]]:
    """The doc's runnable pieces in order: ("file", (name, body)), ("python", code), ("run", (argv, output, exit))."""
    steps: list[tuple[str, object]] = []
    lines = text.splitlines()
    i, expected_exit = 0, 0
    while i < len(lines):
        line = lines[i]
        marker = re.fullmatch(r"<!-- exit (\d+) -->", line.strip())
        if marker:
            expected_exit = int(marker.group(1))
        elif line.startswith("```") and line.strip() != "```":
            info = line[3:].split()
            end = lines.index("```", i + 1)
            body = lines[i + 1:end]
            if info[0] == "console":
                commands = [j for j, b in enumerate(body) if b.startswith("$ ")]
                for n, j in enumerate(commands):
                    stop = commands[n + 1] if n + 1 < len(commands) else len(body)
                    assert body[j].startswith("$ autobatch "), f"doc command not run by the test: {body[j]}"
                    steps.append(("run", (shlex.split(body[j][2:])[1:], "\n".join(body[j + 1:stop]), expected_exit)))
            elif info[0] == "python":
                steps.append(("python", "\n".join(body)))
            elif len(info) > 1 and info[1].startswith("file="):
                steps.append(("file", (info[1][len("file="):], "\n".join(body) + "\n")))
            expected_exit, i = 0, end
        elif line.strip():
            expected_exit = expected_exit if line.lstrip().startswith("<!--") else 0
        i += 1
    return steps


def test_docs_examples(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    steps = doc_steps(DOC.read_text(encoding="utf-8"))
    runs = [s for s in steps if s[0] == "run"]
    assert len(runs) >= 10 and any(s[0] == "file" for s in steps) and any(s[0] == "python" for s in steps)
    for kind, payload in steps:
        if kind == "file":
            name, body = payload
            Path(name).write_text(body)
        elif kind == "python":
            exec(compile(payload, str(DOC), "exec"), {})
        else:
            argv, shown, exit_code = payload
            result = invoke(*argv)
            assert result.exit_code == exit_code, f"autobatch {' '.join(argv)}\n{result.output}"
            assert result.output.rstrip("\n") == shown, f"autobatch {' '.join(argv)}"


def test_solve_takes_micro_batch_as_check_and_verify_ga_do():
    from typer.testing import CliRunner

    from autobatch.cli import app

    fixed = CliRunner().invoke(app, ["solve", "--target", "224", "--gpus", "16", "--micro-batch", "7", "--json"])
    assert fixed.exit_code == 0 and (json.loads(fixed.stdout)["micro_batch"], json.loads(fixed.stdout)["grad_accum"]) == (7, 2)
    none = CliRunner().invoke(app, ["solve", "--target", "224", "--gpus", "16", "--micro-batch", "5"])
    assert none.exit_code == 2 and "no micro batch (= 5) divides 14" in none.stderr
    both = CliRunner().invoke(app, ["solve", "--target", "224", "--micro-batch", "7", "--max-micro", "9"])
    assert both.exit_code == 2 and "--micro-batch fixes the micro batch" in both.stderr


def test_solve_without_a_memory_limit_says_nothing_checked_that_it_fits():
    from typer.testing import CliRunner

    from autobatch.cli import app

    out = CliRunner().invoke(app, ["solve", "--target", "224"]).stdout
    assert "no memory limit was given (--max-micro / max_micro)" in out and "`autobatch find` measures" in out
    limited = CliRunner().invoke(app, ["solve", "--target", "224", "--max-micro", "32"]).stdout
    assert "no memory limit" not in limited


def test_check_with_no_micro_batch_assumes_the_accumulation_every_framework_defaults_to(tmp_path):
    # With only an accelerate file, the note said "as DeepSpeed does" (tried as a new user would): one is every
    # framework's default, and the note says so whichever files were given.
    acc = tmp_path / "accelerate.yaml"
    acc.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_GPU\nnum_processes: 2\n")
    for files in ([], ["--accelerate", str(acc)]):
        result = invoke("check", "--target", "224", "--gpus", "2", *files)
        assert result.exit_code == 0, result.output
        assert ("assumed accumulation 1, the default of DeepSpeed, accelerate and the HF Trainer"
                in " ".join(result.output.split())), result.output

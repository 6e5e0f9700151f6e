"""One clear line instead of a traceback, for inputs a new user tried (issue: every command, tried as a new user would)."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from typer.testing import CliRunner

from autobatch.cli import app
from tests.extras import need

runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, list(args))


def one_line_error(result, code: int = 2) -> str:
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output and result.exception is None or isinstance(result.exception, SystemExit)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


# --- broken JSON without hjson ---------------------------------------------------------------


def test_broken_deepspeed_json_without_hjson_is_one_problem(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "hjson", None)  # as if the deepspeed extra were not installed
    path = tmp_path / "broken.json"
    path.write_text('{"train_batch_size": 224,,}')
    result = invoke("check", "--deepspeed", str(path), "--json")
    assert result.exit_code == 1, result.output
    data = json.loads(result.stdout)
    assert [p["code"] for p in data["problems"]] == ["unreadable-file"]
    assert "must be valid JSON" in data["problems"][0]["message"]
    text = invoke("check", "--deepspeed", str(path))
    assert text.exit_code == 1 and "hjson" not in text.output and "must be valid JSON" in text.stdout


# --- deeply nested files -----------------------------------------------------------------------


@pytest.mark.parametrize("suffix, text", [
    (".json", "[" * 100_000 + "]" * 100_000),
    (".yaml", "[" * 100_000 + "]" * 100_000),
], ids=["json", "yaml"])
def test_deeply_nested_config_is_one_line(tmp_path, suffix, text):
    path = tmp_path / f"deep{suffix}"
    path.write_text(text)
    option = "--deepspeed" if suffix == ".json" else "--accelerate"
    result = invoke("check", option, str(path))
    assert result.exit_code == 1 and "nested" in result.stdout and "Traceback" not in result.output
    assert len(result.stdout.splitlines()) < 5


# --- numbers that are not numbers ---------------------------------------------------------------


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_estimate_refuses_a_fragmentation_that_is_not_finite(value):
    line = one_line_error(invoke("estimate", "--model", "tiny-mlp", "--fragmentation", value))
    assert "fragmentation" in line and value in line  # typer's bound or the library's rule, one line either way


def test_num_classes_zero_is_one_line(tmp_path):
    (tmp_path / "net.py").write_text("import torch\ndef make():\n    return torch.nn.Linear(8, 4)\n")
    line = one_line_error(invoke("find", "--model", f"{tmp_path / 'net.py'}:make", "--input-shape", "8",
                                 "--num-classes", "0", "--device", "cpu", "--memory", "1MiB"))
    assert "num-classes" in line and "0" in line


def test_lazy_modules_are_one_line(tmp_path):
    (tmp_path / "net.py").write_text(
        "import torch\ndef make():\n    return torch.nn.Sequential(torch.nn.LazyLinear(8), torch.nn.Linear(8, 4))\n")
    line = one_line_error(invoke("find", "--model", f"{tmp_path / 'net.py'}:make", "--input-shape", "8",
                                 "--device", "cpu", "--memory", "1MiB"))
    assert "uninitialized" in line and "LazyLinear" in line


def test_plot_into_a_directory_is_refused_before_probing(tmp_path):
    line = one_line_error(invoke("find", "--model", "tiny-mlp", "--device", "cpu", "--memory", "4MiB",
                                 "--plot", str(tmp_path)))
    assert "--plot" in line and "directory" in line


def test_verify_ga_with_a_batch_larger_than_host_memory_is_one_line():
    line = one_line_error(invoke("verify-ga", "--model", "tiny-mlp", "--micro-batch", "1000000000000",
                                 "--grad-accum", "1000"))
    assert "memory" in line and "--micro-batch" in line


# --- a read-only cache ------------------------------------------------------------------------


def test_cache_clear_on_a_read_only_cache_is_one_line(tmp_path, monkeypatch):
    import pathlib

    monkeypatch.setenv("AUTOBATCH_CACHE_DIR", str(tmp_path))
    (tmp_path / "probe").mkdir()
    (tmp_path / "probe" / ("a" * 64 + ".json")).write_text("{}")  # an entry as autobatch names them

    def refuse(self, missing_ok=False):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(pathlib.Path, "unlink", refuse)
    line = one_line_error(invoke("cache", "clear"))
    assert "Permission denied" in line and str(tmp_path) in line


def test_tune_on_a_cache_it_cannot_write_is_one_line_before_any_probe(tmp_path, monkeypatch):
    need("optuna")
    import importlib

    monkeypatch.setenv("AUTOBATCH_CACHE_DIR", str(tmp_path))
    (tmp_path / "tune.db").mkdir()  # the study file cannot be opened (as on a read-only cache)

    def refuse(*args, **kwargs):
        raise AssertionError("probed before the study store was checked")

    monkeypatch.setattr(importlib.import_module("autobatch.probing.probe"), "run_trial", refuse)
    line = one_line_error(invoke("tune", "--model", "tiny-mlp", "--target", "8", "--device", "cpu", "--memory", "4MiB"))
    assert "must be writable" in line and "AUTOBATCH_CACHE_DIR" in line


def test_tune_prints_no_optuna_traceback_before_the_one_line_error(capfd, monkeypatch):
    need("optuna")
    import importlib

    from autobatch.errors import AutobatchError

    import optuna

    levels = []

    def broken(*args, **kwargs):
        levels.append(optuna.logging.get_verbosity())  # what optuna logs when this trial fails
        raise AutobatchError("timing refused on purpose")

    monkeypatch.setattr(importlib.import_module("autobatch.tuning.tune"), "time_plan", broken)
    result = invoke("tune", "--model", "tiny-mlp", "--target", "8", "--device", "cpu", "--memory", "4MiB",
                    "--trials", "1", "--no-grad-checkpointing", "--no-cache")
    assert result.exit_code == 2 and "timing refused on purpose" in result.stderr
    # optuna logs a failed trial's traceback at WARNING: it must be below the level in force
    assert levels and all(level > optuna.logging.WARNING for level in levels)
    captured = capfd.readouterr()
    assert "Traceback" not in captured.err + captured.out + result.output


# --- Ctrl-C ------------------------------------------------------------------------------------


def test_ctrl_c_during_the_probe_exits_130_saying_nothing_was_written(monkeypatch, tmp_path):
    import importlib

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(importlib.import_module("autobatch.answering.answer"), "find_plan", interrupted)
    result = invoke("find", "--model", "tiny-mlp", "--device", "cpu", "--memory", "4MiB",
                    "--deepspeed", str(tmp_path / "ds.json"))
    assert one_line_error(result, 130) == "interrupted; nothing was written"
    assert not (tmp_path / "ds.json").exists()


def test_ctrl_c_between_two_files_says_what_was_written(monkeypatch, tmp_path):
    import importlib

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(importlib.import_module("autobatch.configs.bundle"), "write_accelerate_config", interrupted)
    ds = tmp_path / "ds.json"
    result = invoke("solve", "--target", "8", "--deepspeed", str(ds), "--accelerate", str(tmp_path / "acc.yaml"))
    assert one_line_error(result, 130) == f"interrupted; wrote {ds} (deepspeed config)"


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_overheads_refuse_a_fragmentation_that_is_not_finite(value):
    from autobatch.errors import AutobatchError
    from autobatch.estimating.overheads import Overheads

    with pytest.raises(AutobatchError, match="fragmentation .* must be ≥ 1 and finite"):
        Overheads(fragmentation=value)


# --- under a launcher: the error once per job -------------------------------------------------


def _as_rank(monkeypatch, rank: int) -> None:
    import autobatch.cli._app as cli_app

    monkeypatch.setattr(cli_app, "_GRACE_S", 0.0)  # the wait that lets rank 0 speak first
    for name, value in {"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29531"}.items():
        monkeypatch.setenv(name, value)  # torchrun --nproc-per-node 2


@pytest.mark.parametrize("args", [
    ["find", "--model", "tiny-gpt2", "--device", "cpu", "--memory", "8MiB", "--target", "63"],  # no exact plan
    ["find", "--model", "tiny-gpt2", "--device", "cpu", "--memory", "8MiB", "--target", "0"],  # a broken rule
    ["find", "--model", "tiny-gpt2", "--targte", "64"],  # a flag typed wrong
])
def test_under_a_launcher_rank_0_says_an_error_every_rank_meets_and_the_others_do_not(monkeypatch, args):
    # Each rank said it: the job's log held it twice, and --json two objects on the one stdout
    _as_rank(monkeypatch, 1)
    quiet = invoke(*args, "--json")
    assert quiet.exit_code == 2 and quiet.stdout == "" and "Error" not in quiet.stderr, quiet.output
    _as_rank(monkeypatch, 0)
    said = invoke(*args, "--json")
    assert said.exit_code == 2 and json.loads(said.stdout)["exit_code"] == 2
    assert said.stderr.startswith("Error: ")


def test_under_a_launcher_another_rank_says_its_own_error_on_stderr_with_its_rank(monkeypatch, capsys):
    from autobatch import NoBatchFitsError, RankFailedError
    from autobatch.cli._app import _alike, _say_error

    _as_rank(monkeypatch, 1)
    _say_error("only rank 1 cannot read its weights", 2, as_json=True, alike=False)
    out = capsys.readouterr()
    assert out.out == "" and out.err == "rank 1: Error: only rank 1 cannot read its weights\n"
    assert _alike(NoBatchFitsError("rank 1: even a batch of 1 …")) and _alike(RankFailedError("rank 0 failed", rank=0))
    assert not _alike(ValueError("its own")) and not _alike(autobatch_error("its own"))


def autobatch_error(message: str):
    from autobatch import AutobatchError

    return AutobatchError(message)


# --- Python names from Python, flags on the command line ---------------------------------------


def _python_error(call) -> str:
    from autobatch import AutobatchError

    with pytest.raises(AutobatchError) as info:
        call()
    return str(info.value)


def test_an_error_raised_from_python_names_python_options_and_the_cli_its_flags():
    import autobatch
    from autobatch.configs.deepspeed import zero_section

    model = torch.nn.Linear(64, 4)
    make_batch = lambda b: (torch.randn(b, 64), torch.randint(0, 4, (b,)))  # noqa: E731
    said = {
        "headroom": _python_error(lambda: autobatch.find(model, make_batch, target=8, device="cpu", memory="64KiB",
                                                         headroom="63KiB")),
        "fsdp_unit": _python_error(lambda: autobatch.Strategy("zero2", unit="Block")),
        "deepspeed": _python_error(lambda: zero_section("fsdp2")),
        "model": _python_error(lambda: autobatch.answer(autobatch.Request(model="no_such_module:fn", target=8,
                                                                          device="cpu", memory="1MiB"))),
    }
    for name, message in said.items():
        assert f"--{name.replace('_', '-')}" not in message and name in message, (name, message)
    cli = invoke("find", "--model", "tiny-mlp", "--device", "cpu", "--memory", "4MiB", "--headroom", "3MiB",
                 "--target", "8", "--no-cache")
    assert cli.exit_code == 2 and "no batch keeps the headroom" in cli.stderr and "lower --headroom" in cli.stderr


@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_whose_peers_never_come_says_so_in_one_line_within_its_timeout(monkeypatch, rank):
    # An sbatch script that runs autobatch outside srun (SLURM_NTASKS=2, one process): rank 0 waited
    # its collectives' timeout plus a minute, then died with the store's traceback
    import socket

    import autobatch.cli._app as cli_app

    monkeypatch.setattr(cli_app, "_GRACE_S", 0.0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for name, value in {"SLURM_PROCID": str(rank), "SLURM_NTASKS": "2", "SLURM_LOCALID": str(rank), "SLURM_NODEID": "0",
                        "SLURM_NNODES": "1", "SLURM_JOB_ID": "777", "SLURM_JOB_NAME": "train.sh",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(name, value)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    said = invoke("find", "--model", "tiny-gpt2", "--device", "cpu", "--memory", "8MiB", "--timeout", "1")
    assert said.exit_code == 2, said.output
    line = said.stderr.strip().splitlines()[-1]
    assert f"the job's 2 ranks must meet at 127.0.0.1:{port}, but they did not all come within --timeout 1 s" in line
    assert "`srun autobatch …` in the batch script" in line and "Traceback" not in said.stderr


@pytest.mark.parametrize("args, said", [
    (["--gpus", "4", "--nodes", "2"], "--gpus 4 and --nodes 2 asks for another world; drop --gpus and --nodes"),
    (["--gpus", "4"], "--gpus 4 asks for another world; drop --gpus,"),
    (["--nodes", "4"], "--nodes 4 asks for another world; drop --nodes,"),
])
def test_under_a_launcher_gpus_or_nodes_other_than_its_own_are_refused(monkeypatch, args, said):
    # torchrun --nproc-per-node 2 … find --gpus 4 --nodes 2 planned 8 GPUs in every file, with no word
    _as_rank(monkeypatch, 0)
    result = invoke("find", "--model", "tiny-gpt2", "--device", "cpu", "--memory", "8MiB", "--target", "64", *args)
    assert result.exit_code == 2, result.output
    assert "under torchrun the plan is for the ranks it started, 2 per node × 1 node, but " + said in result.stderr
    from autobatch import Request, RequestError, answer

    with pytest.raises(RequestError, match="gpus_per_node=4 asks for another world; drop gpus_per_node"):
        answer(Request(model="tiny-gpt2", device="cpu", memory="8MiB", gpus_per_node=4))


def test_under_a_launcher_its_own_gpus_and_nodes_may_be_said_again(monkeypatch):
    _as_rank(monkeypatch, 0)
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        monkeypatch.setenv("MASTER_PORT", str(s.getsockname()[1]))
    result = invoke("find", "--model", "tiny-gpt2", "--device", "cpu", "--memory", "8MiB", "--gpus", "2", "--nodes", "1",
                    "--timeout", "1")
    assert "must meet at" in result.stderr and "another world" not in result.stderr  # on to the rendezvous

"""One consistent CLI: the same options for the same concept, help that reads cleanly, output scripts can read.

Every check here runs commands in-process (typer's runner) or reads the click command tree;
nothing probes more than a few tiny batches.
"""

from __future__ import annotations

import json
from pathlib import Path
import re
import subprocess
import sys
import textwrap

import pytest
from typer.main import get_command
from typer.testing import CliRunner

from autobatch import AutobatchError
from autobatch.cli import app
from autobatch.cli._app import COMMAND_ORDER
from tests.extras import need

runner = CliRunner()
MODEL_OPTIONS = {"--model", "--seq-len", "--input-shape", "--num-classes", "--trust-remote-code"}


def commands() -> dict[str, object]:
    group = get_command(app)
    found = {name: cmd for name, cmd in group.commands.items() if name != "cache"}
    found.update({f"cache {name}": cmd for name, cmd in group.commands["cache"].commands.items()})
    return found


def options(cmd) -> set[str]:
    return {opt for p in cmd.params if not p.hidden for opt in (*p.opts, *p.secondary_opts)}


def invoke(*args: str):
    return runner.invoke(app, list(args))


@pytest.fixture(scope="module")
def own_model(tmp_path_factory):
    """A file.py:fn returning a bare nn.Module (with BatchNorm), as a user would write it."""
    path = tmp_path_factory.mktemp("own") / "net.py"
    path.write_text(textwrap.dedent("""
        import torch
        def build():
            return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 3))
    """))
    return f"{path}:build"


# --- 13: every command that takes --model takes the same model options ------------------


def test_every_command_with_model_takes_the_same_model_options():
    with_model = {name: cmd for name, cmd in commands().items() if "--model" in options(cmd)}
    assert set(with_model) == {"find", "check", "estimate", "tune", "verify-ga"}
    for name, cmd in with_model.items():
        assert MODEL_OPTIONS <= options(cmd), f"{name} lacks {MODEL_OPTIONS - options(cmd)}"


def test_own_module_runs_under_every_command(own_model):
    # check needs only the layers: no --input-shape asked, and the BatchNorm is found.
    res = invoke("check", "--target", "8", "--micro-batch", "1", "--grad-accum", "8", "--model", own_model, "--json")
    assert res.exit_code == 1, res.output
    assert [p["code"] for p in json.loads(res.stdout)["problems"]] == ["batchnorm"]
    shape = ["--input-shape", "8", "--num-classes", "3"]
    res = invoke("verify-ga", "--model", own_model, *shape, "--micro-batch", "2", "--grad-accum", "2", "--json")
    assert res.exit_code in (0, 3), res.output  # BatchNorm: FLAGGED, never "pass --input-shape"
    res = invoke("estimate", "--model", own_model, *shape, "--gpu-memory", "1GiB", "--max-micro", "64", "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["max_batch"] == 64
    res = invoke("tune", "--model", own_model, *shape, "--target", "4", "--trials", "1", "--device", "cpu",
                 "--memory", "1MiB", "--max-micro", "4", "--timed-steps", "1", "--no-grad-checkpointing", "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["best"]["plan"]["global_batch"] == 4


def test_check_model_never_asks_for_an_input_shape(own_model):
    res = invoke("check", "--target", "8", "--micro-batch", "2", "--grad-accum", "4", "--model", own_model)
    assert res.exit_code == 0, res.output
    assert "input" not in res.output.lower()


# --- 14: the GPU hint of `autobatch gpus` works with find and estimate ----------------------


def test_gpus_hint_names_only_flags_that_find_and_estimate_take():
    hint = invoke("gpus").stdout.splitlines()[-1]
    flags = set(re.findall(r"--[a-z-]+", hint))
    assert flags == {"--gpu-memory"}
    for name in ("find", "estimate"):
        assert flags <= options(commands()[name])


def test_find_estimates_for_a_gpu_given_by_its_memory(monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    res = invoke("find", "--model", "tiny-mlp", "--gpu-memory", "40GiB", "--max-micro", "64", "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["estimated"] is True and data["gpu"]["total_bytes"] == 40 * 2**30
    assert "custom-40.00GiB" in res.stderr


# --- 15: --model file.py:fn runs that file: help and docs say so ---------------------------


def test_model_help_and_docs_say_that_own_code_runs():
    for name, cmd in commands().items():
        model = next((p for p in cmd.params if "--model" in p.opts), None)
        if model is not None:
            assert "run" in model.help and "trust" in model.help, name
    from pathlib import Path

    usage = (Path(__file__).resolve().parents[1] / "docs" / "usage.md").read_text()
    assert "imports and runs" in usage


def test_estimate_help_names_every_memory_term_real_runs_have():
    # Each term of the estimate a real run has, with the option that sets it (tried as a new user would: FSDP's
    # mixed precision and hf:'s task heads were said in the docs only).
    helps = {opt: p.help or "" for p in commands()["estimate"].params for opt in p.opts}
    assert "CUDA context" in helps["--cuda-context"]
    assert "accumulation" in helps["--grads-held"] and "zero_grad(set_to_none=False)" in helps["--grads-held"]
    assert "bf16-true" in helps["--dtype"] and "under FSDP also its mixed precision" in helps["--dtype"]
    assert "adamw8bit" in helps["--optimizer"] and "uint8" in helps["--optimizer"]
    assert "eager" in helps["--attention"] and "sdpa" in helps["--attention"]
    assert all(head in helps["--model"] for head in ("architectures", "sequence or token classification",
                                                     "image classification", "seq2seq"))


# --- 16: one option name per concept ----------------------------------------------------------


def test_one_name_per_concept():
    every = set().union(*(options(cmd) for cmd in commands().values()))
    assert not every & {"--max-batch", "--world-size", "--checkpointing"}
    for name in ("find", "estimate", "tune", "solve"):
        assert "--max-micro" in options(commands()[name]), name
    for name in ("find", "estimate", "tune"):
        assert {"--min-micro", "--grad-checkpointing"} <= options(commands()[name]), name
    for name in ("find", "estimate", "solve"):
        assert {"--deepspeed", "--accelerate", "--hf", "--script"} <= options(commands()[name]), name
    for name in ("find", "solve", "check", "estimate", "tune", "verify-ga"):
        assert {"--gpus", "--nodes"} <= options(commands()[name]), name


def test_old_spellings_still_work_and_say_the_new_name():
    res = invoke("solve", "--target", "8", "--max-batch", "4")
    assert res.exit_code == 0 and "note: --max-batch is now --max-micro" in res.stderr
    assert res.stdout.startswith("4 per GPU × 2 accumulation")


def test_solve_and_estimate_write_hf_args(tmp_path):
    res = invoke("solve", "--target", "64", "--gpus", "2", "--max-micro", "16", "--hf", str(tmp_path / "a.json"))
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "a.json").read_text())["gradient_accumulation_steps"] == 2
    res = invoke("estimate", "--model", "tiny-mlp", "--gpu-memory", "1GiB", "--max-micro", "16", "--target", "64",
                 "--hf", str(tmp_path / "b.json"))
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "b.json").read_text())["per_device_train_batch_size"] == 16


def test_find_prints_the_launch_lines_solve_prints():
    found = invoke("find", "--model", "tiny-mlp", "--target", "64", "--device", "cpu", "--memory", "3MiB",
                   "--max-micro", "16", "--script", "fit.py")
    assert found.exit_code == 0, found.output
    solved = invoke("solve", "--target", "64", "--max-micro", "16", "--script", "fit.py")
    launch = [line for line in solved.stdout.splitlines() if line.split(":")[0] in ("HF TrainingArguments",
                                                                                      "Lightning", "torchrun")]
    assert len(launch) == 3
    for line in launch:
        assert line in found.stdout.splitlines()


# --- 17: --version, clean help, examples, defaults once, flags named, conflicts ------------


def test_version():
    from autobatch import __version__

    res = invoke("--version")
    assert res.exit_code == 0 and res.stdout.strip() == f"autobatch {__version__}"


def test_help_lists_commands_in_the_order_a_user_needs_them():
    text = invoke("--help").stdout
    listed = [name for name in COMMAND_ORDER if re.search(rf"│ {re.escape(name)}\s", text)]
    assert listed == COMMAND_ORDER
    assert sorted(text.index(f"│ {name} ") for name in listed) == [text.index(f"│ {name} ") for name in listed]


def test_every_commands_description_is_paragraphs_the_terminal_wraps():
    # the docstrings' source line breaks were kept: "estimates for --gpu (or --gpu-memory) from a" then a ragged line
    for name, cmd in commands().items():
        paragraphs = (cmd.help or "").split("\n\n")
        assert paragraphs[0] and all("\n" not in p for p in paragraphs), (name, cmd.help)


@pytest.mark.parametrize("name", ["find", "solve", "check", "estimate", "tune", "verify-ga", "gpus", "models",
                                  "cache", "cache list", "cache clear"])
def test_every_help_ends_with_examples_and_shows_no_bool_type(name):
    res = invoke(*name.split(), "--help")
    assert res.exit_code == 0
    text = res.stdout
    assert "<bool>" not in text and "<int range>" not in text
    examples = text[text.index("Examples:"):]
    assert f"$ autobatch {name}" in examples
    cmd = commands().get(name)  # a group ("cache") has its commands' options, none of its own
    params = cmd.params if cmd is not None else []
    for param in params:
        # A default is shown once: by typer, or in the help text, never both.
        shown = param.show_default is not False and param.default not in (None, False)
        assert not (shown and "default" in (param.help or "").lower()), (name, param.opts)
    seq = next((p for p in params if "--seq-len" in p.opts), None)
    if seq is not None:
        assert isinstance(seq.show_default, str) and "model" in seq.show_default


@pytest.mark.parametrize(("args", "message"), [
    (["find", "--model", "tiny-mlp", "--headroom", "lots", "--device", "cpu", "--memory", "2MiB"],
     "--headroom must be a fraction (0.05), a percentage (5%) or a size (2GiB), but got 'lots'"),
    (["find", "--model", "tiny-gpt2", "--seq-len", "0", "--device", "cpu", "--memory", "2MiB"],
     "--seq-len must be one positive integer or several separated by commas, but got '0'"),
    (["find", "--model", "tiny-mlp", "--device", "cpu", "--memory", "lots"],
     "--memory must be a positive size"),
    (["estimate", "--model", "tiny-mlp", "--gpu-memory", "0GiB"], "--gpu-memory must be a positive size"),
    (["find", "--model", "tiny-mlp", "--device", "cpu", "--memory", "4"],  # four bytes: nobody means that
     "--memory needs a unit (B, KiB, MiB, GiB, TiB, KB, MB, GB, TB), but got '4'; write e.g. 4GiB"),
    (["find", "--model", "tiny-mlp", "--device", "cpu", "--memory", "2MiB", "--min-micro", "8", "--max-micro", "4"],
     "--max-micro (4) must be at least --min-micro (8); raise --max-micro or lower --min-micro"),
    (["estimate", "--model", "tiny-mlp", "--min-micro", "8", "--max-micro", "4"],
     "--max-micro (4) must be at least --min-micro (8); raise --max-micro or lower --min-micro"),
    # a library error opens with the flag the user typed, not the Python name
    (["find", "--model", "tiny-mlp", "--device", "cpu", "--memory", "4MiB", "--dtype", "fp8"],
     "--dtype must be one of fp32, bf16, fp16, bf16-true, fp16-true, but got 'fp8'"),
    (["find", "--model", "tiny-mlp", "--device", "gpu"], "--device must be 'cuda', 'cuda:N' or 'cpu', but got 'gpu'"),
    (["find", "--model", "tiny-mlp", "--device", "cpu", "--memory", "2MiB", "--gpu", "t4"],
     "--gpu names a GPU to estimate for, but find probes --device cpu with real steps"),
    (["estimate", "--model", "tiny-mlp", "--gpu", "t4", "--gpu-memory", "40GiB"],
     "--gpu t4 and --gpu-memory 40GiB both name the GPU to estimate for; pass one"),
    (["find", "--model", "tiny-mlp", "--gpu", "t4", "--gpu-memory", "40GiB"],
     "--gpu t4 and --gpu-memory 40GiB both name the GPU to estimate for; pass one"),
])
def test_bad_values_and_conflicts_are_one_line_naming_the_flag(args, message):
    res = invoke(*args)
    assert res.exit_code == 2
    assert res.stdout == ""
    assert len(res.stderr.splitlines()) == 1 and res.stderr.startswith("Error: ") and message in res.stderr


def test_cache_warning_is_one_line_without_a_source_path(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOBATCH_CACHE_DIR", str(tmp_path))
    base = ["find", "--model", "tiny-mlp", "--target", "8", "--device", "cpu", "--memory", "2MiB", "--max-micro", "8"]
    assert invoke(*base).exit_code == 0
    for entry in tmp_path.rglob("*.json"):
        entry.write_text("{not json")
    res = invoke(*base)
    assert res.exit_code == 0, res.output
    warning = [line for line in res.stderr.splitlines() if "cache" in line]
    assert len(warning) == 1 and warning[0].startswith("warning: autobatch cache: ")
    assert ".py:" not in res.stderr and "warnings.warn" not in res.stderr


# --- 18: output for pipes and scripts -------------------------------------------------------


def test_output_to_a_pipe_is_not_wrapped(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    res = invoke("find", "--model", "tiny-mlp", "--target", "300", "--gpus", "4", "--device", "cpu", "--memory", "3MiB",
                 "--deepspeed", "ds.json")
    assert res.exit_code == 0, res.output
    hf = [line for line in res.stdout.splitlines() if line.startswith("HF TrainingArguments:")]
    assert len(hf) == 1 and len(hf[0]) > 80 and hf[0].endswith("--deepspeed ds.json")


@pytest.mark.parametrize("args", [
    ["solve", "--target", "7", "--gpus", "2"],
    ["solve", "--target", "zero"],
    ["check", "--target", "8", "--micro-batch", "1", "--grad-accum", "8", "--model", "nope"],
    ["estimate", "--model", "tiny-mlp", "--gpu", "no-such-gpu"],
    ["verify-ga", "--model", "nope", "--micro-batch", "1", "--grad-accum", "2"],
    ["find", "--model", "tiny-mlp", "--device", "cpu", "--memory", "1KiB"],
])
def test_json_errors_are_json_on_stdout_and_one_line_on_stderr(args):
    res = invoke(*args, "--json")
    assert res.exit_code == 2
    data = json.loads(res.stdout)
    assert data["exit_code"] == 2 and data["error"]
    assert res.stderr.splitlines() == [f"Error: {data['error']}"]


def test_find_json_with_plot_still_writes_the_plot(tmp_path):
    need("matplotlib")
    png = tmp_path / "p.png"
    res = invoke("find", "--model", "tiny-mlp", "--target", "8", "--device", "cpu", "--memory", "2MiB",
                 "--max-micro", "8", "--plot", str(png), "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["plot"] == str(png) and png.stat().st_size > 0


# --- 19: `autobatch models` builds nothing ------------------------------------------------


def test_models_lists_without_building_or_importing_transformers():
    code = ("import sys, json; from typer.testing import CliRunner; from autobatch.cli import app; "
            "r = CliRunner().invoke(app, ['models', '--json']); assert r.exit_code == 0, r.output; "
            "print(json.dumps([len(json.loads(r.stdout)), 'transformers' in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [13, False]


def test_stored_parameter_counts_are_what_the_models_have():
    need("transformers")
    from autobatch.models import BUILTIN_MODELS, count_parameters

    for name, builtin in BUILTIN_MODELS.items():
        assert builtin.parameters == count_parameters(name), name


RECIPES = sorted((Path(__file__).resolve().parents[1] / "recipes").glob("*.py"))
# Other spellings of the CLI's concepts: a recipe takes the CLI's own (--gpus, --max-micro, …).
SYNONYMS = {"--gpus-per-node", "--devices", "--world-size", "--num-gpus", "--nproc", "--max-batch", "--batch-size",
            "--micro", "--micro-batch-size", "--grad-accumulation", "--accumulation"}


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_recipes_spell_each_concept_as_the_cli_does(recipe):
    flags = set(re.findall(r"add_argument\(\"(--[\w-]+)\"", recipe.read_text()))
    assert not flags & SYNONYMS, f"{recipe.name} takes {sorted(flags & SYNONYMS)}; use the CLI's flag"


def test_the_drop_ins_take_max_micro_and_still_accept_max_batch():
    from autobatch.integrations._common import max_micro_of

    assert max_micro_of(8, None, "AutoBatch") == 8
    with pytest.warns(FutureWarning, match="max_batch= is now max_micro="):
        assert max_micro_of(None, 8, "AutoBatch") == 8
    with pytest.raises(AutobatchError, match="got both max_micro= and its old name max_batch="):
        max_micro_of(8, 8, "AutoBatch")


@pytest.mark.parametrize("group, names", [((), "find, solve, check"), (("cache",), "list, clear")])
def test_a_group_without_its_command_shows_its_help_and_says_what_is_missing(group, names):
    res = invoke(*group)
    assert res.exit_code == 2 and "Usage:" in res.stdout
    line = res.stderr.strip()
    assert len(line.splitlines()) == 1 and f"a command must follow: one of {names}" in line, line

"""An error in the user's own model, data or loss is one line naming their file and line (the
whole traceback with --debug); an error of autobatch's own keeps its traceback."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from autobatch.cli import app

DATA = Path(__file__).resolve().parent / "data"


@pytest.fixture
def user(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shutil.copy(DATA / "user_errors.py", tmp_path / "user.py")
    (tmp_path / "broken.py").write_text("def build(:\n    pass\n")
    (tmp_path / "needs.py").write_text("import torch\ndef build(width):\n    return torch.nn.Linear(width, 2)\n")
    (tmp_path / "missing.py").write_text("import torchh\ndef build():\n    pass\n")
    return tmp_path


def find(*model: str, debug: bool = False):
    flags = ["--debug"] if debug else []
    return CliRunner().invoke(app, [*flags, "find", "--model", *model, "--device", "cpu", "--memory", "4MiB",
                                    "--no-cache"])


CASES = [
    (["user.py:boom"], "the --model function raised ValueError: bad config", "user.py:9 in boom"),
    (["user.py:no_forward", "--input-shape", "64"], "the model's forward raised NotImplementedError: Module "
     "[NoForward] is missing the required \"forward\" function", "module.py"),
    (["user.py:returns_str", "--input-shape", "64"], "must return a tensor of logits", "returned str"),
    (["user.py:returns_none", "--input-shape", "64"], "must return a tensor of logits", "returned NoneType"),
    (["user.py:returns_dict", "--input-shape", "64"], "must return a tensor of logits", "returned dict"),
    (["user.py:frozen", "--input-shape", "64"], "the model has no trainable parameters", "unfreeze"),
    (["user.py:linear", "--input-shape", "32"], "the model's forward raised RuntimeError: mat1 and mat2 shapes "
     "cannot be multiplied (1x32 and 64x10)", "linear.py"),
    (["user.py:vector_loss"], "the loss must be a tensor with one element, but loss_fn returned one of shape",
     "user.py:61"),
    (["user.py:float_loss"], "the loss must be a tensor with one element, but loss_fn returned float", "user.py:65"),
    (["user.py:bad_data"], "make_batch(b) raised KeyError: 'image_path'", "user.py:70 in make"),
    (["user.py:ignores_b"], "make_batch(1) must return a batch of 1 samples, but no tensor in it has a dimension of 1",
     "shapes: (3, 64), (3,)"),
    (["broken.py:build"], "importing the --model file failed: SyntaxError", "broken.py:1"),
    ([":build"], "--model ':build' must be file.py:function or package.module:function", "train.py:build_model"),
    (["user.py:exits"], "the --model function called sys.exit(3)", "user.py:75 in exits"),
    (["needs.py:build"], "--model 'needs.py:build' is called with no arguments, but build() needs width", "defaults"),
    (["missing.py:build"], "importing the --model file or module raised ModuleNotFoundError: No module named 'torchh'",
     "missing.py:1 in <module>"),
]


@pytest.mark.parametrize("model, said, where", CASES, ids=[c[0][0] for c in CASES])
def test_an_error_in_the_users_code_is_one_line_naming_it(user, model, said, where):
    result = find(*model)
    assert result.exit_code == 2, result.output
    line = result.stderr.strip()
    assert len(line.splitlines()) == 1 and "Traceback" not in line, line
    assert said in line and where in line, line


def test_debug_shows_the_users_own_exception(user):
    result = find("user.py:boom", debug=True)
    assert isinstance(result.exception, ValueError) and str(result.exception) == "bad config"


def test_an_error_of_autobatchs_own_keeps_its_traceback(monkeypatch):
    import importlib

    answer = importlib.import_module("autobatch.answering.answer")

    def broken(*args, **kwargs):
        raise ZeroDivisionError("a bug of ours")

    monkeypatch.setattr(answer, "find_plan", broken)
    result = CliRunner().invoke(app, ["find", "--model", "tiny-mlp", "--device", "cpu", "--memory", "4MiB"])
    assert isinstance(result.exception, ZeroDivisionError)

"""Every shell command shown in README.md and the usage docs runs, as written, with the exit code shown.

In fenced ``bash`` blocks, each line is a command; a trailing ``# exit N`` is its expected exit
code (default 0). ``pip install`` lines and the test command itself are what ``.ci/run`` runs,
so they are not run again here. Commands run in one temporary directory per document (files a
command writes, and the probes it caches, are there for the next), with the repository's
``docs/`` reachable as written.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from autobatch.cli import app

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = ["README.md", "docs/usage.md", "docs/field-reports.md", "docs/lengths.md", "docs/sharding.md",
             "docs/uneven.md"]
_BLOCK = re.compile(r"```bash\n(.*?)```", re.S)
_EXIT = re.compile(r"\s+#\s*exit\s+(\d+)\s*$")


def commands(document: str) -> list[tuple[str, int]]:
    found = []
    for block in _BLOCK.findall((ROOT / document).read_text()):
        for line in block.splitlines():
            line = line.strip()
            if not line or line.startswith("#") or line.startswith("pip ") or "-m pytest" in line:
                continue
            match = _EXIT.search(line)
            expected = int(match.group(1)) if match else 0
            found.append((_EXIT.sub("", line) if match else line.split(" #")[0].rstrip(), expected))
    return found


CASES = [(doc, cmd, code) for doc in DOCUMENTS for cmd, code in commands(doc)]


def test_every_document_shows_commands():
    for doc in DOCUMENTS:
        assert commands(doc), f"{doc} shows no bash commands"
    assert any(cmd.startswith("autobatch find") for _, cmd, _ in CASES)


@pytest.mark.parametrize("document", DOCUMENTS)
def test_commands_run_as_documented(document, tmp_path, monkeypatch):
    # A document's commands in one test, in order, as one user runs them: a command reads the files and
    # cached probes the ones before it wrote (one test per command let pytest-xdist run a command on
    # another worker than the ones before it, in another directory, where its cache was not).
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("AUTOBATCH_CACHE_DIR", str(tmp_path / ".cache"))
    for command, expected in commands(document):
        _runs_as_documented(command, expected)


def _runs_as_documented(command: str, expected: int) -> None:
    if command.startswith("autobatch "):
        # In-process through typer's runner: the same command, without a fresh interpreter per line
        # (tests/test_cli_*.py run the console entry point as a subprocess too).
        result = CliRunner().invoke(app, shlex.split(command)[1:])
        code, stdout, stderr = result.exit_code, result.stdout, result.stderr
        if result.exception is not None and not isinstance(result.exception, SystemExit):
            raise result.exception
    else:
        proc = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=60)
        code, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    assert code == expected, f"{command}\nstdout:\n{stdout}\nstderr:\n{stderr}"
    if expected == 2:
        assert "Traceback" not in stderr and len(stderr.strip().splitlines()) == 1, command


_PYTHON = re.compile(r"```python\n(.*?)```", re.S)
SNIPPETS = [(doc, i, code) for doc in DOCUMENTS for i, code in enumerate(_PYTHON.findall((ROOT / doc).read_text()))]


@pytest.mark.parametrize("document, index, code", SNIPPETS, ids=[f"{d}:python{i}" for d, i, _ in SNIPPETS])
def test_python_snippet_runs(document, index, code, capsys):
    exec(compile(code, f"{document}[python {index}]", "exec"), {"__name__": "__doc_snippet__"})
    # A `print(...)  # text` line promises its output: the text, unless it is marked as a sketch.
    promised = [line.split("#", 1)[1].strip() for line in code.splitlines() if line.startswith("print(") and "#" in line]
    printed = capsys.readouterr().out.splitlines()
    for claim in promised:
        if not claim.startswith(("e.g.", "micro ×")):
            assert claim in printed, f"{document} promises {claim!r}, but the snippet printed {printed}"


def test_readme_python_snippet_prints_a_plan_that_accumulates():
    # The budget binds: the plan shown needs gradient accumulation, so the example shows a real plan.
    code = _PYTHON.findall((ROOT / "README.md").read_text())[0]
    claim = next(line.split("#", 1)[1].strip() for line in code.splitlines() if line.startswith("print(plan)"))
    assert re.fullmatch(r"\d+ per GPU × ([2-9]|\d\d+) accumulation × 1 GPU \(1 per node × 1 node\) = \d+", claim), claim


def test_ci_runs_the_test_command_readme_gives():
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Run the tests"):]
    block = [line for line in _BLOCK.search(section).group(1).splitlines() if line.strip()]
    assert block[-1] == "python3 -m pytest -q -n auto" and block[0].startswith("pip install torch==2.13.0 && pip install -e")
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    assert ci[-len(block):] == block


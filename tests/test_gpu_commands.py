"""The commands docs/benchmarks/README.md lists for a GPU machine, run there (skipped without CUDA)."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.gpu import commands

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = commands()  # the block the GPU run (python -m benchmarks.gpu run) takes


def test_gpu_commands_are_listed():
    assert any(c.startswith("autobatch find --model gpt2") for c in COMMANDS)


@pytest.mark.gpu
@pytest.mark.parametrize("command", [c for c in COMMANDS if not c.startswith("python -m pytest")])
def test_gpu_command_runs(command):
    argv = shlex.split(command)
    argv = [sys.executable, "-m", "autobatch", *argv[1:]] if argv[0] == "autobatch" else [sys.executable, *argv[1:]]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=3600)
    assert proc.returncode == 0, proc.stderr[-3000:]

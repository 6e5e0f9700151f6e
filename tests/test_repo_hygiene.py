"""The checkout holds source, not what runs leave behind: no checkpoint or weights are tracked,
and .gitignore keeps them out (a Lightning finder checkpoint was once committed at the root)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ARTEFACTS = (".ckpt", ".pt", ".pth", ".bin", ".safetensors")


def git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)


pytestmark = pytest.mark.skipif(shutil.which("git") is None or git("rev-parse").returncode != 0,
                                reason="needs a git checkout")


def test_no_binary_artefact_is_tracked():
    tracked = git("ls-files").stdout.splitlines()
    assert [path for path in tracked if path.endswith(ARTEFACTS)] == []


@pytest.mark.parametrize("name", [".scale_batch_size_0f3a.ckpt", "lightning_logs/x.ckpt", "model.pt", "w.safetensors"])
def test_gitignore_keeps_run_artefacts_out(name):
    assert git("check-ignore", "-q", "--no-index", name).returncode == 0, f"{name} is not ignored"

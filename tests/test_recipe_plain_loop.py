"""recipes/plain_loop_ga.py runs as its header says with DDP on 2 gloo processes (the one-process
command runs in tests/test_recipes.py with the other recipes)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "plain_loop_ga.py"
TIMEOUT_S = 60


def run(args: list[str]) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")}
    # Own session, so that a hang kills torchrun's workers too, and only them.
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise AssertionError(f"{' '.join(args)} did not finish within {TIMEOUT_S} s") from None
    assert proc.returncode == 0, out + err
    return out


def losses(out: str) -> list[float]:
    return [float(x) for x in re.findall(r"loss (\d+\.\d+)", out)]


def test_header_names_the_commands_this_test_runs() -> None:
    header = RECIPE.read_text().split("from __future__")[0]
    assert "python recipes/plain_loop_ga.py --steps 30 --micro-batch 2 --grad-accum 4 --verify" in header
    assert "torchrun --standalone --nproc-per-node 2 recipes/plain_loop_ga.py --steps 30 --micro-batch 2 --grad-accum 2" in header


@pytest.mark.slow
def test_ddp_with_two_gloo_processes() -> None:
    # --standalone: torchrun picks a free port itself, so parallel runs cannot collide.
    out = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(RECIPE), "--steps", "30", "--micro-batch", "2", "--grad-accum", "2"])
    assert "# 2 micro batch * 2 grad accum * 2 ranks = 8 sequences per step" in out
    trained = losses(out)
    assert trained[-1] < trained[0] * 0.6

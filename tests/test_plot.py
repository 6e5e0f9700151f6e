"""Plots: non-empty PNG files for a probe and a tuning run; a clear error without matplotlib."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from autobatch import MissingDependencyError, SimulatedBackend, Workload, probe
from autobatch.tuning.tune import tune
from tests.extras import need

PNG = b"\x89PNG\r\n\x1a\n"


def _work() -> Workload:
    return Workload(torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)),
                    lambda b: (torch.randn(b, 8), torch.randint(0, 4, (b,))), name="mlp")


def _is_png(path: Path) -> bool:
    data = path.read_bytes()
    return data[:8] == PNG and len(data) > 1000


def test_probe_plot_is_a_png(tmp_path):
    need("matplotlib")
    from autobatch.tuning.plot import plot_probe

    result = probe(_work(), SimulatedBackend("64KiB"))
    path = plot_probe(result, tmp_path / "sub" / "probe.png", chosen=result.safe_batch - 1)
    assert path == tmp_path / "sub" / "probe.png" and _is_png(path)


def test_tune_plot_is_a_png(tmp_path):
    need("matplotlib")
    from autobatch.tuning.plot import plot_tune

    result = tune(_work(), 8, SimulatedBackend("64KiB"), n_trials=3, timed_steps=1, root=tmp_path, max_batch=8)
    assert _is_png(plot_tune(result, tmp_path / "tune.png"))


def test_missing_matplotlib_names_the_extra(tmp_path, monkeypatch):
    from autobatch.tuning.plot import plot_probe

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    result = probe(_work(), SimulatedBackend("64KiB"))
    with pytest.raises(MissingDependencyError, match=r"autobatch\[plot\]"):
        plot_probe(result, tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()

"""``find --timeout``: how long ranks wait for each other, set from the command line."""

from __future__ import annotations

from typer.testing import CliRunner

from autobatch import AutobatchError
from autobatch.cli import app
from autobatch.distributed import launch
from tests.emulated_cuda import emulated

runner = CliRunner()


def test_find_passes_timeout_to_the_workers_it_starts(monkeypatch):
    seen = {}

    def spawn_local(fn, args=(), **kwargs):
        seen.update(kwargs, probe_options=args[3])
        raise AutobatchError("stopped by the test")

    monkeypatch.setattr(launch, "spawn_local", spawn_local)
    with emulated(2, patch=monkeypatch):  # two GPUs and no launcher: find starts one worker per GPU
        res = runner.invoke(app, ["find", "--model", "tiny-gpt2", "--timeout", "42"])
    assert res.exit_code != 0 and "stopped by the test" in res.output
    assert seen["timeout_s"] == 42 and seen["probe_options"]["timeout_s"] == 42


def test_find_timeout_must_be_at_least_a_second():
    res = runner.invoke(app, ["find", "--model", "tiny-gpt2", "--device", "cpu", "--memory", "8MiB", "--timeout", "0"])
    assert res.exit_code == 2 and "--timeout" in res.output

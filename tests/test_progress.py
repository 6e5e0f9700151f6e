"""Long work says how far it is: a trace or a training step past two seconds tells the listener what it
is, at which batch, for how long (autobatch/probing/progress.py); the CLI shows it on stderr and keeps
stdout to the answer, --json included."""

from __future__ import annotations

import json
import threading
import time

import pytest
from typer.testing import CliRunner

import autobatch.cli.find as find_cli
from autobatch.cli import app
from autobatch.probing import progress
from autobatch.probing.progress import listening, working


@pytest.fixture
def quick(monkeypatch):
    """Every piece of work counts as long, and the CLI prints every report: the tests run in seconds."""
    monkeypatch.setattr(progress, "AFTER_S", 0.0)
    monkeypatch.setattr(progress, "EVERY_S", 0.05)
    monkeypatch.setattr(find_cli, "_EVERY_S", 0.0)


def test_long_work_reports_what_and_how_long_and_quick_work_says_nothing(monkeypatch) -> None:
    monkeypatch.setattr(progress, "AFTER_S", 0.1)
    monkeypatch.setattr(progress, "EVERY_S", 0.05)
    heard: list[str] = []
    with listening(heard.append):
        with working("quick"):
            pass
        with working("tracing gpt2 at batch 64 on fake tensors"):
            time.sleep(0.3)
    assert heard and all(h.startswith("tracing gpt2 at batch 64 on fake tensors: ") and h.endswith(" s")
                         for h in heard)
    before = threading.active_count()
    with working("no one listens"):  # no listener: no thread, nothing said
        assert threading.active_count() == before


def test_a_trace_between_the_trials_says_nothing_while_paused_and_counts_only_its_own_seconds(monkeypatch) -> None:
    # A trace between CPU trials waits while they run: its progress went on counting the trials' time ("once for
    # every batch: 12 s" beside a trace of 6.17 s) and showed "tracing" while a trial trained (tried as a new user
    # would).
    import torch

    from autobatch.estimating import background
    from autobatch.estimating.prior import GuardedPrior

    monkeypatch.setattr(progress, "AFTER_S", 0.3)
    monkeypatch.setattr(progress, "EVERY_S", 0.1)

    def trace(batch: int) -> float:
        with working("tracing the stand-in"):
            for _ in range(200):  # 0.4 s of its own, in torch calls it pauses at
                torch.zeros(1)
                time.sleep(0.002)
        return 1.0

    heard: list[str] = []
    with listening(heard.append):
        prior = background.TracedBetween(GuardedPrior(trace, "stand-in"), [1], least=0)
        prior.lend(0.2)  # begun, then paused at a torch call: the trials run 1.5 s meanwhile
        time.sleep(1.5)
        assert heard == []  # 0.2 s of its own so far: under the 0.3 s a report waits for
        prior.finish_within(5.0)
    assert prior.ready() and heard, heard
    told = [float(h.removeprefix("tracing the stand-in: ").removesuffix(" s")) for h in heard]
    assert max(told) <= 1.0, heard  # its own 0.4 to 0.6 s, not the 1.5 s it waited
    prior.stop()


def test_a_listener_that_fails_never_touches_the_work(monkeypatch) -> None:
    monkeypatch.setattr(progress, "AFTER_S", 0.0)

    def broken(text: str) -> None:
        raise RuntimeError("a terminal that went away")

    with listening(broken), working("training"):
        time.sleep(0.05)


def test_estimate_json_keeps_stdout_to_the_answer_and_says_its_traces_on_stderr(quick) -> None:
    result = CliRunner().invoke(app, ["estimate", "--model", "tiny-gpt2", "--gpu", "a100-80gb", "--json"])
    assert result.exit_code == 0
    assert json.loads(result.stdout)["max_batch"] > 0  # stdout: the JSON alone
    lines = result.stderr.splitlines()
    # the step traced once for every batch (the search starts at its smallest, 2), and any batch it
    # does not answer at its own size
    assert lines and all(line.startswith(("… tracing tiny-gpt2 once for every batch", "… tracing tiny-gpt2 at batch "))
                         for line in lines)
    assert any(line.startswith("… tracing tiny-gpt2 once for every batch on fake tensors: ") for line in lines)


def test_find_says_its_training_steps_and_sharded_ones(quick) -> None:
    args = ["find", "--model", "tiny-mlp", "--device", "cpu", "--memory", "2MiB", "--no-cache", "--json"]
    plain = CliRunner().invoke(app, [*args, "--no-trace-prior"])
    assert plain.exit_code == 0 and json.loads(plain.stdout)["max_batch"] > 0
    assert any(line.startswith("… training tiny-mlp at batch ") and "(2 steps)" in line
               for line in plain.stderr.splitlines())
    sharded = CliRunner().invoke(app, [*args, "--strategy", "fsdp2", "--gpus", "2", "--no-trace-prior"])
    assert sharded.exit_code == 0, sharded.output
    assert any(line.startswith("… training tiny-mlp under fsdp2 at batch ") for line in sharded.stderr.splitlines())


def test_the_python_api_hears_it_too(monkeypatch) -> None:
    import torch

    import autobatch

    monkeypatch.setattr(progress, "AFTER_S", 0.0)
    heard: list[str] = []
    request = autobatch.Request(model=torch.nn.Linear(64, 10), make_batch=lambda b: (torch.randn(b, 64),
                                torch.randint(0, 10, (b,))), device="cpu", memory="64KiB", headroom=0,
                                trace_prior=False)
    autobatch.answer(request, on_progress=heard.append)
    assert heard and heard[0].startswith("training model at batch 1 (2 steps): ")

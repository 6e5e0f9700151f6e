"""tune: candidate plans per checkpointing setting, a study that resumes, pruning, the CLI.

Throughput figures come from benchmarks; these tests check structure (which plans, how many
trials, what is stored), never that one plan is faster than another.
"""

from __future__ import annotations

import json
from pathlib import Path

import optuna
import pytest
import torch
from torch.utils.checkpoint import checkpoint
from typer.testing import CliRunner

from autobatch import AutobatchError, SimulatedBackend, Workload
from autobatch.tuning.cache import list_entries
from autobatch.cli import app
from autobatch.planning.solver import NoExactPlanError
from autobatch.tuning.candidates import candidate_plans, time_plan
from autobatch.tuning.tune import SlowerThanBestPruner, list_studies, tune
from tests.extras import need


class Checkpointable(torch.nn.Module):
    """Two wide blocks whose activations dominate, with the transformers checkpointing switch."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(8, 128), torch.nn.GELU(), torch.nn.Linear(128, 8)) for _ in range(2)
        )
        self.head = torch.nn.Linear(8, 4)
        self.checkpointing = False

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None) -> None:
        self.checkpointing = True

    def gradient_checkpointing_disable(self) -> None:
        self.checkpointing = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpointing else block(x)
        return self.head(x)


def _work() -> Workload:
    return Workload(Checkpointable, lambda b: (torch.randn(b, 8), torch.randint(0, 4, (b,))), name="ckpt")


def _plain() -> Workload:
    return Workload(torch.nn.Linear(8, 4), lambda b: (torch.randn(b, 8), torch.randint(0, 4, (b,))), name="linear")


BUDGET = "160KiB"  # parameters + AdamW ≈ 73 KiB; activations set the rest
TARGET = 16


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tune-cache")


def test_checkpointing_raises_the_max_micro_and_adds_plans(root):
    candidates, probes = candidate_plans(_work(), TARGET, SimulatedBackend(BUDGET), root=root, max_batch=64)
    assert set(probes) == {False, True}
    assert probes[True].safe_batch > probes[False].safe_batch
    off = [c.plan.micro_batch for c in candidates if not c.grad_checkpointing]
    on = [c.plan.micro_batch for c in candidates if c.grad_checkpointing]
    assert off == [m for m in (16, 8, 4, 2, 1) if m <= probes[False].safe_batch]
    assert on == [m for m in (16, 8, 4, 2, 1) if m <= probes[True].safe_batch]
    assert all(c.plan.global_batch == TARGET for c in candidates)
    assert len(list_entries(root)) == 2  # one cached probe per setting


def test_a_model_without_the_switch_only_tries_checkpointing_off(tmp_path):
    candidates, probes = candidate_plans(_plain(), 8, SimulatedBackend("64KiB"), root=tmp_path, max_batch=8)
    assert set(probes) == {False}
    assert [c.plan.micro_batch for c in candidates] == [8, 4, 2, 1]


def test_study_resumes_and_reports_the_best_plan(root):
    first = tune(_work(), TARGET, SimulatedBackend(BUDGET), n_trials=3, timed_steps=2, root=root, max_batch=64)
    storage = first.storage
    assert storage == f"sqlite:///{(root / 'tune.db').resolve()}"
    assert len(optuna.load_study(study_name=first.study_name, storage=storage).trials) == 3
    # the first trial is the largest-micro plan without checkpointing: the baseline
    assert (first.baseline.trial_number, first.baseline.candidate.plan.micro_batch) == (0, 16)
    assert first.baseline.candidate.grad_checkpointing is False

    second = tune(_work(), TARGET, SimulatedBackend(BUDGET), n_trials=2, timed_steps=2, root=root, max_batch=64)
    assert second.study_name == first.study_name
    assert len(optuna.load_study(study_name=second.study_name, storage=storage).trials) == 5
    assert {"name": second.study_name, "trials": 5} in list_studies(root)
    assert len(list_entries(root)) == 2  # the second run read both probes from the cache

    best = second.best
    assert best.candidate in second.candidates and best.state == "COMPLETE"
    assert best.candidate.plan.global_batch == TARGET
    assert best.samples_per_second >= second.baseline.samples_per_second
    assert second.speedup == pytest.approx(best.samples_per_second / second.baseline.samples_per_second)
    data = second.to_dict()
    assert data["best"]["plan"]["global_batch"] == TARGET and len(data["measurements"]) <= 5
    assert "speed-up" in str(second) and second.study_name in str(second)


def test_a_resumed_study_times_its_baseline_again_before_claiming_a_speedup(tmp_path, monkeypatch):
    # The first run's process was cold: every plan timed at 10 samples/s. The second run's plans all
    # run at 40. Against the first run's baseline that read as a 4× speed-up that is not there.
    import importlib

    module = importlib.import_module("autobatch.tuning.tune")
    rate = {"now": 10.0}
    timed: list[str] = []

    def timing(workload, model, backend, plan, *, steps, on_step=None, spread=None):
        timed.append(f"{plan.micro_batch}x{plan.grad_accum}")
        return rate["now"], 0.01

    monkeypatch.setattr(module, "time_plan", timing)
    first = tune(_plain(), TARGET, SimulatedBackend(BUDGET), n_trials=1, root=tmp_path, max_batch=64)
    assert first.speedup == 1.0
    rate["now"] = 40.0
    second = tune(_plain(), TARGET, SimulatedBackend(BUDGET), n_trials=2, root=tmp_path, max_batch=64)
    assert timed[1] == timed[0]  # the baseline, timed again first in the second run
    assert second.baseline.trial_number == 1 and second.baseline.samples_per_second == 40.0
    assert second.speedup == 1.0 and len(second.measurements) == 3
    assert [m.earlier_run for m in second.measurements] == [True, False, False]
    assert "timing(s) from earlier runs are in --json as earlier_run, not compared" in str(second)
    # this run's own timings only: 40 is not pruned against an earlier, faster machine's figure
    rate["now"] = 1000.0
    tune(_plain(), TARGET, SimulatedBackend(BUDGET), n_trials=1, root=tmp_path, max_batch=64)
    rate["now"] = 40.0
    fourth = tune(_plain(), TARGET, SimulatedBackend(BUDGET), n_trials=2, root=tmp_path, max_batch=64)
    assert all(m.state == "COMPLETE" for m in fourth.measurements if not m.earlier_run)


def test_a_plan_proposed_again_in_a_run_is_never_timed_again_pruned_or_not(tmp_path, monkeypatch):
    # A pruned plan was timed again when the sampler proposed it again: the docs say a repeat reuses the first
    import importlib

    module = importlib.import_module("autobatch.tuning.tune")
    timed: list[str] = []

    def timing(workload, model, backend, plan, *, steps, on_step=None, spread=None):
        label = f"{plan.micro_batch}x{plan.grad_accum}"
        timed.append(label)
        rate = 100.0 if plan.grad_accum == 1 else 10.0  # the baseline fast, every other plan pruned
        if on_step is not None:
            on_step(0, rate)
        return rate, 0.01

    monkeypatch.setattr(module, "time_plan", timing)
    result = tune(_plain(), TARGET, SimulatedBackend(BUDGET), n_trials=15, root=tmp_path, max_batch=64)
    assert len(timed) == len(set(timed)) == 5, timed  # five plans for 16 on one GPU: each timed once
    states = [m.state for m in result.measurements]
    assert states.count("COMPLETE") == 1 and states.count("PRUNED") == len(timed) - 1
    # once every plan is timed the study stops, and the trials proposing a plan again are counted aloud
    assert result.trials_run == 5 + result.repeats < 15 and result.trials_asked == 15
    summary = str(result)
    assert f"every candidate plan was timed after {result.trials_run} of the 15 trials asked" in summary
    assert (f"{result.repeats} of this run's {result.trials_run} trials proposed a plan timed already" in summary) \
        == (result.repeats > 0)
    data = result.to_dict()
    assert (data["trials_asked"], data["trials_run"], data["repeats"]) == (15, result.trials_run, result.repeats)


def test_tune_refuses_a_seed_optuna_cannot_take_and_names_a_damaged_study(tmp_path):
    with pytest.raises(AutobatchError, match="seed must be a whole number from 0 to 4294967295"):
        tune(_plain(), TARGET, SimulatedBackend(BUDGET), n_trials=1, root=tmp_path, seed=-1)
    (tmp_path / "tune.db").write_text("this is not a database, but a note of mine\n" * 20)
    with pytest.raises(AutobatchError, match="which is damaged .*`autobatch cache clear` removes it"):
        tune(_plain(), TARGET, SimulatedBackend(BUDGET), n_trials=1, root=tmp_path)


def test_a_different_target_is_a_different_study(root):
    result = tune(_work(), 8, SimulatedBackend(BUDGET), n_trials=1, timed_steps=1, root=root, max_batch=64,
                  checkpointing=[False])
    assert result.baseline.candidate.plan.micro_batch == 8
    assert len(optuna.load_study(study_name=result.study_name, storage=result.storage).trials) == 1


def test_pruner_stops_clearly_slower_trials_only():
    study = optuna.create_study(direction="maximize", pruner=SlowerThanBestPruner.create(0.5))
    study.add_trial(optuna.trial.create_trial(value=100.0, params={}, distributions={}))
    slow, close = study.ask(), study.ask()
    slow.report(40.0, 0)
    close.report(60.0, 0)
    assert slow.should_prune() is True
    assert close.should_prune() is False
    with pytest.raises(AutobatchError, match="prune ratio must be in"):
        SlowerThanBestPruner(1.5)


def test_time_plan_gives_the_model_back_unchanged():
    model = Checkpointable()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    from autobatch.planning.plan import Plan

    work = Workload(model, _work().make_batch, grad_checkpointing=True)
    seen = []
    rate, seconds = time_plan(work, model, SimulatedBackend("1MiB"), Plan(4, 2), steps=2,
                              on_step=lambda i, r: seen.append(i))
    assert seen == [0, 1] and rate > 0 and seconds > 0
    swung: list[float] = []
    time_plan(work, model, SimulatedBackend("1MiB"), Plan(4, 2), steps=3, spread=swung)
    assert len(swung) == 1 and swung[0] >= 0  # two timed steps or more: how far they swung
    time_plan(work, model, SimulatedBackend("1MiB"), Plan(4, 2), steps=1, spread=swung)
    assert len(swung) == 1  # one step has no spread
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert model.checkpointing is False


def test_unreachable_target_and_bad_arguments_say_why(tmp_path):
    with pytest.raises(NoExactPlanError, match="no exact plan"):
        tune(_plain(), 7, SimulatedBackend("64KiB"), n_trials=1, root=tmp_path, max_batch=8, multiple_of=2)
    with pytest.raises(AutobatchError, match="n_trials must be a positive integer"):
        tune(_plain(), 8, SimulatedBackend("64KiB"), n_trials=0, root=tmp_path)


# --- CLI --------------------------------------------------------------------------------------

# docs/tune-and-cache.md shows these commands; they run here one to one.
DOC_COMMANDS = [
    "tune --model tiny-mlp --target 16 --trials 3 --device cpu --memory 2MiB --max-micro 16 --timed-steps 2",
    "tune --model tiny-mlp --target 16 --trials 2 --device cpu --memory 2MiB --max-micro 16 --timed-steps 2 "
    "--plot tune.png",
    "cache list",
    "cache clear",
]


def test_doc_shows_exactly_these_commands():
    doc = Path(__file__).resolve().parents[1] / "docs" / "tune-and-cache.md"
    shown = [line[len("$ autobatch "):] for line in doc.read_text().splitlines() if line.startswith("$ ")]
    assert shown == DOC_COMMANDS


def test_cli_commands_of_the_doc(tmp_path, monkeypatch):
    need("autobatch.models")
    need("matplotlib")
    monkeypatch.setenv("AUTOBATCH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    outputs = []
    for command in DOC_COMMANDS:
        result = runner.invoke(app, command.split())
        assert result.exit_code == 0, result.output
        outputs.append(result.output)
    assert "best:" in outputs[0] and "speed-up:" in outputs[0] and "plan: " in outputs[0]
    assert (tmp_path / "tune.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "1 cached probe" in outputs[2] and ": 5 trials" in outputs[2]
    assert "removed 2 files" in outputs[3]


def test_cli_json_and_errors(tmp_path, monkeypatch):
    need("autobatch.models")
    monkeypatch.setenv("AUTOBATCH_CACHE_DIR", str(tmp_path / "cache"))
    runner = CliRunner()
    base = "tune --model tiny-mlp --target 8 --trials 1 --device cpu --memory 2MiB --max-micro 8 --timed-steps 1"
    result = runner.invoke(app, [*base.split(), "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["best"]["plan"]["global_batch"] == 8 and data["max_micro"] == {"off": 8}
    bad = runner.invoke(app, [*base.split(), "--grad-checkpointing", "sometimes"])
    assert bad.exit_code == 2 and "unexpected extra argument(s) (sometimes)" in bad.stderr
    listed = runner.invoke(app, ["cache", "list", "--json"])
    assert json.loads(listed.stdout)["entries"][0]["max_batch"] == 8


@pytest.mark.parametrize("lead, within", [(1.03, True), (1.5, False)])
def test_a_lead_no_larger_than_the_steps_swung_is_called_noise(tmp_path, monkeypatch, lead, within):
    """On a busy machine steps swing: a best plan 3 % ahead of the baseline, whose steps each swung
    by 4–5 %, is no answer; one 50 % ahead is. Both say how far their steps swung."""
    import importlib

    module = importlib.import_module("autobatch.tuning.tune")

    def timing(workload, model, backend, plan, *, steps, on_step=None, spread=None):
        spread.append(0.05 if plan.grad_accum == 1 else 0.04)
        return (100.0 if plan.grad_accum == 1 else 100.0 * lead), 0.01

    monkeypatch.setattr(module, "time_plan", timing)
    result = tune(_plain(), TARGET, SimulatedBackend(BUDGET), n_trials=3, root=tmp_path, max_batch=64)
    assert result.best.candidate != result.baseline.candidate
    assert (result.best.spread, result.baseline.spread) == (0.04, 0.05)
    assert result.within_spread is within and result.to_dict()["within_spread"] is within
    assert result.to_dict()["best"]["spread"] == 0.04
    text = str(result)
    assert "± 4.0 % over its steps" in text and "± 5.0 % over its steps" in text
    assert ("no more than the two plans' steps swung (± 4.0 % and ± 5.0 %): time more steps (--timed-steps 10)"
            in text) is within

"""The trace beside the trials (autobatch/estimating/background.py): the search takes its lead once it
is ready, never waits for it, and nothing it does outlives the probe."""

from __future__ import annotations

import dataclasses
import doctest
import math
import os
import threading
import time
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor

import autobatch
from autobatch.estimating import background, spawned
from autobatch.estimating.background import NOT_READY, TracedBeside, beside
from autobatch.estimating.spawned import DIED, SpawnedBeside
from autobatch.estimating.prior import GuardedPrior, try_trace_prior
from autobatch.pipeline import find_plan
from autobatch.probing.backends import CudaBackend
from autobatch.probing.probe import prior_report
from autobatch.probing.search import search_max
from autobatch.probing.trial import Trial
from tests.emulated_cuda import emulated_cuda  # noqa: F401 - the fixture
from tests.tiny import mlp, mlp_workload


def no_trace_thread() -> bool:
    """No trace left behind: no thread, no process of its own."""
    return not any(t.name == "autobatch-trace" and t.is_alive() for t in threading.enumerate()) and not [
        p for p in Path("/proc").iterdir() if p.name.isdigit() and _child_tracing(p)]


def _child_tracing(proc: Path) -> bool:
    try:
        parent = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
        return parent == os.getpid() and b"autobatch.estimating.spawned" in (proc / "cmdline").read_bytes()
    except (OSError, IndexError, ValueError):  # ended while read
        return False


def oracle(b: int) -> Trial:
    return Trial(b, 100 + 7 * b <= 1000, 100 + 7 * b, 100 + 7 * b, resident_bytes=100)


class Beside:
    """A prior traced beside the trials, ready after ``after`` questions (the search asks once a trial)."""

    def __init__(self, after: int | None):
        self.after, self.asked, self.stopped, self.from_trial = after, 0, False, None

    def ready(self) -> bool:
        self.asked += 1
        return self.after is not None and self.asked > self.after

    def stop(self) -> None:
        self.stopped = True

    def __call__(self, batch: int) -> float:
        return 100 + 7 * batch


def batches(outcome) -> list[int]:
    return [t.batch for t in outcome.trials]


def test_a_prior_ready_at_once_leads_as_a_traced_prior_does():
    prior = Beside(after=0)
    outcome = search_max(oracle, 1000, prior=prior)
    assert batches(outcome) == batches(search_max(oracle, 1000, prior=lambda b: 100 + 7 * b)) == [1, 128, 129]
    assert prior.from_trial == 1 and prior.stopped


def test_a_prior_never_ready_leaves_the_trials_alone_and_is_stopped():
    prior = Beside(after=None)
    outcome = search_max(oracle, 1000, prior=prior)
    assert batches(outcome) == batches(search_max(oracle, 1000)) == [1, 25, 128, 129]
    assert prior.from_trial is None and prior.stopped


def test_a_prior_ready_midway_leads_from_then_on_and_the_answer_stays_exact():
    prior = Beside(after=1)
    outcome = search_max(oracle, 1000, prior=prior)
    assert outcome.max_batch == 128 and batches(outcome)[-2:] == [128, 129]
    assert batches(outcome)[:2] == [1, 25]  # the trials alone until it was ready
    assert prior.from_trial == 2 and len(outcome.trials) <= 5


def test_a_trace_still_running_when_the_search_ends_is_cancelled_and_never_waited_for():
    started = threading.Event()

    def endless(batch: int) -> float:
        started.set()
        while True:  # a trace that would never end: every torch call checks the stop
            torch.zeros(1)

    prior = TracedBeside(GuardedPrior(endless, "endless"), [1])
    started.wait(10)
    start = time.perf_counter()
    outcome = search_max(oracle, 1000, prior=prior)
    assert outcome.max_batch == 128 and batches(outcome) == [1, 25, 128, 129]
    assert time.perf_counter() - start < 5 and prior.cancelled
    assert no_trace_thread()
    record = prior_report(prior)["trace_prior"]
    assert record["led"] is False and record["reason"] == NOT_READY and record["failure"] is None


def _slow_steps():
    # Trials that take a second a step while the trace (on fake tensors) does not wait: the trace
    # is ready long before the second trial.
    def loss_fn(model, batch):
        x, y = batch
        if not isinstance(x, FakeTensor):
            time.sleep(0.5)
        return torch.nn.functional.cross_entropy(model(x), y)

    return autobatch.Workload(mlp, lambda b: (torch.randn(b, 64), torch.randint(0, 10, (b,))), loss_fn=loss_fn)


def test_on_a_real_probe_the_trace_beside_leads_and_leaves_nothing_behind():
    work = _slow_steps()
    state = torch.get_rng_state()
    prior = beside(work, device_type="cpu")
    result = autobatch.probe(work, autobatch.SimulatedBackend("2MiB"), prior=prior, headroom=0)
    alone = autobatch.probe(mlp_workload(), autobatch.SimulatedBackend("2MiB"), headroom=0)  # the same memory, no waits
    assert result.max_batch == alone.max_batch
    record = result.trace_record
    assert record["led"] is True and record["from_trial"] >= 1 and len(result.trials) <= len(alone.trials)
    assert no_trace_thread()
    assert torch.equal(torch.get_rng_state(), state)


def test_a_model_passed_in_is_bit_identical_after_a_probe_traced_beside():
    model = mlp()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    work = mlp_workload(model)
    autobatch.probe(work, autobatch.SimulatedBackend("2MiB"), prior=beside(work, device_type="cpu"))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_find_on_a_gpu_traces_beside_its_trials(emulated_cuda):  # noqa: F811 - the fixture
    finding = find_plan(mlp_workload(), backend=CudaBackend(), max_batch=256, headroom=0)
    record = finding.probe.trace_record
    assert "from_trial" in record and record["failure"] is None
    assert no_trace_thread()


def test_the_examples_run():
    assert doctest.testmod(background).failed == 0


def test_a_prior_flat_over_the_three_largest_fits_calibrates_by_its_offset():
    # A prior that took the lead after three trials can be flat over all of them (a staircase's
    # step, or a trace that books the same bytes there): no slope to scale by, and no division by it.
    from autobatch.probing.memory_curve import calibrate

    curve = calibrate(lambda b: 1000.0, {10: 500, 20: 600, 30: 700})
    assert curve(30) == 700 and curve(40) >= 700


def test_the_report_says_from_which_trial_the_trace_led():
    from autobatch.probing.result import trace_record

    said = trace_record({"led": True, "reason": None, "from_trial": 1, "traced_batches": [2, 4, 16], "seconds": 1.5,
                         "failure": None})
    result = autobatch.probe(mlp_workload(), autobatch.SimulatedBackend("2MiB"))
    line = type(result)(**{**result.__dict__, "extra": {"trace_prior": said}}).trace_line()
    assert line.startswith("led by the fake-tensor trace from trial 2 on (traced beside the trials: traced at batches 2, 4, 16")


def _instant(b: int) -> Trial:
    return oracle(b)


def test_a_trace_between_cheap_trials_never_runs_longer_than_they_took_and_says_why_it_did_not_lead():
    def endless(batch: int) -> float:
        while True:  # a trace that would never end: it pauses and stops at its torch calls
            torch.zeros(1)

    def slow_trial(b: int) -> Trial:
        time.sleep(0.1)
        return oracle(b)

    prior = background.TracedBetween(GuardedPrior(endless, "endless"), [1], least=0)
    outcome = search_max(slow_trial, 1000, prior=prior)
    assert batches(outcome) == [1, 25, 128, 129] and prior.cancelled
    assert no_trace_thread()
    record = prior_report(prior)["trace_prior"]
    assert record["led"] is False and record["between"] is True
    assert record["reason"].startswith("the trials were cheaper than the trace: they ended the search in ")
    assert "run between them for as long" in record["reason"], record  # begun, unlike a trace never lent a window
    # It ran while the search lent it time, before each trial but the first: up to what the trials
    # had taken so far each time: the three trials before the last, 0.3 s in all (windows that
    # forgot what was lent before would take 0.1 + 0.2 + 0.3 = 0.6 s). Its pace unknown (no batch
    # traced), it was also let run once as long again as it had, after the first trial: 0.1 s that
    # the second window then did not add. The slack is the trace's way to its next torch call and
    # the thread's wake-up, four times.
    assert 0 < prior.trials_seconds and prior.used <= prior.trials_seconds + 0.2


def test_a_trace_between_is_not_begun_in_a_window_shorter_than_its_start_takes():
    started = []

    def trace(batch: int) -> float:
        started.append(batch)  # an unpausable start (torch's lazy imports) would run here
        return 100 + 7 * batch

    def trial(b: int) -> Trial:
        time.sleep(0.05)
        return oracle(b)

    # trials of 0.05 s lend it 0.05, 0.1 and 0.15 s, each short of FIRST_WINDOW: never begun, no thread
    prior = background.TracedBetween(GuardedPrior(trace, "short"), [1])
    outcome = search_max(trial, 1000, prior=prior)
    assert batches(outcome) == [1, 25, 128, 129] and started == [] and prior.used == 0 and no_trace_thread()
    record = prior_report(prior)["trace_prior"]
    assert record["led"] is False and record["reason"].startswith("the trials were cheaper than the trace")
    assert "the trace was not begun" in record["reason"] and "run between them" not in record["reason"], record
    # trials of a second lend it a window as long as its start: begun after the first, it leads from there
    slow = background.TracedBetween(GuardedPrior(trace, "begun"), [1])
    outcome = search_max(lambda b: time.sleep(background.FIRST_WINDOW) or oracle(b), 1000, prior=slow)
    assert started and batches(outcome) == [1, 128, 129] and prior_report(slow)["trace_prior"]["from_trial"] == 1


def _calls(n: int, apart: float = 0.002) -> None:
    """``n`` torch calls ``apart`` seconds apart: a trace's work, pausing (and stopping) at each call."""
    for _ in range(n):
        torch.zeros(1)
        time.sleep(apart)


class _Once:
    """A trace of ``calls`` torch calls, 2 ms apart, for every batch at once (as the symbolic one): no
    batch traced before it ends, each answered at once after."""

    def __init__(self, calls: int):
        self.calls, self.done = calls, False

    def __call__(self, batch: int) -> float:
        _calls(0 if self.done else self.calls)
        self.done = True
        return 100 + 7 * batch


def test_a_trace_whose_pace_is_unknown_is_let_run_once_as_long_again_and_leads_a_trial_sooner():
    def trial(b: int) -> Trial:
        time.sleep(0.2)
        return oracle(b)

    # One trace for every batch, about 0.3 s (150 torch calls 2 ms apart), nothing traced before it
    # ends: lent the first trial's 0.2 s it is not done, so its pace is unknown; let run once as long
    # again (0.2 s, less than the next trial), it ends, and leads from the first trial, as a prior
    # ready at once does: 1, 128, 129 (it would lead from the second, 1, 25, 128, 129, without).
    prior = background.TracedBetween(GuardedPrior(_Once(150), "once"), [1], least=0)
    outcome = search_max(trial, 1000, prior=prior)
    record = prior_report(prior)["trace_prior"]
    assert batches(outcome) == [1, 128, 129], record
    assert record["led"] and record["from_trial"] == 1, record
    assert prior.used <= 2 * 0.2 + 0.1  # twice the first trial at most, and the slack to a torch call
    # an endless one is let run so once only: each later window only catches up with the trials
    endless = background.TracedBetween(GuardedPrior(_Once(10**6), "endless"), [1], least=0)
    outcome = search_max(trial, 1000, prior=endless)
    assert batches(outcome) == [1, 25, 128, 129] and endless.used <= endless.trials_seconds + 0.2 + 0.1


class _SlowStart:
    """A trace whose one trace for every batch stops after ``start`` torch calls, then goes batch by batch
    (``by_batch``, as the curve prior says it once its one trace is done), ``calls`` torch calls a batch,
    20 ms apart (their time is the sleeps', however loaded the machine), keeping what it traced: CLIP's,
    its batch pinned in its loss."""

    def __init__(self, start: int, calls: int):
        self.start, self.calls, self.traced, self.by_batch = start, calls, {}, False

    def __call__(self, batch: int) -> float:
        _calls(self.start if not self.by_batch else 0, apart=0.02)
        self.by_batch = True
        for b in (2, 4, 16, 64):
            if b not in self.traced:
                _calls(self.calls, apart=0.02)
                self.traced[b] = 100 + 7 * b
        return 100 + 7 * batch


def test_a_trace_lent_time_is_weighed_as_soon_as_its_first_batch_shows_its_pace():
    def trial(b: int) -> Trial:
        time.sleep(1.0)
        return dataclasses.replace(oracle(b), seconds_per_step=0.001)

    # Its one trace stops after 0.08 s (4 torch calls), so four traces at that pace look cheap (0.32 s); each
    # takes 0.72 s (36 calls). Lent the first trial's 1.0 s, its first batch, at 0.8 s, shows 2.4 s still to
    # trace at that pace against two trials of about 1.05 s (the next, at 25: its steps grown, not its
    # set-up). It pauses there and is given up, not run to the window's end.
    prior = background.TracedBetween(GuardedPrior(_SlowStart(4, 36), "slow start"), [1], least=0)
    search_max(trial, 1000, prior=prior)
    record = prior_report(prior)["trace_prior"]
    assert record["traced_batches"] == [2] and record["reason"].startswith("the trace would have cost more"), record
    assert prior.used < 1.0, prior.used  # the window would have run to 1.0 s


def test_a_trace_gone_batch_by_batch_is_weighed_at_its_one_traces_seconds_a_batch_before_it_traces_one():
    def trial(b: int) -> Trial:
        time.sleep(1.0)
        return dataclasses.replace(oracle(b), seconds_per_step=0.0005)

    # Its one trace for every batch stops after 0.7 s (35 torch calls) without answering, and each of the four
    # traces at a batch to come takes as long (CLIP's, its batch pinned in its loss: 4.2 s, then 4.4 s a batch).
    # Lent the first trial's 1.0 s, it pauses as it goes batch by batch: four traces at that pace, 2.8 s,
    # against two trials of about 1.02 s (the next, at 25: its steps grown, not its set-up). Given up there,
    # with no batch traced, not run to the window's end (nor to its first batch, at 1.4 s, and given up only
    # then, as before).
    prior = background.TracedBetween(GuardedPrior(_SlowStart(35, 35), "slow start"), [1], least=0)
    outcome = search_max(trial, 1000, prior=prior)
    record = prior_report(prior)["trace_prior"]
    assert record["traced_batches"] == [] and record["reason"].startswith("the trace would have cost more"), record
    assert prior.used < 1.0, prior.used
    assert batches(outcome) == [1, 25, 128, 129] and no_trace_thread()


class _Paced:
    """A trace of ``calls`` torch calls a batch, 2 ms apart (it pauses at them, so its time is its
    own), that keeps what it traced."""

    def __init__(self, calls: int):
        self.calls, self.traced = calls, {}

    def __call__(self, batch: int) -> float:
        _calls(self.calls)
        self.traced[batch] = 100 + 7 * batch
        return self.traced[batch]


def test_a_trace_between_that_would_cost_more_than_it_saves_is_given_up_once_its_pace_is_known():
    def trial(b: int) -> Trial:
        time.sleep(0.05)
        return oracle(b)

    # About 0.12 s a traced batch, four to trace, against trials of 0.05 s: lent their time before
    # each trial, it has traced one batch before the fourth (at 129, next to the fit at 128); what it
    # still needs at its pace passes two such trials, so it is given up there, before that trial.
    prior = background.TracedBetween(GuardedPrior(_Paced(60), "paced"), [2, 4, 16, 64], least=0)
    outcome = search_max(trial, 1000, prior=prior)
    assert batches(outcome) == [1, 25, 128, 129] and prior.cancelled and no_trace_thread()
    record = prior_report(prior)["trace_prior"]
    assert record["led"] is False and record["traced_batches"] == [2]
    assert record["reason"].startswith("the trace would have cost more than the trials it saves: "), record["reason"]
    assert "against about 0.05 s for the next trial" in record["reason"]
    # where the trials cost more than the traced batches, the same trace pays and leads
    dear = background.TracedBetween(GuardedPrior(_Paced(60), "paced"), [2, 4, 16, 64], least=0)
    led = search_max(lambda b: time.sleep(0.4) or oracle(b), 1000, prior=dear)
    assert prior_report(dear)["trace_prior"]["led"] is True and len(led.trials) < len(outcome.trials)


def test_a_trace_between_dear_trials_leads_from_the_first_trial_after_it_is_done():
    work = _slow_steps()  # a second a trial; the trace of this MLP takes a fraction of that
    result = autobatch.probe(work, autobatch.SimulatedBackend("2MiB"), prior=background.between(work), headroom=0)
    alone = autobatch.probe(mlp_workload(), autobatch.SimulatedBackend("2MiB"), headroom=0)
    record = result.trace_record
    assert result.max_batch == alone.max_batch
    assert record["led"] is True and record["from_trial"] == 1 and record["between"] is True
    assert "traced between the trials" in result.trace_line()
    assert len(result.trials) < len(alone.trials)


def test_the_trials_between_the_windows_of_a_trace_keep_their_random_numbers():
    inside, go_on = threading.Event(), threading.Event()

    def forks(batch: int) -> float:
        with torch.random.fork_rng(devices=[]):  # as the trace's steps do
            torch.manual_seed(0)
            inside.set()
            while not go_on.is_set():
                torch.zeros(1)  # where it pauses once its time is up
        return 1.0

    prior = background.TracedBetween(GuardedPrior(forks, "forks"), [1], least=0)
    trials = torch.Generator().manual_seed(7)  # the draws the trials would make with no trace
    torch.manual_seed(7)
    lent = 0.0
    while not inside.is_set():
        lent += 0.01
        prior.lend(lent)  # the trace is now paused inside its fork, having seeded it
    assert torch.equal(torch.rand(4), torch.rand(4, generator=trials))  # a trial's draw, not the trace's seed
    go_on.set()
    prior.finish_within(60)  # the trace closes its fork, putting back the state from before that draw
    assert prior.ready()
    assert torch.equal(torch.rand(4), torch.rand(4, generator=trials))  # the next draw goes on after it
    prior.stop()


def test_find_on_a_simulated_budget_traces_between_its_trials():
    finding = find_plan(mlp_workload(), backend=autobatch.SimulatedBackend("2MiB"), max_batch=256, headroom=0)
    record = finding.probe.trace_record
    assert record["between"] is True and (record["led"] or record["reason"].startswith(
        ("the trials were cheaper", "the trace would have cost more")))
    assert no_trace_thread()


def test_a_trace_between_never_lent_time_leaves_no_thread_behind():
    prior = background.between(mlp_workload())  # made, then never used (a probe that raised before searching)
    assert isinstance(prior, background.TracedBetween) and not prior.ready()
    assert no_trace_thread()
    prior.stop()
    assert prior_report(prior)["trace_prior"]["reason"].startswith("the trials were cheaper than the trace")


def test_a_trace_between_the_trials_pauses_before_or_after_an_unpaused_section_never_in_it():
    # A sharded trace's wrapped copy holds DeepSpeed's groups while it steps: a trial run in a pause
    # there built its engine on a group the trace then destroyed ("Group … is not registered")
    steps = []

    def whole(batch: int) -> float:
        with background.unpaused():
            for i in range(40):
                torch.zeros(1)
                time.sleep(0.002)
                steps.append(i)
        torch.zeros(1)  # where it may pause
        return 1.0

    prior = background.TracedBetween(GuardedPrior(whole, "whole"), [1, 2], least=0)
    try:
        prior.lend(0.001)  # far less than the section takes: it ends the section, then pauses
        assert len(steps) == 40 and not prior.ready()
    finally:
        prior.stop()
    assert no_trace_thread()



# The trace beside GPU trials in a process of its own (autobatch/estimating/spawned.py): on a GPU the
# trials are the interpreter launching kernels, and a trace on a thread held that interpreter.

def built(name: str = "tiny-mlp", **settings) -> autobatch.Workload:
    """A workload built from its name, as the request path builds it."""
    from autobatch.answering.rows import workload_of

    return workload_of(autobatch.Request(model=name, **settings))


def test_a_model_built_from_its_name_is_traced_by_a_process_of_its_own_and_one_passed_in_on_a_thread():
    prior = beside(built(), device_type="cpu")
    try:
        assert isinstance(prior, SpawnedBeside) and prior._process.pid != os.getpid()
        assert os.getpgid(prior._process.pid) != os.getpgid(0)  # its own process group: Ctrl-C is the probe's
    finally:
        prior.stop()
    assert no_trace_thread()
    passed_in = beside(mlp_workload(), device_type="cpu")
    passed_in.stop()
    assert isinstance(passed_in, TracedBeside) and no_trace_thread()
    with_function = built(optimizer=lambda params: torch.optim.SGD(params, lr=0.1))  # does not pickle
    assert spawned.recipe_of(with_function) is None


def test_the_spawned_trace_imports_a_users_module_as_this_process_does(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # tests.tiny is found through this process's sys.path only
    work = built("tests.tiny:mlp", input_shape="64")
    prior = beside(work, device_type="cpu")
    try:
        assert isinstance(prior, SpawnedBeside) and prior(64) == try_trace_prior(work, device_type="cpu")(64)
    finally:
        prior.stop()
    assert prior.report()["failure"] is None


def test_where_no_interpreter_can_be_started_the_named_model_is_traced_on_a_thread(monkeypatch, tmp_path):
    monkeypatch.setattr(spawned.sys, "executable", str(tmp_path / "no-python"))
    prior = beside(built(), device_type="cpu")
    prior.stop()
    assert isinstance(prior, TracedBeside) and no_trace_thread()


def test_the_spawned_trace_answers_the_prior_traced_here_at_every_batch():
    work = built("tiny-gpt2", seq_len=32, dtype="bf16")
    here = try_trace_prior(work, allocator="caching", device_type="cuda")
    asked = [2, 4, 16, 64, 100, 1000]  # past the traced batches: one more trace checks the laws
    expected = [here(b) for b in asked]
    state = torch.get_rng_state()
    prior = beside(work, allocator="caching", device_type="cuda")
    try:
        assert isinstance(prior, SpawnedBeside)
        assert [prior(b) for b in asked] == expected
        assert prior.ready() and prior.remaining() == 0.0
    finally:
        prior.stop()
    said = prior.report()
    assert said["traced_batches"] == here.traced_batches and said["failure"] is None and said["seconds"] > 0
    assert torch.equal(torch.get_rng_state(), state) and no_trace_thread()


def test_a_spawned_trace_still_running_when_the_search_ends_is_killed_at_once():
    prior = beside(built("gpt2", seq_len=1024), device_type="cuda")  # seconds to start and to trace
    start = time.perf_counter()
    outcome = search_max(oracle, 1000, prior=prior)
    assert outcome.max_batch == 128 and batches(outcome) == [1, 25, 128, 129]
    assert time.perf_counter() - start < 5 and prior.cancelled and no_trace_thread()
    assert prior._process.returncode is not None
    record = prior_report(prior)["trace_prior"]
    assert record["led"] is False and record["reason"] == NOT_READY and record["failure"] is None


def test_a_spawned_trace_whose_process_dies_fails_the_prior_with_its_last_words_and_sees_no_gpu(monkeypatch):
    monkeypatch.setattr(spawned, "_CHILD", "import os, sys; sys.exit('sees ' + repr(os.environ['CUDA_VISIBLE_DEVICES']))")
    prior = beside(built(), device_type="cpu")
    assert math.isnan(prior(8)) and not prior.ready()  # asked outright: it waits, and hears the child has gone
    outcome = search_max(oracle, 1000, prior=prior)
    assert outcome.max_batch == 128
    record = prior_report(prior)["trace_prior"]
    assert record["failure"] == DIED.format(code=1) + ": sees ''" and record["led"] is False
    assert no_trace_thread()


def test_a_spawned_trace_that_cannot_build_its_model_says_why_as_a_trace_on_a_thread_does():
    work = built()
    spawned.rebuildable(work.model, "tiny-mlp", {"seq_len": 16})  # tiny-mlp takes no length
    prior = beside(work, device_type="cpu")
    try:
        assert math.isnan(prior(8)) and not prior.ready()
    finally:
        prior.stop()
    record = prior_report(prior)["trace_prior"]
    assert record["failure"].startswith("AutobatchError: ") and "tiny-mlp" in record["failure"]


def test_find_on_a_gpu_traces_a_named_model_in_a_process_of_its_own(emulated_cuda, monkeypatch):  # noqa: F811
    made = []
    monkeypatch.setattr(background, "SpawnedBeside", lambda *a, **k: made.append(SpawnedBeside(*a, **k)) or made[-1])
    report = autobatch.answer(autobatch.Request(model="tiny-gpt2", seq_len=32, max_micro=64, headroom=0))
    record = report.rows[0].probe.trace_record
    assert len(made) == 1 and record["failure"] is None and "from_trial" in record
    assert no_trace_thread()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_real_gpu_the_spawned_trace_answers_after_the_process_has_trained_on_the_card():
    # A child forked after a backward on the card cannot run one ("CUDA error: initialization error"):
    # the spawned one starts clean, and sees no GPU.
    from autobatch.pipeline import trace_prior_for

    layer = torch.nn.Linear(8, 8).cuda()
    layer(torch.randn(4, 8, device="cuda")).sum().backward()
    work = built("tiny-gpt2", seq_len=32, dtype="bf16")
    here = try_trace_prior(work, allocator="caching", device_type="cuda")
    prior = trace_prior_for(work, CudaBackend())
    try:
        assert isinstance(prior, SpawnedBeside) and prior(64) == here(64)
    finally:
        prior.stop()
    assert prior.report()["failure"] is None and no_trace_thread()
    report = autobatch.answer(autobatch.Request(model="tiny-gpt2", seq_len=32, dtype="bf16", max_micro=256))
    assert report.rows[0].probe.trace_record["failure"] is None

"""The trace beside the trials (autobatch/estimating/background.py): the search takes its lead once it
is ready, never waits for it, and nothing it does outlives the probe."""

from __future__ import annotations

import doctest
import math
import multiprocessing
import os
import signal
import threading
import time

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor

import autobatch
from autobatch.estimating import background, forked
from autobatch.estimating.background import NOT_READY, TracedBeside, beside
from autobatch.estimating.forked import DIED, ForkedBeside
from autobatch.estimating.prior import GuardedPrior, try_trace_prior, warm_batches
from autobatch.pipeline import find_plan
from autobatch.probing.backends import CudaBackend
from autobatch.probing.probe import prior_report
from autobatch.probing.search import search_max
from autobatch.probing.trial import Trial
from tests.emulated_cuda import BAD_FORK, emulated_cuda  # noqa: F401 - the fixture
from tests.tiny import mlp, mlp_workload


def no_trace_thread() -> bool:
    """No trace left behind: no thread, no forked process."""
    return not any(t.name == "autobatch-trace" and t.is_alive() for t in threading.enumerate()) and not any(
        p.name == "autobatch-trace" for p in multiprocessing.active_children())


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
    # Traced in a forked child, which the emulated GPU refuses as torch does: the trace touches none.
    finding = find_plan(mlp_workload(), backend=CudaBackend(), max_batch=256, headroom=0)
    record = finding.probe.trace_record
    assert "from_trial" in record and record["failure"] is None
    assert no_trace_thread()


def test_a_forked_trace_that_touches_the_gpu_fails_as_torch_fails_it(emulated_cuda):  # noqa: F811 - the fixture
    torch.cuda.current_device()  # the probe's process uses the GPU

    def on_the_gpu(batch: int) -> float:
        return float(torch.cuda.current_device() + batch)

    prior = ForkedBeside(GuardedPrior(on_the_gpu, "on the GPU"), [1])
    start = time.perf_counter()
    try:
        assert not prior.finish_within(30) and time.perf_counter() - start < 10  # failed: not waited for
    finally:
        prior.stop()
    assert prior.report()["failure"] == f"RuntimeError: {BAD_FORK}"[:len("RuntimeError: ") + 160]


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

    prior = background.TracedBetween(GuardedPrior(endless, "endless"), [1])
    outcome = search_max(slow_trial, 1000, prior=prior)
    assert batches(outcome) == [1, 25, 128, 129] and prior.cancelled
    assert no_trace_thread()
    record = prior_report(prior)["trace_prior"]
    assert record["led"] is False and record["between"] is True
    assert record["reason"].startswith("the trials were cheaper than the trace: they ended the search in ")
    # It ran while the search lent it time, before each trial but the first: up to what the trials
    # had taken so far each time: the three trials before the last, 0.3 s in all (windows that
    # forgot what was lent before would take 0.1 + 0.2 + 0.3 = 0.6 s). The slack is the trace's
    # way to its next torch call and the thread's wake-up, three times.
    assert 0 < prior.trials_seconds and prior.used <= prior.trials_seconds + 0.2


class _Paced:
    """A trace of ``calls`` torch calls a batch, 2 ms apart (it pauses at them, so its time is its
    own), that keeps what it traced."""

    def __init__(self, calls: int):
        self.calls, self.traced = calls, {}

    def __call__(self, batch: int) -> float:
        for _ in range(self.calls):
            torch.zeros(1)
            time.sleep(0.002)
        self.traced[batch] = 100 + 7 * batch
        return self.traced[batch]


def test_a_trace_between_that_would_cost_more_than_it_saves_is_given_up_once_its_pace_is_known():
    def trial(b: int) -> Trial:
        time.sleep(0.05)
        return oracle(b)

    # About 0.12 s a traced batch, four to trace, against trials of 0.05 s: lent their time before
    # each trial, it has traced one batch before the fourth (at 129, next to the fit at 128); what it
    # still needs at its pace passes two such trials, so it is given up there, before that trial.
    prior = background.TracedBetween(GuardedPrior(_Paced(60), "paced"), [2, 4, 16, 64])
    outcome = search_max(trial, 1000, prior=prior)
    assert batches(outcome) == [1, 25, 128, 129] and prior.cancelled and no_trace_thread()
    record = prior_report(prior)["trace_prior"]
    assert record["led"] is False and record["traced_batches"] == [2]
    assert record["reason"].startswith("the trace would have cost more than the trials it saves: "), record["reason"]
    assert "against about 0.05 s for the next trial" in record["reason"]
    # where the trials cost more than the traced batches, the same trace pays and leads
    dear = background.TracedBetween(GuardedPrior(_Paced(60), "paced"), [2, 4, 16, 64])
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

    prior = background.TracedBetween(GuardedPrior(forks, "forks"), [1])
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

    prior = background.TracedBetween(GuardedPrior(whole, "whole"), [1, 2])
    try:
        prior.lend(0.001)  # far less than the section takes: it ends the section, then pauses
        assert len(steps) == 40 and not prior.ready()
    finally:
        prior.stop()
    assert no_trace_thread()


# The trace beside the trials in a forked process (autobatch/estimating/forked.py): on a GPU the trials
# are the interpreter launching kernels, and a trace on a thread held that interpreter.

def test_beside_forks_where_the_platform_can_and_traces_on_a_thread_where_it_cannot(monkeypatch):
    assert forked.FORKS  # the suite runs on Linux
    prior = beside(mlp_workload(), device_type="cpu")
    prior.stop()
    assert isinstance(prior, ForkedBeside) and no_trace_thread()
    monkeypatch.setattr(forked, "FORKS", False)
    prior = beside(mlp_workload(), device_type="cpu")
    prior.stop()
    assert isinstance(prior, TracedBeside) and no_trace_thread()


def test_the_forked_trace_runs_in_another_process_and_answers_the_prior_traced_here(tmp_path):
    seen = tmp_path / "pids"

    def loss_fn(model, batch):
        x, y = batch
        if isinstance(x, FakeTensor):
            with open(seen, "a") as f:
                f.write(f"{os.getpid()}\n")
        return torch.nn.functional.cross_entropy(model(x), y)

    work = autobatch.Workload(mlp, lambda b: (torch.randn(b, 64), torch.randint(0, 10, (b,))), loss_fn=loss_fn)
    here = try_trace_prior(work)
    asked = [2, 4, 16, 64, 100, 1000]  # past the traced batches: one more trace checks the laws
    expected = [here(b) for b in asked]
    seen.unlink()
    state = torch.get_rng_state()
    prior = ForkedBeside(try_trace_prior(work), warm_batches(here.first))
    try:
        assert [prior(b) for b in asked] == expected
        assert prior.ready() and prior.remaining() == 0.0
    finally:
        prior.stop()
    assert {int(p) for p in seen.read_text().split()} - {os.getpid()}  # traced there
    assert str(os.getpid()) not in seen.read_text().split()  # never here
    assert prior.report()["traced_batches"] == here.traced_batches == [2, 4, 16, 64]
    assert torch.equal(torch.get_rng_state(), state) and no_trace_thread()


def test_a_forked_trace_still_running_when_the_search_ends_is_ended_at_once_even_between_torch_calls():
    def endless(batch: int) -> float:
        while True:  # no torch call to stop at: a thread could not be cancelled here, a process can
            pass

    prior = ForkedBeside(GuardedPrior(endless, "endless"), [1])
    start = time.perf_counter()
    outcome = search_max(oracle, 1000, prior=prior)
    assert outcome.max_batch == 128 and batches(outcome) == [1, 25, 128, 129]
    assert time.perf_counter() - start < 5 and prior.cancelled and no_trace_thread()
    record = prior_report(prior)["trace_prior"]
    assert record["led"] is False and record["reason"] == NOT_READY and record["failure"] is None
    assert record["traced_batches"] == [] and record["seconds"] > 0


def test_a_forked_trace_whose_process_dies_fails_the_prior_and_the_search_goes_on_alone():
    def dies(batch: int) -> float:
        os._exit(3)

    prior = ForkedBeside(GuardedPrior(dies, "dies"), [1, 4])
    assert math.isnan(prior(8))  # asked outright: it waits, and hears the child has gone
    assert not prior.ready()
    outcome = search_max(oracle, 1000, prior=prior)
    assert outcome.max_batch == 128
    record = prior_report(prior)["trace_prior"]
    assert record["failure"] == DIED.format(code=3) and record["led"] is False
    assert no_trace_thread()


def test_a_forked_trace_that_raises_says_why_as_a_trace_on_a_thread_does():
    work = autobatch.Workload(mlp, lambda b: (_ for _ in ()).throw(ValueError(f"no batch of {b}")))
    prior = beside(work, device_type="cpu")
    assert isinstance(prior, ForkedBeside)
    try:
        assert math.isnan(prior(8)) and not prior.ready()
    finally:
        prior.stop()
    record = prior_report(prior)["trace_prior"]
    assert record["failure"] == "ValueError: no batch of 2" and record["led"] is False
    outcome = autobatch.probe(mlp_workload(), autobatch.SimulatedBackend("2MiB"), prior=beside(work, device_type="cpu"))
    assert outcome.max_batch == autobatch.probe(mlp_workload(), autobatch.SimulatedBackend("2MiB")).max_batch


def test_ctrl_c_reaches_the_probe_not_the_forked_trace():
    prior = beside(mlp_workload(), device_type="cpu")
    try:
        os.kill(prior._process.pid, signal.SIGINT)  # as a terminal sends it to the whole process group
        assert prior.finish_within(60) and prior(64) > 0
    finally:
        prior.stop()
    assert no_trace_thread()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("where", ["cpu", "cuda"])
def test_on_a_real_gpu_the_trace_beside_leads_forked_from_a_model_on_the_host_and_threaded_from_one_on_the_gpu(where):
    # CUDA refuses a forked child: a trace that asked it anything would fail there, and say so.
    from autobatch.pipeline import trace_prior_for

    model = mlp().to(where)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    work = _slow_steps()
    work = autobatch.Workload(model, work.make_batch, loss_fn=work.loss_fn)
    backend = CudaBackend()
    prior = trace_prior_for(work, backend)
    assert isinstance(prior, ForkedBeside if where == "cpu" else TracedBeside)
    result = autobatch.probe(work, backend, prior=prior, max_batch=4096, headroom=0)
    record = result.trace_record
    assert record["failure"] is None and record["led"] is True, record
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()) and no_trace_thread()

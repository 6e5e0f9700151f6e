"""The sharded trace beside CPU trials in a process of its own (autobatch/estimating/spawned_between.py),
started as the model is built (spawned.warmed): on a simulated budget the sharded trace had run between
the trials, every second of it one the search waited, and its rows, whose trials are mostly set-up,
cost more with it than without."""

from __future__ import annotations

import os
import sys
import time
from functools import partial

import pytest

import autobatch
from autobatch.distributed.fake_group import fake_process_group
from autobatch.estimating import background, spawned, spawned_between
from autobatch.estimating.spawned_between import NOT_WAITED, SpawnedBetween
from autobatch.pipeline import sharded_prior_in_its_world, sharded_trace_prior
from autobatch.probing import pending as pending_module
from autobatch.probing.pending import Pending
from autobatch.probing.probe import prior_report
from autobatch.probing.trial import Trial
from autobatch.strategy import parse_strategy
from tests.test_trace_beside import built, no_trace_thread
from tests.tiny import mlp_workload


def _idle(pid: int) -> bool:
    return os.sched_getscheduler(pid) == os.SCHED_IDLE


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE") or sys.version_info < (3, 11), reason="Linux's idle policy")
def test_on_the_cpu_a_named_model_is_traced_by_a_process_of_its_own_at_the_lowest_priority():
    ours = os.sched_getscheduler(0)
    prior = _sharded(built(), "fsdp2")
    try:
        child = prior._process.pid
        assert isinstance(prior, SpawnedBetween) and child != os.getpid()
        # Linux's idle policy: it runs where nothing else wants the core, and gives it back at once. Set by
        # the probe as it starts the child, before the child's interpreter imports torch (some 2 s of CPU the
        # probe's build had to share while the child set it itself, after its imports)
        assert _idle(child) and os.sched_getscheduler(0) == ours  # this process is left as it was
        # the probe's session (a session of its own would weigh as much as the probe's: autogroup),
        # its own process group (Ctrl-C is the probe's)
        assert os.getsid(child) == os.getsid(0) and os.getpgid(child) == child != os.getpgid(0)
    finally:
        prior.stop()
    assert no_trace_thread()
    passed_in = mlp_workload()  # a model passed in: traced here, between the trials, on a thread
    assert background.spawned_between(passed_in, min_batch=None, allocator="exact", device_type="cpu",
                                      traced=_in_a_world_of_four("fsdp2")) is None
    unsharded = background.between(built())  # an unsharded one: its trace starts cheap, between the trials
    unsharded.stop()
    assert isinstance(unsharded, background.TracedBetween) and no_trace_thread()


def _in_a_world_of_four(strategy: str):
    return partial(sharded_prior_in_its_world, strategy=parse_strategy(strategy), world=4, deepspeed_config=None)


def _sharded(work, strategy: str) -> SpawnedBetween:
    prior = background.spawned_between(work, min_batch=None, allocator="exact", device_type="cpu",
                                       traced=_in_a_world_of_four(strategy))
    assert isinstance(prior, SpawnedBetween)
    return prior


def test_the_search_waits_for_the_spawned_trace_only_for_the_cpu_it_did_not_have(monkeypatch):
    cpu = {"seconds": 0.0}
    monkeypatch.setattr(spawned_between, "cpu_seconds", lambda pid: cpu["seconds"])
    prior = _sharded(built("gpt2", seq_len=1024), "fsdp2")  # seconds to start and to trace
    try:
        prior.lend(0.3)  # it has had no CPU: the search waits the trials' 0.3 s
        assert 0.3 <= prior.lent < 0.6 and not prior.ready()
        cpu["seconds"] = 0.2  # had less than it was lent (a busy machine): never more, in all, than the trials took
        prior.lend(0.5)
        assert 0.5 <= prior.lent < 0.8
        cpu["seconds"] = 5.0  # had the idle core: more than the trials have taken, so no wait
        before = prior.lent
        prior.lend(4.0)
        assert prior.lent - before < 0.05
        # Given up (it would cost more than it saves): never waited for again, but not killed
        prior.give_up(left=9.0, trial=1.0)
        cpu["seconds"] = 0.0
        prior.lend(60.0)
        assert prior.lent - before < 0.05 and prior._process.poll() is None
    finally:
        prior.stop()
    record = prior_report(prior)["trace_prior"]
    assert record["led"] is False and record["between"] is True and record["waited"] == round(prior.lent, 3)
    assert record["reason"] == NOT_WAITED.format(left=9.0, trial=1.0, lent=before)
    assert no_trace_thread()


def test_a_spawned_trace_given_up_still_leads_once_it_is_ready_on_the_idle_core():
    prior = _sharded(built(), "fsdp2")
    try:
        prior.give_up(left=9.0, trial=1.0)
        pending = Pending(prior)
        # generous: at the idle policy it waits while the suite's other worker holds the cores
        deadline = time.perf_counter() + 180
        while pending.take(trials_run=3) is None and time.perf_counter() < deadline:
            time.sleep(0.1)
        assert prior.ready() and prior.from_trial == 3 and prior.lent == 0.0
    finally:
        prior.stop()
    record = prior.report()
    assert record["from_trial"] == 3 and record["failure"] is None and "reason" not in record


@pytest.mark.parametrize("strategy", ["fsdp2", "zero1", "ddp"])
def test_the_spawned_sharded_trace_answers_the_sharded_prior_traced_here_at_every_batch(strategy):
    work = built()
    chosen = parse_strategy(strategy)
    asked = [2, 4, 16, 64, 100]
    with fake_process_group(4):
        here = sharded_trace_prior(work, chosen, allocator="exact", device_type="cpu")
        expected = [here(b) for b in asked]
    prior = _sharded(work, strategy)
    try:
        assert [prior(b) for b in asked] == expected
    finally:
        prior.stop()
    said = prior.report()
    assert said["traced_batches"] == here.traced_batches and said["failure"] is None
    assert no_trace_thread()


def test_find_starts_the_trace_process_as_it_builds_the_model_and_the_probe_takes_it(monkeypatch):
    made = []
    monkeypatch.setattr(background, "SpawnedBetween", lambda *a, **k: made.append(SpawnedBetween(*a, **k)) or made[-1])
    report = autobatch.answer(autobatch.Request(model="tiny-llama", seq_len=16, memory="24MiB", strategy="fsdp2",
                                                gpus_per_node=4, headroom=0))
    record = report.rows[0].probe.trace_record
    assert len(made) == 1 and made[0].warm and made[0].name == "tiny-llama"
    assert record["failure"] is None and record["between"] is True and "waited" in record
    assert no_trace_thread()
    alone = autobatch.answer(autobatch.Request(model="tiny-llama", seq_len=16, memory="24MiB", strategy="fsdp2",
                                               gpus_per_node=4, headroom=0, trace_prior=False))
    assert report.rows[0].probe.max_batch == alone.rows[0].probe.max_batch and len(made) == 1


def test_a_process_warmed_for_a_probe_that_does_not_trace_is_ended_with_it():
    with spawned.warmed():
        work = spawned.named_workload("tiny-mlp", {}, {})
        (warm, process), = [(w, w.process) for w in spawned._warming.started]
        assert process.poll() is None and spawned.recipe_of(work) is not None
    assert process.poll() is not None and not warm.taken  # a cached answer, say: ended on leaving
    assert no_trace_thread()
    with spawned.warmed():  # a probe that changed the settings after the build does not take it
        work = spawned.named_workload("tiny-mlp", {}, {})
        (warm,) = spawned._warming.started
        changed = type(work)(**{**work.__dict__, "steps": 3})
        prior = _sharded(changed, "fsdp2")
        try:
            assert isinstance(prior, SpawnedBetween) and not prior.warm and warm.process.poll() is not None
        finally:
            prior.stop()
    assert no_trace_thread()


def _timed(monkeypatch, pending: Pending, batch: int, wall: float, step: float | None) -> None:
    """A trial at ``batch`` that fits, ``wall`` seconds by the pending's clock, its steady step ``step``."""
    clock = iter([0.0, wall])
    monkeypatch.setattr(pending_module, "time", type("Clock", (), {"perf_counter": staticmethod(lambda: next(clock))}))
    pending.timed(lambda b: Trial(b, True, 1, 1, seconds_per_step=step), batch)
    monkeypatch.undo()


def test_a_trial_is_priced_by_its_steps_grown_with_the_batch_and_its_set_up_not(monkeypatch):
    pending = Pending(None)
    _timed(monkeypatch, pending, 4, 2.0, 0.05)  # a sharded trial: 1.9 s of wrapper, two steps of 0.05 s
    assert pending.cost(16) == pytest.approx(1.9 + 0.1 * 4)
    _timed(monkeypatch, pending, 8, 2.0, 1.0)  # a large model's: all steps, grown whole
    assert pending.cost(16) == pytest.approx(4.0)
    _timed(monkeypatch, pending, 10, 2.0, None)  # steps not timed: grown whole
    assert pending.cost(20) == pytest.approx(4.0)
    assert Pending(None).cost(8) is None


def test_a_trace_that_would_cost_more_than_two_set_up_bound_trials_is_not_waited_for(monkeypatch):
    # After one sharded trial of 2 s (1.9 s of it the wrapper), a trace 5 s from done: priced grown
    # whole, the trial at 16 would cost 8 s and the search waited for the trace; it costs 2.3 s.
    class Tracing:
        given_up, waited = None, False

        def ready(self):
            return False

        def remaining(self):
            return 5.0

        def give_up(self, left, trial):
            self.given_up = (left, trial)

        def finish_within(self, seconds):
            self.waited = True
            return False

    prior = Tracing()
    pending = Pending(prior)
    _timed(monkeypatch, pending, 4, 2.0, 0.05)
    assert pending.wait_before(16) is False and not prior.waited
    assert prior.given_up == (5.0, pytest.approx(2.3))

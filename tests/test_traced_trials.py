"""Sharded trials on fake tensors share one wrapped copy: each equals a fresh trial at its batch, field by field."""

from __future__ import annotations

import pytest

from autobatch.distributed.fake_group import fake_process_group
from autobatch.distributed.sharded_trial import run_sharded_trial
from autobatch.distributed.simulated_world import probe_sharded
from autobatch.distributed.traced_trials import OneWrapper
from autobatch.estimating.estimate import load_fake_model
from autobatch.estimating.fake_backends import fake_backend
from autobatch.strategy import parse_strategy
from tests.ranks import slow

# fsdp1 and zero1 wrap as fsdp2 and zero2 do, with less: they run with AUTOBATCH_SLOW_TESTS set; so does
# zero2, whose rank 0 and last rank the estimate below checks trial by trial against fresh trials
_LIKE_ANOTHER = slow("a strategy that wraps as another one checked by default does (~4 s)")
_BELOW = slow("ZeRO-2's trials on one copy are checked by the estimate below, rank 0 and the last (~11 s)")
STRATEGIES = ["ddp", pytest.param("fsdp1", marks=_LIKE_ANOTHER), "fsdp2", pytest.param("zero1", marks=_LIKE_ANOTHER),
              pytest.param("zero2", marks=_BELOW), "zero3"]
# the ranks each strategy plays here: the last one too under ZeRO-2, whose shards and reductions differ by rank
RANKS = {"ddp": (0,), "fsdp1": (0,), "fsdp2": (0,), "zero1": (0,), "zero2": (0, 3), "zero3": (0,)}
FIELDS = ("fits", "peak_bytes", "reserved_bytes", "forward_backward_bytes", "optimizer_bytes", "resident_bytes")


@pytest.fixture(scope="module")
def llama():
    return load_fake_model("tiny-llama").to_workload(dtype="bf16")


@pytest.mark.parametrize("name", STRATEGIES)
def test_each_trial_on_one_wrapped_copy_equals_a_fresh_trial(llama, name):
    strategy = parse_strategy(name)
    backend, apart = fake_backend(llama.model, 3_000_000), fake_backend(llama.model, 3_000_000)
    for rank in RANKS[name]:
        with fake_process_group(4, rank=rank):
            one = OneWrapper(llama, llama.model, strategy, backend)
            try:
                # the first trial (two steps), then one past the capacity on the same copy
                for batch in (1, 9):
                    fresh = run_sharded_trial(llama, llama.model, strategy, apart, batch)  # its own count
                    reused = one(batch)
                    assert [getattr(reused.trial, f) for f in FIELDS] == [getattr(fresh.trial, f) for f in FIELDS], batch
                    assert reused.breakdown == fresh.breakdown, batch
                    assert reused.config == fresh.config
            finally:
                one.close()


def test_an_estimate_wraps_once_per_rank_played_and_answers_as_fresh_trials(llama, monkeypatch):
    import autobatch.distributed.sharded_trial as sharded

    wraps = []
    real_wrap = sharded.wrap_model
    monkeypatch.setattr(sharded, "wrap_model", lambda *a, **k: wraps.append(1) or real_wrap(*a, **k))
    backend = fake_backend(llama.model, 3_000_000)
    once = probe_sharded(llama, backend, "zero2", 4, headroom=0)
    assert len(wraps) == len(once.extra["sharding"]["ranks_played"]) == 2  # rank 0, then the last rank
    from autobatch.distributed import simulated_world  # fresh copies, as on a device

    monkeypatch.setattr(simulated_world, "sharded_trials", _fresh)
    fresh = probe_sharded(llama, fake_backend(llama.model, 3_000_000), "zero2", 4, headroom=0)
    def figures(t):
        return {k: v for k, v in t.to_dict().items() if k != "seconds_per_step"}

    assert [figures(t) for t in once.trials] == [figures(t) for t in fresh.trials]
    assert once.extra["sharding"] == fresh.extra["sharding"]


from contextlib import contextmanager  # noqa: E402


@contextmanager
def _fresh(workload, template, strategy, backend, deepspeed_config=None):
    yield lambda batch: run_sharded_trial(workload, template, strategy, backend, batch, deepspeed_config=deepspeed_config)

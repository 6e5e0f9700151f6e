"""An estimate's sharded trials book a fresh run's requests at their batch, as one GPU's estimate books its own.

The trials share one wrapped copy; booking its later steps as they ran would book another run than the
job's (the optimizer state the first step made pins that step's blocks). Each trial's requests are those
of a fresh run at its batch (:mod:`autobatch.estimating.fresh_log`): checked here against a fresh run's
own booking, strategy by strategy, and from a first trial at batch 1, whose steps PyTorch runs with a
request fewer (``labels[..., 1:]`` needs no copy there).
"""

from __future__ import annotations

import json

import pytest

from autobatch.estimating import fresh_log
from autobatch.distributed.fake_group import fake_process_group
from autobatch.distributed.traced_trials import OneWrapper
from autobatch.estimating.estimate import load_fake_model
from autobatch.estimating.fake_backends import fake_backend
from autobatch.strategy import parse_strategy

STRATEGIES = ["ddp", "fsdp1", "fsdp2", "zero1", "zero2", "zero3"]
CARD = 1 << 40
WORKSPACE = 64 << 20


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    # two blocks of 256 wide at 256 tokens: tensors of megabytes, which the allocator's segments tell apart
    folder = tmp_path_factory.mktemp("small-gpt2")
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2, "n_embd": 256, "n_head": 4,
                                                    "vocab_size": 1000, "n_positions": 256}))
    return load_fake_model(f"hf:{folder}", seq_len=256).to_workload(dtype="bf16")


def _trials(work, strategy, batches, card=CARD):
    backend = fake_backend(work.model, card)
    backend.booking = fresh_log.FreshBooking(backend, card, WORKSPACE)
    one = OneWrapper(work, work.model, parse_strategy(strategy), backend, None, backend.booking)
    try:
        return [one(b) for b in batches], one
    finally:
        one.close()


@pytest.mark.parametrize("strategy, first", [(name, 2) for name in STRATEGIES] + [("zero2", 1)])
def test_a_trial_on_the_shared_copy_books_what_a_fresh_run_at_its_batch_books(gpt2, strategy, first):
    # the estimate's first trial is at 2; from 1 (a request fewer), the copy PyTorch skips there is left out
    with fake_process_group(4, rank=0):
        (_, shared), _ = _trials(gpt2, strategy, [first, 7])
        (fresh,), _ = _trials(gpt2, strategy, [7])
    assert shared.trial.reserved_bytes == fresh.trial.reserved_bytes > fresh.trial.peak_bytes
    assert (shared.trial.peak_bytes, shared.trial.fits) == (fresh.trial.peak_bytes, True)
    assert shared.breakdown == fresh.breakdown and shared.breakdown.peak == fresh.trial.reserved_bytes
    assert fresh.trial.peak_bytes >= fresh.breakdown.peak - fresh.breakdown.other  # the rest is the allocator's


def test_the_curve_through_two_trials_books_a_third_batch_as_its_trial_does(gpt2):
    with fake_process_group(4, rank=0):
        (first, second, far), one = _trials(gpt2, "zero3", [1, 2, 40])
    assert one.curve(40) == far.trial.reserved_bytes
    assert one.curve(2) == second.trial.reserved_bytes


def test_where_the_requests_cannot_be_told_apart_the_trial_runs_fresh(gpt2, monkeypatch):
    import autobatch.distributed.traced_trials as traced

    wraps = []
    real = traced.wrap_copy
    monkeypatch.setattr(traced, "wrap_copy", lambda *a, **k: wraps.append(1) or real(*a, **k))
    monkeypatch.setattr(fresh_log, "UNPAIRED_SHARE", -1.0)  # no steady step pairs with the reference
    with fake_process_group(4, rank=0):
        (_, shared), _ = _trials(gpt2, "fsdp2", [2, 7])
        monkeypatch.undo()
        (fresh,), _ = _trials(gpt2, "fsdp2", [7])
    assert len(wraps) == 2  # the second trial wrapped a copy of its own
    assert shared.trial.reserved_bytes == fresh.trial.reserved_bytes


def test_each_strategy_row_is_led_by_its_own_first_two_trials_and_books_them():
    import autobatch

    report = autobatch.answer(autobatch.Request(model="tiny-gpt2", gpu_memory="600MiB", gpus_per_node=4,
                                                strategy=",".join(STRATEGIES), estimate=True, dtype="bf16"))
    for row in report.rows:
        probe = row.probe
        batches = [t.batch for t in probe.trials]
        # first at 2 (PyTorch makes a request fewer at 1); the second at 3, or where the row before put the boundary
        assert batches[0] == 2 and len(batches) <= 5, (row.strategy.name, batches)
        assert probe.trace_record["led"] and probe.trace_record["traced_batches"] == batches[:2]
        assert probe.capacity_bytes == report.beside_the_context
        assert all(t.reserved_bytes >= t.peak_bytes for t in probe.trials if t.fits)


def test_a_first_step_request_whose_op_and_size_part_at_the_new_batch_is_booked_at_the_larger_with_no_fresh_trial():
    # llama-1b checkpointed under ZeRO-3: at batch 2 a first-step activation of 2 × 2048 bytes and a constant
    # 4096 look alike, and part at 3; the trial ran afresh (five wraps of llama-70b: 14 minutes)
    class Tracker:
        making = None

    tracker = Tracker()
    log = fresh_log.TaggedLog(tracker)

    def step(requests):
        start = log.mark()
        for op, nbytes in requests:
            tracker.making = op
            log.free(log.malloc(nbytes))
        return start, log.mark()

    first = step([("add", 4096), ("add", 4096), ("add", 4096), ("mm", 8192)])  # one add of the first step alone
    last = step([("add", 4096), ("add", 4096), ("mm", 8192)])
    fresh = fresh_log.FreshRequests(log, [first, last], batch=2)
    steady = step([("add", 4096), ("add", 6144), ("mm", 12288)])  # one add constant, one per sample
    requests = fresh.at(*steady, batch=3)
    assert requests is not None and fresh.over == 1  # no fresh trial; one request booked at the larger size
    sizes = sorted(n for _, n in requests if n is not None)
    # the first step's two paired adds and its lone one (6144, the larger), its mm; the last step as the steady
    assert sizes == sorted([4096, 6144, 6144, 12288] + [4096, 6144, 12288]), sizes

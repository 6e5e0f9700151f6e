"""Every trial of a sharded probe, and every row of a strategy list, starts from the same baseline.

Before the fix a parameter list kept in the trial's own frame outlived the collection at its end,
and with it ZeRO-1/2's flat fp32 copy of the model: from the second trial on, each trial held one
more copy of the model than a real rank does, so the search answered low (1655 against 1752 on
real ranks in the measured case), and in a strategy list the copy moved into the next row.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import autobatch
from autobatch import Request, answer
from autobatch.distributed.fake_group import fake_process_group
from autobatch.distributed.sharded_trial import run_sharded_trial
from autobatch.distributed.simulated_world import probe_sharded
from autobatch.pipeline import sharded_trace_prior
from autobatch.probing.backends import SimulatedBackend
from autobatch.probing.heap import frozen_heap
from autobatch.strategy import parse_strategy
from tests import sharded_jobs
from tests.extras import need

STRATEGIES = ("ddp", "fsdp1", "fsdp2", "zero1", "zero2", "zero3")
BUDGET = "600KiB"


def _needs(name: str) -> None:
    if name.startswith("zero"):
        need("deepspeed")


@pytest.mark.parametrize("name", STRATEGIES)
def test_the_same_trial_three_times_holds_the_same_memory(name: str) -> None:
    _needs(name)
    backend = SimulatedBackend("64MiB")
    strategy = parse_strategy(name)
    with frozen_heap(), fake_process_group(2):
        done = [run_sharded_trial(sharded_jobs.workload(), sharded_jobs.blocks(), strategy, backend, 3)
                for _ in range(3)]
    first = done[0]
    assert first.breakdown is not None and first.breakdown.other == 0  # nothing was held before the wrap
    for later in done[1:]:
        untimed = dataclasses.replace(later.trial, seconds_per_step=first.trial.seconds_per_step)
        assert untimed == first.trial and later.breakdown == first.breakdown
    assert backend.allocated_bytes() == 0  # and nothing stays after the last one


@pytest.mark.parametrize("traced", [False, True], ids=["trials-alone", "trace-led"])
@pytest.mark.parametrize("name", STRATEGIES)
def test_every_trial_of_a_search_starts_from_the_first_ones_baseline(name: str, traced: bool) -> None:
    _needs(name)
    strategy = parse_strategy(name)
    trials: list[autobatch.Trial] = []
    prior = sharded_trace_prior(sharded_jobs.workload(), strategy) if traced else None
    result = probe_sharded(sharded_jobs.workload(), SimulatedBackend(BUDGET), strategy, 2, headroom=0,
                           on_trial=trials.append, prior=prior)
    searched = result.trials  # rank 0's search (the last rank then plays the answer once more)
    held = {t.resident_bytes for t in searched if t.fits}
    assert len(searched) >= 3 and len(held) == 1, [(t.batch, t.fits, t.resident_bytes) for t in searched]
    assert result.extra["sharding"]["per_rank"]["other"] == 0


def _rows(order: tuple[str, ...]) -> dict[str, tuple[int, int | None]]:
    report = answer(Request(model=sharded_jobs.blocks(), make_batch=sharded_jobs.batch, device="cpu", memory=BUDGET,
                            gpus_per_node=2, strategy=",".join(order), headroom=0, trace_prior=False))
    return {row.strategy.name: (row.probe.max_batch, row.probe.max_trial.resident_bytes) for row in report.rows}


def test_a_strategy_list_gives_each_row_exactly_as_the_strategy_alone() -> None:
    need("deepspeed")
    alone = {}
    for name in STRATEGIES:
        alone.update(_rows((name,)))
    assert _rows(STRATEGIES) == alone
    assert _rows(tuple(reversed(STRATEGIES))) == alone
    assert torch.distributed.is_initialized() is False


@pytest.mark.parametrize("traced", [False, True], ids=["real steps", "fake tensors"])
def test_zero3_leaves_torchs_linear_as_it_found_it(traced: bool) -> None:
    # DeepSpeed's ZeRO-3 replaces torch.nn.functional.linear "for good"; every later step in the
    # process (the next strategy's row, the user's training) would run its linear instead.
    need("deepspeed")
    from autobatch.estimating.estimate import load_fake_model
    from autobatch.estimating.fake_backends import fake_backend

    before = torch.nn.functional.linear
    if traced:
        work = load_fake_model("tiny-llama").to_workload()
        backend = fake_backend(work.model, 3_000_000)
    else:
        work, backend = sharded_jobs.workload(), SimulatedBackend("600KiB")
    probe_sharded(work, backend, "zero3", 4, max_batch=2)
    assert torch.nn.functional.linear is before

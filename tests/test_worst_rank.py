"""The one-process probe answers for the rank with the largest state, not for rank 0.

ZeRO-1/2 split their flat buffers, and what each rank reduces, by rank: on this model under
ZeRO-2 over four ranks, rank 3 peaks 360 KiB above rank 0, some seventy samples' worth. Before,
the probe played rank 0 alone and answered seventy samples too many for rank 3.
"""

from __future__ import annotations

import pytest
import torch

import autobatch
from autobatch.distributed.fake_group import fake_process_group
from autobatch.distributed.sharded_trial import run_sharded_trial
from autobatch.distributed.simulated_world import probe_sharded
from autobatch.probing.backends import SimulatedBackend
from autobatch.probing.heap import frozen_heap
from autobatch.strategy import parse_strategy
from tests.extras import need

WORLD, B = 4, 8


def uneven() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(300, 300), torch.nn.Linear(300, 300), torch.nn.Linear(300, 7))


def _workload() -> autobatch.Workload:
    return autobatch.Workload(uneven, lambda b: torch.randn(b, 300))


def _peak(rank: int, batch: int, *, world: int = WORLD, strategy: str = "zero2", model=uneven,
          dtype: str | None = None) -> int:
    """Rank ``rank`` of ``world``'s reserved peak at ``batch``: real steps on a simulated budget."""
    work = autobatch.Workload(model, lambda b: torch.randn(b, 300), dtype=dtype)
    with frozen_heap(), fake_process_group(world, rank=rank):
        return run_sharded_trial(work, model(), parse_strategy(strategy), SimulatedBackend("4GiB"),
                                 batch).trial.reserved_bytes


def _plays_rank_0_alone(strategy: str) -> None:
    trials: list[autobatch.Trial] = []
    result = probe_sharded(_workload(), SimulatedBackend("4MiB"), strategy, 4, headroom=0, on_trial=trials.append)
    assert result.extra["sharding"]["ranks_played"] == [0] and len(trials) == len(result.trials)


def test_the_last_rank_plays_the_answer_and_limits_it() -> None:
    need("deepspeed")
    last = WORLD - 1
    budget = (_peak(last, B) + _peak(last, B + 1)) // 2  # rank 3 fits B, not B + 1
    assert _peak(0, B + 20) < budget  # rank 0 alone would answer far above B
    result = probe_sharded(_workload(), SimulatedBackend(budget), "zero2", WORLD, headroom=0)
    assert result.max_batch == B
    sharding = result.extra["sharding"]
    assert sharding["ranks_played"] == [0, last] and sharding["limiting_rank"] == last
    assert sharding["per_rank"]["peak"] == _peak(last, B)  # the breakdown is the limiting rank's


def test_where_rank_0_is_the_largest_the_last_rank_costs_one_trial() -> None:
    need("deepspeed")
    trials: list[autobatch.Trial] = []
    result = probe_sharded(_workload(), SimulatedBackend("4MiB"), "zero1", 2, headroom=0, on_trial=trials.append)
    assert result.extra["sharding"]["limiting_rank"] == 0
    assert len(trials) == len(result.trials) + 1 and trials[-1].batch == result.max_batch and trials[-1].fits


def odd() -> torch.nn.Module:  # no dimension divides 3, 4 or 7: every rank's chunk differs in size
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(300, 300), torch.nn.LayerNorm(300), torch.nn.Linear(300, 301),
                               torch.nn.Linear(301, 7))


@pytest.mark.parametrize("strategy, worlds", [("fsdp2", (2, 3, 4, 7)), ("zero3", (3, 4))])
def test_where_no_rank_holds_more_than_rank_0_rank_0_plays_alone(strategy, worlds) -> None:
    """Real steps on every rank: the reason FSDP2's and ZeRO-3's probes play rank 0 alone
    (simulated_world._RANK_0_HOLDS_MOST). FSDP2's chunks differ, rank 0's the largest; ZeRO-3's
    partitions are all the padded size (in a process that has run other engines before, rank 0 may
    still hold a little more than the rest, never less)."""
    if strategy == "zero3":
        need("deepspeed")
    uneven_seen = False
    for dtype in ("fp32", "bf16"):
        for world in worlds:
            # rank 0 last: a process's first DeepSpeed engine costs more
            peaks = [_peak(rank, B, world=world, strategy=strategy, model=odd, dtype=dtype)
                     for rank in [*range(1, world), 0]]
            assert max(peaks) == peaks[-1], (dtype, world, peaks)
            uneven_seen |= min(peaks) < peaks[-1]
    assert uneven_seen or strategy != "fsdp2"  # FSDP2's chunks differ: another rank held less
    _plays_rank_0_alone(strategy)


def test_under_fsdp1_ranks_differ_by_bytes_either_way_so_rank_0_plays_alone() -> None:
    """FSDP1's ranks hold the same padded flat shard and differ only by their views of it: a few bytes
    either way, at middle ranks as much as at the last, far below a sample's activations."""
    peaks = [_peak(rank, B, world=4, strategy="fsdp1", model=odd) for rank in range(4)]
    assert max(abs(p - peaks[0]) for p in peaks) <= 64  # bytes; one sample's input alone is 1200
    _plays_rank_0_alone("fsdp1")

"""The one-process answer against real ranks: two gloo processes train at the answer and one above it.

For each strategy two real gloo ranks wrap the model with the libraries' own calls
(tests/sharded_jobs.py, not autobatch's wrappers) and train two AdamW steps at B and at B + 1,
counted by a storage counter written apart from autobatch's (tests/independent_tracker.py).
The budget is then set 48 KiB above the larger rank's real peak at B, and the one-process probe
(this process as one rank of two on the fake group) must answer exactly B: every real rank fits
at its answer, and none fits at the answer + 1 (a sample costs about 450 KiB).

48 KiB is tight enough that counting one copy of the model too many (66 KiB; the probe counted
ZeRO-1/2's meta copy of the parameters as memory) answers B − 1, and loose enough for what a real
group's collectives may still hold when a peak is read (at most two blocks' unsharded parameters,
33 KiB, which the fake group never holds).
"""

from __future__ import annotations

import pytest

import autobatch
from autobatch.distributed.launch import spawn_local
from autobatch.distributed.simulated_world import probe_sharded
from autobatch.distributed.zero import zero_config
from autobatch.probing.backends import SimulatedBackend
from autobatch.strategy import parse_strategy
from tests import sharded_jobs
from tests.extras import need

STRATEGIES = ("ddp", "fsdp1", "fsdp2", "zero1", "zero2", "zero3")
B = 3
WORLD = 2
MARGIN = 48 << 10


def _zero_section(name: str) -> dict | None:
    """The ZeRO section autobatch writes into the DeepSpeed config for this model (the job trains with it)."""
    strategy = parse_strategy(name)
    if strategy.zero_stage is None:
        return None
    return zero_config(sharded_jobs.blocks(), strategy, batch=B, world_size=WORLD)["zero_optimization"]


@pytest.fixture(scope="module")
def real() -> dict[str, list[list[int]]]:
    """Each strategy's real peaks: per batch (B, B + 1), per rank."""
    need("deepspeed")
    runs = [(name, b, _zero_section(name)) for name in STRATEGIES for b in (B, B + 1)]
    ranks = spawn_local(sharded_jobs.real_rank_peaks, (runs,), nprocs=WORLD, backend="gloo", timeout_s=240)
    out: dict[str, list[list[int]]] = {}
    for i, (name, _, _) in enumerate(runs):
        out.setdefault(name, []).append([ranks[r][i] for r in range(WORLD)])
    return out


@pytest.mark.parametrize("name", STRATEGIES)
def test_the_one_process_answer_is_the_largest_batch_every_real_rank_fits(real, name) -> None:
    at, above = real[name]
    budget = max(at) + MARGIN
    assert min(above) > budget  # B + 1 fits on no rank, by far
    result = probe_sharded(autobatch.Workload(sharded_jobs.blocks, sharded_jobs.long_batch), SimulatedBackend(budget),
                           name, WORLD, headroom=0)
    assert result.max_batch == B, (result.max_batch, real[name], result.extra["sharding"].get("per_rank"))

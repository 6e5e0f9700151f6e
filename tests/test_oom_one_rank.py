"""One rank out of memory in the middle of a sharded step: no rank hangs, every rank records it.

Two gloo ranks probe each strategy in lockstep, rank 0 on 120 MiB and rank 1 on 80 MiB (simulated
mixed GPUs), with the caching-allocator model, which raises out of memory mid-step as a GPU does.
Before the trial fence (autobatch/distributed/fence.py) rank 0 waited in a collective rank 1
never joined: DDP until the timeout, FSDP2 until the process aborted, ZeRO-2 until the
connection dropped. Now rank 1's failure ends the step on rank 0 at its next collective, the
trial is "does not fit" on both, and rank 1 alone is named as the limit.
"""

from __future__ import annotations

import pytest

from autobatch.distributed.launch import spawn_local
from tests import sharded_jobs
from tests.extras import need
from tests.ranks import slow

BUDGETS = ("120MiB", "80MiB")


def _probe(strategies: tuple[str, ...], timeout_s: float) -> list[dict]:
    need("deepspeed")
    # The agreement waits timeout_s at most, the fence half that: a hang fails the run, it never
    # stalls it. Generous, so that a slow rank on a loaded machine is not taken for a hung one.
    return spawn_local(sharded_jobs.out_of_memory_on_one_rank, (strategies, BUDGETS, timeout_s), nprocs=2,
                       backend="gloo", timeout_s=120)


def _check(ranks: list[dict], name: str) -> None:
    zero, one = ranks[0][name], ranks[1][name]
    assert zero["max_batch"] == one["max_batch"] and zero["agreed"] == one["agreed"]
    best = zero["max_batch"]
    assert (best, True) in zero["agreed"] and (best + 1, False) in zero["agreed"]  # an exact boundary
    assert zero["limiting"] == (1,)  # the rank that ran out, not the one it stopped
    stopped = [t for t in zero["mine"] if not t[1]]
    assert stopped and all(t[2].startswith("stopped: ") for t in stopped), stopped
    assert all(t[2] == "out of memory" for t in one["mine"] if not t[1])


@pytest.fixture(scope="module")
def default_strategies() -> list[dict]:
    return _probe(("ddp", "zero2"), 30.0)


# zero2: a backward that ran out of memory left its saved tensors in the autograd engine's queue, 58 MB on
# rank 0, which then ran out itself below its own limit: the answer was 29 where 37 fits.
@pytest.mark.parametrize("name", ["ddp", "zero2"])
def test_one_rank_out_of_memory_ends_the_step_on_every_rank(default_strategies, name) -> None:
    _check(default_strategies, name)


@slow("the other four strategies on two gloo ranks (~45 s; FSDP1 on gloo waits out the fence's timeout)")
def test_one_rank_out_of_memory_under_fsdp2_fsdp1_zero1_and_zero3() -> None:
    ranks = _probe(("fsdp2", "fsdp1", "zero1", "zero3"), 8.0)
    for name in ("fsdp2", "fsdp1", "zero1", "zero3"):
        _check(ranks, name)


def test_one_rank_out_of_memory_in_ddps_constructor_is_named_on_every_rank() -> None:
    # DDP's constructor broadcasts the weights: before, rank 0 waited in that broadcast while rank 1
    # called the error agreement, and both gave up "lost contact" after the timeout.
    told = spawn_local(sharded_jobs.ddp_buckets_do_not_fit_on_rank_1, nprocs=2, backend="gloo", timeout_s=60)
    for name, message in told:
        assert name == "NoBatchFitsError"
        assert message.startswith("rank 1: the model's weights and DDP's gradient buckets alone do not fit")


def test_offload_under_a_launcher_on_the_cpu_is_refused_on_every_rank_before_any_trial() -> None:
    """On the CPU the host is the simulated device itself: a launched probe refuses offload as the
    one-process probe does, every rank alike (no rank waits in a collective for another)."""
    told = spawn_local(sharded_jobs.offload_under_a_launcher_on_the_cpu, nprocs=2, backend="gloo", timeout_s=60)
    for rank in told:
        for (name, message), asked in zip(rank, ("--strategy fsdp2 --offload params --accelerate accelerate.yaml",
                                                 "--strategy zero2 --offload optimizer --deepspeed ds.json")):
            assert name == "AutobatchError"
            assert "moves state to host memory, which on the CPU is the simulated device itself" in message
            assert message.endswith(asked + "`")

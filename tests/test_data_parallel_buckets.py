"""Plans for several data-parallel ranks from a probe or estimate of one bare device count DDP's buckets."""

from __future__ import annotations

from autobatch import SimulatedBackend
from autobatch.estimating.estimate import estimate
from autobatch.pipeline import find_plan
from autobatch.estimating.overheads import Overheads
from tests.tiny import mlp, mlp_workload

GRADIENTS = sum(p.numel() * p.element_size() for p in mlp().parameters())  # one bucket copy of them


def test_a_multi_gpu_plan_from_one_bare_device_leaves_room_for_ddps_buckets():
    # trials alone: a trace beside the trials leads from whichever trial it is ready by, which a loaded machine moves
    one = find_plan(mlp_workload(), backend=SimulatedBackend("4MiB"), gpus_per_node=1, headroom=0, use_trace_prior=False)
    four = find_plan(mlp_workload(), backend=SimulatedBackend("4MiB"), gpus_per_node=4, headroom=0, use_trace_prior=False)
    assert [t.batch for t in four.probe.trials] == [t.batch for t in one.probe.trials]  # the same probe
    assert four.probe.extra["ddp_buckets_bytes"] == GRADIENTS and "ddp_buckets_bytes" not in one.probe.extra
    assert four.probe.safe_batch < one.probe.safe_batch
    assert four.plan.micro_batch == four.probe.safe_batch and four.plan.world_size == 4
    assert four.probe.safe_peak_bytes <= four.probe.capacity_bytes


def test_an_estimate_for_several_gpus_counts_ddps_buckets_in_every_trial():
    work = mlp_workload()
    one = estimate(work, gpu_memory="64MiB", headroom=0, overheads=Overheads.none())
    eight = estimate(work, gpu_memory="64MiB", headroom=0, overheads=Overheads.none(), data_parallel=8)
    assert eight.extra["ddp_buckets_bytes"] == GRADIENTS and "ddp_buckets_bytes" not in one.extra
    assert eight.trials[0].batch == one.trials[0].batch
    assert eight.trials[0].reserved_bytes == one.trials[0].reserved_bytes + GRADIENTS
    assert eight.max_batch < one.max_batch


def test_a_booked_estimate_books_ddps_buckets_before_every_trials_requests():
    # By default the trace's requests are booked through the caching allocator's model: the buckets
    # are held from the start, so each trial reserves them too and fewer samples fit.
    import torch

    from autobatch import Workload

    wide = Workload(lambda: torch.nn.Sequential(torch.nn.Linear(2048, 2048), torch.nn.Linear(2048, 10)),
                    lambda b: (torch.randn(b, 2048), torch.randint(0, 10, (b,))), name="wide")
    one = estimate(wide, gpu_memory="700MiB", headroom=0)
    eight = estimate(wide, gpu_memory="700MiB", headroom=0, data_parallel=8)
    buckets = eight.extra["ddp_buckets_bytes"]
    assert buckets == (2048 * 2048 + 2048 + 2048 * 10 + 10) * 4
    assert eight.max_batch < one.max_batch
    assert eight.trials[0].reserved_bytes >= one.trials[0].reserved_bytes + buckets

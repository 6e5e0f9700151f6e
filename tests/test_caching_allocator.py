"""The caching-allocator model, the simulated backend that books in it, and what the probe makes of its retries."""

from __future__ import annotations

import pytest
import torch

from autobatch import AutobatchError, SimulatedBackend, Workload, is_oom_error, probe
from autobatch.probing.backends.caching_allocator import CachingAllocator, allocation_size, round_size
from tests.backend_suite import BackendContract

MIB = 1 << 20


def test_requests_are_rounded_to_512_bytes_and_pooled_by_size():
    assert [round_size(n) for n in (1, 512, 513, 1000)] == [512, 512, 1024, 1024]
    assert allocation_size(1 * MIB) == 2 * MIB           # small pool: 2 MiB segments
    assert allocation_size(1 * MIB + 512) == 20 * MIB    # 1-10 MiB: 20 MiB segments
    assert allocation_size(10 * MIB + 1) == 12 * MIB     # large: rounded up to 2 MiB


def test_small_blocks_share_a_2mib_segment_and_stay_cached_until_empty_cache():
    a = CachingAllocator(64 * MIB)
    blocks = [a.malloc(100_000) for _ in range(20)]      # 20 x 100,352 bytes fit one 2 MiB segment
    assert (a.allocated, a.reserved, len(a.segments)) == (20 * 100_352, 2 * MIB, 1)
    for block in blocks:
        a.free(block)
    assert (a.allocated, a.reserved) == (0, 2 * MIB)      # cached, not given back
    a.empty_cache()
    assert a.reserved == 0


def test_mid_sized_blocks_are_cut_from_20mib_segments_and_split_only_above_1mib():
    a = CachingAllocator(64 * MIB)
    first = a.malloc(3 * MIB)
    assert (a.allocated, a.reserved) == (3 * MIB, 20 * MIB)
    a.malloc(3 * MIB)
    assert (a.reserved, len(a.segments)) == (20 * MIB, 1)  # the rest of the same segment
    a.free(first)
    again = a.malloc(2 * MIB + 512 * 1024)  # best fit: the freed 3 MiB block; the 0.5 MiB rest is not split off
    assert again.size == 3 * MIB


def test_a_request_that_fits_only_after_flushing_the_cache_counts_a_retry():
    a = CachingAllocator(40 * MIB)
    a.free(a.malloc(24 * MIB))            # a 24 MiB segment stays cached
    a.malloc(30 * MIB)                    # 24 + 30 > 40: flush the cache, retry, succeed
    assert (a.num_alloc_retries, a.reserved, a.num_ooms) == (1, 30 * MIB, 0)


def test_running_out_raises_torchs_out_of_memory_error_with_its_wording():
    a = CachingAllocator(40 * MIB, device_index=3, device_total=48 * MIB)
    a.malloc(30 * MIB)
    with pytest.raises(torch.OutOfMemoryError, match=r"CUDA out of memory. Tried to allocate 16.00 MiB. GPU 3 "
                                                      r"has a total capacity of 48.00 MiB") as info:
        a.malloc(15 * MIB)
    assert is_oom_error(info.value)
    assert (a.num_ooms, a.num_alloc_retries) == (1, 1)
    assert a.reserved == 30 * MIB


def test_a_memory_fraction_limits_what_is_reserved():
    a = CachingAllocator(64 * MIB, limit=16 * MIB)
    a.malloc(12 * MIB)
    with pytest.raises(torch.OutOfMemoryError, match="16.00 MiB allowed"):
        a.malloc(12 * MIB)


class TestSimulatedCachingBackend(BackendContract):
    @pytest.fixture
    def backend(self):
        return SimulatedBackend("16MiB", allocator="caching")


def test_the_caching_backend_reserves_segments_the_exact_one_does_not():
    exact, caching = SimulatedBackend("64MiB"), SimulatedBackend("64MiB", allocator="caching")
    with exact.track(), caching.track():
        torch.empty(1000)
    assert exact.peak().reserved == 4000
    assert (caching.peak().allocated, caching.peak().reserved) == (4096, 2 * MIB)
    with pytest.raises(AutobatchError, match="allocator must be one of exact, caching, but got allocator='pool'"):
        SimulatedBackend("1MiB", allocator="pool")


def _flush_workload() -> Workload:
    """Its first step frees a (10 + 2b) MiB scratch, then asks for (12 + 2b) MiB: a flush at larger batches."""
    first = {"step": True}

    def loss(model, batch):
        x, y = batch
        if first["step"]:
            scratch = torch.empty((10 + 2 * len(x)) * MIB, dtype=torch.uint8)
            del scratch
            big = torch.empty((12 + 2 * len(x)) * MIB, dtype=torch.uint8)
            del big
        first["step"] = not first["step"]
        return torch.nn.functional.cross_entropy(model(x), y)

    return Workload(lambda: torch.nn.Linear(4, 3), lambda b: (torch.randn(b, 4), torch.randint(0, 3, (b,))),
                    loss_fn=loss, optimizer="sgd", name="flush")


def test_batches_that_fit_only_after_a_cache_flush_stay_out_of_the_safe_batch():
    result = probe(_flush_workload(), SimulatedBackend("40MiB", allocator="caching"), max_batch=12, headroom=0)
    retried = [t.batch for t in result.trials if t.fits and t.alloc_retries]
    clean = [t.batch for t in result.trials if t.fits and not t.alloc_retries]
    assert retried and clean
    assert result.max_batch == 12 and result.max_trial.alloc_retries == 1
    assert result.safe_batch < min(retried)
    assert result.safe_batch >= max(b for b in clean if b < min(retried))
    if result.safe_batch + 1 == min(retried):  # the output says why the batches above it are not safe
        assert f"{min(retried)} fit only after the allocator freed its cached blocks and retried" in str(result)
    else:
        assert "freed its cached blocks" not in str(result)


def test_the_host_running_out_of_ram_is_reported_not_counted_as_the_budget():
    def greedy(model, batch):
        x, y = batch
        if len(x) > 4:  # a real allocation failure of the host's allocator, without using any RAM
            torch.empty(1 << 60, dtype=torch.uint8)
        return torch.nn.functional.cross_entropy(model(x), y)

    work = Workload(lambda: torch.nn.Linear(4, 3), lambda b: (torch.randn(b, 4), torch.randint(0, 3, (b,))),
                    loss_fn=greedy, name="greedy")
    with pytest.raises(AutobatchError, match=r"this machine ran out of RAM while simulating a 16.00 GiB device "
                                             r"\(.*DefaultCPUAllocator: can't allocate memory.*lower --memory"):
        probe(work, SimulatedBackend("16GiB"))


def test_the_search_stays_exact_on_the_allocators_staircase():
    from autobatch.probing.probe import make_backend
    from tests.tiny import mlp_workload

    backend = make_backend("cpu", "12MiB", allocator="caching")
    result = probe(mlp_workload(), backend)
    outcome = {t.batch: t.fits for t in result.trials}
    assert result.limited_by == "memory"
    assert outcome[result.max_batch] and outcome[result.max_batch + 1] is False
    assert all(t.reserved_bytes % (2 * MIB) == 0 for t in result.trials if t.fits)  # whole segments


def test_the_answer_says_why_a_batch_that_fit_after_a_retry_is_not_safe():
    from autobatch.probing.backends import DeviceInfo
    from autobatch.probing.probe import ProbeResult, summarise
    from autobatch.probing.trial import Trial

    trials = (Trial(1, True, 100, 100), Trial(5, True, 500, 500), Trial(6, True, 600, 600, alloc_retries=1),
              Trial(7, False, 1000, 1000))
    summary = summarise(trials, 6, 1000)
    result = ProbeResult(max_batch=6, safe_batch=summary.safe_batch, limited_by="memory", min_batch=1, trials=trials,
                         device=DeviceInfo("simulated", "cpu", None, 1000, 1000, 0, 1000, host="h"),
                         capacity_bytes=1000, headroom_bytes=0, bytes_per_sample=100.0, fixed_bytes=0.0,
                         safe_peak_bytes=500, safe_peak_measured=True)
    assert result.safe_batch == 5
    assert "safe batch 5 (peak 500 B, headroom 0 B; 6 fit only after the allocator freed its cached blocks and " \
           "retried, a step from running out: no batch from it on is safe)" in str(result)

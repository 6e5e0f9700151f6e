"""The trace replayed at any batch (``estimating/replay.py``), booked as the device books it.

The prior the search follows is the traced step's log of requests, fitted once and replayed;
these tests hold it to a fresh trace at batches never traced, for exact bytes and for the
caching-allocator model, and show what following the device's staircase saves.
"""

from __future__ import annotations

import doctest
import importlib
import logging

import pytest
import torch

from autobatch import SimulatedBackend, Workload
from autobatch.estimating.estimate import fake_model, trace_trial
from autobatch.estimating.fake_backends import _new_fake_mode
from autobatch.estimating.prior import trace_prior
from autobatch.estimating.replay import AllocationLog, fit_log
from autobatch.pipeline import booked_as, find_plan
from autobatch.probing.backends.caching_allocator import CachingAllocator
from tests.tiny import cnn_workload, lm_workload, mlp_workload


def traced(sizes) -> AllocationLog:
    log = AllocationLog()
    handles = [log.malloc(n) for n in sizes]
    log.free(handles[0])
    return log


def test_sizes_are_fitted_through_three_batches_and_checked_against_a_fourth():
    law = lambda b: (8 * b, 3 * b * b + 5, 4096)  # activations, a batch × batch matrix, a constant
    laws = fit_log({b: traced(law(b)) for b in (1, 4, 16, 64)})
    assert laws.sizes(1000) == list(law(1000))
    assert laws.peak(1000) == sum(law(1000))
    # A size no polynomial of degree two follows (padding to a multiple of 48) is refused.
    padded = lambda b: (-(-b // 48) * 48, 16)
    assert fit_log({b: traced(padded(b)) for b in (1, 4, 16, 64)}) is None
    # So are logs whose requests differ in number.
    assert fit_log({b: traced((8,) * (1 + b // 16)) for b in (1, 4, 16, 64)}) is None


def test_the_caching_replay_books_blocks_as_the_allocator_model_does():
    laws = fit_log({b: traced((1000 * b, 200)) for b in (1, 4, 16, 64)})
    cache = CachingAllocator(1 << 40)
    first, second = cache.malloc(1000 * 3000), cache.malloc(200)
    cache.free(first)
    assert laws.peak(3000, "caching") == cache.peak_reserved == 22 << 20  # a 20 MiB segment and a 2 MiB one
    with pytest.raises(ValueError, match="allocator must be one of exact, caching"):
        laws.peak(3000, "buddy")


@pytest.mark.parametrize("make, allocators", [(lm_workload, ("caching",)), (cnn_workload, ("exact", "caching"))],
                         ids=["transformer", "batchnorm-cnn"])
def test_the_prior_equals_a_fresh_trace_at_batches_never_traced(make, allocators):
    work = make()
    priors = {name: trace_prior(work, allocator=name) for name in allocators}
    mode = _new_fake_mode()
    model = fake_model(work.model, mode)
    model.train()
    for batch in (3, 37, 250):
        cache = CachingAllocator(1 << 62)
        trial = trace_trial(work, model, batch, fake_mode=mode, log=cache)
        booked = {"exact": trial.peak_bytes, "caching": cache.peak_reserved}
        assert {name: prior(batch) for name, prior in priors.items()} == {name: booked[name] for name in allocators}


def test_where_the_optimizer_sets_small_batches_peak_the_replay_has_the_corner():
    # The MLP's peak is AdamW's step up to ~150 samples, the activations' above: a line between
    # traced batches cuts that corner; the replay has it at every batch.
    work = mlp_workload()
    prior = trace_prior(work)
    for batch in (100, 150, 200):
        assert prior(batch) == trace_prior(work, min_batch=batch)(batch)


class _Chunked(torch.nn.Module):
    """Runs its layer on chunks of 16 samples: more requests at larger batches."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(64, 10)

    def forward(self, x):
        return torch.cat([self.net(chunk) for chunk in x.split(16)])


def test_traces_that_differ_in_shape_are_joined_by_lines(caplog):
    work = Workload(_Chunked(), lambda b: (torch.randn(b, 64), torch.randint(0, 10, (b,))), name="chunked")
    with caplog.at_level(logging.DEBUG, logger="autobatch.estimating.prior"):
        prior = trace_prior(work)
        at = {b: prior(b) for b in (16, 40, 48, 56, 64)}
    assert at[16] < at[40] < at[64] and at[48] - at[40] == pytest.approx(at[56] - at[48])  # on one line
    assert any("differ in shape" in r.getMessage() for r in caplog.records)


def test_a_probe_books_the_prior_as_its_backend_books_memory():
    assert booked_as(SimulatedBackend("1MiB")) == "exact"
    assert booked_as(SimulatedBackend("1MiB", allocator="caching")) == "caching"

    class Cuda:
        device = torch.device("cuda", 0)

    assert booked_as(Cuda()) == "caching"


def test_on_the_allocators_staircase_the_prior_steps_with_the_device(trace_first):
    # 64 MiB booked in 2 and 20 MiB segments: long flat runs, then a segment's jump. Followed
    # step by step, the traced staircase puts the first guess on the answer.
    def search(**options):
        finding = find_plan(mlp_workload(), backend=SimulatedBackend("64MiB", allocator="caching"), headroom=0, **options)
        return finding.probe.max_batch, [(t.batch, t.fits) for t in finding.probe.trials]

    assert search() == (10240, [(1, True), (10240, True), (10241, False)])
    best, alone = search(use_trace_prior=False)
    assert best == 10240 and len(alone) == 16 and {(10240, True), (10241, False)} <= set(alone)


@pytest.mark.parametrize("module", ["autobatch.estimating.replay", "autobatch.estimating.prior", "autobatch.probing.search"])
def test_docstring_examples_run(module):
    assert doctest.testmod(importlib.import_module(module)).failed == 0

"""frozen_heap: the trials' garbage collections skip what was alive before the probe, and the collector comes back as it was."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from autobatch.probing.heap import frozen_heap


class Node:
    """An object in a reference cycle: only the cycle collector frees it."""

    def __init__(self) -> None:
        self.me = self


def test_the_body_collects_its_own_cycles_and_skips_what_was_alive_before() -> None:
    before = Node()
    with frozen_heap():
        assert gc.get_freeze_count() > 0 and not any(o is before for o in gc.get_objects())  # out of its walk
        made = Node()
        gone = weakref.ref(made)
        del made
        gc.collect()
        assert gone() is None  # a wrapper the trial dropped is freed by the trial's collection
    assert gc.get_freeze_count() == 0 and any(o is before for o in gc.get_objects())


def test_once_cuda_is_initialised_garbage_from_before_is_collected_first(monkeypatch: pytest.MonkeyPatch) -> None:
    # It may hold device memory the probe must see free.
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    old = Node()
    gone = weakref.ref(old)
    del old
    with frozen_heap():
        assert gone() is None


def test_before_cuda_the_full_collection_is_skipped_and_garbage_waits_for_the_next_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    gc.collect()  # nothing older pending, so only the collector, not a threshold, can free it
    old = Node()
    gone = weakref.ref(old)
    del old
    with frozen_heap():
        gc.collect()
        assert gone() is not None  # frozen with the rest: the body's collections never walk it
    gc.collect()
    assert gone() is None


def test_an_error_in_the_body_still_unfreezes() -> None:
    with pytest.raises(ValueError, match="boom"), frozen_heap():
        raise ValueError("boom")
    assert gc.get_freeze_count() == 0


def test_a_process_that_froze_its_own_objects_is_left_as_it_was() -> None:
    # Left as it was: neither unfrozen (the count drops to 0) nor frozen again (it grows by every object made
    # since). Frozen objects that die leave the count, and under pytest-xdist the worker's I/O thread frees a
    # few of its own meanwhile, so "as it was" is "no more, and at most a handful fewer".
    def as_it_was(frozen: int) -> bool:
        return frozen - 100 < gc.get_freeze_count() <= frozen

    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        kept = [[] for _ in range(1000)]  # tracked, made after the freeze: frozen again, they would count
        with frozen_heap():
            with frozen_heap():  # nested too: nothing to undo that is not the process's own
                pass
            assert as_it_was(frozen), (gc.get_freeze_count(), frozen)
        assert as_it_was(frozen), (gc.get_freeze_count(), frozen)
        del kept
    finally:
        gc.unfreeze()


def test_probes_run_their_trials_with_the_heap_frozen_and_give_it_back() -> None:
    from autobatch import SimulatedBackend, Workload, probe, probe_lengths
    from autobatch.distributed.simulated_world import probe_sharded
    from tests import sharded_jobs
    from tests.tiny import mlp_workload

    frozen: list[bool] = []

    def seen(*_: object) -> None:
        frozen.append(gc.get_freeze_count() > 0)

    probe(mlp_workload(), SimulatedBackend("2MiB"), on_trial=seen)
    probe_sharded(sharded_jobs.workload(), SimulatedBackend("320KiB"), "fsdp2", 2, max_batch=2, on_trial=seen)
    tokens = Workload(torch.nn.Sequential(torch.nn.Embedding(64, 16), torch.nn.Linear(16, 64)),
                      lambda b, s: torch.randint(0, 64, (b, s)))
    probe_lengths(tokens, [8, 16], SimulatedBackend("1MiB"), on_trial=seen)
    assert len(frozen) > 6 and all(frozen)
    assert gc.get_freeze_count() == 0

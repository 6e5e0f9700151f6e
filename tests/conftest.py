from __future__ import annotations

import gc

import pytest
import torch


@pytest.fixture(autouse=True)
def _private_cache(tmp_path_factory, monkeypatch):
    # `find` caches probes per user; tests must never read or write a real user's cache.
    monkeypatch.setenv("AUTOBATCH_CACHE_DIR", str(tmp_path_factory.mktemp("autobatch-cache")))


@pytest.fixture(scope="module")
def frozen_suite_heap():
    """The heap the suite built before this module, out of the collector's walk while it runs.

    For modules whose code under test calls ``gc.collect()`` on every trial or backend (the CUDA
    backend, accelerate's and Lightning's finders): each full collection would walk every object
    the whole test process holds, about 0.35 s a call, where a user's process pays for its own
    heap once per probe. What the module creates is collected as before. autobatch's own
    ``frozen_heap`` does the same for sharded probes, and steps aside while this one holds.
    """
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

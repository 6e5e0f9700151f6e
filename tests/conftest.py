from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _private_cache(tmp_path_factory, monkeypatch):
    # `find` caches probes per user; tests must never read or write a real user's cache.
    monkeypatch.setenv("AUTOBATCH_CACHE_DIR", str(tmp_path_factory.mktemp("autobatch-cache")))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

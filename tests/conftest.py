from __future__ import annotations

import os
from pathlib import Path

# README runs the suite with `-n auto`: one pytest-xdist worker per core. Each takes its share of
# the cores for torch's threads, and so do the ranks and commands its tests start (they inherit
# OMP_NUM_THREADS), or every worker's thread pool would spread over every core: measured on two
# cores, two workers at two threads each spent 389 s of CPU on what one thread does in 251 s.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
_SHARE = max(1, (os.cpu_count() or 1) // _WORKERS)
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(_SHARE))

import pytest  # noqa: E402
import torch  # noqa: E402

from autobatch.probing.heap import frozen_heap  # noqa: E402

if _WORKERS > 1 and torch.get_num_threads() > _SHARE:  # torch imported before this file set the variable
    torch.set_num_threads(_SHARE)


@pytest.fixture(autouse=True)
def _private_cache(tmp_path_factory, monkeypatch):
    # `find` caches probes per user; tests must never read or write a real user's cache.
    monkeypatch.setenv("AUTOBATCH_CACHE_DIR", str(tmp_path_factory.mktemp("autobatch-cache")))


ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True, scope="session")
def _no_files_left_in_the_checkout():
    # A finder that checkpoints into the working directory (Lightning's scale_batch_size writes
    # .scale_batch_size_*.ckpt) once left one committed at the root: the suite leaves none behind.
    before = set(ROOT.glob("*.ckpt"))
    yield
    left = sorted(str(p.name) for p in set(ROOT.glob("*.ckpt")) - before)
    assert not left, f"the tests left {left} in the checkout; run such code in a temporary directory"


@pytest.fixture
def trace_first(monkeypatch):
    """``find``'s trace made when the search first asks, as before it ran between the trials.

    For the tests of the trace-led search itself on a simulated budget: their tiny models' trials
    take hundredths of a second, less than their traces, so paced between them
    (:func:`autobatch.estimating.background.between`) the trace would not lead them.
    ``tests/test_trace_beside.py`` tests the pacing.
    """
    from autobatch import pipeline
    from autobatch.estimating.prior import try_trace_prior

    monkeypatch.setattr(pipeline, "between", lambda workload, **options: try_trace_prior(workload, **options))


@pytest.fixture(scope="module")
def frozen_suite_heap():
    """The heap the suite built before this module, out of the collector's walk while it runs.

    For modules whose code under test calls ``gc.collect()`` on every trial or backend (the CUDA
    backend, accelerate's and Lightning's finders): each full collection would walk every object
    the whole test process holds, about 0.35 s a call. autobatch's own ``frozen_heap`` does this
    around every probe; here it spans the module, and the probes' own step aside while it holds.
    What the module creates is collected as before.
    """
    with frozen_heap():
        yield


# Under -n (pytest-xdist balances test by test, --dist load), the tests of a module that shares a fixture built
# once per module or class (ranks started for real, a sweep of estimates) run on one worker: split over two,
# each worker built it (the launchers' eight ranks twice, a minute each), and two of them starting ranks at once
# raced for one port. The others are balanced test by test as before: what --dist loadgroup does with groups.
def pytest_configure(config):
    if getattr(config.option, "dist", "no") == "load":  # the controller: schedule by group
        config.option.dist = "loadgroup"


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    node.workerinput["group_shared_fixtures"] = True  # a worker parses the command line anew: tell it


def _shares_a_fixture(item) -> bool:
    """Whether ``item`` uses a fixture built once per module or class (pytest's own fixture info)."""
    info = getattr(item, "_fixtureinfo", None)
    defs = getattr(info, "name2fixturedefs", {}) or {}
    return any(str(getattr(d, "scope", "")) in ("module", "class") for group in defs.values() for d in group)


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups (a worker's own hook runs first otherwise)
def pytest_collection_modifyitems(config, items):
    if getattr(config, "workerinput", {}).get("group_shared_fixtures"):
        config.option.loadgroup = True  # xdist names each grouped test's group after its id
        for item in items:
            if _shares_a_fixture(item):
                item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

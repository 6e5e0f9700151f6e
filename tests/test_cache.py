"""The probe cache: hits, misses, invalidation by every fingerprint field, concurrency, corrupt files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

import autobatch.tuning.fingerprint as fingerprint_module
from autobatch import SimulatedBackend, Workload
from autobatch.tuning.cache import (
    CacheWarning, cache_dir, cached_probe, clear, list_entries, load, probe_result_from_dict,
)
from autobatch.tuning.fingerprint import Fingerprint, fingerprint

BUDGET = "64KiB"


def _mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def _work(**changes) -> Workload:
    settings = dict(model=_mlp, make_batch=lambda b: (torch.randn(b, 16), torch.randint(0, 4, (b,))), name="mlp16")
    settings.update(changes)
    return Workload(**settings)


@pytest.fixture()
def root(tmp_path: Path) -> Path:
    return tmp_path / "cache"


def test_miss_then_hit_returns_the_same_result(root):
    first, cached_first = cached_probe(_work(), SimulatedBackend(BUDGET), root=root)
    again, cached_again = cached_probe(_work(), SimulatedBackend(BUDGET), root=root)
    assert (cached_first, cached_again) == (False, True)
    assert again == first
    assert [e.digest for e in list_entries(root)] == [p.stem for p in (root / "probe").glob("*.json")]


def test_no_cache_probes_again_and_refreshes_the_entry(root):
    cached_probe(_work(), SimulatedBackend(BUDGET), root=root)
    _, cached = cached_probe(_work(), SimulatedBackend(BUDGET), root=root, use_cache=False)
    assert cached is False
    assert len(list_entries(root)) == 1


def test_round_trip_keeps_extra_fields(root):
    result, _ = cached_probe(_work(), SimulatedBackend(BUDGET), root=root)
    data = {**result.to_dict(), "note": "kept"}
    rebuilt = probe_result_from_dict(json.loads(json.dumps(data)))
    assert rebuilt == result and rebuilt.extra == {"note": "kept", "probed_at": result.extra["probed_at"],
                                                   "trace_prior": result.trace_record}


# --- invalidation: every field of the fingerprint changes the digest ---------------------------

INFO = SimulatedBackend("1MiB").info()
BASE = fingerprint(_work(), INFO)


def _bigger() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))


class _Renamed(torch.nn.Sequential):
    pass


CHANGES = {
    "parameter shapes": lambda: fingerprint(_work(model=_bigger), INFO),
    "architecture": lambda: fingerprint(_work(model=lambda: _Renamed(*_mlp())), INFO),
    "dtype": lambda: fingerprint(_work(dtype="bf16"), INFO),
    "sequence length": lambda: fingerprint(
        _work(make_batch=lambda b: (torch.randn(b, 2, 16), torch.randint(0, 4, (b, 2)))), INFO),
    "optimizer": lambda: fingerprint(_work(optimizer="sgd"), INFO),
    "gradient checkpointing": lambda: fingerprint(_work(grad_checkpointing=True), INFO),
    "wrapper": lambda: fingerprint(_work(), INFO, wrapper="ddp"),
    "world size": lambda: fingerprint(_work(), INFO, world_size=2),
    "gpu total memory": lambda: fingerprint(_work(), SimulatedBackend("2MiB").info()),
    "gpu name": lambda: fingerprint(_work(), INFO.__class__(**{**INFO.to_dict(), "name": "NVIDIA H200"})),
    "probe settings": lambda: fingerprint(_work(), INFO, settings={"headroom": 0.1}),
}


@pytest.mark.parametrize("field", list(CHANGES))
def test_every_field_changes_the_digest(field):
    assert CHANGES[field]().digest != BASE.digest


@pytest.mark.parametrize("attribute", ["torch_version", "cuda_version", "autobatch_version"])
def test_software_versions_change_the_digest(monkeypatch, attribute):
    if attribute == "torch_version":
        monkeypatch.setattr(torch, "__version__", "0.0.1")
    elif attribute == "cuda_version":
        monkeypatch.setattr(torch.version, "cuda", "99.9")
    else:
        monkeypatch.setattr(fingerprint_module, "autobatch_version", lambda: "99.0")
    assert fingerprint(_work(), INFO).digest != BASE.digest


@pytest.mark.parametrize("variable", ["PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"])
def test_the_allocator_configuration_changes_the_digest(monkeypatch, variable):
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    plain = fingerprint(_work(), INFO).digest
    monkeypatch.setenv(variable, "expandable_segments:True")  # no fragmentation: more fits
    assert fingerprint(_work(), INFO).digest != plain


def test_weights_and_free_memory_do_not_change_the_digest():
    model = _mlp()
    torch.nn.init.constant_(model[0].weight, 3.0)
    assert fingerprint(_work(model=model), INFO).digest == fingerprint(_work(model=_mlp()), INFO).digest
    busy = INFO.__class__(**{**INFO.to_dict(), "free_bytes": 1, "capacity_bytes": 1, "host": "elsewhere"})
    assert fingerprint(_work(), busy).digest == BASE.digest


def test_a_changed_field_is_a_miss_end_to_end(root):
    cached_probe(_work(), SimulatedBackend(BUDGET), root=root)
    assert cached_probe(_work(optimizer="sgd"), SimulatedBackend(BUDGET), root=root)[1] is False
    assert cached_probe(_work(), SimulatedBackend("128KiB"), root=root)[1] is False
    assert cached_probe(_work(), SimulatedBackend(BUDGET), root=root, headroom=0)[1] is False
    assert cached_probe(_work(), SimulatedBackend(BUDGET), root=root)[1] is True
    assert len(list_entries(root)) == 4


def test_a_different_free_capacity_is_a_miss(root):
    result, _ = cached_probe(_work(), SimulatedBackend(BUDGET), root=root)
    fp = fingerprint(_work(), SimulatedBackend(BUDGET).info(), settings={"headroom": 0.05, "max_batch": None,
                                                                        "min_batch": None})
    assert load(fp, root=root, capacity=result.capacity_bytes) == result
    assert load(fp, root=root, capacity=result.capacity_bytes // 2) is None


# --- bad files: one warning, a miss, and the file rebuilt --------------------------------------


def _only_file(root: Path) -> Path:
    (path,) = (root / "probe").glob("*.json")
    return path


@pytest.mark.parametrize("content", [
    b"{not json", b"\xff\xfe\x00garbage", b"", b'{"schema": "something-else", "version": 1}', b"[1, 2, 3]",
    b'{"schema": "autobatch.probe-cache", "version": 999}',
])
def test_corrupt_or_foreign_file_warns_once_and_is_rebuilt(root, content):
    first, _ = cached_probe(_work(), SimulatedBackend(BUDGET), root=root)
    path = _only_file(root)
    path.write_bytes(content)
    with pytest.warns(CacheWarning, match="it will be rebuilt") as record:
        result, cached = cached_probe(_work(), SimulatedBackend(BUDGET), root=root)
    assert len(record) == 1 and cached is False and result.max_batch == first.max_batch
    assert json.loads(path.read_text())["schema"] == "autobatch.probe-cache"
    assert cached_probe(_work(), SimulatedBackend(BUDGET), root=root)[1] is True


def test_a_file_holding_another_fingerprint_is_not_trusted(root):
    cached_probe(_work(), SimulatedBackend(BUDGET), root=root)
    path = _only_file(root)
    data = json.loads(path.read_text())
    data["fingerprint"]["optimizer"] = "sgd"
    data["result"]["max_batch"] = 10**6  # a wrong answer must never be served
    path.write_text(json.dumps(data))
    with pytest.warns(CacheWarning, match="fingerprint does not match"):
        result, cached = cached_probe(_work(), SimulatedBackend(BUDGET), root=root)
    assert cached is False and result.max_batch < 10**6


def test_malformed_result_warns_and_is_a_miss(root):
    cached_probe(_work(), SimulatedBackend(BUDGET), root=root)
    path = _only_file(root)
    data = json.loads(path.read_text())
    del data["result"]["trials"]
    path.write_text(json.dumps(data))
    with pytest.warns(CacheWarning, match="malformed result"):
        assert cached_probe(_work(), SimulatedBackend(BUDGET), root=root)[1] is False


def test_list_skips_bad_files_with_a_warning_and_clear_removes_everything(root):
    cached_probe(_work(), SimulatedBackend(BUDGET), root=root)
    (root / "probe" / ("0" * 64 + ".json")).write_text("nope")  # a damaged entry of autobatch's
    (root / "probe" / "junk.json").write_text("nope")  # a file autobatch did not write
    (root / "tune.db").write_bytes(b"")
    with pytest.warns(CacheWarning):
        entries = list_entries(root)
    assert [e.workload for e in entries] == ["mlp16"]
    assert "mlp16" in str(entries[0]) and "max batch" in str(entries[0])
    assert clear(root) == 3  # the entry, the damaged one and the study: not the file autobatch did not write
    assert not (root / "tune.db").exists() and (root / "probe" / "junk.json").exists()
    with pytest.warns(CacheWarning, match="junk.json: unreadable: JSONDecodeError, and not a file autobatch wrote \\(left as it is\\)"):
        assert list_entries(root) == []


def test_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("AUTOBATCH_CACHE_DIR", str(tmp_path / "mine"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "mine"
    monkeypatch.delenv("AUTOBATCH_CACHE_DIR")
    assert cache_dir() == tmp_path / "xdg" / "autobatch"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "autobatch"


def test_an_unwritable_cache_warns_and_still_answers(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")  # a file where the cache folder should be
    with pytest.warns(CacheWarning, match="could not write"):
        result, cached = cached_probe(_work(), SimulatedBackend(BUDGET), root=blocker)
    assert cached is False and result.max_batch > 0


# --- two processes writing the same key at once ------------------------------------------------

_WRITER = textwrap.dedent("""
    import sys, warnings
    from pathlib import Path
    warnings.simplefilter("error")   # a torn or unreadable file would raise here
    from autobatch.probing.backends import DeviceInfo
    from autobatch.tuning.cache import load, store
    from autobatch.tuning.fingerprint import Fingerprint
    from autobatch.probing.probe import ProbeResult, summarise
    from autobatch.probing.trial import Trial

    root, who = Path(sys.argv[1]), int(sys.argv[2])
    fp = Fingerprint(fields={"k": 1}, digest="ab" * 32)
    device = DeviceInfo("simulated", "cpu", None, 1 << 20, 1 << 20, 0, 1 << 20, host="h")
    for i in range(80):
        # entries must agree with their own trials (the cache checks): max fits, max + 1 does not
        top = who * 1000 + i
        trials = tuple(Trial(b, True, b * 100, b * 100) for b in range(1, 2 + (i % 40)))
        trials += (Trial(top, True, top * 100, top * 100), Trial(top + 1, False, 1 << 20, 1 << 20))
        safe = summarise(trials, top, 1 << 20).safe_batch
        result = ProbeResult(max_batch=top, safe_batch=safe, limited_by="memory", min_batch=1, trials=trials,
                             device=device, capacity_bytes=1 << 20, headroom_bytes=0, bytes_per_sample=1.0,
                             fixed_bytes=2.0, safe_peak_bytes=None, safe_peak_measured=False, workload="w" * (i % 300))
        store(fp, result, root=root)
        got = load(fp, root=root)
        assert got is not None and got.max_batch // 1000 in (1, 2), got
    print("ok")
""")


def test_two_processes_writing_the_same_key_never_tear_the_file(tmp_path):
    root = tmp_path / "cache"
    env = {**os.environ, "PYTHONWARNINGS": "error::UserWarning"}
    procs = [
        subprocess.Popen([sys.executable, "-c", _WRITER, str(root), str(who)], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for who in (1, 2)
    ]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=120))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for proc, (out, err) in zip(procs, outputs):
        assert proc.returncode == 0, err[-2000:]
        assert out.strip() == "ok"
    fp = Fingerprint(fields={"k": 1}, digest="ab" * 32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        final = load(fp, root=root)
    assert final is not None and final.max_batch in (1079, 2079)
    assert not list((root / "probe").glob("*.tmp"))


def test_the_version_is_read_from_a_source_tree_that_is_not_installed(monkeypatch):
    # Run from a checkout (PYTHONPATH=.), the package metadata is missing: the version comes from
    # autobatch.__version__ (a real GPU machine found the fallback importing from the wrong package).
    import importlib.metadata

    import autobatch
    from autobatch.tuning import fingerprint as fingerprint_module

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    assert fingerprint_module.autobatch_version() == autobatch.__version__

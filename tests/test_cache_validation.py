"""Cache entries are checked before they are served: a damaged one warns once and the probe runs again."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from autobatch import SimulatedBackend, Workload
from autobatch.tuning.cache import CacheWarning, cached_probe

from .tiny import mlp


def work() -> Workload:
    return Workload(mlp(), lambda b: (torch.randn(b, 64), torch.randint(0, 10, (b,))))


def probe_twice(tmp_path, edit):
    backend = SimulatedBackend("4MiB")
    first, hit = cached_probe(work(), backend, headroom=0.05, root=tmp_path)
    assert not hit
    (path,) = (tmp_path / "probe").glob("*.json")
    entry = json.loads(path.read_text())
    edit(entry["result"])
    path.write_text(json.dumps(entry))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        again, hit = cached_probe(work(), backend, headroom=0.05, root=tmp_path)
    cache_warnings = [w for w in caught if issubclass(w.category, CacheWarning)]
    return first, again, hit, cache_warnings


def same(a, b) -> bool:
    """The same answer from the same trials (their timings differ between two probes)."""
    return (a.max_batch, a.safe_batch, [(t.batch, t.fits) for t in a.trials]) == \
        (b.max_batch, b.safe_batch, [(t.batch, t.fits) for t in b.trials])


def _set(key, value):
    def edit(result):
        result[key] = value
    return edit


@pytest.mark.parametrize("edit, why", [
    (_set("safe_batch", 1), "safe_batch"),  # within range, but not what its trials and headroom give
    (_set("safe_batch", 9999), "safe_batch"),
    (_set("max_batch", 9999), "max_batch"),
    (_set("safe_batch", "abc"), "safe_batch"),
    (_set("max_batch", "abc"), "max_batch"),
    (_set("safe_batch", -1), "safe_batch"),
    (_set("capacity_bytes", "lots"), "capacity_bytes"),
    (_set("limited_by", "luck"), "limited_by"),
    (_set("trials", "none"), "malformed"),
    (_set("trials", [{"batch": "x", "fits": True, "peak_bytes": 1, "reserved_bytes": 1}]), "trials"),
    (_set("trials", [{"batch": 1, "fits": True, "peak_bytes": 1, "reserved_bytes": 1, "forward_bytes": "x"}]), "trials"),
    (_set("device", []), "malformed"),
    (_set("safe_peak_measured", "yes"), "safe peak"),
])
def test_a_damaged_entry_warns_once_and_is_probed_again(tmp_path, edit, why):
    first, again, hit, cache_warnings = probe_twice(tmp_path, edit)
    assert not hit and same(again, first)
    assert len(cache_warnings) == 1 and why in str(cache_warnings[0].message)


def test_max_batch_must_agree_with_its_own_trials(tmp_path):
    def shift(result):  # a max batch the trial log does not prove: max - 1 fitted, max + 1 ran out
        result["max_batch"] -= 1
        result["safe_batch"] = min(result["safe_batch"], result["max_batch"])

    first, again, hit, cache_warnings = probe_twice(tmp_path, shift)
    assert not hit and same(again, first)
    assert len(cache_warnings) == 1 and "trials" in str(cache_warnings[0].message)


def test_an_intact_entry_is_served(tmp_path):
    first, again, hit, cache_warnings = probe_twice(tmp_path, lambda result: None)
    assert hit and same(again, first) and not cache_warnings


NESTED = "[" * 100_000 + "]" * 100_000  # parses past Python's recursion limit


@pytest.mark.parametrize("content", [
    NESTED,
    '{"schema": "autobatch-probe", "version": 1, "digest": ' + NESTED + "}",
    "[1, 2, 3]",
    "\x00\xff garbage",
    '{"schema": 1e999}',
], ids=["nested", "nested-inside", "a-list", "binary", "infinity"])
def test_any_content_in_a_cache_file_is_skipped_by_find_and_cache_list(tmp_path, monkeypatch, content):
    from typer.testing import CliRunner

    from autobatch.cli import app
    from autobatch.tuning.cache import SCHEMA, SCHEMA_VERSION

    content = content.replace('"autobatch-probe", "version": 1', f'"{SCHEMA}", "version": {SCHEMA_VERSION}')
    monkeypatch.setenv("AUTOBATCH_CACHE_DIR", str(tmp_path))
    args = ["find", "--model", "tiny-mlp", "--device", "cpu", "--memory", "4MiB", "--max-micro", "8", "--no-trace-prior",
            "--json"]
    first = CliRunner().invoke(app, args)
    assert first.exit_code == 0, first.output
    for path in (tmp_path / "probe").glob("*.json"):  # the entry find just wrote, and a stray one beside it
        path.write_text(content)
        (tmp_path / "probe" / f"stray-{path.name}").write_text(content)
    again = CliRunner().invoke(app, args)
    assert again.exit_code == 0 and json.loads(again.stdout)["cached"] is False, again.output
    listed = CliRunner().invoke(app, ["cache", "list", "--json"])
    assert listed.exit_code == 0 and "Traceback" not in listed.output


def test_cache_clear_removes_only_what_autobatch_wrote(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from autobatch.cli import app

    monkeypatch.setenv("AUTOBATCH_CACHE_DIR", str(tmp_path))
    cached_probe(work(), SimulatedBackend("4MiB"), headroom=0.05, root=tmp_path)
    (tmp_path / "probe" / "mydata.json").write_text('{"a": 1}')  # the user's own, in a folder they pointed at
    (tmp_path / "notes.txt").write_text("mine")
    listed = CliRunner().invoke(app, ["cache", "list"])
    assert "mydata.json: not an autobatch probe-cache file, and not a file autobatch wrote (left as it is)" in listed.output
    cleared = CliRunner().invoke(app, ["cache", "clear"])
    assert cleared.exit_code == 0 and "removed 1 file from" in cleared.stdout
    assert (tmp_path / "probe" / "mydata.json").read_text() == '{"a": 1}' and (tmp_path / "notes.txt").exists()
    assert list((tmp_path / "probe").glob("*.json")) == [tmp_path / "probe" / "mydata.json"]

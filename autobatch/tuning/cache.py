"""Probe results on disk, keyed by fingerprint, so nobody pays for the same probe twice.

One JSON file per fingerprint in a per-user cache directory. Files are written to a temporary
name and moved into place with ``os.replace`` (atomic on POSIX and Windows), so a reader sees
the old file or the new one, never half of one, however many processes write at once. A file
that cannot be read, or was written by something else, gives a one-line warning and is treated
as a miss: the probe runs again and its result replaces the file.
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from ..errors import AutobatchError
from ..probing.backends import DeviceInfo, MemoryBackend
from ..probing.probe import DEFAULT_HEADROOM, make_backend, probe
from ..probing.result import ProbeResult
from ..probing.trial import Trial
from ..probing.workload import Workload
from .entry import entry_problem
from .fingerprint import Fingerprint, fingerprint

__all__ = [
    "CacheEntry",
    "CacheWarning",
    "cache_dir",
    "cached_probe",
    "clear",
    "list_entries",
    "load",
    "store",
    "probe_result_from_dict",
    "SCHEMA",
    "SCHEMA_VERSION",
]

SCHEMA = "autobatch.probe-cache"
SCHEMA_VERSION = 1
# The free memory of a shared GPU moves a little between runs; within this fraction of the
# total a cached result still holds, beyond it the probe runs again.
CAPACITY_TOLERANCE = 0.01
_SUFFIX = ".json"


class CacheWarning(UserWarning):
    """A cache file was unreadable or foreign and is being rebuilt."""


def cache_dir() -> Path:
    """The per-user cache directory (created on first use by the writers).

    ``$AUTOBATCH_CACHE_DIR`` wins; else ``$XDG_CACHE_HOME/autobatch``, ``%LOCALAPPDATA%\\autobatch``
    on Windows, or ``~/.cache/autobatch``.
    """
    override = os.environ.get("AUTOBATCH_CACHE_DIR")
    if override:
        return Path(override).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg).expanduser() / "autobatch"
    if sys.platform == "win32" and os.environ.get("LOCALAPPDATA"):
        return Path(os.environ["LOCALAPPDATA"]) / "autobatch"
    return Path.home() / ".cache" / "autobatch"


def _probe_dir(root: Path | None) -> Path:
    return (root if root is not None else cache_dir()) / "probe"


# --- ProbeResult from its to_dict() ----------------------------------------------------------


def _pick(cls: type, data: Mapping[str, Any]) -> dict[str, Any]:
    names = {f.name for f in fields(cls) if f.init}
    return {k: v for k, v in data.items() if k in names}


def probe_result_from_dict(data: Mapping[str, Any]) -> ProbeResult:
    """Rebuild a :class:`ProbeResult` from :meth:`ProbeResult.to_dict` (keys it does not know go to ``extra``).

    Raises ``KeyError``/``TypeError``/``ValueError`` on a dict of another shape.

    Example:
        >>> import torch
        >>> from autobatch import SimulatedBackend, Workload, probe
        >>> work = Workload(torch.nn.Linear(8, 2), lambda b: (torch.randn(b, 8), torch.zeros(b, dtype=torch.long)))
        >>> result = probe(work, SimulatedBackend("64KiB"), headroom=0)
        >>> probe_result_from_dict(result.to_dict()) == result
        True
    """
    data = dict(data)
    device = DeviceInfo(**_pick(DeviceInfo, data.pop("device")))
    trials = tuple(Trial(**_pick(Trial, t)) for t in data.pop("trials"))
    known = _pick(ProbeResult, data)
    extra = {k: v for k, v in data.items() if k not in known}
    known.pop("extra", None)
    return ProbeResult(**known, device=device, trials=trials, extra=extra)


# --- files ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CacheEntry:
    """One cached probe, as ``autobatch cache list`` shows it."""

    path: Path
    digest: str
    workload: str
    device: str
    max_batch: int
    safe_batch: int
    created: float

    def __str__(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(self.created))
        return (f"{self.digest[:16]}  {self.workload}  on {self.device}: max batch {self.max_batch}, "
                f"safe {self.safe_batch}  ({when})")


def _warn(path: Path, why: str) -> None:
    warnings.warn(f"autobatch cache: ignoring {path} ({why}); it will be rebuilt", CacheWarning, stacklevel=3)


def _skip(path: Path, why: str) -> None:
    """One warning for a file that is not a valid entry: one of autobatch's is rebuilt, anyone else's left alone."""
    if _ours(path.name):
        _warn(path, why)
    else:
        warnings.warn(f"autobatch cache: ignoring {path}: {why}, and not a file autobatch wrote (left as it is)",
                      CacheWarning, stacklevel=3)


def _read(path: Path) -> dict[str, Any] | None:
    """The parsed entry, or ``None`` (with one warning) when it is not a valid autobatch entry."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (FileNotFoundError, NotADirectoryError):  # nothing cached yet
        return None
    except (OSError, ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError; JSON nested too deep
        _skip(path, f"unreadable: {type(exc).__name__}")
        return None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        _skip(path, "not an autobatch probe-cache file")
        return None
    if data.get("version") != SCHEMA_VERSION:
        _warn(path, f"cache format version {data.get('version')!r}, this autobatch reads {SCHEMA_VERSION}")
        return None
    return data


def load(fp: Fingerprint, *, root: Path | None = None, capacity: int | None = None) -> ProbeResult | None:
    """The cached result for ``fp``, or ``None`` on a miss (a bad file warns once and is a miss).

    A file whose recorded fingerprint differs from ``fp`` (a foreign or tampered file under
    that name) is a miss, as is one probed at a capacity further than
    ``CAPACITY_TOLERANCE`` of the total from ``capacity``.
    """
    path = _probe_dir(root) / f"{fp.digest}{_SUFFIX}"
    data = _read(path)
    if data is None:
        return None
    try:  # any content at all: a file that is not what autobatch wrote is skipped, never a crash
        if data.get("digest") != fp.digest or data.get("fingerprint") != fp.fields:
            _warn(path, "its fingerprint does not match its name")
            return None
        result = probe_result_from_dict(data["result"])
        problem = entry_problem(result)
    except Exception as exc:
        _warn(path, f"malformed result: {type(exc).__name__}")
        return None
    if problem is not None:  # a damaged or edited entry: never serve a plan from it
        _warn(path, problem)
        return None
    if capacity is not None:
        total = result.device.total_bytes or result.capacity_bytes
        if abs(result.capacity_bytes - capacity) > CAPACITY_TOLERANCE * total:
            return None  # the GPU has more or less free memory than when probed: a plain miss
    return result


def store(fp: Fingerprint, result: ProbeResult, *, root: Path | None = None) -> Path:
    """Write ``result`` under ``fp`` atomically and return the file's path."""
    folder = _probe_dir(root)
    folder.mkdir(parents=True, exist_ok=True)
    entry = {
        "schema": SCHEMA,
        "version": SCHEMA_VERSION,
        "digest": fp.digest,
        "created": time.time(),
        "fingerprint": fp.fields,
        "result": result.to_dict(),
    }
    text = json.dumps(entry, indent=1, sort_keys=True, default=_fallback)
    path = folder / f"{fp.digest}{_SUFFIX}"
    fd, tmp = tempfile.mkstemp(prefix=f".{fp.digest[:16]}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        _replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _fallback(value: Any) -> Any:
    return str(value)  # e.g. a numpy scalar in extra: keep the file valid JSON


def _replace(src: str, dst: Path) -> None:
    # On Windows a reader holding dst open makes the move fail for a moment; POSIX never does.
    for attempt in range(50):
        try:
            os.replace(src, dst)
            return
        except PermissionError:
            if attempt == 49:
                raise
            time.sleep(0.01)


def list_entries(root: Path | None = None) -> list[CacheEntry]:
    """Every readable cached probe, newest first (unreadable files warn and are skipped)."""
    folder = _probe_dir(root)
    entries = []
    for path in sorted(folder.glob(f"*{_SUFFIX}")) if folder.is_dir() else []:
        data = _read(path)
        if data is None:
            continue
        try:  # any content at all, as in load()
            result = data.get("result") or {}
            entries.append(CacheEntry(
                path=path, digest=str(data["digest"]), workload=str(result.get("workload", "?")),
                device=str((result.get("device") or {}).get("name", "?")), max_batch=int(result["max_batch"]),
                safe_batch=int(result["safe_batch"]), created=float(data.get("created", 0.0)),
            ))
        except Exception:
            _warn(path, "malformed entry")
    return sorted(entries, key=lambda e: e.created, reverse=True)


def clear(root: Path | None = None) -> int:
    """Delete every cached probe and the tuning studies; return how many files were removed.

    Only files autobatch names are removed: an entry is named by its fingerprint's digest (64
    hexadecimal digits), a file being written by its first 16; anything else in the folder (a file
    of the user's, when the cache points at a folder of theirs) is left where it is.
    """
    base = root if root is not None else cache_dir()
    folder = _probe_dir(root)
    doomed = [p for p in (list(folder.glob("*")) if folder.is_dir() else []) if p.is_file() and _ours(p.name)]
    doomed += [base / name for name in ("tune.db", "tune.db-journal", "tune.db-wal", "tune.db-shm") if (base / name).is_file()]
    removed = 0
    for path in doomed:
        try:
            path.unlink(missing_ok=True)
        except OSError as exc:  # a read-only cache: say which file and why, after what was removed
            raise AutobatchError(
                f"the cache must be writable to clear it, but removing {path} failed ({exc.strerror or exc}); "
                f"removed {removed} of {len(doomed)} files; check the permissions of {base}"
            ) from None
        removed += 1
    return removed


_OURS = re.compile(r"^(?:[0-9a-f]{64}\.json|\.[0-9a-f]{16}\..+\.tmp)$")


def _ours(name: str) -> bool:
    """Whether autobatch named this file: an entry (``<digest>.json``) or one being written."""
    return _OURS.match(name) is not None


# --- the probe, through the cache -------------------------------------------------------------


def cached_probe(
    workload: Workload,
    backend: MemoryBackend | None = None,
    *,
    max_batch: int | None = None,
    min_batch: int | None = None,
    headroom: float | int | str = DEFAULT_HEADROOM,
    on_trial: Callable[[Trial], None] | None = None,
    wrapper: str = "none",
    world_size: int = 1,
    use_cache: bool = True,
    root: Path | None = None,
    make_prior: Callable[[], Callable[[int], float] | None] | None = None,
) -> tuple[ProbeResult, bool]:
    """:func:`autobatch.probe` through the on-disk cache: ``(result, cached)``.

    Args:
        workload, backend, max_batch, min_batch, headroom, on_trial: as for :func:`~autobatch.probe`.
        wrapper, world_size: how training will wrap the model (``"ddp"``) and on how many ranks;
            part of the fingerprint.
        use_cache: ``False`` always probes, and stores the fresh result (``--no-cache``).
        root: the cache directory; default :func:`cache_dir`.
        make_prior: called only when the probe runs (not on a hit): the search's prior, or
            ``None`` for none (see :func:`autobatch.estimating.prior.try_trace_prior`).

    Example:
        >>> import tempfile, torch
        >>> from autobatch import SimulatedBackend, Workload
        >>> work = Workload(torch.nn.Linear(8, 2), lambda b: (torch.randn(b, 8), torch.zeros(b, dtype=torch.long)))
        >>> root = Path(tempfile.mkdtemp())
        >>> first, hit = cached_probe(work, SimulatedBackend("64KiB"), root=root)
        >>> again, hit_again = cached_probe(work, SimulatedBackend("64KiB"), root=root)
        >>> (hit, hit_again, again.max_batch == first.max_batch)
        (False, True, True)
    """
    backend = backend if backend is not None else make_backend()
    settings = {"headroom": headroom, "max_batch": max_batch, "min_batch": min_batch}
    fp = fingerprint(workload, backend.info(), wrapper=wrapper, world_size=world_size, settings=settings)
    if use_cache:
        hit = load(fp, root=root, capacity=backend.capacity())
        if hit is not None:
            return hit, True
    prior = make_prior() if make_prior is not None else None
    result = probe(workload, backend, max_batch=max_batch, min_batch=min_batch, headroom=headroom, on_trial=on_trial,
                   prior=prior)
    # When the trials ran, kept with the result: a later hit says when it was probed.
    probed_at = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    result = replace(result, extra={**result.extra, "probed_at": probed_at})
    try:
        store(fp, result, root=root)
    except OSError as exc:  # a read-only or full disk must not cost the user the probe they just ran
        warnings.warn(f"autobatch cache: could not write the result ({exc}); continuing without it",
                      CacheWarning, stacklevel=2)
    return result, False

"""Which sequence lengths a model was probed at: the table's rows into the cache, and back out.

``find --seq-len 256,512,…`` stores each row as the probe of that length would be stored, so a
later ``find --seq-len 512`` reads it; ``check --model … --seq-len N`` asks which lengths the
cache holds for the model, to say when a micro batch was never probed at ``N``.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from ..probing.backends import MemoryBackend
from ..probing.workload import Workload
from .cache import CacheWarning, _probe_dir, _read, probe_result_from_dict, store
from .fingerprint import fingerprint, model_signature
from .entry import entry_problem

__all__ = ["store_rows", "probed_lengths", "seq_len_of"]


def store_rows(table: Any, workload: Workload, backend: MemoryBackend, options: Mapping[str, Any],
               *, root: Path | None = None) -> None:
    """Cache each row of a length table under the fingerprint a single probe at its length has.

    ``workload.make_batch(b, seq_len)``; ``options`` are the probe's ``headroom``, ``max_batch``
    and ``min_batch``, as :func:`~autobatch.tuning.cache.cached_probe` keys them.
    """
    settings = {"headroom": options.get("headroom"), "max_batch": options.get("max_batch"),
                "min_batch": options.get("min_batch")}
    make_batch = workload.make_batch
    for row in table.rows:
        if entry_problem(row.train) is not None:  # nothing fit at this length: no probe the cache would keep
            continue
        at = replace(workload, make_batch=lambda b, s=row.seq_len: make_batch(b, s))
        try:
            store(fingerprint(at, backend.info(), settings=settings), row.train, root=root)
        except OSError as exc:  # a read-only or full disk must not cost the user the table
            warnings.warn(f"autobatch cache: could not write the row at seq_len {row.seq_len} ({exc})",
                          CacheWarning, stacklevel=2)


def seq_len_of(batch: Any) -> int | None:
    """The sequence length in a fingerprint's batch signature (``input_ids``, else the first 2-D tensor)."""
    if isinstance(batch, Mapping):
        if "shape" in batch and isinstance(batch["shape"], list):
            return int(batch["shape"][1]) if len(batch["shape"]) >= 2 else None
        if "input_ids" in batch:
            return seq_len_of(batch["input_ids"])
        values = list(batch.values())
    elif isinstance(batch, list):
        values = batch
    else:
        return None
    for value in values:
        found = seq_len_of(value)
        if found is not None:
            return found
    return None


def _shape_of(signature: Any) -> Any:
    return {k: v for k, v in signature.items() if k != "class"} if isinstance(signature, dict) else None


def probed_lengths(model: torch.nn.Module, *, root: Path | None = None) -> list[dict[str, Any]]:
    """Every cached probe of ``model`` (matched by architecture and parameter shapes) that has a
    sequence length: ``{"seq_len", "max_batch", "safe_batch", "device"}``, shortest first."""
    # The class's module is left out: a model loaded from file.py:fn lives in a module named per process.
    signature = _shape_of(json.loads(json.dumps(model_signature(model), sort_keys=True, default=str)))
    folder = _probe_dir(root)
    found = []
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        data = _read(path)
        if data is None or _shape_of((data.get("fingerprint") or {}).get("model")) != signature:
            continue
        seq_len = seq_len_of(data["fingerprint"].get("batch"))
        try:
            result = probe_result_from_dict(data["result"])
        except (KeyError, TypeError, ValueError, AttributeError):
            continue  # a malformed entry: the cache's own readers warn about it
        if entry_problem(result) is not None:
            continue  # one the cache ignores (and rebuilds) is no probe to compare with either
        if seq_len is not None:
            found.append({"seq_len": seq_len, "max_batch": result.max_batch, "safe_batch": result.safe_batch,
                          "device": result.device.name})
    return sorted(found, key=lambda p: (p["seq_len"], p["device"]))

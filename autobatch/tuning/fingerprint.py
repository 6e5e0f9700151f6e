"""A stable fingerprint of everything that decides a probe's answer, and nothing that does not.

Two probes with the same fingerprint give the same batch sizes, so the second one can be read
from the cache. The fingerprint holds the model's architecture and parameter *shapes* (never
their values: random or trained weights need the same memory), the batch shape, the training
settings, the device, the software versions and the allocator configuration. Any field that
changes changes the digest.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import AutobatchError
from ..modelinfo import require_materialized
from ..probing.backends import DeviceInfo
from ..probing.preserve import kept_rng
from ..probing.samples import check_sample_count
from ..probing.workload import Workload

__all__ = ["Fingerprint", "fingerprint", "model_signature", "batch_signature", "autobatch_version",
           "ALLOCATOR_CONF_VARIABLES"]

# Where torch reads the caching allocator's configuration (the second is the newer, device-neutral name).
ALLOCATOR_CONF_VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


@dataclass(frozen=True)
class Fingerprint:
    """The fields that key a cached result, and their hex digest.

    ``fields`` is JSON-ready; ``digest`` is the SHA-256 of its canonical JSON (sorted keys),
    so the same fields give the same digest in every process and on every machine.
    """

    fields: dict[str, Any]
    digest: str

    @property
    def short(self) -> str:
        """The first 16 hex digits: enough to tell entries apart in listings and file names."""
        return self.digest[:16]


def autobatch_version() -> str:
    """The installed autobatch version (the package metadata, else ``autobatch.__version__``)."""
    try:
        from importlib.metadata import version

        return version("autobatch")
    except Exception:  # not installed as a distribution (e.g. run from a source tree)
        from .. import __version__

        return __version__


def _build_for_signature(model: Any) -> torch.nn.Module:
    if isinstance(model, torch.nn.Module):
        return model
    # A factory is built on the meta device: shapes without memory, seconds for big models.
    # Factories that cannot run there (they load files, call .cuda()) are built for real.
    try:
        with torch.device("meta"):
            built = model()
    except Exception:
        built = model()
    if not isinstance(built, torch.nn.Module):
        raise AutobatchError(f"the model factory must return a torch.nn.Module, but it returned {type(built).__name__}")
    return built


def model_signature(model: torch.nn.Module) -> dict[str, Any]:
    """Module classes, parameter and buffer names with shapes and dtypes (no values), and the attention."""
    return {
        "class": f"{type(model).__module__}.{type(model).__qualname__}",
        "modules": [f"{name}:{type(m).__qualname__}" for name, m in model.named_modules()],
        "parameters": [
            [name, list(p.shape), str(p.dtype).removeprefix("torch."), bool(p.requires_grad)]
            for name, p in model.named_parameters()
        ],
        "buffers": [[name, list(b.shape), str(b.dtype).removeprefix("torch.")] for name, b in model.named_buffers()],
        # a transformers model's attention (eager keeps the probabilities, sdpa does not): the same modules
        "attention": getattr(getattr(model, "config", None), "_attn_implementation", None),
    }


def batch_signature(batch: Any) -> Any:
    """The structure of a batch with each tensor replaced by its shape and dtype."""
    if isinstance(batch, torch.Tensor):
        return {"shape": list(batch.shape), "dtype": str(batch.dtype).removeprefix("torch.")}
    if isinstance(batch, Mapping):
        return {str(k): batch_signature(v) for k, v in sorted(batch.items(), key=lambda kv: str(kv[0]))}
    if isinstance(batch, (list, tuple)):
        return [batch_signature(v) for v in batch]
    if isinstance(batch, (int, float, str, bool)) or batch is None:
        return batch
    return type(batch).__qualname__


def _callable_name(fn: Any) -> str:
    if isinstance(fn, str):
        return fn.lower()
    module = getattr(fn, "__module__", None) or ""
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    return f"{module}.{name}" if module else name


def _dtype_name(dtype: Any) -> str:
    if dtype is None:
        return "fp32"
    return str(dtype).removeprefix("torch.").lower()


def _first_batch(workload: Workload) -> Any:
    """``make_batch(1)``, which must hold one sample (the user's code runs here: errors name it)."""
    batch = workload.make_batch(1)
    check_sample_count(batch, 1, workload.make_batch)
    return batch


def fingerprint(
    workload: Workload,
    device: DeviceInfo,
    *,
    wrapper: str = "none",
    world_size: int = 1,
    settings: Mapping[str, Any] | None = None,
) -> Fingerprint:
    """Fingerprint a workload on a device.

    Args:
        workload: what is probed; its model is read for shapes only (a factory is built on the
            meta device), and ``make_batch(1)`` gives the per-sample shapes (the sequence length).
        device: the device, from ``backend.info()``: its kind, name and total memory count; its
            free memory does not (the cache checks that apart, see :mod:`autobatch.cache`).
        wrapper: ``"none"`` or ``"ddp"``: DDP adds gradient buckets to the peak.
        world_size: the data-parallel world size the probe assumed.
        settings: other options that change the answer (``headroom``, ``max_batch``, …).

    Example:
        >>> import torch
        >>> from autobatch import SimulatedBackend, Workload
        >>> work = Workload(torch.nn.Linear(8, 2), lambda b: (torch.randn(b, 8), torch.zeros(b, dtype=torch.long)))
        >>> a = fingerprint(work, SimulatedBackend("1MiB").info())
        >>> b = fingerprint(work, SimulatedBackend("2MiB").info())
        >>> a.digest == b.digest
        False
    """
    if wrapper not in ("none", "ddp"):
        raise AutobatchError(f"wrapper must be 'none' or 'ddp', but got {wrapper!r}")
    if not isinstance(world_size, int) or world_size < 1:
        raise AutobatchError(f"world_size must be a positive integer, but got world_size={world_size!r}")
    with kept_rng():  # a factory's weight init and make_batch(1) draw random numbers: not the user's to lose
        model = require_materialized(_build_for_signature(workload.model))
        batch = _first_batch(workload)
    fields: dict[str, Any] = {
        "model": model_signature(model),
        "batch": batch_signature(batch),
        "loss_fn": _callable_name(workload.loss_fn),
        "optimizer": _callable_name(workload.optimizer),
        "dtype": _dtype_name(workload.dtype),
        "grad_checkpointing": bool(workload.grad_checkpointing),
        "grads_held": bool(workload.grads_held),
        "steps": workload.steps,
        "wrapper": wrapper,
        "world_size": world_size,
        # Capacity (free memory) is left out: it moves by megabytes between runs on a shared
        # GPU; the cache compares it separately, within a tolerance.
        "device": {"kind": device.kind, "name": device.name, "total_bytes": device.total_bytes},
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        # The allocator's settings change what fits (expandable_segments ends fragmentation).
        "allocator_conf": {name: os.environ.get(name) for name in ALLOCATOR_CONF_VARIABLES},
        "autobatch": autobatch_version(),
        "settings": {str(k): _jsonable(v) for k, v in sorted((settings or {}).items())},
    }
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"), default=str)
    return Fingerprint(fields=json.loads(canonical), digest=hashlib.sha256(canonical.encode()).hexdigest())


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)

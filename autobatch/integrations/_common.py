"""What the integrations share: the lazy import of a framework, the probe on one rank or all, the plan."""

from __future__ import annotations

import importlib
import itertools
import logging
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist

from ..distributed.lockstep import probe_distributed
from ..errors import AutobatchError, MissingDependencyError
from ..planning.plan import Plan
from ..planning.solver import solve
from ..probing.backends import MemoryBackend
from ..probing.heap import frozen_heap
from ..probing.memtrack import making_batch
from ..probing.oom import is_oom_error, oom_message
from ..probing.preserve import borrowed_model
from ..probing.probe import DEFAULT_HEADROOM, probe
from ..probing.result import ProbeResult
from ..probing.search import NoTrace, search_max
from ..probing.trial import Trial, to_device
from ..probing.workload import Workload, default_loss, resolve_dtype

__all__ = ["require", "world", "probe_here", "plan_for", "log_main", "batches_from_dataset", "POOL", "max_micro_of", "probe_eval_batch"]

POOL = 256  # samples collated once for probe batches; larger batches repeat them

log = logging.getLogger("autobatch.integrations")


def max_micro_of(max_micro: int | None, max_batch: int | None, where: str) -> int | None:
    """The cap on the per-device batch: ``max_micro``, as ``--max-micro`` names it everywhere; the
    earlier ``max_batch=`` still works, with a warning naming the new keyword."""
    if max_batch is None:
        return max_micro
    if max_micro is not None:
        raise AutobatchError(f"{where} takes max_micro= (the cap on the per-device batch), but got both max_micro= "
                             "and its old name max_batch=; pass max_micro= alone")
    import warnings

    warnings.warn(f"{where}: max_batch= is now max_micro=, as --max-micro on the command line", FutureWarning,
                  stacklevel=3)
    return max_batch


def require(module: str, extra: str, feature: str) -> ModuleType:
    """Import ``module`` or raise one line saying which extra installs it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        package = module.split(".")[0]
        raise MissingDependencyError(
            f"{feature} needs {package}, which is not installed; pip install 'autobatch[{extra}]'"
        ) from None


def world() -> tuple[int, int]:
    """(rank, world size) of the initialized process group, else (0, 1)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


UNTRACED = "a drop-in probes the framework's own training step, which it does not trace"


def probe_here(
    workload: Workload,
    backend: MemoryBackend | None = None,
    *,
    max_batch: int | None = None,
    min_batch: int | None = None,
    headroom: float | int | str = DEFAULT_HEADROOM,
) -> ProbeResult:
    """Probe on this device, or on every rank in lockstep (under DDP) when a group of several ranks exists.

    Every rank gets the same answer: the lockstep probe agrees after each trial.
    """
    if world()[1] > 1:
        return probe_distributed(
            workload, backend, max_batch=max_batch, min_batch=min_batch, headroom=headroom, wrap="ddp",
            prior=NoTrace(UNTRACED),
        ).to_probe_result()
    return probe(workload, backend, max_batch=max_batch, min_batch=min_batch, headroom=headroom,
                 prior=NoTrace(UNTRACED))


def plan_for(result: ProbeResult, target: int, world_size: int, *, use: str = "safe") -> Plan:
    """The exact plan for ``target`` on ``world_size`` data-parallel ranks, micro batch within the probe."""
    largest = result.safe_batch if use == "safe" else result.max_batch
    return solve(target, gpus_per_node=world_size, max_micro=max(largest, result.min_batch), min_micro=result.min_batch)


def log_main(logger: logging.Logger, message: str, *args: object) -> None:
    """Log on rank 0 only (every rank holds the same plan)."""
    if world()[0] == 0:
        logger.info(message, *args)


def batches_from_dataset(dataset: Any, collate: Callable[[list[Any]], Any], pool: int = POOL) -> Callable[[int], Any]:
    """``make_batch(b)``: ``b`` samples of ``dataset`` (its first ones, repeated), collated by ``collate``.

    The first ``pool`` samples are collated once, now; a probe batch then gathers its rows from
    them, so each batch is new memory of its own size (rows of a dataset tensor are views of the
    whole tensor, which a simulated device would count in full).
    """
    if hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__"):
        samples = [dataset[i] for i in range(min(pool, len(dataset)))]
    else:
        samples = list(itertools.islice(iter(dataset), pool))
    if not samples:
        raise AutobatchError("the training dataset is empty: no batch to probe with")
    collated, n = collate(samples), len(samples)

    def take(value: Any, index: torch.Tensor) -> Any:
        if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == n:
            return value.index_select(0, index)
        if isinstance(value, Mapping):
            taken = {k: take(v, index) for k, v in value.items()}
            return taken if type(value) is dict else type(value)(taken)
        if isinstance(value, (list, tuple)):
            items = [take(v, index) for v in value]
            return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
        return value

    return lambda b: take(collated, torch.arange(b) % n)


def probe_eval_batch(
    model: torch.nn.Module,
    make_batch: Callable[[int], Any],
    backend: MemoryBackend,
    *,
    dtype: str | torch.dtype | None = None,
    max_batch: int | None = None,
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor] = default_loss,
) -> int:
    """The exact largest evaluation batch: forward passes under ``no_grad`` in eval mode, same search as training."""
    autocast_dtype = resolve_dtype(dtype)

    def run(batch_size: int) -> Trial:
        error = None
        backend.release()
        resident = list(lent.parameters()) + list(lent.buffers())
        with backend.track(resident):
            try:
                with making_batch():
                    made = make_batch(batch_size)
                batch = to_device(made, backend.device)
                del made
                autocast = (torch.autocast(backend.device.type, dtype=autocast_dtype)
                            if autocast_dtype is not None else nullcontext())
                with torch.no_grad(), autocast:
                    loss_fn(lent, batch)
                del batch
            except Exception as exc:
                if not is_oom_error(exc):
                    raise
                error = oom_message(exc)
            peak = backend.peak()
        backend.release()
        return Trial(batch_size, error is None, peak.allocated, peak.reserved, peak.reserved, peak.reserved,
                     resident_bytes=backend.allocated_bytes() if error is None else None, error=error)

    with frozen_heap(), borrowed_model(model, backend.device) as lent:  # each trial's collection: the probe's objects only
        lent.eval()
        outcome = search_max(run, backend.capacity(), max_batch=max_batch)
    return outcome.max_batch

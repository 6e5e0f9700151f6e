"""Wrap a model for trials the way data-parallel training wraps it: DDP and its gradient buckets.

:func:`ddp_for_trials` wraps real tensors in ``DistributedDataParallel``. Its reducer reads its
tensors' data, which fake tensors have none of, so a trace takes :func:`traced_buckets` instead:
what DDP allocates, its flat gradient buckets, bucketed by torch's own rule, with no reducer.
"""

from __future__ import annotations

import gc
import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from ..probing.backends import MemoryBackend

__all__ = ["ddp_for_trials", "traced_buckets", "DDP_BUCKET_LIMITS"]

# DDP's bucket limits by default: a first bucket of 1 MiB (``dist._DEFAULT_FIRST_BUCKET_BYTES``),
# then ``bucket_cap_mb`` = 25 MiB each.
DDP_BUCKET_LIMITS = (1024 * 1024, 25 * 1024 * 1024)


def _quiet_buffer_kwargs() -> dict[str, bool]:
    # Newer torch renamed the switch that keeps DDP's forward from broadcasting buffers.
    params = inspect.signature(DistributedDataParallel.__init__).parameters
    return {"forward_sync_buffers": False} if "forward_sync_buffers" in params else {"broadcast_buffers": False}


@contextmanager
def ddp_for_trials(model: torch.nn.Module, backend: MemoryBackend, *, group: Any = None) -> Iterator[torch.nn.Module]:
    """Yield ``model`` wrapped in ``DistributedDataParallel``, ready for :func:`~autobatch.probing.trial.run_trial`.

    DDP allocates a gradient bucket per group of parameters (as large as the gradients
    themselves) when it is constructed; training pays for them, so the probe must too. The
    wrapper is built inside ``backend.track`` so the simulated backend counts the buckets (a real
    GPU's allocator sees them anyway), and they stay counted for as long as the wrapper lives.

    The trials run under ``no_sync`` and without the forward buffer broadcast: a step then
    holds the same tensors (buckets, gradients, activations) but issues no collective. That is
    deliberate: a rank that runs out of memory mid-step would otherwise leave the others waiting
    in the gradient all-reduce forever. The ranks agree after each trial instead
    (:func:`autobatch.distributed.lockstep.probe_distributed`). Construction itself communicates (DDP checks
    parameter shapes and broadcasts rank 0's weights), so every rank must enter this together.

    Args:
        model: the (borrowed) model, already on ``backend.device``.
        backend: the rank's memory backend.
        group: the process group DDP communicates on (default: the whole job).

    Example:
        >>> # inside an initialized process group, with ``lent`` from borrowed_model(...)
        >>> # with ddp_for_trials(lent, backend) as wrapped:
        >>> #     trial = run_trial(workload, wrapped, backend, 8)
    """
    # Where the parameters really are (on a GPU, backend.device): DDP checks device_ids against them.
    where = next((p.device for p in model.parameters()), backend.device)
    device_ids = [where.index] if where.type == "cuda" else None
    resident = [p for p in model.parameters()] + [b for b in model.buffers()]
    with backend.track(resident):
        wrapped = DistributedDataParallel(model, device_ids=device_ids, process_group=group, **_quiet_buffer_kwargs())
    try:
        with wrapped.no_sync():
            yield wrapped
    finally:
        # The reducer owns the buckets and the autograd hooks on the user's parameters; dropping
        # the wrapper frees the former and removes the latter. It sits in reference cycles, so
        # collect it now, while its process group is alive: destroyed later, during interpreter
        # exit, it can abort the process ("terminate called without an active exception").
        del wrapped
        gc.collect()


def traced_buckets(model: torch.nn.Module) -> list[torch.Tensor]:
    """DDP's gradient buckets for ``model`` in its steady steps, allocated as its reducer allocates them.

    DDP's reducer takes the parameters that need a gradient (each once) and gives each bucket
    one flat tensor of its parameters' total size: a copy of the gradients, held as long as the
    wrapper lives. After the first step it rebuilds them in the order the gradients arrived
    (about the reverse of the parameters'), a first bucket of 1 MiB then 25 MiB each, one dtype
    and device per bucket (torch's ``dist._compute_bucket_assignment_by_size``, called here).
    Its autograd hooks copy each gradient into its bucket and back in place after the all-reduce
    (``gradient_as_bucket_view=False``, the default of DDP, HF Trainer, accelerate and Lightning),
    so a step allocates nothing more. Under ``FakeTensorMode`` the buckets are fake: a trace of
    DDP without the reducer, which reads data a fake tensor has none of.
    ``tests/test_ddp_traced.py`` checks them against the real wrapper's, bucket by bucket and byte for byte.
    """
    import torch.distributed as dist

    seen: set[int] = set()
    params = [p for m in model.modules() for p in m.parameters(recurse=False)
              if p.requires_grad and not (id(p) in seen or seen.add(id(p)))][::-1]  # type: ignore[func-returns-value]
    if not params:
        return []
    buckets, _ = dist._compute_bucket_assignment_by_size(params, list(DDP_BUCKET_LIMITS), [False] * len(params))
    return [torch.empty(sum(params[i].numel() for i in bucket), dtype=params[bucket[0]].dtype,
                        device=params[bucket[0]].device) for bucket in buckets]

"""What runs in the trace's own process (:mod:`autobatch.estimating.spawned`): build, trace, answer.

The child is told the model's recipe first, and builds it on fake tensors at once, at the lowest
CPU priority: started as the probe starts building its own copy (:func:`~autobatch.estimating.spawned.warmed`),
its interpreter, imports and build run on a core the probe leaves idle. It is then told how to
trace (the allocator, the device type's autocast, and for a sharded probe the function, named by
the probe, that traces its step on a fake group of its world), traces
the warm batches, saying each as it ends, and answers the batches asked until told to stop or the
probe is gone. One that no probe takes is killed where it stands (:func:`~autobatch.estimating.spawned.warmed`).
"""

from __future__ import annotations

import contextlib
import multiprocessing.connection
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

from .prior import GuardedPrior, try_trace_prior, warm_batches

__all__ = ["child"]


def _said(prior: GuardedPrior, started: float) -> dict[str, Any]:
    return {"traced_batches": prior.traced_batches, "traced_once": prior.traced_once,
            "seconds": round(time.perf_counter() - started, 3), "failure": prior.failure}


def child(started: float) -> None:
    """The child's whole life (``started``: when its interpreter began)."""
    conn = multiprocessing.connection.Connection(int(sys.argv[1]))
    try:
        spec, load, settings = conn.recv()
    except (EOFError, OSError):
        return
    import torch  # at the lowest priority already: the probe set it as it started this process (spawned)

    torch.set_num_threads(1)
    try:
        from .estimate import load_fake_model

        built: Any = load_fake_model(spec, **load).to_workload(**settings)
    except Exception as exc:  # noqa: BLE001 - said when the trace is asked for, as the prior's failure
        built = exc
    try:
        # its start done: the CPU seconds it took, so the probe reckons the traces' pace without them
        conn.send(("built", time.process_time()))
        min_batch, allocator, device_type, traced = conn.recv()
        with _prior_of(spec, built, min_batch, allocator, device_type, traced) as prior:
            for batch in warm_batches(prior.first):
                if prior.failure is not None:
                    break
                prior(batch)
                conn.send(("traced", time.process_time(), _said(prior, started)))
            conn.send(("ready", _said(prior, started)))
            while (batch := conn.recv()) is not None:
                value = prior(batch)
                conn.send(("value", value, _said(prior, started)))
    except (EOFError, OSError):  # the probe is gone
        return


@contextlib.contextmanager
def _prior_of(spec: str, built: Any, min_batch: int | None, allocator: str, device_type: str,
              traced: Callable[..., Any] | None) -> Iterator[GuardedPrior]:
    """The prior of ``built`` (the workload, or why it could not be built) for the block: its plain
    step's trace, or what ``traced`` makes of it (a context manager the probe named, such as
    :func:`autobatch.pipeline.sharded_prior_in_its_world`: the sharded step's, on a fake group of the
    probe's world, open while the prior answers)."""
    with contextlib.ExitStack() as stack:
        try:
            if isinstance(built, Exception):
                raise built
            prior = (try_trace_prior(built, min_batch=min_batch, allocator=allocator, device_type=device_type)
                     if traced is None else
                     stack.enter_context(traced(built, min_batch=min_batch, allocator=allocator, device_type=device_type)))
            if prior is None:
                raise RuntimeError("no fake copy of the model")
        except Exception as exc:  # noqa: BLE001 - the prior only saves trials: its failure is said, not raised
            prior = GuardedPrior.failed(spec, exc)
        yield prior

"""How the ranks of a lockstep probe agree: one collective per step, bounded in time, the same result everywhere.

Every rank runs the same search; these collectives hand each rank identical inputs, so the
searches take identical steps and no rank waits in a collective another skipped:
:func:`share_trial` gathers every rank's figures and :func:`agreed_trial` makes one trial of them
(it fits only where it fit everywhere; its bytes are the largest any rank measured);
:func:`agree_on_errors` stops every rank together when one failed; :func:`agreed_prior` gives
every rank the same prior values (the largest any rank predicts). Each collective completes
within the timeout or raises one clear error (:func:`collective`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..errors import AutobatchError, NoBatchFitsError
from ..probing.backends import MemoryBackend
from ..probing.search import NoTrace
from ..probing.trial import Trial
from .fence import STOPPED_BY_PEER, is_stopped_by_peer
from .result import RankFailedError

__all__ = ["Comm", "comm_device", "collective", "agree_on_errors", "share_trial", "agreed_trial", "warm_up",
           "agreed_prior"]

_BUCKET_BYTES = 25 << 20  # DistributedDataParallel's default bucket_cap_mb

# The figures each rank shares after a trial, in this order (float64: exact for bytes below 8 PiB).
_FIELDS = ("fits", "peak", "reserved", "forward_backward", "optimizer", "resident", "seconds", "retries", "forward")


@dataclass(frozen=True)
class Comm:
    """Where the agreement's tensors live and how long any rank may keep the others waiting."""

    device: torch.device
    timeout_s: float


def comm_device(backend: MemoryBackend | None = None) -> torch.device:
    # NCCL only moves CUDA tensors, and must move them on the GPU this rank probes (the current
    # device may still be GPU 0 on every rank); gloo only CPU ones.
    if dist.get_backend() == "nccl":
        if backend is not None and backend.device.type == "cuda":
            return backend.device
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def collective(comm: Comm, what: str, start: Callable[[], Any], after: Callable[[], Any] = lambda: None) -> Any:
    """Run one collective to completion within ``comm.timeout_s``, and ``after`` (reading the result).

    NCCL's collectives return at once and fail later, at the next synchronisation or as a
    watchdog abort; waiting on the work with a timeout and synchronising here makes any failure
    one clear error, raised at this step, in time.
    """
    try:
        work = start()
        if work is not None:
            # Poll rather than wait(timeout): gloo's wait ignores a timeout shorter than the group's.
            deadline, pause = time.monotonic() + comm.timeout_s, 0.0005
            while not work.is_completed():
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the collective did not complete within {comm.timeout_s:.0f} s")
                time.sleep(pause)
                pause = min(2 * pause, 0.05)
            work.wait()  # the collective's own error, if it failed
        if comm.device.type == "cuda":
            torch.cuda.synchronize(comm.device)
        return after()
    except RuntimeError as exc:  # DistBackendError, gloo/NCCL timeouts and aborts are RuntimeErrors
        raise AutobatchError(
            f"lost contact with the other ranks while {what} (no answer within {comm.timeout_s:.0f} s: "
            f"{str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__}); "
            "a rank crashed, hung or was not started — read every rank's log"
        ) from exc


def agree_on_errors(comm: Comm, exc: BaseException | None, stage: str) -> None:
    """Collective: if any rank failed, every rank raises.

    The failing rank raises its own error, the others :class:`RankFailedError` naming it; when
    the error is that nothing fits (:class:`NoBatchFitsError`), every rank raises that same
    error, word for word.
    """
    flag = torch.tensor([0.0 if exc is None else 1.0], device=comm.device)
    failed = collective(comm, stage, lambda: dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True),
                         lambda: flag.item())
    if failed == 0:
        return
    mine = None if exc is None else (
        type(exc).__name__, str(exc).splitlines()[0][:500] if str(exc) else "", isinstance(exc, NoBatchFitsError))
    messages: list[Any] = [None] * dist.get_world_size()
    collective(comm, stage, lambda: dist.all_gather_object(messages, mine))
    rank, (name, message, no_fit) = next((r, m) for r, m in enumerate(messages) if m is not None)
    if no_fit:
        raise NoBatchFitsError(f"rank {rank}: {message}") from exc
    if exc is not None:
        raise exc
    raise RankFailedError(
        f"rank {rank} failed while {stage} with {name}: {message}; every rank stopped with it "
        f"(the traceback is in rank {rank}'s log)",
        rank=rank,
    )


def share_trial(comm: Comm, trial: Trial | None) -> list[Trial | None]:
    """Collective: every rank's trial figures (``None`` for a rank whose trial raised)."""
    if trial is None:
        row = [-1.0] * len(_FIELDS)
    else:
        # 1 fits, 0 out of memory here, 2 stopped by another rank's out-of-memory error
        fits = 1.0 if trial.fits else 2.0 if is_stopped_by_peer(trial.error) else 0.0
        row = [fits, trial.peak_bytes, trial.reserved_bytes, trial.forward_backward_bytes,
               trial.optimizer_bytes, -1.0 if trial.resident_bytes is None else trial.resident_bytes,
               -1.0 if trial.seconds_per_step is None else trial.seconds_per_step, trial.alloc_retries,
               trial.forward_bytes]
    mine = torch.tensor(row, dtype=torch.float64, device=comm.device)
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    return collective(comm, "sharing a trial", lambda: dist.all_gather(rows, mine, async_op=True),
                       lambda: [_row_to_trial(trial.batch if trial else 0, r.tolist()) for r in rows])


def _row_to_trial(batch: int, row: list[float]) -> Trial | None:
    if row[0] < 0:
        return None
    fits, peak, reserved, fb, opt, resident, seconds, retries, forward = row
    return Trial(
        batch=batch, fits=fits == 1, peak_bytes=int(peak), reserved_bytes=int(reserved),
        forward_backward_bytes=int(fb), optimizer_bytes=int(opt),
        resident_bytes=None if resident < 0 else int(resident), seconds_per_step=None if seconds < 0 else seconds,
        error=None if fits == 1 else STOPPED_BY_PEER if fits == 2 else "out of memory", alloc_retries=int(retries),
        forward_bytes=int(forward),
    )


def agreed_trial(batch: int, trials: list[Trial]) -> Trial:
    failed = [r for r, t in enumerate(trials) if not t.fits]
    fits = not failed
    return Trial(
        batch=batch,
        fits=fits,
        peak_bytes=max(t.peak_bytes for t in trials),
        reserved_bytes=max(t.reserved_bytes for t in trials),
        forward_backward_bytes=max(t.forward_backward_bytes for t in trials),
        optimizer_bytes=max(t.optimizer_bytes for t in trials),
        resident_bytes=max(t.resident_bytes or 0 for t in trials) if fits else None,
        # The slowest rank sets the pace of a synchronous step.
        seconds_per_step=max(t.seconds_per_step or 0.0 for t in trials) if fits else None,
        error=None if fits else "out of memory on rank " + ", ".join(map(str, failed)),
        alloc_retries=max(t.alloc_retries for t in trials),
        forward_bytes=max(t.forward_bytes for t in trials) if fits else 0,
    )


def warm_up(comm: Comm, model: torch.nn.Module) -> None:
    """Collective: one all-reduce the size of a DDP gradient bucket (at most 25 MiB) on the comm device."""
    grads = sum(p.numel() for p in model.parameters() if p.requires_grad)
    size = max(1, min(grads, _BUCKET_BYTES // 4)) if comm.device.type == "cuda" else 1
    bucket = torch.zeros(size, dtype=torch.float32, device=comm.device)
    collective(comm, "setting up the communicator", lambda: dist.all_reduce(bucket, async_op=True))
    del bucket


def agreed_prior(comm: Comm, prior: Callable[[int], float] | None) -> Callable[[int], float] | None:
    """Collective: a prior every rank reads the same, or ``None`` on every rank unless all have one.

    Each value is one ``all_reduce`` (the largest any rank predicts; NaN everywhere if any rank's
    trace failed there), asked in the same order on every rank because the searches are the
    same; cached, so a batch asked again costs no collective. A prior that raises reads NaN,
    which the search takes as "no prior" from then on.
    """
    if isinstance(prior, NoTrace):
        prior = None  # no prior, for a reason the result records
    flag = torch.tensor([0.0 if prior is None else 1.0], device=comm.device)
    everyone = collective(comm, "agreeing on the trace prior",
                          lambda: dist.all_reduce(flag, op=dist.ReduceOp.MIN, async_op=True), lambda: flag.item())
    if prior is None or not everyone:
        return None
    known: dict[int, float] = {}

    def agreed(batch: int) -> float:
        if batch not in known:
            try:
                value = float(prior(batch))
            except Exception:  # a trace that fails costs the prior, never the probe
                value = math.nan
            pair = torch.tensor([value if math.isfinite(value) else 0.0, 0.0 if math.isfinite(value) else 1.0],
                                dtype=torch.float64, device=comm.device)
            known[batch] = collective(
                comm, f"agreeing on the trace prior at batch {batch}",
                lambda: dist.all_reduce(pair, op=dist.ReduceOp.MAX, async_op=True),
                lambda: math.nan if pair[1].item() else pair[0].item())
        return known[batch]

    return agreed

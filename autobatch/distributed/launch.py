"""Ranks and process groups: read what a launcher set, start the group, or start the workers ourselves.

``torchrun`` and ``accelerate launch`` (which runs torchrun underneath for several processes)
set ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and
``MASTER_PORT`` in each worker's environment. :func:`rank_env` reads them, :func:`process_group`
joins the group with a timeout, and :func:`spawn_local` plays the launcher on one machine
(one worker per visible GPU) for users who have never met torchrun. The lockstep probe that runs
inside the group is :func:`autobatch.distributed.lockstep.probe_distributed`.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import pickle
import re
import socket
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .. import errors
from ..errors import AutobatchError
from .environment import RankEnv, exit_rank, is_launched, rank_env
from .result import RankFailedError

__all__ = [
    "RankEnv",
    "rank_env",
    "is_launched",
    "is_main_process",
    "rank_gpu",
    "process_group",
    "spawn_local",
    "exit_rank",
    "DEFAULT_TIMEOUT_S",
]

# Every agreement between ranks gives up after this long. Trials take seconds; setup (loading a
# model on every rank) can take minutes, which is what the margin is for.
DEFAULT_TIMEOUT_S = 300.0
# The process group's own timeout is longer than the agreement's, so that the agreement raises
# one clear error before NCCL's watchdog aborts the process.
_WATCHDOG_MARGIN_S = 60.0
_DESTROY_WAIT_S = 5.0
# A script that calls spawn_local at its top level, unguarded: each worker, starting, runs it again.
UNGUARDED = ("spawn_local was called in a worker process as it started: each worker runs the calling script again "
             "on start, so a call at the script's top level runs in every worker too; put the call under "
             "`if __name__ == \"__main__\":`")
# What spawn_local's fork server imports once for all its workers (what every probe on a rank needs).
_PRELOAD = ("torch", "torch.distributed", "torch.distributed.fsdp", "autobatch.distributed.launch")


def is_main_process() -> bool:
    """Rank 0 of the initialized group, else of the launcher's environment: the one that prints and writes."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return rank_env().is_main


def rank_gpu(env: RankEnv | None = None) -> int:
    """This rank's GPU index: its local rank, or 0 where the launcher left it one GPU (``CUDA_VISIBLE_DEVICES``)."""
    return (env or rank_env()).device_index(torch.cuda.device_count())


def _default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


@contextmanager
def process_group(backend: str | None = None, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> Iterator[RankEnv]:
    """Join the launcher's process group for the block (or use the one already joined).

    A group this function joins it also leaves. Every collective in it fails after
    ``timeout_s`` (plus a minute's margin, so that :func:`probe_distributed`'s own wait, of
    ``timeout_s``, ends first with a clear error) instead of waiting forever for a rank that died.

    Args:
        backend: ``"nccl"`` or ``"gloo"``; default NCCL when CUDA is available.
        timeout_s: seconds any collective may wait.

    Example:
        >>> with process_group("gloo") as env:  # doctest: +SKIP
        ...     result = probe_distributed(work, SimulatedBackend("1GiB"))
    """
    env = rank_env()
    if dist.is_initialized():
        yield env
        return
    if not dist.is_available():
        raise AutobatchError("torch.distributed is not available in this torch build; probe one device with autobatch.probe")
    if env.world_size > 1 and (env.master_addr is None or env.master_port is None):
        raise AutobatchError(
            f"{env.launcher or 'the launcher'} started {env.world_size} ranks but MASTER_ADDR/MASTER_PORT are not set; "
            "start the job with torchrun, accelerate launch or the deepspeed launcher, which set them, or export "
            "both before srun or mpirun"
        )
    addr, port = env.master_addr, env.master_port
    if env.world_size == 1:  # a lone process still needs an address to rendezvous with itself
        addr, port = addr or "127.0.0.1", port or _free_port()
    backend = backend or _default_backend()
    if backend == "nccl":
        torch.cuda.set_device(rank_gpu(env))
    # The rendezvous named outright (srun and mpirun set no RANK/WORLD_SIZE for env:// to read), and
    # waited for as long as --timeout says: init_process_group would wait its collectives' longer timeout,
    # then raise the store's traceback.
    timeout = timedelta(seconds=timeout_s + _WATCHDOG_MARGIN_S)
    try:
        store, _, _ = next(dist.rendezvous(f"tcp://{_host(addr)}:{port}", env.rank, env.world_size,
                                           timeout=timedelta(seconds=timeout_s)))
    except (RuntimeError, ValueError) as exc:  # DistStoreError: the others never came, or no one listens there
        raise AutobatchError(_not_joined(env, addr, port, timeout_s, exc)) from None
    store.set_timeout(timeout)
    # as init_process_group keeps its own rendezvous's store: keys of its own, apart from other users of the store
    dist.init_process_group(backend, store=dist.PrefixStore("default_pg", store), rank=env.rank,
                            world_size=env.world_size, timeout=timeout)
    failed = True
    try:
        yield env
        failed = False
    finally:
        # DDP's reducer sits in reference cycles; collect it, and let every rank get here, before
        # the group is torn down, or a rank can abort at exit with "terminate called without an
        # active exception". A failed barrier (a rank already gone) must not hide the real error,
        # and a rank that is leaving with an error does not wait: another rank may be hung, and the
        # barrier would hold the error back for the group's whole timeout.
        gc.collect()
        if not failed:
            try:
                dist.barrier()
            except Exception:  # noqa: BLE001 - best effort on the way out
                pass
            dist.destroy_process_group()
        else:
            # Destroying a group waits for its pending collectives, which a hung rank never
            # completes: give it a few seconds, then let the error through.
            leaving = threading.Thread(target=dist.destroy_process_group, daemon=True)
            leaving.start()
            leaving.join(_DESTROY_WAIT_S)


def _not_joined(env: RankEnv, addr: str, port: Any, timeout_s: float, exc: Exception) -> str:
    """The one line for a rendezvous the other ranks never reached within ``timeout_s``."""
    first = (str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__).rstrip(".")
    if "EADDRINUSE" in str(exc) or "address already in use" in str(exc).lower():
        return (f"rank {env.rank} could not listen at {addr}:{port} for the job's {env.world_size} ranks: another "
                "process holds that port; export another MASTER_PORT, free and the same on every rank")
    joined = re.search(r"(\d+)/(\d+) clients joined", first)
    seen = f" ({joined.group(1)} of {joined.group(2)} joined)" if joined else ""
    where = {"slurm": "run it as a task of the job step (`srun autobatch …` in the batch script: the batch script "
                      "itself is one process, whatever SLURM_NTASKS says)",
             "mpirun": "start every rank with mpirun -np N"}.get(env.launcher or "", "start every rank with the "
                                                                              "same launcher command")
    return (f"the job's {env.world_size} ranks must meet at {addr}:{port}, but they did not all come within "
            f"{errors.assigned('timeout', f'{timeout_s:g}')} s{seen}: {first}; {where}, or raise "
            f"{errors.option('timeout')} where ranks start slowly")


def _host(addr: str) -> str:
    """An IPv6 address in brackets, as a URL wants it."""
    return f"[{addr}]" if ":" in addr and not addr.startswith("[") else addr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(
    local_rank: int, world: int, port: int, backend: str | None, timeout_s: float,
    fn: Callable[..., Any], args: tuple[Any, ...], out: str, env: dict[str, str],
) -> None:
    # Forked from the fork server, this process has the server's environment: take the caller's.
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(
        RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )
    try:
        with process_group(backend, timeout_s=timeout_s):
            result = fn(*args)
        if local_rank == 0:
            Path(out, "result").write_bytes(pickle.dumps(result))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent through the file
        Path(out, f"error-{local_rank}").write_bytes(
            pickle.dumps((type(exc).__name__, str(exc), isinstance(exc, AutobatchError))))
        traceback.print_exc()
        exit_rank(1)
    # Like a launched rank: skip torch's native teardown, which can abort a finished process.
    exit_rank(0)


def spawn_local(
    fn: Callable[..., Any],
    args: tuple[Any, ...] = (),
    *,
    nprocs: int | None = None,
    backend: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> Any:
    """Run ``fn(*args)`` on one new process per local GPU, inside one process group; return rank 0's result.

    This is what ``torchrun --nproc-per-node N`` would do on this machine, so the same code
    (e.g. :func:`probe_distributed`) runs whether or not the user started a launcher. Each
    worker sees ``RANK``/``LOCAL_RANK``/``WORLD_SIZE`` like under torchrun and, with NCCL,
    has ``cuda:<local rank>`` as its current device.

    Args:
        fn: a picklable function (defined at module level; a ``functools.partial`` of one works):
            the workers are forked from a fresh interpreter (multiprocessing's fork server, which
            imported torch once), never from this process, with this process's environment.
            Build the workload inside it: lambdas in a
            :class:`~autobatch.probing.workload.Workload` do not pickle.
        args: its arguments, picklable.
        nprocs: workers to start; default the number of visible GPUs.
        backend: ``"nccl"`` or ``"gloo"``; default NCCL when CUDA is available.
        timeout_s: seconds any collective may wait; the whole run is also stopped after
            ``2 * timeout_s`` plus a minute for start-up, so it can never hang.

    Raises:
        AutobatchError: a worker failed or was killed; the message names the rank and its error.
            A worker's own :class:`~autobatch.errors.AutobatchError` (e.g. ``NoBatchFitsError``)
            is raised as that class.

    Example:
        >>> # def job(): return probe_distributed(my_workload(), SimulatedBackend("1GiB")).max_batch
        >>> # spawn_local(job, nprocs=2, backend="gloo")
    """
    import torch.multiprocessing as mp
    # Not re-exported by torch.multiprocessing, which exports only its two subclasses.
    from torch.multiprocessing.spawn import ProcessException

    if getattr(multiprocessing.current_process(), "_inheriting", False):  # a worker starting runs the script again
        raise AutobatchError(UNGUARDED)
    nprocs = torch.cuda.device_count() if nprocs is None else nprocs
    if not isinstance(nprocs, int) or nprocs < 1:
        raise AutobatchError(
            f"spawn_local needs at least one worker, but got nprocs={nprocs!r} (no visible GPU?); "
            "pass nprocs=N with backend='gloo' to run on the CPU"
        )
    deadline = time.monotonic() + 2 * timeout_s + 60
    with tempfile.TemporaryDirectory(prefix="autobatch-spawn-") as out:
        context = mp.start_processes(
            _worker, args=(nprocs, _free_port(), backend, timeout_s, fn, args, out, dict(os.environ)),
            nprocs=nprocs, join=False, start_method=_fork_server(),
        )
        try:
            while not context.join(timeout=0.5):
                if time.monotonic() > deadline:
                    raise AutobatchError(
                        f"the {nprocs} local workers did not finish within {2 * timeout_s + 60:.0f} s; "
                        "they were stopped — raise timeout_s for very slow models"
                    )
        except ProcessException as exc:
            raise _worker_error(Path(out), exc) from exc
        finally:
            for process in context.processes:  # only the workers started above
                if process.is_alive():
                    process.terminate()
                    process.join(5)
        return pickle.loads(Path(out, "result").read_bytes())


def _fork_server() -> str:
    """Start method ``"forkserver"``, its server running with torch imported once: each worker is
    forked from it, fresh (no thread, no CUDA context), where ``"spawn"`` imported torch again in every
    worker, seconds each. The caller's module list for a server started later is left as it was."""
    if "forkserver" not in multiprocessing.get_all_start_methods():  # Windows has none
        return "spawn"
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    before = list(getattr(server, "_preload_modules", ["__main__"]))
    forkserver.set_forkserver_preload(before + [m for m in _PRELOAD if m not in before])
    try:
        forkserver.ensure_running()  # a server already running is kept, with what it imported
    finally:
        forkserver.set_forkserver_preload(before)
    return "forkserver"


def _worker_error(out: Path, exc: BaseException) -> AutobatchError:
    errors_ = {}
    for path in sorted(out.glob("error-*")):
        errors_[int(path.name.split("-")[1])] = pickle.loads(path.read_bytes())
    if not errors_:
        rank = getattr(exc, "error_index", None)
        signal = getattr(exc, "signal_name", None)
        # Killed by a signal (the kernel's out-of-memory killer sends one), or a Python error before the
        # worker's own code ran (its traceback is above: a script calling spawn_local unguarded, UNGUARDED)
        why = (f"was killed by {signal} before it could report an error (out of host memory? the system log says)"
               if signal else f"exited with code {getattr(exc, 'exit_code', '?')} before it could report an error "
               "(the traceback above says why)")
        return AutobatchError(f"rank {rank} {why}; every other worker was stopped")
    # The rank that failed first is the one the others stopped for (they raise RankFailedError).
    rank, (name, message, ours) = next(
        ((r, e) for r, e in errors_.items() if e[0] != RankFailedError.__name__), next(iter(errors_.items())))
    first_line = message.splitlines()[0] if message else ""
    if ours:
        # An agreed error names its rank already ("rank 1: ..."), on every rank.
        text = first_line if re.match(r"rank \d+\b", first_line) else f"rank {rank}: {first_line}"
        kind = getattr(errors, name, None)
        if isinstance(kind, type) and issubclass(kind, AutobatchError) and kind.__init__ is Exception.__init__:
            return kind(text)  # the worker's own class, e.g. NoBatchFitsError (one that takes only a message)
        return AutobatchError(text)
    return AutobatchError(f"rank {rank} failed with {name}: {first_line}")

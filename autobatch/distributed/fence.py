"""One rank out of memory mid-step: every rank learns of it at its next collective, and no rank hangs.

A sharded step (FSDP, ZeRO, DDP's gradient all-reduce) runs collectives between its kernels. A
rank that runs out of memory leaves that step; the others then wait in a collective it never
joins, until the process group's timeout (minutes) or NCCL's watchdog kills the job. Hooks that
all-reduce an out-of-memory flag before each unit (Composer's way under FSDP) still leave a gap:
an allocation that fails between the hook and the unit's own collective (its all-gather's output)
pairs the flag's all-reduce with the others' all-gather.

A :class:`TrialFence` closes the gap by giving each trial its own process group and taking it
down on failure. The rank that runs out of memory writes its rank under the trial's key in the
job's store, drops its wrapper, then destroys the trial's groups (its own and those DeepSpeed
made during the trial). On gloo that closes its connections, so a peer blocked in any collective
with it fails at once ("Connection closed by peer"), and that peer takes its groups down too,
which frees whoever waits on it in turn. A watcher thread on every rank reads the store: once the
key appears it gives the trial's gloo groups a timeout of a second (a collective started after the
connections closed would otherwise wait out the group's whole timeout), and aborts its NCCL
groups, whose collectives do not see a closed peer, which ends the collectives blocked in them.
Either way each rank's step raises, the rank finds the key, and records the trial as "does not
fit" because of that rank; every rank then meets the others in the probe's own agreement, on the
default group, which the fence never touches.
"""

from __future__ import annotations

import itertools
import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

__all__ = ["TrialFence", "live_groups", "groups_made_since", "is_stopped_by_peer", "STOPPED_BY_PEER"]

# How a trial that another rank's failure ended says so (it proves nothing about this rank's memory).
_STOPPED = "stopped: "
STOPPED_BY_PEER = _STOPPED + "another rank ran out of memory in the same step"


def is_stopped_by_peer(error: str | None) -> bool:
    """Whether a failed trial's error is another rank's out-of-memory error, not this rank's."""
    return bool(error) and error.startswith(_STOPPED)

_POLL_S = 0.05
_AFTER_FAILURE = timedelta(seconds=1)
_probes = itertools.count()


def live_groups() -> list[Any]:
    """Every process group alive in this process (the default one included)."""
    return list(distributed_c10d._world.pg_map)


def groups_made_since(before: set[Any]) -> list[Any]:
    """The process groups alive now that were not in ``before`` (never the default group)."""
    return [g for g in live_groups() if g not in before and g is not dist.GroupMember.WORLD]


class TrialFence:
    """A process group for one trial's collectives, taken down on every rank when one runs out of memory.

    Every rank must create fences in the same order (one per trial, as the search runs in lockstep):
    the fence's key in the store is the probe's and trial's count.

    Example:
        >>> # with TrialFence(timeout_s=300) as fence:         # every rank, for each trial
        >>> #     try: train(group=fence.group)
        >>> #     except OutOfMemoryError: fence.out_of_memory(); ...
        >>> #     except Exception: if fence.peer_failure() is None: raise
    """

    _probe = next(_probes)
    _trials = itertools.count()

    def __init__(self, *, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.key = f"autobatch/fence/{TrialFence._probe}/{next(TrialFence._trials)}"
        self.group: Any = None
        self._before: set[Any] = set()
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None
        self._new_group: Any = dist.new_group
        self._failed_here = False
        self._store = distributed_c10d._get_default_store()

    @classmethod
    def new_probe(cls) -> None:
        """Start a new count: every rank calls it at the same point (a probe's start)."""
        cls._probe, cls._trials = next(_probes), itertools.count()

    def __enter__(self) -> TrialFence:
        self._before = set(live_groups())
        fence_timeout = timedelta(seconds=self.timeout_s)
        self.group = dist.new_group(timeout=fence_timeout)
        # The groups a wrapper makes during the trial (DeepSpeed's world group) would inherit the
        # job's timeout, which outlasts the agreement after the trial: they take the fence's.
        original = self._new_group = dist.new_group

        def new_group(*args: Any, timeout: timedelta | None = None, **kwargs: Any) -> Any:
            return original(*args, timeout=timeout or fence_timeout, **kwargs)

        dist.new_group = new_group
        self._watcher = threading.Thread(target=self._watch, name="autobatch-fence", daemon=True)
        self._watcher.start()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        dist.new_group = self._new_group
        self._stop.set()
        if self._watcher is not None:
            self._watcher.join()
        self.take_down()

    def out_of_memory(self) -> None:
        """This rank ran out of memory: say so to every rank (whose watchers abort NCCL groups).

        The groups come down in :meth:`take_down`, once the trial's wrapper is gone and collected:
        taken down while DDP's reducer still held its group, the peers blocked on this rank stayed
        blocked.
        """
        self._store.set(self.key, str(dist.get_rank()))
        self._failed_here = True

    def peer_failure(self) -> str | None:
        """Why this trial failed on another rank (``"stopped: rank 1 ran out of memory …"``), else ``None``.

        A rank that learns of it then takes its own groups down (:meth:`take_down`), so that whoever
        waits on it is freed in turn.
        """
        if not self._store.check([self.key]):
            return None
        rank = self._store.get(self.key).decode()
        return STOPPED_BY_PEER.replace("another rank", f"rank {rank}")

    def _watch(self) -> None:
        while not self._stop.wait(_POLL_S):
            try:
                failed = self._store.check([self.key])
            except Exception:  # noqa: BLE001 - the store is gone (rank 0 left): the main thread reports it
                return  # a traceback from this thread would only bury that one line
            if failed:
                for group in self._trial_groups():
                    if dist.get_backend(group) == "nccl":
                        group.abort()  # the collectives blocked in it raise
                    else:
                        # A gloo collective blocked on the failed rank fails once that rank closes its
                        # connections; one started after that would wait out the group's timeout:
                        # from now on it waits a second.
                        group._get_backend(torch.device("cpu"))._set_default_timeout(_AFTER_FAILURE)
                return

    def _trial_groups(self) -> list[Any]:
        return groups_made_since(self._before)

    def take_down(self) -> None:
        """Destroy the trial's groups (its own, and those a wrapper made during it), once the wrapper is gone."""
        if self._failed_here:
            time.sleep(3 * _POLL_S)  # every watcher has read the key before the connections close
        self._failed_here = False
        self.group = None
        for group in self._trial_groups():
            dist.destroy_process_group(group)

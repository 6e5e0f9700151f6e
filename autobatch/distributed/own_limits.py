"""Each rank's own largest batch, for a plan per rank (``find --uneven``).

The agreed search (:mod:`.lockstep`) stops at the smallest rank's largest batch. After it, each
rank goes on from its own trials, up to its own largest batch, against its own capacity:

* unsharded (DDP's trials run under ``no_sync``): a trial runs no collective, so every rank
  searches on its own, as far as it needs, and the ranks meet once at the end;
* sharded (FSDP, ZeRO): every trial runs collectives on every rank, so the searches go in rounds:
  each rank tries its own next batch, a rank whose search has ended trains its largest fit
  meanwhile, and a trial another rank's out-of-memory error stopped is run again.

Each rank's safe batch is its own (its capacity less its headroom), and its step-time line is
drawn through the seconds its fitting trials took (:func:`~autobatch.planning.uneven.step_line`)
on a GPU; a simulated budget keeps no times (its CPU steps say nothing of a GPU's speed).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..errors import AutobatchError
from ..planning.per_rank import RankLimit, step_line
from ..probing.probe import resolve_headroom, summarise
from ..probing.search import SearchOutcome, search_max
from ..probing.trial import Trial
from .agreement import Comm, agree_on_errors, collective, share_trial
from .fence import is_stopped_by_peer

__all__ = ["own_limits"]

_ROUNDS = 256  # lockstep rounds past which a search that makes no headway is an error


def own_limits(
    comm: Comm,
    run: Callable[[int], Trial],
    known: Sequence[Trial],
    *,
    capacity: int,
    headroom: float | int | str,
    min_batch: int,
    max_batch: int | None,
    lockstep: bool,
    prior: Callable[[int], float] | None = None,
    timed: bool = True,
) -> tuple[RankLimit, ...]:
    """Collective: every rank's :class:`~autobatch.planning.per_rank.RankLimit`, in rank order.

    ``run(b)`` runs this rank's own trial at ``b`` (an out-of-memory error is a trial that does not
    fit); ``known`` are this rank's trials so far, which cost nothing again. Without ``timed`` (a
    simulated budget: its steps run on this machine's CPU, not at the speed of the GPU it stands
    for) no step times are kept, and the plan takes the ranks as equally fast.
    """
    known = [t for t in known if t.fits or not is_stopped_by_peer(t.error)]
    if lockstep:
        outcome, trials = _in_rounds(comm, run, known, capacity=capacity, min_batch=min_batch, max_batch=max_batch)
    else:
        error = None
        try:
            outcome = search_max(run, capacity, min_batch=min_batch, max_batch=max_batch, prior=prior, known=known)
        except Exception as exc:
            error, outcome = exc, None
        agree_on_errors(comm, error, "searching each rank's own largest batch")
        trials = [*known, *outcome.trials]
    trials = [t for t in trials if not t.fits or t.batch <= outcome.max_batch]
    limit = capacity - resolve_headroom(headroom, capacity)
    safe = max(min(summarise(trials, outcome.max_batch, limit).safe_batch, outcome.max_batch), 1)
    line = step_line([(t.batch, t.seconds_per_step) for t in trials if t.fits and t.seconds_per_step]) if timed else None
    mine = (outcome.max_batch, safe, line)
    everyone: list[Any] = [None] * dist.get_world_size()
    collective(comm, "gathering each rank's own limits", lambda: dist.all_gather_object(everyone, mine))
    return tuple(RankLimit(r, *row) for r, row in enumerate(everyone))


class _Stepper:
    """:func:`search_max` one trial at a time: :meth:`ask` the next batch (``None`` once it ended), :meth:`tell` its trial.

    The search runs in a thread that only does arithmetic; every trial runs in the caller's thread.
    """

    def __init__(self, search: Callable[[Callable[[int], Trial]], SearchOutcome]):
        self._asks: queue.Queue[int | None] = queue.Queue()
        self._answers: queue.Queue[Trial] = queue.Queue()
        self.outcome: SearchOutcome | None = None
        self.error: BaseException | None = None

        def run(batch: int) -> Trial:
            self._asks.put(batch)
            return self._answers.get()

        def body() -> None:
            try:
                self.outcome = search(run)
            except BaseException as exc:  # noqa: BLE001 - raised again in the caller's thread
                self.error = exc
            finally:
                self._asks.put(None)

        self._thread = threading.Thread(target=body, name="autobatch-own-search", daemon=True)
        self._thread.start()

    def ask(self) -> int | None:
        batch = self._asks.get()
        if batch is None:
            self._thread.join()
            if self.error is not None:
                raise self.error
        return batch

    def tell(self, trial: Trial) -> None:
        self._answers.put(trial)


def _in_rounds(comm: Comm, run: Callable[[int], Trial], known: list[Trial], *, capacity: int, min_batch: int,
               max_batch: int | None) -> tuple[SearchOutcome, list[Trial]]:
    """Sharded trials: every rank trains in every round, its own next batch or, once its search
    ended, its largest fit. A rank whose largest fit runs out of memory beside the others' larger
    batches searches again below it: the answer is what fits while every rank trains its own."""
    history = list(known)

    def start(trials: list[Trial]) -> _Stepper:
        return _Stepper(lambda step: search_max(step, capacity, min_batch=min_batch, max_batch=max_batch,
                                                known=trials))

    stepper = start(history)
    pending = stepper.ask()
    for _ in range(_ROUNDS):
        busy = torch.tensor([0.0 if pending is None else 1.0], device=comm.device)
        searching = collective(comm, "agreeing whether a rank still searches",
                               lambda: dist.all_reduce(busy, op=dist.ReduceOp.MAX, async_op=True), lambda: busy.item())
        if pending is None and stepper.outcome.max_batch == 0:
            raise AutobatchError(f"rank {dist.get_rank()}: even a batch of {min_batch} runs out of memory beside the "
                                 "other ranks' larger batches; run without --uneven for the uniform plan")
        batch = stepper.outcome.max_batch if pending is None else pending
        trial = failure = None
        try:
            trial = run(batch)
        except Exception as exc:
            failure = exc
        shared = share_trial(comm, trial)
        if any(t is None for t in shared):
            agree_on_errors(comm, failure, f"running this rank's own trial at batch {batch}")
        if not searching and all(t.fits for t in shared):
            return stepper.outcome, history  # every rank's largest fit trained beside the others'
        if not trial.fits and is_stopped_by_peer(trial.error):
            continue  # another rank ran out of memory: this trial says nothing, run it again
        history.append(trial)
        if pending is not None:
            stepper.tell(trial)
            pending = stepper.ask()
        elif not trial.fits:  # its largest fit no longer fits beside the others: search below it
            stepper = start([t for t in history if not t.fits or t.batch < batch])
            pending = stepper.ask()
    raise AutobatchError(f"each rank's own search made no headway in {_ROUNDS} rounds (a rank's trials keep "
                         "being stopped by another's); run without --uneven for the uniform plan")

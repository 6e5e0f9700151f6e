"""A fresh sharded trial's requests to the allocator at any batch, from one fresh trial and one steady step.

An estimate's sharded trials share one wrapped copy (:mod:`autobatch.distributed.traced_trials`): the first wraps the
model and runs the workload's steps, each later one runs one more step at its own batch. What a
GPU's caching allocator reserves depends on the order of a run's requests, not only on its
peak: in a fresh run, the optimizer's state made in the first step lands in blocks that step's
activations freed, and pins them. Booking the later trials' steps on the shared copy therefore
books another run than the job's (−4 % to +106 % of a fresh run's reserved peak, measured on
gpt2 under FSDP2 and ZeRO-2/3).

So the first trial's log (wrap, first step, steady steps) is kept as the reference: its order is
a fresh run's at any batch, and only the sizes change. A later trial's steady step, logged at its
own batch, gives each size there: its requests pair with the reference's last step by the op
that made each one (the same ops run at every batch), and each of the reference's earlier steps
pairs with its last step at the reference's batch by op and size. A request of the first step
with no partner in the last step takes the size its op and size became there (the law); none where
the law has none (the optimizer's state, a wrapper's lazy buffers: the batch does not set them).
Where the law gives several (at batch 2 a request of 2 × 2048 bytes and a constant 4096 look
alike, then part at 3: a checkpointed first step's own activations), the largest is booked: never
less than the request, and no fresh trial (each re-wrap of llama-70b took minutes). A steady step
with requests the reference lacks past a small share (the copy ``labels[..., 1:].contiguous()``
makes only from batch 2) cannot be told: :meth:`FreshRequests.at` answers ``None`` then, and the
caller runs a fresh trial. ``tests/test_fresh_log.py`` books the requests made so against a fresh
trial's own, strategy by strategy.

:class:`FreshBooking` is what the trials call (the estimate's backend carries it): it starts a log
at each wrap, makes the reference, books requests on the card, and draws the curve through them.
"""

from __future__ import annotations

import difflib
import itertools
from typing import Any

import math
from dataclasses import replace

from .replay import AllocationLog, book

__all__ = ["TaggedLog", "FreshRequests", "FreshBooking", "UNPAIRED_SHARE"]

_UNLIMITED = 1 << 62

_STARTS = itertools.count(1)

#: The share of a steady step's requested bytes that may have no partner in the reference's step:
#: the requests PyTorch makes only above batch 1 (a copy of the shifted labels), kilobytes of gigabytes.
UNPAIRED_SHARE = 1 / 256


class TaggedLog(AllocationLog):
    """An :class:`~autobatch.estimating.replay.AllocationLog` that keeps which op made each request
    (the tracker's ``making``), numbered apart from every other log (a block of an earlier log freed
    now names no request of this one)."""

    def __init__(self, tracker: Any):
        super().__init__()
        self._requests = next(_STARTS) << 40
        self.tracker = tracker
        self.made_by: dict[int, Any] = {}

    def malloc(self, nbytes: int, *, force: bool = False) -> int:
        index = super().malloc(nbytes, force=force)
        self.made_by[index] = self.tracker.making
        return index

    def mark(self) -> int:
        """Where the log stands: a bound of a step's events."""
        return len(self.events)


def _pairs(a: list[Any], b: list[Any]) -> dict[int, int]:
    """Each position of ``a`` paired with one of ``b`` where the two sequences agree, in order."""
    if a == b:
        return {i: i for i in range(len(a))}
    matcher = difflib.SequenceMatcher(None, a, b, autojunk=False)
    return {block.a + k: block.b + k for block in matcher.get_matching_blocks() for k in range(block.size)}


class FreshRequests:
    """A fresh trial's requests at any batch, from the fresh trial logged in ``log`` (see the module).

    Args:
        log: the log the trials are recorded in.
        steps: each step's ``(start, end)`` in the log; the wrap is everything before the first.
        batch: the fresh trial's batch.
    """

    def __init__(self, log: TaggedLog, steps: list[tuple[int, int]], batch: int):
        self.log, self.batch = log, batch
        self.seen: dict[int, dict[int, int]] = {}  # each steady step's batch: the reference's sizes there
        self.over = 0  # requests booked at the largest of the sizes their op and size became (see at())
        # The wrap as what it leaves: a wrapper that moves a whole model to the device and shards it there
        # frees most of what it made, where a job builds the model sharded (zero.Init, FSDP on the meta
        # device) and never holds it whole; booked as it ran, llama-70b's wrap alone reserved 161 GiB.
        wrap = log.events[:steps[0][0]]
        gone = {i for i, n in wrap if n < 0}
        self.reference = [(i, n) for i, n in wrap if i not in gone] + log.events[steps[0][0]:steps[-1][1]]
        made = [self._made(start, end) for start, end in steps]
        self.last = made[-1]
        last_sized = [(op, n) for _, op, n in self.last]
        # each earlier step's requests, by position, paired with the last step's (same batch: op and size alike)
        self.earlier = [(requests, _pairs([(op, n) for _, op, n in requests], last_sized)) for requests in made[:-1]]

    def _made(self, start: int, end: int) -> list[tuple[int, Any, int]]:
        """The requests of ``events[start:end]``: index, op, bytes."""
        return [(i, self.log.made_by.get(i), n) for i, n in self.log.events[start:end] if n >= 0]

    def at(self, start: int, end: int, batch: int) -> list[tuple[int, int | None]] | None:
        """The fresh trial's requests (as :func:`~autobatch.estimating.replay.book` takes them) at
        ``batch``, of the steady step logged at ``events[start:end]``; ``None`` where they cannot be told."""
        steady = self._made(start, end)
        pairs = _pairs([op for _, op, _ in self.last], [op for _, op, _ in steady])
        paired = set(pairs.values())
        unpaired = sum(n for k, (_, _, n) in enumerate(steady) if k not in paired)
        if unpaired > UNPAIRED_SHARE * sum(n for _, _, n in steady):
            return None
        size: dict[int, int] = {}
        law: dict[tuple[Any, int], set[int]] = {}
        for a, b in pairs.items():
            index, op, nbytes = self.last[a]
            size[index] = steady[b][2]
            law.setdefault((op, nbytes), set()).add(steady[b][2])
        for requests, to_last in self.earlier:
            for k, (index, op, nbytes) in enumerate(requests):
                partner = pairs.get(to_last.get(k, -1))
                if partner is not None:
                    size[index] = steady[partner][2]
                    continue
                images = law.get((op, nbytes))
                if images is not None:  # several: the largest, never less than the request books
                    size[index] = max(images)
                    self.over += len(images) > 1
        self.seen[batch] = size
        return self._sized(size)

    def predict(self, batch: int) -> list[tuple[int, int | None]] | None:
        """The requests at ``batch`` with each size on the line through the reference's and the steady step's
        farthest from it (``None`` before one): a guide between and past the traced batches, no answer."""
        others = [b for b in self.seen if b != self.batch]
        if not others:
            return None
        far = max(others, key=lambda b: abs(b - self.batch))
        there, scale = self.seen[far], (batch - self.batch) / (far - self.batch)
        size = {i: max(0, round(n + (there[i] - n) * scale)) for i, n in self.reference if n >= 0 and i in there}
        return self._sized(size)

    def requests(self) -> list[tuple[int, int | None]]:
        """The fresh trial's own requests, as it made them."""
        return self._sized({})

    def _sized(self, size: dict[int, int]) -> list[tuple[int, int | None]]:
        return [(i, None if n < 0 else size.get(i, n)) for i, n in self.reference]


class FreshBooking:
    """Booking on a card of ``capacity`` bytes, after ``workspace`` bytes, for the sharded trials of an
    estimate's ``backend`` (:class:`~autobatch.distributed.traced_trials.OneWrapper` calls it)."""

    def __init__(self, backend: Any, capacity: int, workspace: int):
        self.backend, self.capacity, self.workspace = backend, capacity, workspace
        self.first = (workspace,) if workspace else ()

    def attach(self) -> TaggedLog:
        """A new log of every request from here on, in order, with the op that made it."""
        tracker = self.backend._tracker
        tracker.allocator = TaggedLog(tracker)
        return tracker.allocator

    def detach(self) -> None:
        self.backend._tracker.allocator = None

    def reference(self, log: TaggedLog, steps: list[tuple[int, int]], batch: int) -> FreshRequests:
        """The fresh trial just logged (each step's bounds) as the reference for the trials after it."""
        return FreshRequests(log, steps, batch)

    def reserved(self, requests: list[tuple[int, int | None]]) -> tuple[bool, int, int]:
        """Whether the card serves ``requests``, the peak it reserves (what it would need where it cannot),
        and the requests served only after flushing its cache."""
        booking = book(requests, self.capacity, first=self.first)
        if booking.fits:
            return True, booking.peak_reserved, booking.retries
        return False, book(requests, _UNLIMITED, first=self.first).peak_reserved, booking.retries

    def on_the_card(self, trial: Any, breakdown: Any, requests: list[tuple[int, int | None]]) -> tuple[Any, Any]:
        """The traced trial and its breakdown as the card's caching allocator books ``requests``."""
        fits, reserved, retries = self.reserved(requests)
        held = self.workspace
        trial = replace(trial, fits=trial.fits and fits, peak_bytes=trial.peak_bytes + held, reserved_bytes=reserved,
                        forward_backward_bytes=trial.forward_backward_bytes + held,
                        optimizer_bytes=trial.optimizer_bytes + held,
                        resident_bytes=None if trial.resident_bytes is None or not fits else trial.resident_bytes + held,
                        alloc_retries=retries)
        if breakdown is not None:  # the allocator's cache and rounding, and the workspaces, are the rest of the peak
            terms = breakdown.peak - breakdown.other
            breakdown = replace(breakdown, other=max(0, reserved - terms), peak=reserved)
        return trial, breakdown

    def curve(self, fresh: FreshRequests | None, batch: int) -> float:
        """The reserved peak a fresh run at ``batch`` books on the card, its sizes on the line through two
        trials' (:meth:`FreshRequests.predict`); NaN before a second trial."""
        requests = None if fresh is None else fresh.predict(batch)
        return math.nan if requests is None else float(self.reserved(requests)[1])

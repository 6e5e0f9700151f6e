"""The trace beside GPU trials in a process of its own: another core, not the trials' interpreter.

On a GPU a trial is mostly the interpreter launching kernels. A trace on a thread of the same
process holds that interpreter while it runs, and every torch call of a trial lets it go and waits
to have it back: on an H200 a CLIP search led by such a trace took 63.0 s where its trials alone
took 34.0 s (docs/benchmarks/wall_cuda.md). A child forked from the probe cannot trace either:
once the parent has used CUDA, a forked child's backward pass fails ("CUDA error: initialization
error"; autograd refuses a fork after its device threads started), as seen there.

So a model this process built from a request's name (:func:`named_workload`: a built-in, ``hf:`` or
``file.py:fn`` model) is traced by a fresh interpreter that builds it again, on fake tensors, from
the same name, options and settings (:class:`SpawnedBeside`): it sees no GPU (``CUDA_VISIBLE_DEVICES`` empty, so
it takes no memory on the card being probed), runs torch on one thread, in a session of its own
(Ctrl-C is the probe's), its output kept apart, and answers the prior over a pipe: the traces of
:func:`~autobatch.estimating.prior.warm_batches` at once, then any batch the search asks. Its
startup (an interpreter, torch) runs beside the trials too. :meth:`SpawnedBeside.stop` kills it
where it stands. A model passed in from Python (its code, hooks and closures need not exist in
another process) is traced on a thread (:class:`~autobatch.estimating.background.TracedBeside`).

Example:
    >>> import autobatch
    >>> work = autobatch.load_model("tiny-mlp").to_workload(optimizer="sgd")
    >>> rebuildable(work.model, "tiny-mlp", {})
    >>> prior = SpawnedBeside(recipe_of(work), min_batch=None, allocator="exact", device_type="cpu")
    >>> here = autobatch.trace_prior(work, allocator="exact", device_type="cpu")
    >>> prior(100) == here(100)  # the same prior, traced in the child
    True
    >>> prior.stop(); prior.report()["traced_batches"]  # 2 where the smallest is 1, then powers of four
    [2, 4, 16, 64]
"""

from __future__ import annotations

import json
import math
import multiprocessing
import multiprocessing.connection
import os
import pickle
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path
from typing import Any

from .prior import GuardedPrior, beside_report, left_at_pace, try_trace_prior, warm_batches

__all__ = ["SpawnedBeside", "SPAWNS", "DIED", "rebuildable", "named_workload", "recipe_of", "child"]

SPAWNS = os.name == "posix"  # a pipe's end handed to the child by its descriptor
DIED = "the trace's process ended before it answered (exit code {code})"
_POLL = 0.5  # seconds between looks at whether the child still lives, while waiting for its answer
_SETTINGS = ("optimizer", "dtype", "grad_checkpointing", "grads_held", "steps")
# The child imports as this process does: its sys.path, handed over whole (argv[2]).
_CHILD = ("import json, sys, time; t = time.perf_counter(); sys.path[:] = json.loads(sys.argv[2]); "
          "from autobatch.estimating.spawned import child; child(t)")
_BUILT: weakref.WeakKeyDictionary[Any, tuple[str, dict[str, Any]]] = weakref.WeakKeyDictionary()


def rebuildable(model: Any, spec: str, load: dict[str, Any]) -> None:
    """Say that ``model`` is ``load_model(spec, **load)``'s, built here from a request's name and
    untouched since, so a trace may build it again elsewhere (a ``file.py:fn`` is imported there
    again, as each worker of a ``find`` on several GPUs imports it)."""
    _BUILT[model] = (spec, dict(load))


def named_workload(spec: str, load: dict[str, Any], settings: dict[str, Any]) -> Any:
    """``load_model(spec, **load).to_workload(**settings)``, marked :func:`rebuildable`: how a probe
    builds a request's named model."""
    from ..models import load_model

    workload = load_model(spec, **load).to_workload(**settings)
    rebuildable(workload.model, spec, load)
    return workload


def recipe_of(workload: Any) -> tuple[str, dict[str, Any], dict[str, Any]] | None:
    """``(spec, load options, settings)`` that build ``workload`` again in another process, or
    ``None`` (a model passed in, an optimizer given as a function that does not pickle)."""
    try:
        built = _BUILT.get(workload.model)
    except TypeError:  # a factory that cannot be weakly referenced
        return None
    if built is None:
        return None
    recipe = (*built, {name: getattr(workload, name) for name in _SETTINGS})
    try:
        pickle.dumps(recipe)
    except Exception:  # noqa: BLE001 - a function in the settings: traced here instead
        return None
    return recipe


def _said(prior: GuardedPrior, started: float) -> dict[str, Any]:
    return {"traced_batches": prior.traced_batches, "seconds": round(time.perf_counter() - started, 3),
            "failure": prior.failure}


def child(started: float) -> None:
    """The child's whole life: build the workload on fake tensors, trace the warm batches (saying each
    as it ends), then answer the batches asked until told to stop or the probe is gone."""
    import torch

    from .estimate import load_fake_model

    conn = multiprocessing.connection.Connection(int(sys.argv[1]))
    (spec, load, settings), min_batch, allocator, device_type = conn.recv()
    torch.set_num_threads(1)
    try:
        workload = load_fake_model(spec, **load).to_workload(**settings)
        prior = try_trace_prior(workload, min_batch=min_batch, allocator=allocator, device_type=device_type)
    except Exception as exc:  # noqa: BLE001 - the prior only saves trials: its failure is said, not raised
        prior = GuardedPrior.failed(spec, exc)
    try:
        for batch in warm_batches(prior.first):
            if prior.failure is not None:
                break
            prior(batch)
            conn.send(("traced", _said(prior, started)))
        conn.send(("ready", _said(prior, started)))
        while (batch := conn.recv()) is not None:
            value = prior(batch)
            conn.send(("value", value, _said(prior, started)))
    except (EOFError, OSError):  # the probe is gone
        return


class SpawnedBeside:
    """A prior traced by a child process while the trials run: ``ready()`` says when it can lead,
    ``stop()`` ends it; the contract of :class:`~autobatch.estimating.background.TracedBeside`.

    Called before it is ready it waits for it (the search never does). ``from_trial`` is the
    number of trials run before it took the lead (the search sets it), ``None`` while it has not.
    """

    def __init__(self, recipe: tuple[str, dict[str, Any], dict[str, Any]], *, min_batch: int | None,
                 allocator: str, device_type: str = "cuda"):
        self.name = recipe[0]
        self.from_trial: int | None = None
        self.asked = False
        self.cancelled = False
        self._said: dict[str, Any] = {"traced_batches": [], "seconds": 0.0, "failure": None}
        self._started = time.perf_counter()
        self._ended: float | None = None
        self._done = False
        here, there = multiprocessing.Pipe()
        self._log = tempfile.TemporaryFile()
        path = [str(Path(__file__).resolve().parents[2]), *sys.path]  # this autobatch first, then as here
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-c", _CHILD, str(there.fileno()), json.dumps(path)], pass_fds=(there.fileno(),),
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=self._log,
                env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, start_new_session=True)
        except BaseException:
            here.close()
            self._log.close()
            raise
        finally:
            there.close()
        self._conn = here
        try:
            here.send((recipe, min_batch, allocator, device_type))
        except OSError:
            self._died()

    # What the child has said.

    def _take(self, message: tuple) -> Any:
        kind, *rest = message
        self._said = rest[-1]
        if kind == "ready":
            self._done = True
        return rest[0] if kind == "value" else None

    def _drain(self) -> None:
        try:
            while not self._conn.closed and self._conn.poll():
                self._take(self._conn.recv())
        except (EOFError, OSError):
            self._died()

    def _died(self) -> None:
        """The child is gone without its answer: the prior fails, said with the last line it wrote."""
        if self._said["failure"] is None and not self.cancelled:
            try:
                code = self._process.wait(5)
            except subprocess.TimeoutExpired:
                code = None
            self._log.seek(0)
            last = [line for line in self._log.read().decode(errors="replace").splitlines() if line.strip()]
            said = DIED.format(code=code) + (f": {last[-1].strip()[:160]}" if last else "")
            self._said = {**self._said, "failure": said}
        self._done = True
        if not self._conn.closed:
            self._conn.close()

    def _wait(self, seconds: float | None) -> Any:
        """Wait up to ``seconds`` (``None``: for good) for the child's next message and take it."""
        deadline = None if seconds is None else time.perf_counter() + seconds
        while not self._conn.closed:
            left = _POLL if deadline is None else min(_POLL, deadline - time.perf_counter())
            if left < 0:
                return None
            try:
                if self._conn.poll(left):
                    return self._take(self._conn.recv())
            except (EOFError, OSError):
                break
            if self._process.poll() is not None:
                self._drain()  # what it said before it ended
                break
        self._died()
        return None

    # The contract of a prior traced beside the trials.

    def ready(self) -> bool:
        """Whether the traces are done and the prior can lead (not when its trace failed)."""
        self._drain()
        return self._done and not self.cancelled and self._said["failure"] is None

    def remaining(self) -> float | None:
        """The seconds the trace still needs at its pace so far, or ``None`` before one batch is traced."""
        self._drain()
        if self._done:
            return 0.0
        return left_at_pace(time.perf_counter() - self._started, len(self._said["traced_batches"]))

    def finish_within(self, seconds: float) -> bool:
        """Wait up to ``seconds`` for the trace to end; whether it can lead now."""
        deadline = time.perf_counter() + seconds
        while not self._done and time.perf_counter() < deadline:
            self._drain()
            if self._done:
                break
            self._wait(deadline - time.perf_counter())
        return self.ready()

    def __call__(self, batch: int) -> float:
        self.asked = True
        while not self._done:
            self._wait(None)
        if self._said["failure"] is not None or self._conn.closed:
            return math.nan
        try:
            self._conn.send(batch)
        except OSError:
            self._died()
            return math.nan
        while not self._conn.closed:
            value = self._wait(None)
            if value is not None:
                return value
        return math.nan

    def stop(self) -> None:
        """End the child where it stands (a trace still running is cancelled) and wait for it."""
        self._drain()
        if not self._done:  # still tracing: killed where it stands
            self.cancelled = True
            self._ended = time.perf_counter()
            self._process.kill()
        elif not self._conn.closed:  # waiting for a batch: told to end
            try:
                self._conn.send(None)
            except OSError:
                pass
        if not self._conn.closed:
            self._conn.close()
        try:
            self._process.wait(1.0)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._log.close()

    def report(self) -> dict[str, Any]:
        """What the child said of its traces (its seconds from its start); one that never led says why."""
        said = dict(self._said)
        if self.cancelled:  # stopped mid-trace: its seconds are the time it ran
            said["seconds"] = round((self._ended or time.perf_counter()) - self._started, 3)
        return beside_report(said, self.from_trial, self.asked)


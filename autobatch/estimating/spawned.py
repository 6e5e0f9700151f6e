"""The trace beside GPU trials in a process of its own: another core, not the trials' interpreter.

On a GPU a trial is mostly the interpreter launching kernels. A trace on a thread of the same
process holds that interpreter while it runs, and every torch call of a trial lets it go and waits
to have it back: on an H200 a CLIP search led by such a trace took 63.0 s where its trials alone
took 34.0 s (docs/benchmarks/wall_cuda.md). A child forked from the probe cannot trace either:
once the parent has used CUDA, a forked child's backward pass fails ("CUDA error: initialization
error"; autograd refuses a fork after its device threads started), as seen there.

So a model this process built from a request's name (:func:`named_workload`: a built-in, ``hf:`` or
``file.py:fn`` model) is traced by a fresh interpreter that builds it again, on fake tensors, from
the same name, options and settings (:class:`SpawnedBeside`; what it runs:
:mod:`~autobatch.estimating.spawned_child`): it sees no GPU (``CUDA_VISIBLE_DEVICES`` empty, so it
takes no memory on the card being probed), runs torch on one thread at the lowest CPU priority, in
a process group of its own (Ctrl-C is the probe's), its output kept apart, and answers the prior
over a pipe: the traces of :func:`~autobatch.estimating.prior.warm_batches` at once, then any batch
the search asks. Inside :func:`warmed` (``find`` is) it is started before this process builds its
own copy, and its interpreter, imports and build run meanwhile, on a core the build leaves idle;
else it starts when the probe asks for the prior. :meth:`SpawnedBeside.stop` kills it where it
stands. A model passed in from Python (its code, hooks and closures need not exist in another
process) is traced on a thread (:class:`~autobatch.estimating.background.TracedBeside`). A sharded
probe's trace runs in such a child too, lent the trials' time beside CPU trials
(:class:`~autobatch.estimating.spawned_between.SpawnedBetween`).

Example:
    >>> import autobatch
    >>> work = autobatch.load_model("tiny-mlp").to_workload(optimizer="sgd")
    >>> rebuildable(work.model, "tiny-mlp", {})
    >>> prior = SpawnedBeside(recipe_of(work), min_batch=None, allocator="exact", device_type="cpu")
    >>> here = autobatch.trace_prior(work, allocator="exact", device_type="cpu")
    >>> prior(100) == here(100)  # the same prior, traced in the child
    True
    >>> prior.stop(); prior.report()["traced_once"], prior.report()["traced_batches"]  # one symbolic trace
    (True, [])
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import pickle
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .prior import WARM_TRACES, beside_report, traced_nothing

__all__ = ["SpawnedBeside", "SPAWNS", "DIED", "rebuildable", "named_workload", "recipe_of", "warmed"]

SPAWNS = os.name == "posix"  # a pipe's end handed to the child by its descriptor
DIED = "the trace's process ended before it answered (exit code {code})"
_POLL = 0.5  # seconds between looks at whether the child still lives, while waiting for its answer
_SETTINGS = ("optimizer", "dtype", "grad_checkpointing", "grads_held", "steps")
# The child imports as this process does: its sys.path, handed over whole (argv[2]).
_CHILD = ("import json, sys, time; t = time.perf_counter(); sys.path[:] = json.loads(sys.argv[2]); "
          "from autobatch.estimating.spawned_child import child; child(t)")
_BUILT: weakref.WeakKeyDictionary[Any, tuple[str, dict[str, Any]]] = weakref.WeakKeyDictionary()
# A model's trace process started as it was built (warmed), with the settings it was built with.
_WARM: weakref.WeakKeyDictionary[Any, tuple[dict[str, Any], _Started]] = weakref.WeakKeyDictionary()
# Its own process group, so Ctrl-C is the probe's, in the probe's session, so it weighs as one of the
# probe's processes where Linux shares the CPU between sessions (autogroup); a new session before 3.11.
_OWN_GROUP: dict[str, Any] = {"process_group": 0} if sys.version_info >= (3, 11) else {"start_new_session": True}
_warming = threading.local()  # .on inside warmed(); .started: the processes it started


def _lowest_priority(pid: int) -> None:
    """Run the child ``pid`` at the lowest CPU priority: Linux's idle policy (``SCHED_IDLE``: it runs only
    where nothing else wants the core, and a probe's thread that wakes takes the core back at once), else
    nice 19. Set here as the child is started, before its interpreter imports torch (about two seconds
    of CPU that, at the probe's priority, the probe's own build and wrapping had to share). The child
    shares the probe's session (its process group is its own, so Ctrl-C is the probe's): where Linux
    weighs sessions against each other (autogroup), a session of its own would weigh as much as the
    probe's, whatever its priority inside."""
    try:
        os.sched_setscheduler(pid, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):  # not Linux (or the child has ended)
        try:
            os.setpriority(os.PRIO_PROCESS, pid, 19)
        except (AttributeError, OSError):  # a platform that refuses: it runs at the probe's priority
            pass
    try:
        own_session = os.getsid(pid) == pid  # Python 3.10 starts it in one: its group weighs the least there
    except OSError:  # it has ended
        return
    if own_session:
        try:
            with open(f"/proc/{pid}/autogroup", "w") as group:
                group.write("19")
        except OSError:  # no autogroup here
            pass


class _Started:
    """A trace's own process, started and told its model's recipe: it builds the model at once."""

    def __init__(self, recipe: tuple[str, dict[str, Any], dict[str, Any]]):
        self.started = time.perf_counter()
        self.taken = False
        here, there = multiprocessing.Pipe()
        self.log = tempfile.TemporaryFile()
        path = [str(Path(__file__).resolve().parents[2]), *sys.path]  # this autobatch first, then as here
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-c", _CHILD, str(there.fileno()), json.dumps(path)], pass_fds=(there.fileno(),),
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=self.log,
                env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, **_OWN_GROUP)
        except BaseException:
            here.close()
            self.log.close()
            raise
        finally:
            there.close()
        _lowest_priority(self.process.pid)  # before its interpreter imports anything
        self.conn = here
        try:
            here.send(recipe)
        except OSError:
            pass  # it died at once: said when it is asked

    def end(self) -> None:
        """End a process no probe took (it is building, or waiting to be told how to trace)."""
        if self.taken:
            return
        self.process.kill()
        self.process.wait()
        self.conn.close()
        self.log.close()


def _start(recipe: tuple[str, dict[str, Any], dict[str, Any]]) -> _Started | None:
    try:
        pickle.dumps(recipe)
        return _Started(recipe)
    except Exception:  # noqa: BLE001 - no process to warm (a setting that does not pickle, no interpreter)
        return None


def rebuildable(model: Any, spec: str, load: dict[str, Any]) -> None:
    """Say that ``model`` is ``load_model(spec, **load)``'s, built here from a request's name and
    untouched since, so a trace may build it again elsewhere (a ``file.py:fn`` is imported there
    again, as each worker of a ``find`` on several GPUs imports it)."""
    _BUILT[model] = (spec, dict(load))


def named_workload(spec: str, load: dict[str, Any], settings: dict[str, Any]) -> Any:
    """``load_model(spec, **load).to_workload(**settings)``, marked :func:`rebuildable`: how a probe
    builds a request's named model. Inside :func:`warmed`, the trace's own process is started first,
    and builds its copy while this process builds this one."""
    from ..models import load_model

    started = _start((spec, dict(load), dict(settings))) if getattr(_warming, "on", False) and SPAWNS else None
    try:
        workload = load_model(spec, **load).to_workload(**settings)
    except BaseException:
        if started is not None:
            started.end()
        raise
    rebuildable(workload.model, spec, load)
    if started is not None:
        _warming.started.append(started)
        try:
            _WARM[workload.model] = (_settings_of(workload), started)
        except TypeError:  # a model that cannot be weakly referenced: the warm copy goes unused
            pass
    return workload


@contextmanager
def warmed() -> Iterator[None]:
    """Start the trace's own process of each model :func:`named_workload` builds in the block as the
    block builds it (a probe that traces takes it up); whatever no probe took is ended on leaving."""
    outer = getattr(_warming, "on", False), getattr(_warming, "started", [])
    _warming.on, _warming.started = True, []
    try:
        yield
    finally:
        for started in _warming.started:
            started.end()
        _warming.on, _warming.started = outer


def _warm_for(model: Any, settings: dict[str, Any]) -> _Started | None:
    """The process started as ``model`` was built, if its settings are still those (else it is ended)."""
    try:
        warm = _WARM.pop(model, None) if model is not None else None
    except TypeError:
        return None
    if warm is None:
        return None
    if warm[0] != settings or warm[1].process.poll() is not None:
        warm[1].end()
        return None
    return warm[1]


def _settings_of(workload: Any) -> dict[str, Any]:
    return {name: getattr(workload, name) for name in _SETTINGS}


def recipe_of(workload: Any) -> tuple[str, dict[str, Any], dict[str, Any]] | None:
    """``(spec, load options, settings)`` that build ``workload`` again in another process, or
    ``None`` (a model passed in, an optimizer given as a function that does not pickle)."""
    try:
        built = _BUILT.get(workload.model)
    except TypeError:  # a factory that cannot be weakly referenced
        return None
    if built is None:
        return None
    recipe = (*built, _settings_of(workload))
    try:
        pickle.dumps(recipe)
    except Exception:  # noqa: BLE001 - a function in the settings: traced here instead
        return None
    return recipe


class SpawnedBeside:
    """A prior traced by a child process while the trials run: ``ready()`` says when it can lead,
    ``stop()`` ends it; the contract of :class:`~autobatch.estimating.background.TracedBeside`.

    Called before it is ready it waits for it (the search never does). ``from_trial`` is the
    number of trials run before it took the lead (the search sets it), ``None`` while it has not.
    ``traced``: a module-level function the child calls on its workload, with ``min_batch``,
    ``allocator`` and ``device_type``, for a context manager that yields the prior (a sharded step's,
    :func:`autobatch.pipeline.sharded_prior_in_its_world`); ``None``: the plain step's trace.
    ``model``: the probe's, whose process started as it was built (:func:`warmed`) is taken up.
    """

    def __init__(self, recipe: tuple[str, dict[str, Any], dict[str, Any]], *, min_batch: int | None,
                 allocator: str, device_type: str = "cuda", traced: Callable[..., Any] | None = None,
                 model: Any = None):
        self.name = recipe[0]
        self.from_trial: int | None = None
        self.asked = False
        self.cancelled = False
        self._said: dict[str, Any] = traced_nothing()
        self._cpu: dict[str, float] = {}  # the child's CPU seconds when it was built, and at its last traced batch
        self._ended: float | None = None
        self._done = False
        warm = _warm_for(model, recipe[2])
        self.warm = warm is not None  # started as the model was built (warmed)
        started = warm or _Started(recipe)  # OSError where no interpreter starts
        started.taken = True
        self._process, self._conn, self._log, self._started = started.process, started.conn, started.log, started.started
        try:
            self._conn.send((min_batch, allocator, device_type, traced))
        except OSError:
            self._died()

    # What the child has said.

    def _take(self, message: tuple) -> Any:
        kind, *rest = message
        if kind == "built":  # the child's CPU seconds when it had started and built the model
            self._cpu["built"] = rest[0]
            return None
        self._said = rest[-1]
        if kind == "traced":  # and when it had traced one more batch
            self._cpu["traced"] = rest[0]
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
        """The seconds the trace still needs at its pace so far, in the child's CPU seconds a traced
        batch (its start, the interpreter, imports and build, not counted: that is done), or ``None``
        before one batch is traced."""
        self._drain()
        if self._done:
            return 0.0
        traced = len(self._said["traced_batches"])
        if not traced or "built" not in self._cpu or "traced" not in self._cpu:
            return None
        return (self._cpu["traced"] - self._cpu["built"]) / traced * max(0, WARM_TRACES - traced)

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


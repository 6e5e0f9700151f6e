"""Progress on long work: a trace or a training step that runs past :data:`AFTER_S` seconds says what
it is doing, at which batch, for how long, to the listener :func:`listening` installs
(``autobatch.answer(on_progress=…)``; the CLI shows it on stderr, never on stdout).

Without a listener :func:`working` costs nothing. With one, a daemon thread waits beside the work
and calls the listener once past the threshold and every :data:`EVERY_S` seconds after, until the
work ends; the listener decides what to show (a spinner's text, or a line now and then). Work that
waits :func:`paused` (a trace between the trials, while a trial runs) says nothing meanwhile, and the
time it waits is not counted: it reads as the trace's own seconds, not the trials'.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

__all__ = ["AFTER_S", "EVERY_S", "listening", "working", "paused"]

AFTER_S = 2.0   # work shorter than this says nothing
EVERY_S = 1.0   # past it, how often the listener hears the elapsed time

_LOOK_S = 0.25  # how often a ticker looks whether its work waits
_listeners: list[Callable[[str], None]] = []
_waiting: set[int] = set()  # the threads whose work waits (paused)


@contextmanager
def listening(callback: Callable[[str], None] | None) -> Iterator[None]:
    """Within the block, long work in this process reports to ``callback`` (``None``: to no one new)."""
    if callback is None:
        yield
        return
    _listeners.append(callback)
    try:
        yield
    finally:
        _listeners.remove(callback)


@contextmanager
def working(what: str) -> Iterator[None]:
    """Tell the listener ``"{what}: N s"`` while the block runs past :data:`AFTER_S` seconds.

    Example:
        >>> heard = []
        >>> with listening(heard.append), working("tracing gpt2 at batch 8"):
        ...     pass
        >>> heard  # quick work says nothing
        []
    """
    if not _listeners:
        yield
        return
    tell, done, worker = _listeners[-1], threading.Event(), threading.get_ident()

    def tick() -> None:
        worked, last, due, look = 0.0, time.monotonic(), AFTER_S, min(_LOOK_S, EVERY_S)
        wait = min(look, AFTER_S)
        while not done.wait(wait):
            now, wait = time.monotonic(), look
            if worker in _waiting:
                last = now
                continue
            worked, last = worked + now - last, now
            if worked >= due:
                try:
                    tell(f"{what}: {worked:.0f} s")
                except Exception:  # noqa: BLE001 - a listener's error must not touch the work
                    return
                due = worked + EVERY_S

    ticker = threading.Thread(target=tick, name="autobatch-progress", daemon=True)
    ticker.start()
    try:
        yield
    finally:
        done.set()
        ticker.join()


@contextmanager
def paused() -> Iterator[None]:
    """Within the block this thread's work waits (a trace between the trials, for its next window): its
    :func:`working` says nothing, and counts no time, until the block ends.

    Example:
        >>> import threading
        >>> heard = []
        >>> def trace():
        ...     with working("tracing the model"), paused():
        ...         time.sleep(2.5)  # the trials run meanwhile
        >>> with listening(heard.append):
        ...     thread = threading.Thread(target=trace); thread.start(); thread.join()
        >>> heard  # 2.5 s waited, none worked
        []
    """
    ident = threading.get_ident()
    _waiting.add(ident)
    try:
        yield
    finally:
        _waiting.discard(ident)

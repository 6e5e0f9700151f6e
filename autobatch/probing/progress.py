"""Progress on long work: a trace or a training step that runs past :data:`AFTER_S` seconds says what
it is doing, at which batch, for how long, to the listener :func:`listening` installs
(``autobatch.answer(on_progress=…)``; the CLI shows it on stderr, never on stdout).

Without a listener :func:`working` costs nothing. With one, a daemon thread waits beside the work
and calls the listener once past the threshold and every :data:`EVERY_S` seconds after, until the
work ends; the listener decides what to show (a spinner's text, or a line now and then).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

__all__ = ["AFTER_S", "EVERY_S", "listening", "working"]

AFTER_S = 2.0   # work shorter than this says nothing
EVERY_S = 1.0   # past it, how often the listener hears the elapsed time

_listeners: list[Callable[[str], None]] = []


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
    tell, start, done = _listeners[-1], time.monotonic(), threading.Event()

    def tick() -> None:
        wait = AFTER_S
        while not done.wait(wait):
            try:
                tell(f"{what}: {time.monotonic() - start:.0f} s")
            except Exception:  # noqa: BLE001 - a listener's error must not touch the work
                return
            wait = EVERY_S

    ticker = threading.Thread(target=tick, name="autobatch-progress", daemon=True)
    ticker.start()
    try:
        yield
    finally:
        done.set()
        ticker.join()

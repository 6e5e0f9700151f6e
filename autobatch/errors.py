"""Errors a user can act on: each message states the rule, the value and the fix."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping

__all__ = ["AutobatchError", "ConfigError", "MissingDependencyError", "MinimumBatchError", "NoBatchFitsError",
           "RequestError", "option"]

_OPTION = re.compile("\x00(\\w+)\x00")


def option(name: str) -> str:
    """A placeholder for the option ``name`` in a :class:`RequestError`'s message, spelt when shown:
    ``max_micro`` from Python, ``--max-micro`` where the CLI shows it."""
    return f"\x00{name}\x00"


class AutobatchError(Exception):
    """Root of every error autobatch raises on purpose.

    The CLI prints ``str(error)`` as one line and exits with code 2; anything that is not an
    ``AutobatchError`` is a bug or the user's own exception and keeps its traceback.
    """


class ConfigError(AutobatchError):
    """Several problems found together, so the user can fix them all in one go."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("; ".join(self.problems))


class MissingDependencyError(AutobatchError, ImportError):
    """An optional dependency is needed for this feature and is not installed."""


class MinimumBatchError(AutobatchError):
    """The model cannot train below a minimum per-device batch (e.g. BatchNorm needs 2)."""

    def __init__(self, message: str, min_batch: int):
        self.min_batch = min_batch
        super().__init__(message)


class NoBatchFitsError(AutobatchError):
    """Even the smallest allowed batch runs out of memory."""


class RequestError(ConfigError):
    """Every problem of a :class:`~autobatch.Request`, found on construction, before anything runs.

    Each problem names its options through :func:`option`, so one message reads in the caller's
    words: ``str(error)`` in Python's keywords, :meth:`spelt` with the CLI's flags.
    """

    def __init__(self, problems: list[str]):
        self.templates = list(problems)
        super().__init__([self._fill(p, lambda name: name) for p in self.templates])

    @staticmethod
    def _fill(template: str, spell: Callable[[str], str]) -> str:
        return _OPTION.sub(lambda m: spell(m.group(1)), template)

    def spelt(self, names: Mapping[str, str]) -> str:
        """The message with each option as ``names`` spells it (keywords missing from ``names`` stay)."""
        return "; ".join(self._fill(p, lambda name: names.get(name, name)) for p in self.templates)

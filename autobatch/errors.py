"""Errors a user can act on: each message states the rule, the value and the fix."""

from __future__ import annotations

__all__ = ["AutobatchError", "ConfigError", "MissingDependencyError", "MinimumBatchError", "NoBatchFitsError"]


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

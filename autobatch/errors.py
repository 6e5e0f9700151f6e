"""Errors a user can act on: each message states the rule, the value and the fix."""

from __future__ import annotations

import os
import re
import sys
import traceback
from collections.abc import Mapping

__all__ = ["AutobatchError", "ConfigError", "MissingDependencyError", "MinimumBatchError", "NoBatchFitsError",
           "RequestError", "option", "assigned", "spell", "user_code_error"]

_OPTION = re.compile("\x00(\\w+)(?:\x01([^\x00]*))?\x00")


def option(name: str) -> str:
    """A placeholder for the option ``name`` in an error's message, spelt when shown: ``max_micro``
    from Python, ``--max-micro`` where the CLI shows it."""
    return f"\x00{name}\x00"


def assigned(name: str, value: object) -> str:
    """``name=value`` from Python, ``--flag value`` on the command line: the fix an error proposes."""
    return f"\x00{name}\x01{value}\x00"


def spell(text: str, names: Mapping[str, str] | None = None) -> str:
    """``text`` with the placeholders of :func:`option` and :func:`assigned` spelt by ``names`` (keyword → flag),
    or as Python's keywords without it."""
    def one(match: re.Match[str]) -> str:
        name, value = match.group(1), match.group(2)
        if names is None or name not in names:
            return name if value is None else f"{name}={value}"
        return names[name] if value is None else f"{names[name]} {value}"

    return _OPTION.sub(one, text)


class AutobatchError(Exception):
    """Root of every error autobatch raises on purpose.

    The CLI prints it as one line and exits with code 2; anything that is not an
    ``AutobatchError`` is a bug or the user's own exception and keeps its traceback. A message
    may name options through :func:`option` and :func:`assigned`: ``str(error)`` spells them as
    Python's keywords, :meth:`spelt` as the CLI's flags.
    """

    def __str__(self) -> str:
        return spell(super().__str__())

    def spelt(self, names: Mapping[str, str]) -> str:
        """The message with each option as ``names`` spells it (a name missing from ``names`` stays)."""
        return spell(Exception.__str__(self), names)


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
        super().__init__(problems)
        self.problems = [spell(p) for p in problems]


# The library's functions that hand control to the user's code, and what that code was doing.
_HANDOFFS = {
    "_import_function": "importing the --model file or module",
    "_user_model": "the --model function",
    "batch_on": "make_batch(b)",
    "step_loss": "the loss (loss_fn: the model's forward and the loss)",
    "default_loss": "the model's forward",
    "forward_backward": "the training step's backward",
    "_step": "the training step's backward",
    "_optimizer_step": "the optimizer step",
    "make_optimizer": "the optimizer",
    "_forward": "the evaluation forward",
    "_first_batch": "make_batch(b)",
    "_build_for_signature": "the model function",
    "_global_batch": "make_batch(b)",
    "_mean": "the loss (loss_fn: the model's forward and the loss)",
    "_backward": "the backward of the loss",
}
_PACKAGE = os.path.dirname(os.path.abspath(__file__))
_LIBRARIES = tuple({os.path.dirname(os.__file__), *(p for p in sys.path if p.endswith(("site-packages", "dist-packages")))})


def _library(filename: str) -> bool:
    return filename.startswith("<") or filename.startswith(_LIBRARIES) or filename.startswith(_PACKAGE)


def user_code_error(exc: BaseException) -> str | None:
    """One line for an error raised in the user's own model, data or loss, or ``None`` when it is not.

    The error is the user's when the deepest of autobatch's frames is one that hands control to
    their code (building the model, ``make_batch``, the forward, the loss, the optimizer). The
    line names what ran, the error, and the innermost frame of their own files (else of the
    library their code called, as torch's for a shape that does not match).

    Example:
        >>> try:
        ...     import autobatch.models as m; m._import_function(":build")
        ... except AutobatchError as e:
        ...     print(user_code_error(e))
        None
    """
    if isinstance(exc, SyntaxError) and exc.filename and not _library(exc.filename):
        return f"importing the --model file failed: SyntaxError: {exc.msg} ({exc.filename}:{exc.lineno})"
    if isinstance(exc, AutobatchError):
        return None
    frames = traceback.extract_tb(exc.__traceback__)
    # (the simulated budget's dispatch mode sits under every op: it passes the user's ops through)
    ours = [i for i, frame in enumerate(frames)
            if os.path.abspath(frame.filename).startswith(_PACKAGE) and frame.name != "__torch_dispatch__"]
    if not ours or frames[ours[-1]].name not in _HANDOFFS:
        return None
    inner = frames[ours[-1] + 1:]
    own = [frame for frame in inner if not _library(os.path.abspath(frame.filename))]
    forwards = [frame for frame in inner if frame.name == "forward"]  # torch's layer, where a shape did not match
    at = (own or forwards or inner or [frames[ours[-1]]])[-1]
    what = "called sys.exit({})".format(exc.code) if isinstance(exc, SystemExit) else \
        f"raised {type(exc).__name__}: {' '.join(str(exc).split())}"
    return f"{_HANDOFFS[frames[ours[-1]].name]} {what} ({at.filename}:{at.lineno} in {at.name})"

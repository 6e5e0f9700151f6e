"""The ``autobatch`` command: a thin typer layer over the library.

Each command parses flags, calls library functions and prints; one module per command group.
:mod:`._app` holds the app and the error boundary, :mod:`.options` the options commands share.
"""

from __future__ import annotations

import sys

from . import estimate, find, plan, tune, verify_ga  # noqa: F401 - registers the commands
from ._app import app, cache_app

__all__ = ["app", "main"]

app.add_typer(cache_app, name="cache")


def main() -> None:
    from .. import exit_rank, is_launched

    if not is_launched():
        app(prog_name="autobatch")
        return
    try:
        app(prog_name="autobatch")
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    exit_rank(code)  # under torchrun / accelerate launch: see exit_rank for why


if __name__ == "__main__":
    sys.exit(main())

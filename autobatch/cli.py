"""The ``autobatch`` command: a thin typer layer over the library.

Each command parses flags, calls library functions and prints. Library errors
(:class:`~autobatch.errors.AutobatchError`) become one line on stderr and exit code 2; the
traceback is shown only with ``autobatch --debug …``.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from typing import Any

import typer

from .errors import AutobatchError

__all__ = ["app", "main"]

app = typer.Typer(
    name="autobatch",
    help="Find the per-GPU batch that fits, and reach your global batch exactly.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
_state = {"debug": os.environ.get("AUTOBATCH_DEBUG", "") not in ("", "0")}


@app.callback()
def _root(
    debug: bool = typer.Option(False, "--debug", help="Show the full traceback on errors."),
) -> None:
    if debug:
        _state["debug"] = True


def command(*args: Any, **kwargs: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``app.command`` that turns AutobatchError into one line and exit code 2."""

    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*a: Any, **kw: Any) -> Any:
            try:
                return fn(*a, **kw)
            except AutobatchError as exc:
                if _state["debug"]:
                    raise
                typer.echo(f"Error: {exc}", err=True)
                raise typer.Exit(2) from None

        return app.command(*args, **kwargs)(wrapper)

    return register


def fail(message: str) -> None:
    """Stop a command with one line (for checks done in the CLI layer itself)."""
    raise AutobatchError(message)


# --- commands -----------------------------------------------------------------------------
# Each command lives in its own section below; add new ones at the end of this file.


def main() -> None:
    app(prog_name="autobatch")


if __name__ == "__main__":
    sys.exit(main())

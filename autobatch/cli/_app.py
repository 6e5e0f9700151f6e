"""The typer app, the error boundary every command goes through, and the --debug switch.

Library errors (:class:`~autobatch.errors.AutobatchError`) become one line on stderr and exit
code 2; the traceback is shown only with ``autobatch --debug …``.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import typer

from ..errors import AutobatchError

__all__ = ["app", "cache_app", "command", "fail", "outputs"]

app = typer.Typer(
    name="autobatch",
    help="Find the per-GPU batch that fits, and reach your global batch exactly.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
cache_app = typer.Typer(help="The on-disk cache of probe results and tuning studies.", no_args_is_help=True)
_state = {"debug": False}
_outputs: dict[str, str] = {}  # files the running command has written, for the Ctrl-C message


def outputs() -> dict[str, str]:
    """The dict a command fills with ``{kind: path}`` as it writes files (see ``write_plan_configs``)."""
    return _outputs


@app.callback()
def _root(
    debug: bool = typer.Option(False, "--debug", help="Show the full traceback on errors (or AUTOBATCH_DEBUG=1)."),
) -> None:
    # Set on every invocation, so one --debug run does not leak into the next in the same process.
    _state["debug"] = debug or os.environ.get("AUTOBATCH_DEBUG", "") not in ("", "0")


def command(*args: Any, group: typer.Typer | None = None, **kwargs: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``app.command`` (or ``group.command``) that turns AutobatchError into one line and exit code 2."""

    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*a: Any, **kw: Any) -> Any:
            _outputs.clear()
            try:
                return fn(*a, **kw)
            except AutobatchError as exc:
                if _state["debug"]:
                    raise
                typer.echo(f"Error: {exc}", err=True)
                raise typer.Exit(2) from None
            except KeyboardInterrupt:
                if _state["debug"]:
                    raise
                done = ", ".join(f"{path} ({kind.replace('_', ' ')})" for kind, path in _outputs.items())
                typer.echo(f"interrupted; {'wrote ' + done if done else 'nothing was written'}", err=True)
                raise typer.Exit(130) from None  # 128 + SIGINT, as a shell reports it

        return (group or app).command(*args, **kwargs)(wrapper)

    return register


def fail(message: str) -> None:
    """Stop a command with one line (for checks done in the CLI layer itself)."""
    raise AutobatchError(message)

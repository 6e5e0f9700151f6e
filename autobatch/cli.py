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


# --- verify-ga ------------------------------------------------------------------------------


@command("verify-ga")
def verify_ga_command(
    model: str = typer.Option(..., "--model", help="Built-in model name (see autobatch.models)."),
    micro_batch: int = typer.Option(..., "--micro-batch", help="Samples per micro-batch per rank."),
    grad_accum: int = typer.Option(..., "--grad-accum", help="Micro-batches accumulated per optimizer step."),
    world_size: int = typer.Option(1, "--world-size", help="Data-parallel ranks, simulated in this process."),
    seq_len: int | None = typer.Option(None, "--seq-len", help="Sequence length of the padded LM batch."),
    normalised: bool = typer.Option(
        False, "--normalised/--naive",
        help="Check autobatch's token-normalised loss, or (default) the naive mean per micro-batch / GA.",
    ),
    tolerance: float = typer.Option(1e-5, "--tolerance", help="Largest overall relative gradient error that passes."),
    seed: int = typer.Option(0, "--seed", help="Seed for the weights, the batch and every forward pass."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Does micro-batch x GA (x ranks) give the big batch's gradient? Exit 0 PASS, 1 FAIL, 3 FLAGGED."""
    import json

    from .verify_ga import verify_model

    result = verify_model(
        model, seq_len=seq_len, micro_batch=micro_batch, grad_accum=grad_accum, world_size=world_size,
        mode="normalised" if normalised else "naive", tolerance=tolerance, seed=seed,
    )
    typer.echo(json.dumps(result.to_dict(), indent=2) if as_json else str(result))
    if result.exit_code:
        raise typer.Exit(result.exit_code)


def main() -> None:
    app(prog_name="autobatch")


if __name__ == "__main__":
    sys.exit(main())

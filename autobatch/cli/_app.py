"""The typer app, the error boundary every command goes through, and the root options.

Library errors (:class:`~autobatch.errors.AutobatchError`) and usage errors (a flag typed wrong)
become one line on stderr and exit code 2; with ``--json``, stdout still carries one JSON object
(``{"error": …, "exit_code": 2}``) so a script can always parse it. The traceback is shown only
with ``autobatch --debug …``. Under a launcher rank 0 says the error: the other ranks say one every
rank meets alike (a flag typed wrong, a request that breaks a rule) not at all, and one of their
own on stderr with their rank, never as stdout's JSON. Warnings (a damaged cache entry) are one line without a source path.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import re
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import typer
from typer.core import TyperCommand, TyperGroup

try:  # typer >= 0.20 carries its own copy of click, whose exceptions it raises
    from typer import _click as click
except ImportError:  # pragma: no cover - older typer uses click itself
    import click

from ..errors import AutobatchError, RequestError, user_code_error
from .options import FLAGS

__all__ = ["app", "cache_app", "command", "in_flags", "COMMAND_ORDER", "RENAMED", "outputs"]

# The order a user needs them in: probe and plan, plan alone, check, then the rest.
COMMAND_ORDER = ["find", "solve", "check", "estimate", "tune", "verify-ga", "gpus", "models", "cache"]

# The largest whole number a flag takes: batch arithmetic is exact below 2**64 (planning/divisors.py);
# torch seeds are signed 64-bit.
MAX_WHOLE = 2**64 - 1
INT_BOUNDS = {"seed": 2**63 - 1}

# Spellings of earlier releases, still accepted (hidden from --help) with a note naming the new flag.
RENAMED = {"--max-batch": "--max-micro", "--world-size": "--gpus"}

_state = {"debug": False}


def _one_line(message: Warning | str, category: type[Warning], *_: Any, **__: Any) -> None:
    sys.stderr.write(f"warning: {message}\n")


def _typed_value(argv: Sequence[str], param: Any) -> str | None:
    """What the user typed for ``param`` (``--flag VALUE`` or ``--flag=VALUE``), to quote it back."""
    names = set(getattr(param, "opts", ()))
    for i, arg in enumerate(argv):
        flag, eq, value = arg.partition("=")
        if flag in names:
            return value if eq else (argv[i + 1] if i + 1 < len(argv) else None)
    return None


_RULES = [  # what typer says about a bad value, as the rule the flag must follow
    (re.compile(r"Input should be greater than or equal to (\S+)"), "must be ≥ {}"),
    (re.compile(r"Input should be less than or equal to (\S+)"), "must be ≤ {}"),
    (re.compile(r"Input should be greater than (\S+)"), "must be > {}"),
    (re.compile(r"Input should be a valid integer"), "must be a whole number"),
    (re.compile(r"Input should be a valid number"), "must be a number"),
    (re.compile(r"Input should be a finite number"), "must be a finite number"),
]


def _bad_value(exc: Any, argv: Sequence[str]) -> str | None:
    """``--target must be ≥ 1, but got '0'``: a bad value as one line naming the flag the user typed."""
    param = getattr(exc, "param", None)
    typed = _typed_value(argv, param)
    if typed is None:
        return None
    flag = next((o for o in param.opts if o in " ".join(argv)), param.opts[0])
    if typed.strip().lower().lstrip("+-") in ("nan", "inf", "infinity"):
        return f"{flag} must be a finite number, but got {typed!r}"
    for pattern, rule in _RULES:
        match = pattern.search(exc.message)
        if match:
            return f"{flag} {rule.format(*match.groups())}, but got {typed!r}"
    return f"{flag}: {exc.message.rstrip('.')}, but got {typed!r}"


def _wants_json(args: Sequence[str]) -> bool:
    return "--json" in args


def _json_error(message: str, code: int) -> None:
    typer.echo(json.dumps({"error": message, "exit_code": code}, ensure_ascii=False))


# A rank that leaves an error to rank 0 waits this long before it exits, so that rank 0 has said it
# before the launcher, seeing this rank fail, stops the others.
_GRACE_S = 1.0


def _other_rank() -> int | None:
    """This process's rank under a launcher where it is not rank 0, else ``None``."""
    from .. import is_launched, rank_env

    try:
        return (rank_env().rank or None) if is_launched() else None
    except Exception:  # malformed launcher variables: the error being said is the one to show
        return None


def _alike(exc: BaseException) -> bool:
    """An error every rank raises alike: a request that breaks a rule, a target no plan reaches,
    nothing fitting (agreed word for word), or another rank's failure, which rank 0 names too."""
    from .. import NoBatchFitsError, NoExactPlanError, RankFailedError

    return isinstance(exc, (RequestError, NoExactPlanError, NoBatchFitsError, RankFailedError))


def _say_error(message: str, code: int, *, as_json: bool, alike: bool) -> None:
    """``Error: message`` on stderr (and the JSON object on stdout with ``--json``), once per job:
    see the module's docstring."""
    rank = _other_rank()
    if rank is not None:
        if not alike:  # its own: the others cannot say it
            typer.echo(f"rank {rank}: Error: {message}", err=True)
        time.sleep(_GRACE_S)
        return
    if as_json:
        _json_error(message, code)
    typer.echo(f"Error: {message}", err=True)


def _tidy(params: list[Any]) -> list[Any]:
    """Help shows no ``<bool>`` for a flag (it takes no value) and ``<int>`` rather than ``<int range>``."""
    for param in params:
        descriptor = getattr(param, "type_descriptor", None)
        if getattr(param, "is_flag", False):
            param.metavar = ""
        elif param.metavar is None and descriptor is not None and getattr(descriptor, "is_ranged", False):
            param.metavar = f"<{descriptor.ranged_type_name}>"
    return params


class AutobatchCommand(TyperCommand):
    """A command whose help reads cleanly and which accepts the renamed spellings (:data:`RENAMED`)."""

    def get_params(self, ctx: Any) -> list[Any]:
        return _tidy(super().get_params(ctx))

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        known = {opt for param in self.params for opt in (*param.opts, *param.secondary_opts)}
        typed = {arg.partition("=")[0] for arg in args}
        rewritten = []
        for arg in args:
            old, eq, value = arg.partition("=")
            new = RENAMED.get(old)
            if new is not None and old not in known and new in known:
                if new in typed:  # two spellings of one option: which one was meant is anybody's guess
                    raise click.exceptions.UsageError(f"{old} is the old name of {new}, and both were given; pass {new} alone",
                                                      ctx=ctx)
                typer.echo(f"note: {old} is now {new}", err=True)
                arg = new + eq + value
            rewritten.append(arg)
        rest = super().parse_args(ctx, rewritten)
        for param in self.params:  # every whole number has a bound: past it, torch and the OS overflow
            value = ctx.params.get(param.name)
            bound = INT_BOUNDS.get(param.name, MAX_WHOLE)
            if isinstance(value, int) and not isinstance(value, bool) and value > bound:
                raise click.exceptions.BadParameter(f"Input should be less than or equal to {bound}", ctx=ctx,
                                                    param=param)
        return rest


class AutobatchGroup(TyperGroup):
    """Commands in :data:`COMMAND_ORDER`, and every usage error as one line (JSON too with --json)."""

    def get_params(self, ctx: Any) -> list[Any]:
        return _tidy(super().get_params(ctx))

    def list_commands(self, ctx: Any) -> list[str]:
        names = super().list_commands(ctx)
        rank = {name: i for i, name in enumerate(COMMAND_ORDER)}
        return sorted(names, key=lambda name: rank.get(name, len(rank)))

    def main(self, args: Sequence[str] | None = None, prog_name: str | None = None,
             complete_var: str | None = None, standalone_mode: bool = True, **extra: Any) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        argv = list(sys.argv[1:] if args is None else args)
        try:
            result = super().main(argv, prog_name, complete_var, standalone_mode=False, **extra)
        except click.exceptions.ClickException as exc:
            ctx = getattr(exc, "ctx", None)
            command = ctx.command_path if ctx is not None else "autobatch"
            message = exc.format_message().rstrip(".")
            if isinstance(exc, click.exceptions.NoArgsIsHelpError) or not message:  # the help was shown
                listed = getattr(ctx.command, "list_commands", None) if ctx is not None else None
                names = listed(ctx) if listed is not None else []
                message = "a command must follow" + (f": one of {', '.join(names)}" if names else "")
            if isinstance(exc, click.exceptions.BadParameter):
                message = _bad_value(exc, argv) or message
            if isinstance(exc, click.exceptions.UsageError):
                message += f" (see: {command} --help)"
            _say_error(message, exc.exit_code, as_json=_wants_json(argv), alike=True)
            sys.exit(exc.exit_code)
        except typer.Abort:
            typer.echo("Aborted", err=True)
            sys.exit(1)
        sys.exit(result if isinstance(result, int) else 0)


app = typer.Typer(
    name="autobatch",
    cls=AutobatchGroup,
    help="Find the per-GPU batch that fits, and reach your global batch exactly.",
    epilog="Start with: autobatch find --model gpt2 --target 224",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
cache_app = typer.Typer(cls=AutobatchGroup, help="The on-disk cache of probe results and tuning studies.",
                        epilog="Examples:\n\n  $ autobatch cache list\n\n  $ autobatch cache clear", no_args_is_help=True)


def _version(value: bool) -> None:
    if value:
        from .. import __version__

        typer.echo(f"autobatch {__version__}")
        raise typer.Exit()
_outputs: dict[str, str] = {}  # files the running command has written, for the Ctrl-C message


def outputs() -> dict[str, str]:
    """The dict a command fills with ``{kind: path}`` as it writes files (see ``write_plan_configs``)."""
    return _outputs


@app.callback()
def _root(
    debug: bool = typer.Option(False, "--debug", help="Show the full traceback on errors (or AUTOBATCH_DEBUG=1)."),
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                 help="Print the version and exit."),
) -> None:
    # Set on every invocation, so one --debug run does not leak into the next in the same process.
    _state["debug"] = debug or os.environ.get("AUTOBATCH_DEBUG", "") not in ("", "0")


def command(name: str, *, examples: Sequence[str] = (), on: typer.Typer | None = None,
            **kwargs: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register a command: AutobatchError becomes one line and exit code 2; ``examples`` end its --help."""

    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*a: Any, **kw: Any) -> Any:
            with warnings.catch_warnings():
                warnings.showwarning = _one_line  # restored when the command ends
                _outputs.clear()
                try:
                    return fn(*a, **kw)
                except (Exception, SystemExit) as exc:
                    # Our own errors, and those raised in the user's model, data or loss: one line.
                    user = None if isinstance(exc, AutobatchError) else user_code_error(exc)
                    if _state["debug"] or (user is None and not isinstance(exc, AutobatchError)):
                        raise
                    message = (user + "; --debug shows the traceback" if user is not None
                               else in_flags(exc.spelt(FLAGS)))
                    _say_error(message, 2, as_json=bool(kw.get("as_json")), alike=_alike(exc))
                    raise typer.Exit(2) from None
                except KeyboardInterrupt:
                    if _state["debug"]:
                        raise
                    done = ", ".join(f"{path} ({kind.replace('_', ' ')})" for kind, path in _outputs.items())
                    typer.echo(f"interrupted; {'wrote ' + done if done else 'nothing was written'}", err=True)
                    raise typer.Exit(130) from None  # 128 + SIGINT, as a shell reports it

        epilog = "Examples:\n\n" + "\n\n".join(f"  $ {line}" for line in examples) if examples else None
        if fn.__doc__ and "help" not in kwargs:  # each paragraph one line: the terminal wraps it, not the source
            kwargs["help"] = "\n\n".join(" ".join(p.split()) for p in inspect.cleandoc(fn.__doc__).split("\n\n"))
        return (on or app).command(name, cls=AutobatchCommand, epilog=epilog, **kwargs)(wrapper)

    return register


# A library error names options in Python (`max_micro must …`, `got seq_len=4096`, `raise max_micro`);
# on the command line each is the flag the user typed.
_NAMES = "|".join(sorted(FLAGS, key=len, reverse=True))
_OPENING = re.compile(rf"^({_NAMES}) (must|as a fraction)")
_ASSIGNED = re.compile(rf"(?<![\w.-])({_NAMES})=")
_SNAKE = re.compile(rf"(?<![\w.-])({'|'.join(name for name in FLAGS if '_' in name)})(?![\w(=-])")


def in_flags(message: str) -> str:
    """``max_micro must be …, but got max_micro=0`` as ``--max-micro must be …, but got --max-micro 0``.

    Example:
        >>> in_flags("dtype must be one of fp32, bf16, fp16, but got 'fp8'")
        "--dtype must be one of fp32, bf16, fp16, but got 'fp8'"
        >>> in_flags("model_parallel must divide the GPU count, but got model_parallel=4 for 6 GPUs")
        '--model-parallel must divide the GPU count, but got --model-parallel 4 for 6 GPUs'
    """
    message = _OPENING.sub(lambda m: f"{FLAGS[m.group(1)]} {m.group(2)}", message)
    message = _ASSIGNED.sub(lambda m: f"{FLAGS[m.group(1)]} ", message)
    return _SNAKE.sub(lambda m: FLAGS[m.group(1)], message)


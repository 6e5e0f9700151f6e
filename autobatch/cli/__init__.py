"""The ``autobatch`` command: a thin typer layer over the library.

Each command parses flags, calls library functions and prints; one module per command group.
:mod:`._app` holds the app and the error boundary, :mod:`.options` the options commands share.
"""

from __future__ import annotations

import sys

from . import estimate, find, plan, tune, verify_ga  # noqa: F401 - registers the commands
from ._app import app, cache_app

__all__ = ["app", "main", "launcher_flags"]

app.add_typer(cache_app, name="cache")


def launcher_flags(argv: list[str]) -> list[str]:
    """``argv`` without the ``--local_rank=N`` the DeepSpeed launcher (and ``torch.distributed.launch``, as
    ``--local-rank``) puts before the command: the rank's place comes from the environment they also set.

    Example:
        >>> launcher_flags(["--local_rank=1", "find", "--model", "gpt2"])
        ['find', '--model', 'gpt2']
    """
    args = list(argv)
    while args and args[0].split("=")[0] in ("--local_rank", "--local-rank"):
        flag = args.pop(0)
        if "=" not in flag and args and args[0].isdigit():
            args.pop(0)
    return args


def main() -> None:
    from .. import exit_rank, is_launched

    args = launcher_flags(sys.argv[1:])
    if not is_launched():
        app(args=args, prog_name="autobatch")
        return
    try:
        app(args=args, prog_name="autobatch")
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    exit_rank(code)  # under torchrun / accelerate launch: see exit_rank for why


if __name__ == "__main__":
    sys.exit(main())

"""`autobatch --help` and a flag typed wrong answer at once: neither imports torch (about a second
and a half on a laptop), and `import autobatch` alone does not either."""

from __future__ import annotations

import subprocess
import sys

import pytest

from autobatch.cli._app import COMMAND_ORDER

PROBE = """
import sys
from autobatch.cli import main
sys.argv = ["autobatch", *{args!r}]
try:
    main()
except SystemExit as exc:
    code = exc.code
print("torch imported" if "torch" in sys.modules else "torch not imported", file=sys.stderr)
"""


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PROBE.format(args=list(args))], capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("args", [["--help"], ["find", "--help"], ["solve", "--help"], ["find", "--bogus"],
                                  ["solve", "--target", "abc"], ["--version"]],
                         ids=lambda a: " ".join(a))
def test_help_and_usage_errors_do_not_import_torch(args):
    done = run(*args)
    assert done.stderr.strip().endswith("torch not imported"), done.stderr


def test_every_command_helps_without_torch():
    for name in COMMAND_ORDER:
        done = run(name, "--help")
        assert "torch not imported" in done.stderr and "Usage" in done.stdout, (name, done.stderr)


def test_import_autobatch_is_lazy_and_complete():
    code = ("import sys, autobatch; assert 'torch' not in sys.modules; "
            "missing = [n for n in autobatch.__all__ if getattr(autobatch, n, None) is None]; print(missing)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stderr

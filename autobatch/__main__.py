"""``python -m autobatch`` (and ``torchrun -m autobatch``) runs the CLI."""

from .cli import main

main()

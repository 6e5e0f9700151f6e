"""Optional extras in tests: a test that needs one skips and names the extra to install.

``need("accelerate")`` imports the module or skips with "needs the accelerate extra:
pip install -e '.[accelerate]'", so a machine with only ``.[hf,dev]`` installed skips, never fails.
"""

from __future__ import annotations

from typing import Any

import pytest

__all__ = ["EXTRAS", "need"]

# Top-level module -> the extra in pyproject.toml that installs it.
EXTRAS = {
    "transformers": "hf",
    "accelerate": "accelerate",
    "deepspeed": "deepspeed",
    "hjson": "deepspeed",
    "lightning": "lightning",
    "matplotlib": "plot",
}


def need(module: str, *also: str) -> Any:
    """Import ``module`` (and the modules in ``also``) or skip naming the extra that installs it."""
    for other in also:
        need(other)
    extra = EXTRAS.get(module.split(".")[0])
    reason = None if extra is None else f"needs the {extra} extra: pip install -e '.[{extra}]'"
    return pytest.importorskip(module, reason=reason)

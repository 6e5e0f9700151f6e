"""The oldest torch pyproject.toml allows has every torch API the package uses."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# A torch API the package uses, and the first torch release that has it.
NEEDS = {
    "torch.OutOfMemoryError": (2, 5),   # top-level alias; before 2.5 only torch.cuda.OutOfMemoryError
    "torch.optim.Adafactor": (2, 5),
}


def test_the_torch_floor_covers_every_api_the_package_uses():
    floor = re.search(r'"torch>=(\d+)\.(\d+)', (ROOT / "pyproject.toml").read_text())
    assert floor, "pyproject.toml must state a torch floor"
    floor = tuple(map(int, floor.groups()))
    source = "\n".join(p.read_text() for p in (ROOT / "autobatch").rglob("*.py"))
    for api, since in NEEDS.items():
        assert api in source, f"{api} is not used any more: drop it from NEEDS"
        assert floor >= since, f"the package uses {api} (torch {since[0]}.{since[1]}), but allows torch {floor[0]}.{floor[1]}"

"""Tests that need an optional extra skip and name it: with only ``.[hf,dev]`` installed, nothing fails."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tests.extras import EXTRAS, need

TESTS = Path(__file__).resolve().parent


def test_a_missing_extra_skips_naming_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "accelerate", None)  # importing it now raises ImportError
    with pytest.raises(pytest.skip.Exception, match=r"needs the accelerate extra: pip install -e '\.\[accelerate\]'"):
        need("accelerate")


def test_every_optional_import_in_the_tests_goes_through_need():
    optional = "|".join(EXTRAS)
    for path in TESTS.glob("*.py"):
        if path.name in ("extras.py", "test_extras.py"):
            continue
        text = path.read_text()
        assert "pytest.importorskip(" not in text, f"{path.name}: use tests.extras.need, which names the extra"
        # A bare top-level import of an extra, before need() has skipped the module, would fail
        # collection on a machine without it.
        head = text.split("need(", 1)[0]
        bare = re.findall(rf"^(?:import|from) ({optional})\b", head, re.M)
        assert not bare, f"{path.name} imports {bare} at module level"

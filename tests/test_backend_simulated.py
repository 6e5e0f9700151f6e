from __future__ import annotations

import pytest

from autobatch import SimulatedBackend
from tests.backend_suite import BackendContract


class TestSimulatedBackend(BackendContract):
    @pytest.fixture
    def backend(self):
        return SimulatedBackend("16MiB")


def test_budget_accepts_text_and_bytes():
    assert SimulatedBackend("2GiB").capacity() == 2 * 1024**3
    assert SimulatedBackend(4096).capacity() == 4096

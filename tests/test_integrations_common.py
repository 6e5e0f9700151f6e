"""What the integrations share: a missing framework is one line naming the extra; probe batches from a dataset."""

from __future__ import annotations

import importlib
import sys

import pytest
import torch

from autobatch.errors import MissingDependencyError
from autobatch.integrations._common import batches_from_dataset
from autobatch.probing.memtrack import MemoryTracker


@pytest.mark.parametrize("module, framework, extra", [
    ("lightning", "lightning.pytorch", "lightning"),
    ("hf", "transformers", "hf"),
    ("accelerate", "accelerate", None),
])
def test_a_missing_framework_names_the_extra(monkeypatch, module, framework, extra) -> None:
    name = f"autobatch.integrations.{module}"
    monkeypatch.setitem(sys.modules, framework, None)  # import of it raises ImportError
    monkeypatch.delitem(sys.modules, name, raising=False)
    if extra is None:
        # The accelerate drop-in needs no accelerate at all: it only keeps its call shape.
        assert importlib.import_module(name).find_executable_batch_size
        return
    with pytest.raises(MissingDependencyError, match=rf"^autobatch.integrations.{module} needs {framework.split('.')[0]}, "
                                                     rf"which is not installed; pip install 'autobatch\[{extra}\]'$"):
        importlib.import_module(name)


def test_probe_batches_gather_rows_and_count_only_their_own_size() -> None:
    rows = torch.utils.data.TensorDataset(torch.arange(4096.0).view(1024, 4), torch.arange(1024))
    make = batches_from_dataset(rows, torch.utils.data.default_collate)
    with MemoryTracker() as tracker:
        x, y = make(300)  # more than the pool of 256: rows repeat
    assert x.shape == (300, 4) and y[:3].tolist() == [0, 1, 2] and y[256].item() == 0
    assert tracker.peak_bytes == 300 * 4 * 4 + 300 * 8 + 300 * 8  # rows, labels, the index: not the dataset's 16 KiB

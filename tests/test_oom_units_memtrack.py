from __future__ import annotations

import pytest
import torch

from autobatch import AutobatchError, MemoryTracker, format_bytes, is_oom_error, parse_bytes


@pytest.mark.parametrize(
    "exc, expected",
    [
        (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), True),
        (RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB"), True),
        (RuntimeError("CUDA error: out of memory"), True),
        (RuntimeError("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a non-contiguous input."), True),
        (RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes"), True),
        (ValueError("Expected more than 1 value per channel when training"), False),
        (RuntimeError("mat1 and mat2 shapes cannot be multiplied"), False),
        (RuntimeError("CUDA out of memory.", "second arg"), False),
        (KeyError("CUDA out of memory."), False),
    ],
)
def test_is_oom_error(exc, expected):
    assert is_oom_error(exc) is expected


def test_parse_and_format_bytes():
    assert parse_bytes("2GiB") == 2 * 1024**3
    assert parse_bytes("1.5G") == int(1.5 * 1024**3)
    assert parse_bytes("500MB") == 500_000_000
    assert parse_bytes(1024) == 1024
    assert format_bytes(3 * 1024**3) == "3.00 GiB"
    with pytest.raises(AutobatchError, match="memory must be a number with an optional unit"):
        parse_bytes("lots")
    with pytest.raises(AutobatchError, match="memory must be positive"):
        parse_bytes("0GiB")


def test_tracker_counts_storages_once_and_frees_them():
    tracker = MemoryTracker()
    with tracker:
        x = torch.zeros(256)
        view = x[:10]  # noqa: F841  (a view shares the storage)
        y = x + 1
    assert tracker.current_bytes == 2 * 1024
    del y
    assert tracker.current_bytes == 1024
    assert tracker.peak_bytes == 2 * 1024


def test_tracker_budget_raises_a_cuda_style_oom():
    tracker = MemoryTracker(budget=1000)
    with pytest.raises(torch.OutOfMemoryError) as info:
        with tracker:
            torch.zeros(1000)
    assert is_oom_error(info.value) and "CUDA out of memory." in str(info.value)

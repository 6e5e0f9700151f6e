"""The GPU catalogue: names, normalised lookups, custom memory, one-line errors."""

from __future__ import annotations

import pytest

from autobatch.errors import AutobatchError
from autobatch.estimating.gpus import DEFAULT_GPU, GPUS, custom_gpu, lookup_gpu, resolve_gpu

REQUIRED = ["v100-16gb", "v100-32gb", "t4", "a10g", "l4", "rtx-3090", "rtx-4090", "a100-40gb", "a100-80gb",
            "h100-80gb", "h200", "mi250", "mi300x"]


def test_catalogue_has_the_common_cards_with_usable_below_total():
    assert set(REQUIRED) <= set(GPUS)
    for spec in GPUS.values():
        assert 0 < spec.usable_bytes < spec.total_bytes
        assert spec.context_bytes >= 300 << 20


@pytest.mark.parametrize(
    ("name", "expected"),
    [("a100-80gb", "a100-80gb"), ("A100 80GB", "a100-80gb"), ("NVIDIA A100-80G", "a100-80gb"), ("h100", "h100-80gb"),
     ("H200", "h200"), ("rtx4090", "rtx-4090"), ("GeForce RTX 3090", "rtx-3090"), ("MI300X", "mi300x"),
     ("a100_40gb", "a100-40gb")],
)
def test_lookup_normalises_names(name, expected):
    assert lookup_gpu(name).name == expected


def test_unknown_gpu_is_one_line_listing_the_catalogue():
    with pytest.raises(AutobatchError, match="gpu must be one of v100-16gb, .*mi300x, but got 'b200'") as info:
        lookup_gpu("b200")
    assert "\n" not in str(info.value) and "--gpu-memory" in str(info.value)


def test_a100_alone_is_ambiguous():
    with pytest.raises(AutobatchError, match="a100-40gb, a100-80gb"):
        lookup_gpu("a100")


def test_custom_memory_and_resolution_order():
    spec = custom_gpu("40GiB")
    assert spec.total_bytes == 40 << 30 and spec.vendor == "custom"
    assert resolve_gpu("h100", "40GiB") == spec  # memory wins over a name
    assert resolve_gpu().name == DEFAULT_GPU
    with pytest.raises(AutobatchError, match="must be positive"):
        custom_gpu(0)

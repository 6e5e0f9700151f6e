"""DeepSpeed's own config parser, told the data-parallel world size without starting distributed.

DeepSpeedConfig first asks deepspeed.comm for the rank; with no process group that fails and it
falls back to world_size 1 even when an mpu is given. Reporting rank 0 for the duration of the
parse lets it take the data-parallel size from the mpu, as it does under Megatron-style parallelism.
"""

from __future__ import annotations

from typing import Any
from unittest import mock

import pytest
from tests.extras import need


def deepspeed_parse(config: dict[str, Any] | str, world_size: int) -> Any:
    """``deepspeed.runtime.config.DeepSpeedConfig(config)`` on ``world_size`` data-parallel ranks."""
    ds_config = need("deepspeed.runtime.config")

    class Mpu:
        def get_data_parallel_world_size(self) -> int:
            return world_size

    with mock.patch.object(ds_config.dist, "get_rank", return_value=0):
        return ds_config.DeepSpeedConfig(config, mpu=Mpu())

"""Config writers: one :class:`~autobatch.Plan`, the same numbers in every file and command line.

One module per target: :mod:`.deepspeed`, :mod:`.accelerate`, :mod:`.hf`, :mod:`.lightning`,
:mod:`.launch`; :mod:`.files` reads and writes JSON/YAML. Each writer takes a Plan; the Plan's
methods (``plan.to_deepspeed()`` …) delegate here.
"""

from __future__ import annotations

from .accelerate import (
    accelerate_config,
    read_accelerate_config,
    write_accelerate_config,
)
from .bundle import check_plan_outputs, write_plan_configs
from .deepspeed import (
    BATCH_KEYS,
    DerivedBatch,
    deepspeed_config,
    derive_batch_keys,
    read_deepspeed_config,
    write_deepspeed_config,
)
from .files import read_config, write_config
from .hf import hf_flags, hf_training_args
from .launch import accelerate_command, launcher_command, torchrun_command
from .lightning import lightning_settings

__all__ = [
    "BATCH_KEYS",
    "DerivedBatch",
    "accelerate_command",
    "accelerate_config",
    "check_plan_outputs",
    "deepspeed_config",
    "derive_batch_keys",
    "hf_flags",
    "hf_training_args",
    "lightning_settings",
    "read_accelerate_config",
    "read_config",
    "read_deepspeed_config",
    "torchrun_command",
    "launcher_command",
    "write_accelerate_config",
    "write_config",
    "write_deepspeed_config",
    "write_plan_configs",
]

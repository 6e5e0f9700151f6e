"""Write every config a plan is asked for, in one call (what ``solve``, ``find`` and ``estimate`` do)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from .accelerate import write_accelerate_config
from .deepspeed import write_deepspeed_config
from .files import write_config
from .hf import hf_training_args

if TYPE_CHECKING:
    from ..planning.plan import Plan

__all__ = ["write_plan_configs"]

PathLike = str | os.PathLike[str]


def write_plan_configs(
    plan: Plan,
    *,
    deepspeed: PathLike | None = None,
    accelerate: PathLike | None = None,
    hf: PathLike | None = None,
    keep_auto: bool = False,
) -> dict[str, str]:
    """Write the requested files from one plan; return ``{kind: path}`` of what was written.

    Args:
        plan: the plan every file agrees with.
        deepspeed: DeepSpeed JSON; an existing file keeps every key but the three batch keys.
        accelerate: accelerate config YAML (pointing at ``deepspeed`` when both are given).
        hf: HF ``TrainingArguments`` values, JSON or YAML by suffix (pointing at ``deepspeed`` too).
        keep_auto: leave ``"auto"`` batch values in an existing DeepSpeed file.

    Example:
        >>> write_plan_configs(plan, deepspeed="ds.json", accelerate="accelerate.yaml")  # doctest: +SKIP
        {'deepspeed_config': 'ds.json', 'accelerate_config': 'accelerate.yaml'}
    """
    written: dict[str, str] = {}
    if deepspeed is not None:
        write_deepspeed_config(plan, deepspeed, keep_auto=keep_auto, for_accelerate=accelerate is not None)
        written["deepspeed_config"] = str(deepspeed)
    if accelerate is not None:
        write_accelerate_config(plan, accelerate, deepspeed)
        written["accelerate_config"] = str(accelerate)
    if hf is not None:
        write_config(hf, hf_training_args(plan, deepspeed))
        written["hf_args"] = str(hf)
    return written

"""Lightning settings for a plan: ``Trainer`` arguments and the DataLoader batch size.

Lightning's global batch is ``DataLoader batch_size × accumulate_grad_batches × devices ×
num_nodes`` (for data parallelism); ``devices`` is per node.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..planning.plan import Plan

__all__ = ["lightning_settings"]


# The Trainer's strategy for each of autobatch's (Lightning's registry names).
_STRATEGY = {"ddp": "ddp", "fsdp1": "fsdp", "fsdp2": "fsdp", "zero1": "deepspeed_stage_1", "zero2": "deepspeed_stage_2",
             "zero3": "deepspeed_stage_3"}
_PRECISION = {"bf16": "bf16-mixed", "fp16": "16-mixed", "bf16-true": "bf16-true", "fp16-true": "16-true"}


def lightning_settings(plan: Plan, *, strategy: Any = None, precision: str | None = None) -> dict[str, dict[str, Any]]:
    """``{"trainer": Trainer kwargs, "dataloader": DataLoader kwargs}`` for the plan, with the strategy
    and precision the micro batch was probed under (the batch fits only with them).

    Example:
        >>> from autobatch.planning.plan import Plan
        >>> lightning_settings(Plan(7, 2, gpus_per_node=16))
        {'trainer': {'accumulate_grad_batches': 2, 'devices': 16, 'num_nodes': 1}, 'dataloader': {'batch_size': 7}}
    """
    trainer: dict[str, Any] = {
        "accumulate_grad_batches": plan.grad_accum,
        "devices": plan.gpus_per_node,
        "num_nodes": plan.nodes,
    }
    if strategy is not None:
        name = _STRATEGY[strategy.name]
        trainer["strategy"] = f"{name}_offload" if strategy.offload and name.startswith("deepspeed_stage_") and \
            name[-1] in "23" else name
    if precision in _PRECISION:
        trainer["precision"] = _PRECISION[precision]
    return {"trainer": trainer, "dataloader": {"batch_size": plan.micro_batch}}

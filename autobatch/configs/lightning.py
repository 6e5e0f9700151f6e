"""Lightning settings for a plan: ``Trainer`` arguments and the DataLoader batch size.

Lightning's global batch is ``DataLoader batch_size × accumulate_grad_batches × devices ×
num_nodes`` (for data parallelism); ``devices`` is per node.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..planning.plan import Plan

__all__ = ["lightning_settings"]


def lightning_settings(plan: Plan) -> dict[str, dict[str, int]]:
    """``{"trainer": Trainer kwargs, "dataloader": DataLoader kwargs}`` for the plan.

    Example:
        >>> from autobatch.planning.plan import Plan
        >>> lightning_settings(Plan(7, 2, gpus_per_node=16))
        {'trainer': {'accumulate_grad_batches': 2, 'devices': 16, 'num_nodes': 1}, 'dataloader': {'batch_size': 7}}
    """
    return {
        "trainer": {
            "accumulate_grad_batches": plan.grad_accum,
            "devices": plan.gpus_per_node,
            "num_nodes": plan.nodes,
        },
        "dataloader": {"batch_size": plan.micro_batch},
    }

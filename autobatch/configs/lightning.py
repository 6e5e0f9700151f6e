"""Lightning settings for a plan: ``Trainer`` arguments and the DataLoader batch size.

Lightning's global batch is ``DataLoader batch_size × accumulate_grad_batches × devices ×
num_nodes`` (for data parallelism); ``devices`` is per node.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..strategy import as_strategy

if TYPE_CHECKING:
    from ..planning.plan import Plan

__all__ = ["LightningStrategy", "lightning_settings"]


# The Trainer's strategy for each of autobatch's, by Lightning's registry name where one trains as probed.
# Lightning's "fsdp" is FSDP1; FSDP2 (``fully_shard``) is its ModelParallelStrategy, and ZeRO-3 with only
# its optimizer offloaded has no name ("deepspeed_stage_3_offload" offloads the parameters too).
_STRATEGY = {"ddp": "ddp", "fsdp1": "fsdp", "zero1": "deepspeed_stage_1", "zero2": "deepspeed_stage_2",
             "zero3": "deepspeed_stage_3", ("zero2", "optimizer"): "deepspeed_stage_2_offload",
             ("zero3", "params"): "deepspeed_stage_3_offload"}


@dataclass(frozen=True)
class LightningStrategy:
    """A Lightning strategy that has no registry name, as the code that makes it: its repr is that code,
    :meth:`build` makes it (needs ``autobatch[lightning]``).

    FSDP2 is ``ModelParallelStrategy`` with every rank data parallel: sizes left at ``"auto"`` would make
    every GPU of a node tensor parallel. The LightningModule's ``configure_model`` then applies
    ``fully_shard`` over ``self.device_mesh["data_parallel"]``, with ``MixedPrecisionPolicy`` of the run's
    dtype under bf16/fp16, as the batch was probed.

    Example:
        >>> LightningStrategy("ModelParallelStrategy", (("data_parallel_size", 16), ("tensor_parallel_size", 1)))
        ModelParallelStrategy(data_parallel_size=16, tensor_parallel_size=1)
    """

    name: str
    kwargs: tuple[tuple[str, Any], ...]

    def __repr__(self) -> str:
        return f"{self.name}({', '.join(f'{k}={v!r}' for k, v in self.kwargs)})"

    def build(self) -> Any:
        """The ``lightning.pytorch.strategies`` object to pass as ``Trainer(strategy=...)``."""
        try:
            from lightning.pytorch import strategies
        except ImportError:
            from ..errors import MissingDependencyError

            raise MissingDependencyError(f"Lightning's {self.name} needs lightning, which is not installed; "
                                         "pip install 'autobatch[lightning]'") from None
        return getattr(strategies, self.name)(**dict(self.kwargs))


_PRECISION = {"bf16": "bf16-mixed", "fp16": "16-mixed", "bf16-true": "bf16-true", "fp16-true": "16-true"}


def _strategy(plan: Plan, strategy: Any) -> str | LightningStrategy:
    if strategy.name == "fsdp2":
        return LightningStrategy("ModelParallelStrategy", (("data_parallel_size", plan.world_size),
                                                           ("tensor_parallel_size", plan.model_parallel)))
    if strategy.offload is None:
        return _STRATEGY[strategy.name]
    if (strategy.name, strategy.offload) in _STRATEGY:
        return _STRATEGY[strategy.name, strategy.offload]
    return LightningStrategy("DeepSpeedStrategy", (("stage", int(strategy.name[-1])), ("offload_optimizer", True),
                                                   ("offload_parameters", strategy.offload == "params")))


def lightning_settings(plan: Plan, *, strategy: Any = None, precision: str | None = None) -> dict[str, dict[str, Any]]:
    """``{"trainer": Trainer kwargs, "dataloader": DataLoader kwargs}`` for the plan, with the strategy
    and precision the micro batch was probed under (the batch fits only with them).

    Example:
        >>> from autobatch.planning.plan import Plan
        >>> lightning_settings(Plan(7, 2, gpus_per_node=16))
        {'trainer': {'accumulate_grad_batches': 2, 'devices': 16, 'num_nodes': 1}, 'dataloader': {'batch_size': 7}}
    """
    strategy = as_strategy(strategy)  # a name ("zero3") as well as a Strategy
    trainer: dict[str, Any] = {
        "accumulate_grad_batches": plan.grad_accum,
        "devices": plan.gpus_per_node,
        "num_nodes": plan.nodes,
    }
    if strategy is not None:
        trainer["strategy"] = _strategy(plan, strategy)
    if precision in _PRECISION:
        trainer["precision"] = _PRECISION[precision]
    return {"trainer": trainer, "dataloader": {"batch_size": plan.micro_batch}}

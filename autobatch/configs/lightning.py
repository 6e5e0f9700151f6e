"""Lightning settings for a plan: ``Trainer`` arguments and the DataLoader batch size.

Lightning's global batch is ``DataLoader batch_size × accumulate_grad_batches × devices ×
num_nodes`` (for data parallelism); ``devices`` is per node.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..strategy import SIZE_BASED_MIN_PARAMS
from .trained import trained_with

if TYPE_CHECKING:
    from ..planning.plan import Plan

__all__ = ["LightningStrategy", "lightning_settings"]


# The Trainer's strategy for each of autobatch's, by Lightning's registry name where one trains as probed.
# Lightning's "fsdp" wraps the whole model as one unit (FSDP1, no wrap policy): FSDPStrategy with the probed
# block as its unit is written instead. FSDP2 (``fully_shard``) is its ModelParallelStrategy, and ZeRO-3 with
# only its optimizer offloaded has no name ("deepspeed_stage_3_offload" offloads the parameters too).
_STRATEGY = {"ddp": "ddp", "zero1": "deepspeed_stage_1", "zero2": "deepspeed_stage_2",
             "zero3": "deepspeed_stage_3", ("zero2", "optimizer"): "deepspeed_stage_2_offload",
             ("zero3", "params"): "deepspeed_stage_3_offload"}


class Units(tuple):  # type: ignore[type-arg]
    """FSDP's units as the names of their module classes: written as the set of classes Lightning's
    ``auto_wrap_policy`` takes, resolved against the model by :meth:`LightningStrategy.build`."""

    def __repr__(self) -> str:
        return "{" + ", ".join(self) + "}"


@dataclass(frozen=True)
class LightningStrategy:
    """A Lightning strategy that has no registry name, as the code that makes it: its repr is that code,
    :meth:`build` makes it (needs ``autobatch[lightning]``).

    FSDP1 is ``FSDPStrategy`` with the probed block as its unit (Lightning's ``"fsdp"`` alone wraps
    the whole model as one). FSDP2 is ``ModelParallelStrategy`` with every rank data parallel: sizes
    left at ``"auto"`` would make every GPU of a node tensor parallel; your ``configure_model`` then
    applies ``fully_shard`` as :func:`lightning_settings`'s ``"configure_model"`` says.

    Example:
        >>> LightningStrategy("ModelParallelStrategy", (("data_parallel_size", 16), ("tensor_parallel_size", 1)))
        ModelParallelStrategy(data_parallel_size=16, tensor_parallel_size=1)
        >>> LightningStrategy("FSDPStrategy", (("auto_wrap_policy", Units(["GPT2Block"])),))
        FSDPStrategy(auto_wrap_policy={GPT2Block})
    """

    name: str
    kwargs: tuple[tuple[str, Any], ...]

    def __repr__(self) -> str:
        return f"{self.name}({', '.join(f'{k}={v!r}' for k, v in self.kwargs)})"

    def build(self, model: Any = None) -> Any:
        """The ``lightning.pytorch.strategies`` object to pass as ``Trainer(strategy=...)``; a wrap
        policy's classes are looked up in ``model``."""
        try:
            from lightning.pytorch import strategies
        except ImportError:
            from ..errors import MissingDependencyError

            raise MissingDependencyError(f"Lightning's {self.name} needs lightning, which is not installed; "
                                         "pip install 'autobatch[lightning]'") from None
        kwargs = dict(self.kwargs)
        for key, value in kwargs.items():
            if isinstance(value, Units):
                classes = {type(m) for m in (model.modules() if model is not None else ()) if type(m).__name__ in value}
                if len(classes) < len(value):
                    from ..errors import AutobatchError

                    raise AutobatchError(f"{key} names the module classes {value!r}, which build(model) looks up in "
                                         "the model; pass the model that has them")
                kwargs[key] = classes
        return getattr(strategies, self.name)(**kwargs)


_PRECISION = {"bf16": "bf16-mixed", "fp16": "16-mixed", "bf16-true": "bf16-true", "fp16-true": "16-true"}
_TORCH_DTYPE = {"bf16": "torch.bfloat16", "fp16": "torch.float16"}


def _model_parallel(plan: Plan) -> LightningStrategy:
    """Lightning's data parallelism across groups of ``plan.model_parallel`` ranks (its configure_model
    shards or parallelizes the modules); without it every process would be a data-parallel rank."""
    return LightningStrategy("ModelParallelStrategy", (("data_parallel_size", plan.world_size),
                                                       ("tensor_parallel_size", plan.model_parallel)))


def _strategy(plan: Plan, strategy: Any, probed_zero: dict[str, Any] | None = None) -> str | LightningStrategy:
    if strategy.name == "fsdp2" or (strategy.name == "ddp" and plan.model_parallel > 1):
        return _model_parallel(plan)
    if strategy.name == "fsdp1":  # without a block the probe wrapped by size, which a small model's one unit is
        offload = (("cpu_offload", True),) if strategy.offload else ()
        if strategy.unit:
            return LightningStrategy("FSDPStrategy", (("auto_wrap_policy", Units([strategy.unit])), *offload))
        return "fsdp_cpu_offload" if offload else "fsdp"
    if strategy.is_deepspeed and probed_zero:
        # Lightning's DeepSpeed defaults are not the probe's: 200,000,000-element buckets, two of them
        # (overlap_comm), and DeepSpeed's own for ZeRO-3's prefetch and persistence. The probed values
        # as its config, which Lightning then takes whole.
        from .deepspeed import zero_section

        config = {"zero_allow_untested_optimizer": True, "zero_optimization": zero_section(strategy, None, probed_zero)}
        return LightningStrategy("DeepSpeedStrategy", (("config", config),))
    if strategy.offload is None:
        return _STRATEGY[strategy.name]
    if (strategy.name, strategy.offload) in _STRATEGY:
        return _STRATEGY[strategy.name, strategy.offload]
    return LightningStrategy("DeepSpeedStrategy", (("stage", int(strategy.name[-1])), ("offload_optimizer", True),
                                                   ("offload_parameters", strategy.offload == "params")))


def _configure_model(strategy: Any, precision: str | None) -> str:
    """What FSDP2's ``configure_model`` does under ModelParallelStrategy to train as probed."""
    policies = []
    if precision in _TORCH_DTYPE:
        dtype = _TORCH_DTYPE[precision]
        policies.append(f"mp_policy=MixedPrecisionPolicy(param_dtype={dtype}, reduce_dtype={dtype}, output_dtype={dtype})")
    if strategy.offload:
        policies.append("offload_policy=CPUOffloadPolicy()")
    # No block named: wrapped by size, as the files say (a probe names the block a model has; solve knows no model).
    unit = f"each {strategy.unit}" if strategy.unit else f"each submodule of at least {SIZE_BASED_MIN_PARAMS:,} parameters"
    said = (f"fully_shard({unit}, then the module, mesh=self.device_mesh['data_parallel']"
            + "".join(f", {p}" for p in policies) + ")")
    if precision == "fp16":  # ModelParallelStrategy refuses "16-mixed": the step's autocast is the module's own
        said += "; ModelParallelStrategy takes no precision='16-mixed': run training_step under torch.autocast('cuda', torch.float16)"
    return said


def lightning_settings(plan: Plan, *, strategy: Any = None, precision: str | None = None,
                       probed_zero: dict[str, Any] | None = None) -> dict[str, Any]:
    """``{"trainer": Trainer kwargs, "dataloader": DataLoader kwargs}`` for the plan, with the strategy
    and precision the micro batch was probed under (the batch fits only with them). Under FSDP2, a
    ``"configure_model"`` line too: what the LightningModule's ``configure_model`` applies. Under ZeRO
    with ``probed_zero`` (the ``zero_optimization`` values the probe ran with), ``DeepSpeedStrategy``
    takes them as its config; Lightning's registry names would train with its own bucket sizes.
    Any of ``strategy``, ``precision`` and ``probed_zero`` not given is read from ``plan.trained_with``.

    Example:
        >>> from autobatch.planning.plan import Plan
        >>> lightning_settings(Plan(7, 2, gpus_per_node=16))
        {'trainer': {'accumulate_grad_batches': 2, 'devices': 16, 'num_nodes': 1}, 'dataloader': {'batch_size': 7}}
    """
    found = trained_with(plan, strategy=strategy, precision=precision, probed_zero=probed_zero)
    strategy, precision, probed_zero = found.strategy, found.precision, found.probed_zero
    trainer: dict[str, Any] = {
        "accumulate_grad_batches": plan.grad_accum,
        "devices": plan.gpus_per_node,
        "num_nodes": plan.nodes,
    }
    if strategy is not None:
        trainer["strategy"] = _strategy(plan, strategy, probed_zero)
    elif plan.model_parallel > 1:  # plain data parallelism across groups of model-parallel ranks
        trainer["strategy"] = _model_parallel(plan)
    if precision in _PRECISION and not (strategy is not None and strategy.name == "fsdp2" and precision == "fp16"):
        trainer["precision"] = _PRECISION[precision]
    settings: dict[str, Any] = {"trainer": trainer, "dataloader": {"batch_size": plan.micro_batch}}
    if strategy is not None and strategy.name == "fsdp2":
        settings["configure_model"] = _configure_model(strategy, precision)
    return settings

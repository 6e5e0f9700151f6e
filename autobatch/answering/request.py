"""``Request``: what to answer, frozen, and checked whole on construction before anything runs.

A request names the model (or none: plan only), the plan's limits, the strategies, lengths and evaluation,
the device (a GPU or a simulated budget to probe, or a named GPU to estimate for), the cache policy and the
files to write. Every problem is collected and raised together as one :class:`~autobatch.errors.RequestError`,
each naming the option as the caller spelt it: ``max_micro`` from Python, ``--max-micro`` from the command line.
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch

from ..errors import AutobatchError, RequestError, option
from ..strategy import Strategy, parse_strategies, strategy_problems
from .mixed import gpu_problems, mixed_gpus, uneven_problems
from .sizes import budgets_of, per_rank_problems, size_problems, unit_problems

__all__ = ["Request", "MODES"]

MODES = ("solve", "estimate", "probe")
_POSITIVE = ("target", "gpus_per_node", "nodes", "model_parallel", "max_micro", "min_micro", "micro_batch", "multiple_of",
             "base_batch", "train_seq_len", "num_classes")
_OUTPUTS = ("deepspeed", "accelerate", "hf", "plot")
@dataclass(frozen=True, kw_only=True)
class Request:
    """What :func:`autobatch.answer` answers; every field has the name of its CLI flag in snake case.

    Model: ``model`` is a built-in name, ``hf:NAME``, ``file.py:fn`` or ``module:fn`` (as ``--model``),
    an ``nn.Module`` or a function building one (with ``make_batch(b)`` and optionally ``loss_fn``),
    a :class:`~autobatch.Workload`, or ``None``: plan only, from ``max_micro`` (``autobatch solve``).
    ``seq_len`` is one length or several (one row each); ``evaluation`` adds the evaluation batch;
    ``attention`` builds a transformers model with ``"sdpa"`` or ``"eager"`` attention.

    Plan: ``target`` (the global batch), ``gpus_per_node`` × ``nodes`` ÷ ``model_parallel`` ranks
    (default: the GPUs visible here, or the launcher's), ``max_micro``/``min_micro``/``multiple_of``
    limit the micro batch (``micro_batch`` fixes it, for a plan alone), ``base_lr``/``base_batch``
    scale the learning rate.

    Device: ``device``/``memory`` probe a GPU or the CPU against a simulated budget; ``gpu`` or ``gpu_memory``
    estimate for a named card from a fake-tensor trace (``cuda_context``: its CUDA context, default the card's
    catalogue value). ``estimate=None`` (the default) probes wherever it can and estimates where there is no
    GPU; ``True`` always estimates.
    Outputs: ``deepspeed``, ``accelerate``, ``hf`` (merged into existing files) and ``plot``.

    Example:
        >>> import autobatch
        >>> report = autobatch.answer(autobatch.Request(target=224, gpus_per_node=16, max_micro=9))
        >>> print(report.plan)
        7 per GPU × 2 accumulation × 16 GPUs (16 per node × 1 node) = 224
        >>> autobatch.Request(target=0, max_micro=4)
        Traceback (most recent call last):
        ...
        autobatch.errors.RequestError: target must be a positive integer, but got 0
    """

    # the model
    model: Any = None
    make_batch: Callable[..., Any] | None = None
    loss_fn: Callable[..., Any] | None = None
    seq_len: int | Sequence[int] | None = None
    train_seq_len: int | None = None
    evaluation: bool = False
    input_shape: str | tuple[int, ...] | None = None
    num_classes: int = 10
    trust_remote_code: bool = False
    attention: str | None = None   # transformers' attention implementation: "sdpa" or "eager"
    dtype: str = "fp32"
    optimizer: str = "adamw"
    grad_checkpointing: bool = False
    grads_held: bool = False   # gradients held into the next forward (accumulation's micro-steps)
    # the plan
    target: int | None = None
    gpus_per_node: int | None = None
    nodes: int = 1
    model_parallel: int = 1
    max_micro: int | None = None
    min_micro: int | None = None
    micro_batch: int | None = None
    multiple_of: int | None = None
    base_lr: float | None = None
    base_batch: int | None = None
    headroom: float | int | str = 0.05
    uneven: bool = False    # a plan per rank (mixed GPUs): answering/mixed.py
    strategy: str | Strategy | Sequence[Strategy] | None = None
    offload: str | None = None
    fsdp_unit: str | None = None
    # the device
    device: str | None = None
    memory: int | str | Sequence[int | str] | None = None   # one budget, or one per rank under a launcher
    gpu: str | None = None
    gpu_memory: int | str | None = None
    estimate: bool | None = None
    fragmentation: float | None = None   # None: book the traced requests through the caching allocator's model
    workspace: int | str = "64MiB"
    cuda_context: int | str | None = None   # None: the card's catalogue value
    # search and cache
    cache: bool = False
    trace_prior: bool = True
    timeout: float = 300.0
    # outputs
    deepspeed: str | os.PathLike[str] | None = None
    accelerate: str | os.PathLike[str] | None = None
    hf: str | os.PathLike[str] | None = None
    plot: str | os.PathLike[str] | None = None
    keep_auto: bool = False
    script: str = "train.py"

    def __post_init__(self) -> None:
        problems: list[str] = []
        for name in _POSITIVE:
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1):
                problems.append(f"{option(name)} must be a positive integer, but got {value!r}")
        self._check_model(problems)
        self._check_limits(problems)
        self._check_device(problems)
        self._check_rows(problems)
        self._check_outputs(problems)
        problems.extend(uneven_problems(self))
        if problems:
            raise RequestError(problems)
        self._check_plan()

    # -- derived values -------------------------------------------------------------------------

    @property
    def mode(self) -> str:
        """``"solve"`` (no model), ``"estimate"`` (a named GPU, or no GPU to probe) or ``"probe"``."""
        if self.model is None:
            return "solve"
        if self.estimate or (self.estimate is None and self.device is None and self.memory is None
                             and not torch.cuda.is_available()):
            return "estimate"
        return "probe"

    @property
    def strategies(self) -> tuple[Strategy, ...] | None:
        """The strategies asked for, parsed; ``None`` without ``strategy``."""
        if self.strategy is None:
            return None
        if isinstance(self.strategy, Strategy):
            return (self.strategy,)
        if not isinstance(self.strategy, str):
            return tuple(self.strategy)
        return tuple(parse_strategies(self.strategy, offload=self.offload, unit=self.fsdp_unit))

    @property
    def lengths(self) -> tuple[int, ...] | None:
        """``seq_len`` as a tuple of distinct lengths, or ``None``."""
        if self.seq_len is None:
            return None
        given = (self.seq_len,) if isinstance(self.seq_len, numbers.Integral) else tuple(self.seq_len)
        return tuple(dict.fromkeys(given))

    @property
    def one_length(self) -> int | None:
        """The sequence length of a request with one row (the first given), or ``None`` for the model's own."""
        return self.lengths[0] if self.lengths else None

    @property
    def precision(self) -> str | None:
        """The precision the batch is probed with: autocast ``"bf16"``/``"fp16"``, pure weights
        ``"bf16-true"``/``"fp16-true"``, or ``None`` for full fp32."""
        dtype = str(self.dtype).lower().replace("torch.", "")
        return {"bfloat16": "bf16", "float16": "fp16"}.get(dtype, dtype if dtype in ("bf16", "fp16", "bf16-true", "fp16-true") else None)

    @property
    def table(self) -> bool:
        """One row per length (several lengths, or the evaluation batch too)."""
        return bool(self.lengths and len(self.lengths) > 1) or self.evaluation

    def memory_of(self, rank: int) -> int | str | None:
        """Rank ``rank``'s simulated budget ("60MiB,40MiB": rank r takes the r-th), or ``None`` on a real GPU."""
        budgets = budgets_of(self.memory)
        return None if budgets is None else budgets[0] if len(budgets) == 1 else budgets[rank]

    @property
    def launched(self) -> bool:
        from ..distributed.launch import is_launched

        return self.mode == "probe" and is_launched()

    def gpus_here(self) -> int:
        """GPUs per node the plan takes: as given, else the launcher's, else the GPUs visible here (1 on a CPU)."""
        if self.gpus_per_node is not None:
            return self.gpus_per_node
        if self.mode != "probe":
            mix = mixed_gpus(self) if self.mode == "estimate" else None
            return 1 if mix is None else sum(n for _, n in mix) // self.nodes
        if self.launched:
            from ..distributed.launch import rank_env

            return rank_env().local_world_size
        on_cuda = self.memory is None and (self.device or "cuda").startswith("cuda")
        return max(1, torch.cuda.device_count()) if on_cuda and torch.cuda.is_available() else 1

    def planning(self) -> dict[str, Any]:
        """The keyword arguments every planner takes."""
        return dict(target=self.target, nodes=self.nodes, model_parallel=self.model_parallel,
                    multiple_of=self.multiple_of, base_lr=self.base_lr, base_batch=self.base_batch)

    def load_options(self, seq_len: int | None) -> dict[str, Any]:
        """The keyword arguments of :func:`autobatch.load_model` for a model named by a string."""
        from ..probing.workload import weights_dtype

        return dict(seq_len=seq_len, input_shape=self.input_shape, num_classes=self.num_classes,
                    trust_remote_code=self.trust_remote_code, attention=self.attention, weights=weights_dtype(self.dtype))

    def settings(self) -> dict[str, Any]:
        """The training settings of the workload."""
        return dict(optimizer=self.optimizer, dtype=self.dtype, grad_checkpointing=self.grad_checkpointing,
                    grads_held=self.grads_held)

    def outputs(self) -> dict[str, Any]:
        return dict(deepspeed=self.deepspeed, accelerate=self.accelerate, hf=self.hf)

    def to_dict(self) -> dict[str, Any]:
        """The request's plain values (the model by name): what a report was asked."""
        def plain(value: Any) -> Any:
            if value is None or isinstance(value, (str, int, float, bool)):
                return value
            return [plain(v) for v in value] if isinstance(value, (list, tuple)) else (
                getattr(value, "name", None) or type(value).__name__)

        return {f.name: plain(getattr(self, f.name)) for f in fields(self)}

    # -- checks ---------------------------------------------------------------------------------

    def _check_model(self, problems: list[str]) -> None:
        from ..probing.workload import DTYPES, OPTIMIZERS, Workload

        if self.model is None:
            if self.target is None:
                problems.append(f"a plan without a model needs {option('target')} (the global batch)")
            for name in ("seq_len", "evaluation", "plot", "memory", "device", "gpu", "gpu_memory"):
                if getattr(self, name) not in (None, False):
                    problems.append(f"{option(name)} describes a probe or an estimate, which needs {option('model')}")
            return
        if isinstance(self.model, (str, Workload)) and self.make_batch is not None:
            problems.append(f"{option('make_batch')} is for a model passed as an object, but "
                            f"{self.model if isinstance(self.model, str) else 'a Workload'!r} brings its own batches; "
                            f"drop {option('make_batch')}, or pass the nn.Module itself")
        if not isinstance(self.model, (str, Workload)) and self.make_batch is None:
            problems.append(f"a model passed as an object needs {option('make_batch')}(b), which builds a batch of "
                            f"b samples; or pass {option('model')} as a name (e.g. 'tiny-gpt2')")
        if isinstance(self.model, str) and not self.model.strip():
            problems.append(f"{option('model')} must name a model, but got {self.model!r}; see `autobatch models`")
        if not isinstance(self.dtype, torch.dtype) and str(self.dtype).lower() not in DTYPES:
            problems.append(f"{option('dtype')} must be one of fp32, bf16, fp16, bf16-true, fp16-true, but got {self.dtype!r}")
        if isinstance(self.optimizer, str) and self.optimizer.lower() not in OPTIMIZERS:
            problems.append(f"{option('optimizer')} must be one of {', '.join(OPTIMIZERS)}, but got {self.optimizer!r}")

    def _check_limits(self, problems: list[str]) -> None:
        from ..probing.probe import resolve_headroom
        from ..probing.search import HARD_MAX_BATCH

        if self.micro_batch is not None and self.model is not None:
            problems.append(f"{option('micro_batch')} fixes the micro batch of a plan alone, but a probe measures it; "
                            f"drop {option('micro_batch')}, or cap the probe with {option('max_micro')}")
        if self.micro_batch is not None and (self.max_micro is not None or self.min_micro is not None):
            problems.append(f"{option('micro_batch')} fixes the micro batch, so {option('max_micro')} and "
                            f"{option('min_micro')} have nothing to limit; pass {option('micro_batch')} alone")
        if self.model is not None and self.min_micro is not None and self.min_micro > HARD_MAX_BATCH:
            problems.append(f"{option('min_micro')} must be at most {HARD_MAX_BATCH:,} (the largest batch a probe "
                            f"tries), but got {self.min_micro}; give the smallest micro batch the model trains at")
        if self.min_micro is not None and self.max_micro is not None and self.max_micro < self.min_micro:
            problems.append(f"{option('max_micro')} ({self.max_micro}) must be at least {option('min_micro')} "
                            f"({self.min_micro}); raise {option('max_micro')} or lower {option('min_micro')}")
        try:
            resolve_headroom(self.headroom, 1 << 62)
        except (AutobatchError, ValueError, TypeError):
            problems.append(f"{option('headroom')} must be a fraction in [0, 1) (0.05), a percentage (5%) or a "
                            f"size (2GiB), but got {self.headroom!r}")
        if self.base_lr is not None and (isinstance(self.base_lr, bool) or not isinstance(self.base_lr, numbers.Real)
                                         or not math.isfinite(self.base_lr) or self.base_lr <= 0):
            problems.append(f"{option('base_lr')} must be a positive number, but got {self.base_lr!r}; pass e.g. 3e-4")
        if isinstance(self.timeout, bool) or not isinstance(self.timeout, numbers.Real) or not self.timeout > 0 \
                or not math.isfinite(self.timeout):
            problems.append(f"{option('timeout')} must be a positive number of seconds, but got {self.timeout!r}")

    def _check_device(self, problems: list[str]) -> None:
        budgets = budgets_of(self.memory) or ()
        if len(budgets) > 1:
            problems.extend(per_rank_problems(self.memory, len(budgets), self.launched))
        problems.extend(unit_problems([*(("memory", b) for b in budgets), ("gpu_memory", self.gpu_memory),
                                       ("workspace", self.workspace), ("cuda_context", self.cuda_context)]))
        for i, budget in enumerate(budgets or (None,)):
            problems.extend(size_problems(budget, self.gpu_memory if i == 0 else None))
        if self.fragmentation is not None and (not isinstance(self.fragmentation, numbers.Real)
                                               or not math.isfinite(self.fragmentation) or self.fragmentation < 1):
            problems.append(f"{option('fragmentation')} is reserved ÷ allocated memory and must be a finite number "
                            f"≥ 1, but got {self.fragmentation!r}; use e.g. 1.10")
        if self.gpu is not None and self.gpu_memory is not None:
            problems.append(f"{option('gpu')} {self.gpu} and {option('gpu_memory')} {self.gpu_memory} both name the "
                            "GPU to estimate for; pass one")
        named = "gpu" if self.gpu is not None else "gpu_memory" if self.gpu_memory is not None else None
        if self.model is not None and self.mode == "probe" and named is not None:
            where = (f"{option('device')} {self.device}" if self.device is not None
                     else f"the CPU against {option('memory')} {self.memory}" if self.memory is not None
                     else "the CUDA GPU here" if torch.cuda.is_available() else "a CUDA GPU (there is none here)")
            problems.append(f"{option(named)} names a GPU to estimate for, but find probes {where} with real steps; "
                            f"drop {option(named)}, or estimate (`autobatch estimate`; from Python, "
                            "Request(..., estimate=True))")
        if self.estimate and (self.device is not None or self.memory is not None):
            problems.append(f"an estimate traces on fake tensors for a named GPU, so {option('device')} and "
                            f"{option('memory')} do not apply; drop them, or probe with `autobatch find`")
        problems.extend(gpu_problems(self))
        if self.launched and self.device is not None and self.device.startswith("cuda:"):
            problems.append(f"under a launcher every rank probes its own GPU (LOCAL_RANK), but {option('device')} "
                            f"names {self.device} for all of them; drop {option('device')}")

    def _check_rows(self, problems: list[str]) -> None:
        try:
            strategies = self.strategies
        except AutobatchError as exc:
            problems.append(str(exc))
            strategies = None
        given = [name for name in ("offload", "fsdp_unit") if getattr(self, name) is not None]
        if self.strategy is None and given:
            problems.append(f"{' and '.join(option(n) for n in given)} describe{'s' if len(given) == 1 else ''} a "
                            f"sharded strategy, but no {option('strategy')} was given; add {option('strategy')} "
                            f"{'zero3' if given == ['offload'] else 'fsdp2'}")
        problems.extend(strategy_problems(strategies or (), grads_held=self.grads_held, dtype=str(self.dtype),
                        probed=self.model is not None, deepspeed=self.deepspeed, unsharded=self.strategy is None))
        lengths = self.lengths
        if lengths is not None and any(isinstance(s, bool) or not isinstance(s, numbers.Integral) or s < 1
                                       for s in lengths):
            problems.append(f"{option('seq_len')} must be one positive integer or several, but got {self.seq_len!r}; "
                            "e.g. 1024, or (256, 512, 1024)")
            return
        if self.train_seq_len is not None and self.train_seq_len not in (lengths or ()):
            problems.append(f"{option('train_seq_len')} must be one of the {option('seq_len')} values "
                            f"({', '.join(map(str, lengths or ())) or 'none given'}), but got {self.train_seq_len}; "
                            f"add it to {option('seq_len')}")
        many = strategies is not None and len(strategies) > 1
        if self.model is None and many:
            problems.append(f"a plan writes configs for one strategy, but {option('strategy')} names "
                            f"{len(strategies)}; pass one")
        elif many and any(getattr(self, name) is not None for name in _OUTPUTS):
            problems.append(f"configs and plots are written for one strategy, but {option('strategy')} names "
                            f"{len(strategies)}; compare them first, then run again with the one you pick")
        if self.table and strategies is not None:
            drop = f"drop {option('evaluation')} and " if self.evaluation else ""
            problems.append(f"{option('strategy')} probes one sequence length for training; {drop}pass one "
                            f"{option('seq_len')}")
        if self.table and self.plot is not None:
            problems.append(f"{option('plot')} draws one probe's memory curve; with several {option('seq_len')} values "
                            f"or {option('evaluation')} there is no single curve to draw: drop {option('plot')}")
        if self.launched and self.table:
            problems.append(f"several {option('seq_len')} values and {option('evaluation')} probe one device; run "
                            "without a launcher (or one length per launched run)")
        if self.launched and many:
            problems.append(f"under a launcher every rank trains one strategy, but {option('strategy')} names "
                            f"{len(strategies)}; compare them without the launcher (one process answers for "
                            f"{option('gpus_per_node')} N ranks), then launch with the one you pick")

    def _check_outputs(self, problems: list[str]) -> None:
        from ..checking.outputs import output_problems
        from ..configs import check_plan_outputs

        if self.mode == "estimate" and self.plot is not None:
            problems.append(f"{option('plot')} draws the trials of a probe, and an estimate runs none (no CUDA GPU "
                            f"here, or a named GPU); drop {option('plot')}, or run find on the GPU machine")
        if self.mode == "estimate" and self.target is None and any(getattr(self, n) for n in ("deepspeed", "accelerate", "hf")):
            problems.append(f"{option('deepspeed')}, {option('accelerate')} and {option('hf')} write a plan, which "
                            f"needs {option('target')} (the global batch); add {option('target')} N")
        problems.extend(output_problems({name: getattr(self, name) for name in _OUTPUTS}, self.strategies, self.precision,
                                        probed=self.model is not None, checkpointing=bool(self.grad_checkpointing),
                                        simulated=self.memory is not None))
        try:
            check_plan_outputs(**self.outputs())
        except AutobatchError as exc:
            problems.append(str(exc))
        if self.plot is not None:
            from ..tuning.plot import check_plot_path

            try:
                check_plot_path(self.plot)
            except AutobatchError as exc:
                problems.append(str(exc))

    def _check_plan(self) -> None:
        """A target no micro batch reaches on these ranks is known now, not after the probe."""
        from ..planning.solver import check_request

        if self.model is None:
            return  # solve() itself says it, with the nearest plans
        check_request(None if self.uneven else self.target, self.gpus_here(), self.nodes,
                      min_micro=self.min_micro or 1, multiple_of=self.multiple_of, model_parallel=self.model_parallel)


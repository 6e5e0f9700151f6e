"""DeepSpeed ZeRO-1/2/3 around a probe's model: an explicit config, sized from the model, and the engine.

The config is explicit because DeepSpeed's defaults are not the model's: its default
``reduce_bucket_size`` (5e8 elements) alone is a ~1.9 GiB fp32 buffer on every rank, whatever
the model. Bucket sizes come from the user's DeepSpeed file where it sets them, else from the
model as HF Trainer fills ``"auto"``: ``reduce_bucket_size = hidden²``, and for ZeRO-3
``stage3_prefetch_bucket_size = 0.9·hidden²`` and ``stage3_param_persistence_threshold =
10·hidden``. The engine then allocates what it allocates, and the probe measures it.

The optimizer is the workload's own torch optimizer (``zero_allow_untested_optimizer``), so no
DeepSpeed op is compiled (``fused_adam``, ``cpu_adam``); the CPU's shared-memory collective op
is not built either (gloo or the fake group carry the collectives).
"""

from __future__ import annotations

import copy
import logging
import os
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, redirect_stdout
from typing import TYPE_CHECKING, Any

import torch

from ..errors import AutobatchError, MissingDependencyError
from ..probing.workload import Workload, make_optimizer, resolve_dtype
from ..strategy import Strategy
from .fence import groups_made_since, live_groups

if TYPE_CHECKING:
    from .sharding import Wrapped

__all__ = ["hidden_size", "auto_bucket_sizes", "zero_config", "engine_dtype", "wrap_deepspeed", "BUCKET_KEYS"]

BUCKET_KEYS = ("reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size",
               "stage3_param_persistence_threshold", "stage3_max_live_parameters", "stage3_max_reuse_distance")


def hidden_size(model: torch.nn.Module) -> int | None:
    """The model's hidden size: its config's ``hidden_size`` (HF's rule), else the widest ``Linear`` input."""
    config = getattr(model, "config", None)
    for key in ("hidden_size", "n_embd", "d_model"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    sizes = getattr(config, "hidden_sizes", None)
    if sizes:
        return max(sizes)
    widths = [m.in_features for m in model.modules() if isinstance(m, torch.nn.Linear)]
    return max(widths) if widths else None


def auto_bucket_sizes(model: torch.nn.Module, stage: int) -> dict[str, int]:
    """The bucket sizes HF Trainer writes for ``"auto"``, from the model's hidden size.

    Example:
        >>> auto_bucket_sizes(torch.nn.Linear(64, 8), 3)
        {'reduce_bucket_size': 4096, 'stage3_prefetch_bucket_size': 3686, 'stage3_param_persistence_threshold': 640}
    """
    hidden = hidden_size(model)
    if hidden is None:
        return {}
    sizes = {"reduce_bucket_size": hidden * hidden}
    if stage == 3:
        sizes["stage3_prefetch_bucket_size"] = int(0.9 * hidden * hidden)
        sizes["stage3_param_persistence_threshold"] = 10 * hidden
    return sizes


def zero_config(model: torch.nn.Module, strategy: Strategy, *, batch: int, world_size: int,
                dtype: str | torch.dtype | None = None, user_config: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The DeepSpeed config a probe trains ``model`` with under ``strategy``.

    The user's ``zero_optimization`` keys are kept (numbers only: ``"auto"`` is filled from the
    model); the stage and offload are the strategy's; batch keys are the trial's.
    """
    stage = strategy.zero_stage
    if stage is None:
        raise AutobatchError(f"a DeepSpeed config needs a ZeRO strategy, but got {strategy.name}")
    user_zero = dict((user_config or {}).get("zero_optimization") or {})
    zero: dict[str, Any] = {k: v for k, v in user_zero.items() if v != "auto" and not k.startswith("offload_")}
    for key, value in auto_bucket_sizes(model, stage).items():
        zero.setdefault(key, value)
    zero["stage"] = stage
    if strategy.offload in ("optimizer", "params"):
        zero["offload_optimizer"] = {"device": "cpu"}
    if strategy.offload == "params":
        zero["offload_param"] = {"device": "cpu"}
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": 1,
        "train_batch_size": batch * world_size,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    precision = resolve_dtype(dtype)
    if precision == torch.bfloat16:
        config["bf16"] = {"enabled": True}
    elif precision == torch.float16:
        config["fp16"] = {"enabled": True, "initial_scale_power": 8}
    return config


def engine_dtype(config: Mapping[str, Any]) -> torch.dtype | None:
    """The dtype a DeepSpeed config (as :func:`zero_config` writes it) trains its engine in (``None``: fp32,
    or no DeepSpeed config)."""
    for key, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        if (config.get(key) or {}).get("enabled"):
            return dtype
    return None


def _deepspeed() -> Any:
    if "deepspeed" in sys.modules:
        return sys.modules["deepspeed"]
    logger = logging.getLogger("DeepSpeed")
    before, stdout = list(logger.handlers), sys.stdout
    # On a machine without a GPU DeepSpeed warns at import that it fell back to the CPU ("If you
    # have GPU … we were unable to detect it"): that is where a simulated budget or a fake-tensor
    # trace runs on purpose, so the warning would only alarm. Dropped for the import alone.
    logger.addFilter(_cpu_fallback_note)
    try:
        # DeepSpeed logs to stdout at import; stdout may be `--json`'s one object: the import logs
        # to stderr, then its handler is put back on stdout.
        with redirect_stdout(sys.stderr):
            import deepspeed
    except ImportError:
        raise MissingDependencyError(
            "probing a ZeRO strategy needs deepspeed, which is not installed; pip install 'autobatch[deepspeed]'"
        ) from None
    finally:
        logger.removeFilter(_cpu_fallback_note)
    for handler in logger.handlers:
        if handler not in before and isinstance(handler, logging.StreamHandler) and handler.stream is sys.stderr:
            handler.setStream(stdout)
    return deepspeed


def _cpu_fallback_note(record: logging.LogRecord) -> bool:
    return "Setting accelerator to CPU" not in record.getMessage()


@contextmanager
def _logs_on_stderr() -> Iterator[None]:
    """DeepSpeed's stdout handlers write to stderr meanwhile (stdout may carry ``--json``), then as before."""
    logger = logging.getLogger("DeepSpeed")
    moved = [h for h in logger.handlers if isinstance(h, logging.StreamHandler) and h.stream is sys.stdout]
    for handler in moved:
        handler.setStream(sys.stderr)
    try:
        yield
    finally:
        for handler in moved:
            handler.setStream(sys.stdout)


@contextmanager
def _no_shm_comm() -> Any:
    # DeepSpeed's CPU backend compiles a shared-memory collective op (minutes) on first use;
    # gloo or the fake group carry the probe's collectives, so skip it for the engine's setup.
    module = sys.modules.get("deepspeed.comm.torch")
    saved = getattr(module, "build_shm_op", None)
    if module is not None and saved is not None:
        module.build_shm_op = lambda: None  # type: ignore[attr-defined]
    try:
        yield
    finally:
        if module is not None and saved is not None:
            module.build_shm_op = saved  # type: ignore[attr-defined]


@contextmanager
def _stays_on(model: torch.nn.Module, device: torch.device) -> Iterator[None]:
    """The engine's ``module.to(device)`` is skipped for the trial's copy when it is there already.

    A fake tensor (a trace of the step, no memory) cannot be moved in place by ``Module.to``,
    which swaps it; a copy already on the device needs no move.
    """
    if any(t.device != device for t in [*model.parameters(), *model.buffers()]):
        yield
        return
    model.to = lambda *args, **kwargs: model  # type: ignore[method-assign]
    try:
        yield
    finally:
        del model.to


_RANK_CHECKS = ("assert_ints_same_as_other_ranks", "assert_lst_len_same_as_other_ranks")


def _skipped(*args: Any, **kwargs: Any) -> None:
    return None


class _Globals:
    """DeepSpeed state kept in module globals, put back as it was when the wrapper closes.

    It caches the groups it makes (its world group first); a cached group outlives the process
    group it belongs to (the fake group of one probe), so the next engine would use a dead one.
    ZeRO-3 also leaves the root module on its forward stack, and its parameter coordinator in a
    class-level ``lru_cache``; either keeps the whole engine (and its optimizer state) alive after
    the trial. And it replaces ``torch.nn.functional.linear`` with its own for good ("This will
    persist unless manually reset"): every later step in the process, of any strategy and of the
    user's own training, would run DeepSpeed's linear.
    """

    def __init__(self) -> None:
        from deepspeed.runtime.zero import parameter_offload
        from deepspeed.utils import groups

        self.groups = groups
        self.mpu = getattr(groups, "mpu", None)  # the engine sets it from its mpu argument
        self.saved = {k: copy.copy(v) for k, v in vars(groups).items()
                      if k.startswith("_") and k[1:2].isupper() and (v is None or isinstance(v, dict))}
        self.stack = getattr(parameter_offload, "FWD_MODULE_STACK", None)
        self.depth = len(self.stack) if isinstance(self.stack, list) else 0
        self.cuda_device: int | None = None  # the caller's current GPU, set back when the trial ends
        self.checks: list[tuple[Any, str, Any]] = []
        self.groups_before = set(live_groups())  # the groups DeepSpeed makes are destroyed with the trial
        self.local_rank = os.environ.get("LOCAL_RANK")
        self.linear = torch.nn.functional.linear  # ZeRO-3 replaces it while its engine trains
        self.accelerator: list[tuple[Any, str]] = []  # the CPU accelerator's methods as they were, where replaced

    def gpu_apart(self, device: torch.device) -> None:
        """On a trace whose host is apart (``cpu:0``, see :func:`~autobatch.estimating.fake_backends.fake_backend`),
        DeepSpeed's CPU accelerator names ``cpu:0`` as its device until :meth:`destroy`: what the engine
        keeps on its device goes there, what it offloads to ``cpu``, the host, as from a GPU."""
        from .sharding import host_apart

        if not host_apart(device):
            return
        from deepspeed.accelerator import get_accelerator

        accelerator, name = get_accelerator(), str(device)
        for method, stand_in in (("device_name", lambda device_index=None: name), ("current_device_name", lambda: name)):
            self.accelerator.append((accelerator, method))
            setattr(accelerator, method, stand_in)

    def fp16_on_host(self, device: torch.device, config: Mapping[str, Any]) -> None:
        """DeepSpeed's CPU accelerator says fp16 is unsupported, and ``initialize`` refuses an fp16 config
        on it ("Type fp16 is not supported on your device"). On a GPU it is: where the step runs on the
        CPU to stand for one (a simulated budget, a fake-tensor trace), the accelerator says so until
        :meth:`destroy`, and the engine builds the fp16 path the GPU would run (loss scaler, fp32 master)."""
        if device.type == "cuda" or engine_dtype(config) != torch.float16:
            return
        from deepspeed.accelerator import get_accelerator

        accelerator = get_accelerator()
        if accelerator.is_fp16_supported():
            return
        self.accelerator.append((accelerator, "is_fp16_supported"))
        accelerator.is_fp16_supported = lambda: True

    def set_local_rank(self, device: torch.device) -> None:
        """DeepSpeed takes ``LOCAL_RANK`` for its device (``set_device(LOCAL_RANK)``): the GPU probed,
        whatever the launcher set (srun and mpirun set none); put back as it was by :meth:`destroy`."""
        if device.type == "cuda":
            os.environ["LOCAL_RANK"] = str(device.index if device.index is not None else torch.cuda.current_device())
        elif self.local_rank is None:
            from .environment import rank_env

            os.environ["LOCAL_RANK"] = str(rank_env().local_rank)

    def skip_rank_checks(self) -> None:
        """On the fake group, DeepSpeed's "same on every rank" checks compare rank 0 with itself:
        they read broadcast values, which a fake-tensor trace does not have. Skip them until
        :meth:`destroy` (every module that imported them, as it was)."""
        for name, module in list(sys.modules.items()):
            if name.split(".")[0] != "deepspeed" or module is None:
                continue
            for check in _RANK_CHECKS:
                original = vars(module).get(check)
                if callable(original):
                    self.checks.append((module, check, original))
                    setattr(module, check, _skipped)

    def destroy(self) -> None:
        torch.nn.functional.linear = self.linear
        for accelerator, method in self.accelerator:
            vars(accelerator).pop(method, None)  # the class's own method again
        self.accelerator.clear()
        if self.local_rank is None:
            os.environ.pop("LOCAL_RANK", None)
        else:
            os.environ["LOCAL_RANK"] = self.local_rank
        import torch.distributed as dist

        # Each engine makes its own world group (on NCCL a communicator, whose buffers sit outside
        # torch's statistics): left alive, every later trial would have one more.
        for group in groups_made_since(self.groups_before):
            dist.destroy_process_group(group)
        for module, check, original in self.checks:
            setattr(module, check, original)
        self.checks.clear()
        if self.cuda_device is not None:
            torch.cuda.set_device(self.cuda_device)
        for key, value in self.saved.items():
            setattr(self.groups, key, copy.copy(value))
        self.groups.mpu = self.mpu
        if isinstance(self.stack, list):
            del self.stack[self.depth:]
        from deepspeed.runtime.zero import partitioned_param_coordinator as coordinator

        cls = getattr(coordinator, "PartitionedParameterCoordinator", None)
        method = getattr(cls, "_PartitionedParameterCoordinator__params_to_release", None)
        # The cache sits under a profiling wrapper: look through __wrapped__ and closure cells.
        for candidate in (method, getattr(method, "__wrapped__", None),
                          *(cell.cell_contents for cell in getattr(method, "__closure__", None) or ())):
            if hasattr(candidate, "cache_clear"):
                candidate.cache_clear()


class _DataParallelOnly:
    """DeepSpeed's ``mpu`` for data parallelism over one process group, no model parallelism.

    Without an ``mpu``, ZeRO-3 partitions parameters over the default group; a trial under a
    launcher must run all its collectives on its own group (:mod:`autobatch.distributed.fence`).
    """

    def __init__(self, group: Any) -> None:
        import torch.distributed as dist

        self.group, self.world, self.rank = group, dist.get_world_size(group), dist.get_rank(group)

    def get_data_parallel_group(self) -> Any:
        return self.group

    def get_data_parallel_world_size(self) -> int:
        return self.world

    def get_data_parallel_rank(self) -> int:
        return self.rank

    def get_model_parallel_group(self) -> None:
        return None

    def get_model_parallel_world_size(self) -> int:
        return 1

    def get_model_parallel_rank(self) -> int:
        return 0


def wrap_deepspeed(model: torch.nn.Module, strategy: Strategy, workload: Workload, device: torch.device, *,
                   batch: int, user_config: Mapping[str, Any] | None = None, group: Any = None) -> Wrapped:
    """``deepspeed.initialize`` on ``model`` with :func:`zero_config` and the workload's torch optimizer."""
    import torch.distributed as dist

    from .sharding import Wrapped

    deepspeed = _deepspeed()
    import deepspeed.comm.torch  # noqa: F401 - loaded so its op builder can be skipped

    config = zero_config(model, strategy, batch=batch, world_size=dist.get_world_size(), dtype=workload.dtype,
                         user_config=user_config)
    saved_globals = _Globals()
    saved_globals.set_local_rank(device)
    saved_globals.gpu_apart(device)
    saved_globals.fp16_on_host(device, config)
    if dist.get_backend() == "fake":
        saved_globals.skip_rank_checks()
    mpu = None if group is None else _DataParallelOnly(group)
    logger = logging.getLogger("DeepSpeed")
    level = logger.level
    logger.setLevel(logging.ERROR)  # it logs its whole config at INFO on every initialize
    try:
        if device.type == "cuda":  # deepspeed.initialize takes the current GPU as the engine's
            saved_globals.cuda_device = torch.cuda.current_device()
            torch.cuda.set_device(device)
        optimizer = make_optimizer(workload.optimizer, [p for p in model.parameters() if p.requires_grad])
        with _no_shm_comm(), _logs_on_stderr(), _stays_on(model, device):
            engine, ds_optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, mpu=mpu)
    except BaseException:
        saved_globals.destroy()  # out of memory while the engine was built: nothing of it stays
        raise
    finally:
        logger.setLevel(level)

    def step() -> None:
        engine.step()

    return Wrapped(engine, ds_optimizer, engine.backward, step, config=config, _keep=[engine, saved_globals])

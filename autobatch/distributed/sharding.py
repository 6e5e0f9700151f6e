"""Wrap a model the way a strategy trains it: DDP, FSDP2 (``fully_shard``), FSDP1, or DeepSpeed ZeRO.

:func:`wrap_model` takes a private copy of the model (the probe never wraps the user's own
module) inside an initialized process group — a real one under a launcher, or the fake group of
:mod:`~autobatch.distributed.fake_group` for one rank of a simulated world — and returns a
:class:`Wrapped`: the module to call, how to run backward and the optimizer step, and a
``close()`` that drops everything. FSDP wraps one unit per transformer block plus the root, as
HF Trainer and accelerate do; DeepSpeed goes through :mod:`~autobatch.distributed.zero`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist

from ..errors import AutobatchError
from ..probing.workload import Workload, make_optimizer, resolve_dtype
from ..strategy import SIZE_BASED_MIN_PARAMS, Strategy

__all__ = ["Wrapped", "wrap_model", "fsdp_units", "with_unit", "local_tensor", "local_bytes", "is_fake", "host_apart"]


@dataclass
class Wrapped:
    """A model wrapped for training under a strategy, and its optimizer."""

    module: torch.nn.Module
    optimizer: Any
    backward: Callable[[torch.Tensor], None]
    step: Callable[[], None]
    config: dict[str, Any] = field(default_factory=dict)   # DeepSpeed's config, buckets included
    units: int = 0                                          # FSDP units besides the root
    _keep: list[Any] = field(default_factory=list)

    def close(self) -> None:
        """Drop the wrapper, its optimizer and its buffers; the caller collects them (one
        ``gc.collect()`` once its own references are gone, while the group lives)."""
        for item in self._keep:
            destroy = getattr(item, "destroy", None)
            if callable(destroy):
                destroy()
        self._keep.clear()
        self.module = self.optimizer = None  # type: ignore[assignment]
        self.backward = self.step = None  # type: ignore[assignment]


def _to(model: torch.nn.Module, device: torch.device) -> None:
    """``model.to(device)``, skipped when every tensor is there already (fake tensors cannot be swapped in place)."""
    if any(t.device != device for t in [*model.parameters(), *model.buffers()]):
        model.to(device)


def _fsdp2_precision(workload: Workload) -> Any:
    """FSDP2's mixed precision as accelerate, Lightning and the HF Trainer set it for a bf16 or fp16
    run: parameters gathered, and gradients reduced, in that dtype (``MixedPrecisionPolicy``; see
    :func:`_fsdp1_precision`). fp32: torch's default policy."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    dtype = resolve_dtype(workload.dtype)
    if dtype is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype, output_dtype=dtype)


def _fsdp1_precision(workload: Workload) -> Any:
    """FSDP1's ``MixedPrecision`` for a bf16 or fp16 run, as the frameworks that launch it set it
    (accelerate's ``FullyShardedDataParallelPlugin.set_mixed_precision``, Lightning's
    ``FSDPPrecision.mixed_precision_config``): parameters, gradient reduction and buffers in that
    dtype, beside the autocast of the step. Without it, autocast's bf16 copies of the gathered fp32
    weights are saved for backward, where FSDP cannot free them: about two bytes per parameter of
    the whole model on every rank (gpt2 at 512 tokens, 8 ranks: 324 MiB more at batch 4)."""
    dtype = resolve_dtype(workload.dtype)
    if dtype is None:
        return None
    from torch.distributed.fsdp import MixedPrecision

    return MixedPrecision(param_dtype=dtype, reduce_dtype=dtype, buffer_dtype=dtype)


@contextmanager
def _fsdp2_offload(strategy: Strategy, device: torch.device, model: torch.nn.Module) -> Iterator[Any]:
    """FSDP2's offload policy while it wraps: ``CPUOffloadPolicy`` for ``offload="params"`` (the sharded
    parameters, their gradients and the optimizer step on the host), else none.

    In a trace whose host is apart (``device`` is ``cpu:0``: see
    :func:`~autobatch.estimating.fake_backends.fake_backend`), FSDP2 computes on the mesh's device,
    which for a CPU mesh is ``cpu``, the host itself: it is told ``cpu:0`` instead, so what it gathers
    and computes is the device's and what it offloads is the host's. Fake tensors cannot be pinned;
    pinning moves no bytes onto the device."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    if strategy.offload is None:
        yield OffloadPolicy()
        return
    policy = CPUOffloadPolicy(pin_memory=not any(is_fake(p) for p in model.parameters()))
    if not host_apart(device):
        yield policy
        return
    from torch.distributed.fsdp._fully_shard import _fully_shard

    with _replaced(_fully_shard, "_get_device_from_mesh", lambda mesh: device):
        yield policy


def host_apart(device: torch.device) -> bool:
    """Whether ``device`` is a trace's GPU apart from its host (``cpu:0``, where the host is ``cpu``:
    see :func:`~autobatch.estimating.fake_backends.fake_backend`)."""
    return device.type == "cpu" and device.index is not None


@contextmanager
def _replaced(owner: Any, name: str, value: Any) -> Iterator[None]:
    """``owner.name`` is ``value`` inside, and what it was again after."""
    before = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, before)


def _fsdp1_offload(strategy: Strategy) -> Any:
    """FSDP1's ``CPUOffload(offload_params=True)`` for ``offload="params"`` (the flat shards, their
    gradients and the optimizer step on the host), else none."""
    if strategy.offload is None:
        return None
    from torch.distributed.fsdp import CPUOffload

    return CPUOffload(offload_params=True)


class _HostApartFsdp1:
    """What FSDP1's CPU offload needs to run on fake tensors whose GPU is ``cpu:0`` and host ``cpu``.

    FSDP1 takes its compute device from the module, or from the device handle where the module is
    on a CPU: ``cpu``, the host; while it wraps, it is told ``cpu:0``. It then moves its flat
    parameter between the two by ``flat_param.data = ...``, which on a fake tensor keeps the old
    device: a fake tensor's ``.data`` takes its new data's device while the wrapper lives, as a
    real tensor's does. It pins its host shards (a fake tensor cannot be pinned; pinning moves no
    bytes onto the GPU) and waits on the CPU stream once backward ends (``synchronize``, which the
    CPU stream lacks; a trace has nothing in flight). Each goes back when the wrapper is closed.
    """

    def __init__(self, device: torch.device):
        from torch._subclasses.fake_tensor import FakeTensor

        self.device = device
        base = torch._C.TensorBase.data
        pin = torch.Tensor.pin_memory

        def set_data(tensor: Any, value: Any) -> None:
            base.__set__(tensor, value)
            if isinstance(value, FakeTensor):
                tensor.fake_device = value.fake_device

        def pinned(tensor: Any, *args: Any, **kwargs: Any) -> Any:
            return tensor if isinstance(tensor, FakeTensor) else pin(tensor, *args, **kwargs)

        FakeTensor.data = property(base.__get__, set_data)  # type: ignore[method-assign,assignment]
        torch.Tensor.pin_memory = pinned  # type: ignore[method-assign]
        self._restore = [lambda: delattr(FakeTensor, "data"), lambda: setattr(torch.Tensor, "pin_memory", pin)]
        if "synchronize" not in vars(torch.cpu.Stream):
            torch.cpu.Stream.synchronize = lambda stream: None  # type: ignore[attr-defined]
            self._restore.append(lambda: delattr(torch.cpu.Stream, "synchronize"))

    def wrapping(self) -> Any:
        """While FSDP1 wraps: it computes on ``cpu:0``."""
        from torch.distributed.fsdp import _init_utils

        return _replaced(_init_utils, "_get_compute_device", lambda *args, **kwargs: self.device)

    def destroy(self) -> None:
        for restore in self._restore:
            restore()
        self._restore = []


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The part of a parameter this rank holds: a DTensor's local shard, ZeRO-3's partition, else itself."""
    local = getattr(tensor, "_local_tensor", None)
    if isinstance(local, torch.Tensor):
        return local
    partition = getattr(tensor, "ds_tensor", None)
    if isinstance(partition, torch.Tensor):
        return partition
    return tensor


def with_unit(strategy: Strategy, model: torch.nn.Module) -> Strategy:
    """``strategy`` naming the block class FSDP wraps in ``model`` (the one it would take by default),
    so that the configs written from a probe wrap as the probe did."""
    if not strategy.is_fsdp or strategy.unit is not None:
        return strategy
    units = fsdp_units(model)
    return replace(strategy, unit=type(units[0]).__name__) if units else strategy


def local_bytes(tensors: Any, device: torch.device | None = None) -> int:
    """Bytes of the distinct storages behind the local parts of ``tensors`` (views count once); given a
    device with an index (a GPU, or a trace's ``cpu:0`` whose host is apart), only those on it: a
    partition offloaded to the host is not the device's."""
    seen: dict[int, int] = {}
    apart = device is not None and device.index is not None
    for tensor in tensors:
        if not isinstance(tensor, torch.Tensor):
            continue
        local = local_tensor(tensor)
        if apart and local.device != device:
            continue
        storage = local.untyped_storage()
        fake = storage.device.type == "meta"  # a fake tensor's storage: no data, no address
        seen[id(storage) if fake else storage.data_ptr() or id(storage)] = storage.nbytes()
    return sum(seen.values())


def fsdp_units(model: torch.nn.Module, unit: str | None = None) -> list[torch.nn.Module]:
    """The modules FSDP wraps one by one: ``unit``'s class, else the transformer block, as users wrap.

    The block is what HF models name in ``_no_split_modules`` (``GPT2Block``,
    ``LlamaDecoderLayer``); for other models, the items of the largest ``ModuleList`` or
    ``Sequential`` whose items are blocks (modules of modules). A model with no such blocks (a
    plain MLP: a ``Sequential`` of layers) is wrapped by size, as torch's
    ``size_based_auto_wrap_policy`` and accelerate's ``SIZE_BASED_WRAP`` do with their default of
    10**8 parameters: a small model is one unit, the root. Nested matches are left to their
    outermost unit.
    """
    names = {unit} if unit else set(getattr(model, "_no_split_modules", None) or ())
    if names:
        found = [m for m in model.modules() if type(m).__name__ in names and m is not model]
        if not found and unit:
            classes = sorted({type(m).__name__ for m in model.modules()})
            raise AutobatchError(
                f"the FSDP unit must be a module class in the model, but {unit!r} is not one; "
                f"pick one of {', '.join(classes[:12])}{' …' if len(classes) > 12 else ''}")
    else:
        found = _repeated_blocks(model) or _by_size(model)
    outer: list[torch.nn.Module] = []
    inside = set()
    for module in found:
        if id(module) in inside:
            continue
        outer.append(module)
        inside.update(id(m) for m in module.modules())
    return [m for m in outer if any(True for _ in m.parameters())]


def _repeated_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The items of the largest list of blocks: a ``ModuleList``/``Sequential`` whose items hold modules."""
    lists = [m for m in model.modules() if isinstance(m, (torch.nn.ModuleList, torch.nn.Sequential)) and len(m) > 1
             and all(any(True for _ in item.children()) for item in m)]
    return list(max(lists, key=len)) if lists else []


def _by_size(model: torch.nn.Module, min_params: int = SIZE_BASED_MIN_PARAMS) -> list[torch.nn.Module]:
    """Units as a size-based policy makes them: children first, a module whose parameters not yet in
    a unit reach ``min_params`` becomes one (the root, never listed here, takes the rest)."""
    units: list[torch.nn.Module] = []
    claimed: set[int] = set()

    def visit(module: torch.nn.Module) -> None:
        for child in module.children():
            visit(child)
        if module is model:
            return
        free = sum(p.numel() for p in module.parameters() if id(p) not in claimed)
        if free >= min_params:
            units.append(module)
            claimed.update(id(p) for p in module.parameters())

    visit(model)
    return units


def is_fake(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a fake tensor (shapes only: a trace's)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(tensor, FakeTensor)


def _world() -> int:
    if not (dist.is_available() and dist.is_initialized()):
        raise AutobatchError("wrapping for a strategy needs an initialized process group (a launcher or the fake group)")
    return dist.get_world_size()


def _plain_step(optimizer: torch.optim.Optimizer, grads_held: bool = False) -> Callable[[], None]:
    def step() -> None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=not grads_held)  # held: zeroed, into the next forward (accumulation)

    return step


def _bucket_as_is(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks real annotations; ours are strings
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def _backward(loss: torch.Tensor) -> None:
    loss.backward()


def wrap_model(model: torch.nn.Module, strategy: Strategy, workload: Workload, device: torch.device, *,
               batch: int = 1, deepspeed_config: dict[str, Any] | None = None, group: Any = None) -> Wrapped:
    """Wrap ``model`` (a private copy, modified in place) for ``strategy`` on ``device``.

    Args:
        model: the copy to wrap; FSDP and DeepSpeed change it in place.
        strategy: how to wrap.
        workload: for the optimizer (``workload.optimizer``) and the precision (``workload.dtype``).
        device: this rank's device.
        batch: the micro batch (DeepSpeed's config carries it).
        deepspeed_config: the user's DeepSpeed config, whose bucket sizes are used where set.
        group: the process group to shard over (default: the whole job); a group of the whole job.
    """
    world = _world()
    if workload.grads_held and strategy.name != "ddp":
        raise AutobatchError(f"grads_held holds an unsharded step's gradients into the next forward; {strategy.label} "
                             "keeps its own as its engine does: drop grads_held, or use the ddp strategy")
    if strategy.is_deepspeed:
        from .zero import wrap_deepspeed

        return wrap_deepspeed(model, strategy, workload, device, batch=batch, user_config=deepspeed_config, group=group)
    if strategy.name == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        _to(model, device)
        if world > 1 and any(is_fake(p) for p in model.parameters()):
            # A trace: DDP's memory is its buckets (its reducer reads data a fake tensor has none of).
            from .ddp import traced_buckets

            buckets = traced_buckets(model)
            optimizer = make_optimizer(workload.optimizer, [p for p in model.parameters() if p.requires_grad])
            return Wrapped(model, optimizer, _backward, _plain_step(optimizer, workload.grads_held), _keep=[buckets])
        device_ids = [device.index] if device.type == "cuda" else None
        wrapped = DistributedDataParallel(model, device_ids=device_ids, process_group=group) if world > 1 else model
        if world > 1 and dist.get_backend() == "fake":
            # The fake group's all-reduce completes with no tensor, which DDP's reducer refuses; reduce
            # in place (the default hook's memory: the bucket itself) by handing the bucket back.
            wrapped.register_comm_hook(None, _bucket_as_is)
        optimizer = make_optimizer(workload.optimizer, [p for p in wrapped.parameters() if p.requires_grad])
        return Wrapped(wrapped, optimizer, _backward, _plain_step(optimizer, workload.grads_held), _keep=[wrapped])
    units = fsdp_units(model, strategy.unit)
    keep: list[Any] = []  # held and closed beside the wrapper
    if strategy.name == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes():  # the mesh is a real tensor even when the trial runs on fake ones
            if group is None:
                mesh = init_device_mesh(device.type, (world,))
            else:
                from torch.distributed.device_mesh import DeviceMesh

                mesh = DeviceMesh.from_group(group, device.type)
        _to(model, device)
        policy = _fsdp2_precision(workload)
        with _fsdp2_offload(strategy, device, model) as offload:
            for unit in units:
                fully_shard(unit, mesh=mesh, mp_policy=policy, offload_policy=offload)
            fully_shard(model, mesh=mesh, mp_policy=policy, offload_policy=offload)
        wrapped = model
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        classes = {type(u) for u in units}
        policy = ModuleWrapPolicy(classes) if classes else None
        apart = _HostApartFsdp1(device) if strategy.offload is not None and host_apart(device) else None
        with apart.wrapping() if apart is not None else nullcontext():
            wrapped = FullyShardedDataParallel(model, auto_wrap_policy=policy, device_id=device, use_orig_params=True,
                                               process_group=group, mixed_precision=_fsdp1_precision(workload),
                                               cpu_offload=_fsdp1_offload(strategy))
        if apart is not None:
            keep.append(apart)  # its patches go when the wrapper does
    optimizer = make_optimizer(workload.optimizer, [p for p in wrapped.parameters() if p.requires_grad])
    return Wrapped(wrapped, optimizer, _backward, _plain_step(optimizer), units=len(units), _keep=[wrapped, *keep])

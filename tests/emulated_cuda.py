"""An emulated CUDA device for CPU-only test runs: the CUDA path of autobatch, unchanged.

:func:`emulated_cuda` patches ``torch.cuda``'s device and memory functions and ``pynvml`` with
fakes backed by one :class:`~autobatch.probing.backends.caching_allocator.CachingAllocator`
per emulated GPU, and enters two modes for the block:

* a ``TorchFunctionMode`` that sends every tensor meant for ``cuda``/``cuda:N`` (a ``device=``
  argument, ``.to(...)``, ``.cuda()``) to the CPU instead, remembering which GPU it was meant for;
* a ``TorchDispatchMode`` that books every storage made there, and every storage an op makes from
  such tensors, in that GPU's allocator model, and frees it when the storage dies. A booking the
  model cannot serve raises ``torch.OutOfMemoryError`` with torch's wording, mid-op.

The first matrix product on a GPU books a cuBLAS workspace there that only
``torch._C._cuda_clearCublasWorkspaces()`` gives back, as on a real GPU.

Tensors stay CPU tensors (``tensor.device`` says ``cpu``): the steps are real, only the device is
emulated. ``torch.autocast(device_type="cuda")`` runs as CPU autocast. DDP sees CPU parameters
and runs on gloo; while it is built, what it allocates is booked to the module's GPU (its
gradient buckets). Not modelled: kernels and their other workspaces (cuBLASLt, cuDNN), NCCL's real
buffers (a flat ``nccl_bytes`` is taken from the GPU on the first collective instead), streams,
and storages that C++ code makes with no GPU tensor among an op's inputs.
"""

from __future__ import annotations

import contextlib
import os
import sys
import types
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from autobatch.probing.backends.caching_allocator import CachingAllocator

__all__ = ["EmulatedGpu", "EmulatedCuda", "emulated_cuda", "emulated", "visible_gpus"]

GIB = 1 << 30
_CUDA_FUNCTIONS = (
    "is_available", "device_count", "current_device", "set_device", "mem_get_info", "memory_stats",
    "memory_allocated", "memory_reserved", "max_memory_allocated", "max_memory_reserved",
    "reset_peak_memory_stats", "empty_cache", "synchronize", "get_per_process_memory_fraction",
    "set_per_process_memory_fraction", "get_device_name", "get_device_properties", "get_rng_state",
    "set_rng_state", "is_bf16_supported", "is_initialized",
)


@dataclass
class EmulatedGpu:
    """One emulated GPU: its memory, who else uses it, and its allocator model."""

    index: int
    total_bytes: int = 8 * GIB
    name: str = "NVIDIA Emulated GPU"
    context_bytes: int = 300 << 20     # the CUDA context: not the allocator's, not free either
    others_bytes: int = 0              # held by other processes (NVML lists them)
    other_pids: tuple[int, ...] = ()
    nccl_bytes: int = 0                # taken on the first collective (a communicator's buffers)
    cublas_workspace_bytes: int = 4096 * 1024 * 2 + 16 * 1024 * 8  # torch's default below Hopper
    workspace: Any = None              # the cuBLAS workspace block, booked on the first matmul
    fraction: float = 1.0
    charged: int = 0                   # bytes taken outside the allocator so far (NCCL)
    rng: torch.Tensor = field(default_factory=lambda: torch.zeros(16, dtype=torch.uint8))
    allocator: CachingAllocator = field(init=False)

    def __post_init__(self) -> None:
        self.allocator = CachingAllocator(self.free_bytes, device_index=self.index, device_total=self.total_bytes)

    def free_bytes(self) -> int:
        held = self.context_bytes + self.others_bytes + self.charged + self.allocator.reserved
        return max(0, self.total_bytes - held)

    def set_fraction(self, fraction: float) -> None:
        self.fraction = fraction
        self.allocator.limit = None if fraction >= 1 else int(fraction * self.total_bytes)


class EmulatedCuda:
    """The state behind the patched functions: the GPUs, the current one, what NVML reports."""

    def __init__(self, gpus: list[EmulatedGpu], nvml_pid: int | None = None):
        self.gpus = gpus
        self.current = 0
        self.nvml_pid = os.getpid() if nvml_pid is None else nvml_pid  # containers: NVML sees host PIDs
        self.where: dict[int, tuple[int, Any]] = {}  # id(storage) -> (gpu index, allocator block)
        self.targets: list[int | str | None] = []

    def gpu(self, device: Any = None) -> EmulatedGpu:
        return self.gpus[self.index(device)]

    def index(self, device: Any = None) -> int:
        if device is None:
            return self.current
        if isinstance(device, int):
            index = device
        else:
            device = torch.device(device)
            if device.type != "cuda":
                raise ValueError(f"Expected a cuda device, but got: {device}")
            index = self.current if device.index is None else device.index
        if not 0 <= index < len(self.gpus):
            raise torch.AcceleratorError("CUDA error: invalid device ordinal")
        return index

    def storage_gpu(self, tensor: torch.Tensor) -> int | None:
        try:
            known = self.where.get(id(tensor.untyped_storage()))
        except (RuntimeError, NotImplementedError):
            return None
        return None if known is None else known[0]

    # --- booking --------------------------------------------------------------------------------

    def book(self, tensor: torch.Tensor, index: int) -> None:
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        key = id(storage)
        if key in self.where:
            return
        block = self.gpus[index].allocator.malloc(storage.nbytes())
        self.where[key] = (index, block)
        weakref.finalize(storage, self._unbook, key, block)

    def _unbook(self, key: int, block: Any) -> None:
        known = self.where.get(key)
        if known is not None and known[1] is block:
            del self.where[key]
            self.gpus[known[0]].allocator.free(block)

    @contextlib.contextmanager
    def target(self, where: int | str | None) -> Iterator[None]:
        self.targets.append(where)
        try:
            yield
        finally:
            self.targets.pop()


def _is_cuda(device: Any) -> bool:
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True
    if isinstance(device, (str, torch.device)):
        try:
            return torch.device(device).type == "cuda"
        except RuntimeError:
            return False
    return False


def _is_cpu(device: Any) -> bool:
    return isinstance(device, (str, torch.device)) and torch.device(device).type == "cpu"


class _CudaOnCpu(TorchFunctionMode):
    """Sends tensors meant for a CUDA device to the CPU and says which GPU they belong to."""

    def __init__(self, emu: EmulatedCuda):
        super().__init__()
        self.emu = emu

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in (torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu):
            return self._move(func, list(args), kwargs)
        device = kwargs.get("device")
        if _is_cuda(device):
            kwargs["device"] = "cpu"
            with self.emu.target(self.emu.index(device)):
                return func(*args, **kwargs)
        return func(*args, **kwargs)

    def _move(self, func, args: list, kwargs: dict) -> Any:
        src, rest = args[0], list(args[1:])
        if func is torch.Tensor.cpu:
            kwargs = {"device": "cpu", **{k: v for k, v in kwargs.items() if k != "memory_format"}}
        elif func is torch.Tensor.cuda:
            device = kwargs.pop("device", rest[0] if rest else None)
            kwargs = {"device": "cuda" if device is None else device, "non_blocking": kwargs.get("non_blocking", False)}
        else:
            kwargs = _to_kwargs(rest, kwargs)
        device = kwargs.get("device")
        if isinstance(device, int):
            device = kwargs["device"] = f"cuda:{device}"
        at = self.emu.storage_gpu(src)
        if _is_cuda(device):
            index = self.emu.index(device)
            kwargs["device"] = "cpu"
            if at != index:
                kwargs["copy"] = True  # from another device (the host): a copy, as on a GPU
            with self.emu.target(index):
                return torch.Tensor.to(src, **kwargs)
        if _is_cpu(device) and at is not None:
            kwargs["copy"] = True  # back to the host: a copy the GPU does not hold
            with self.emu.target("host"):
                return torch.Tensor.to(src, **kwargs)
        return torch.Tensor.to(src, **kwargs)


def _to_kwargs(rest: list, kwargs: dict) -> dict:
    """``Tensor.to``'s three positional forms as keywords: (device, dtype, ...), (dtype, ...), (tensor, ...)."""
    out = dict(kwargs)
    if rest and isinstance(rest[0], torch.Tensor):
        other = rest.pop(0)
        out.setdefault("device", other.device)
        out.setdefault("dtype", other.dtype)
    elif rest and isinstance(rest[0], torch.dtype):
        out["dtype"] = rest.pop(0)
    elif rest and (rest[0] is None or isinstance(rest[0], (str, torch.device, int)) and not isinstance(rest[0], bool)):
        out["device"] = rest.pop(0)
        if rest and (rest[0] is None or isinstance(rest[0], torch.dtype)):
            out["dtype"] = rest.pop(0)
    for name in ("non_blocking", "copy"):
        if rest:
            out[name] = rest.pop(0)
    return {k: v for k, v in out.items() if not (k in ("device", "dtype") and v is None)}


_MATMULS = {"mm", "addmm", "bmm", "baddbmm", "addbmm", "_addmm_activation", "linear"}


class _Booking(TorchDispatchMode):
    """Books each new storage on the GPU it belongs to: the call's target, else its inputs' GPU.

    The first matrix product on a GPU also books cuBLAS's workspace there, which stays allocated
    (``empty_cache`` cannot free it) until ``torch._C._cuda_clearCublasWorkspaces()``.
    """

    def __init__(self, emu: EmulatedCuda):
        super().__init__()
        self.emu = emu

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        target = self.emu.targets[-1] if self.emu.targets else None
        if target is None:
            inputs, _ = tree_flatten((args, kwargs))
            target = next((g for g in (self.emu.storage_gpu(t) for t in inputs if isinstance(t, torch.Tensor))
                           if g is not None), None)
        if isinstance(target, int) and func.__name__.split(".")[0] in _MATMULS:
            gpu = self.emu.gpus[target]
            if gpu.workspace is None and gpu.cublas_workspace_bytes:
                gpu.workspace = gpu.allocator.malloc(gpu.cublas_workspace_bytes)
        out = func(*args, **(kwargs or {}))
        if isinstance(target, int):
            for item in tree_flatten(out)[0]:
                if isinstance(item, torch.Tensor):
                    self.emu.book(item, target)
        return out


def _fake_nvml(emu: EmulatedCuda) -> types.ModuleType:
    nvml = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    def handle_by_bus(bus_id: str) -> EmulatedGpu:
        for gpu in emu.gpus:
            if _bus_id(gpu.index) == bus_id:
                return gpu
        raise NVMLError("Not Found")

    def processes(gpu: EmulatedGpu) -> list[Any]:
        mine = gpu.context_bytes + gpu.allocator.reserved + gpu.charged
        procs = [types.SimpleNamespace(pid=emu.nvml_pid, usedGpuMemory=mine)]
        others = gpu.other_pids or ((4242,) if gpu.others_bytes else ())
        for pid in others:
            procs.append(types.SimpleNamespace(pid=pid, usedGpuMemory=gpu.others_bytes // len(others)))
        return procs

    nvml.NVMLError = NVMLError
    nvml.nvmlInit = lambda: None
    nvml.nvmlShutdown = lambda: None
    nvml.nvmlDeviceGetHandleByPciBusId = handle_by_bus
    nvml.nvmlDeviceGetComputeRunningProcesses = processes
    nvml.nvmlDeviceGetMemoryInfo = lambda gpu: types.SimpleNamespace(
        total=gpu.total_bytes, free=gpu.free_bytes(), used=gpu.total_bytes - gpu.free_bytes())
    return nvml


def _bus_id(index: int) -> str:
    return f"00000000:{0x18 + index:02X}:00.0"


def _functions(emu: EmulatedCuda) -> dict[str, Any]:
    def set_device(device: Any) -> None:
        emu.current = emu.index(device)

    def reset_peak(device: Any = None) -> None:
        emu.gpu(device).allocator.reset_peak()

    def properties(device: Any = None) -> Any:
        gpu = emu.gpu(device)
        return types.SimpleNamespace(name=gpu.name, total_memory=gpu.total_bytes, pci_domain_id=0,
                                     pci_bus_id=0x18 + gpu.index, pci_device_id=0, major=9, minor=0,
                                     multi_processor_count=132)

    def set_rng_state(state: torch.Tensor, device: Any = "cuda") -> None:
        emu.gpu(device).rng = state.clone()

    return {
        "is_available": lambda: True,
        "is_initialized": lambda: True,
        "device_count": lambda: len(emu.gpus),
        "current_device": lambda: emu.current,
        "set_device": set_device,
        "mem_get_info": lambda device=None: (emu.gpu(device).free_bytes(), emu.gpu(device).total_bytes),
        "memory_stats": lambda device=None: dict(emu.gpu(device).allocator.memory_stats()),
        "memory_allocated": lambda device=None: emu.gpu(device).allocator.allocated,
        "memory_reserved": lambda device=None: emu.gpu(device).allocator.reserved,
        "max_memory_allocated": lambda device=None: emu.gpu(device).allocator.peak_allocated,
        "max_memory_reserved": lambda device=None: emu.gpu(device).allocator.peak_reserved,
        "reset_peak_memory_stats": reset_peak,
        "empty_cache": lambda: [gpu.allocator.empty_cache() for gpu in emu.gpus] and None,
        "synchronize": lambda device=None: emu.gpu(device) and None,
        "get_per_process_memory_fraction": lambda device=None: emu.gpu(device).fraction,
        "set_per_process_memory_fraction": lambda fraction, device=None: emu.gpu(device).set_fraction(fraction),
        "get_device_name": lambda device=None: emu.gpu(device).name,
        "get_device_properties": properties,
        "get_rng_state": lambda device="cuda": emu.gpu(device).rng.clone(),
        "set_rng_state": set_rng_state,
        "is_bf16_supported": lambda including_emulation=True: True,
    }


def _clear_cublas_workspaces(emu: EmulatedCuda) -> None:
    for gpu in emu.gpus:
        if gpu.workspace is not None:
            gpu.allocator.free(gpu.workspace)
            gpu.workspace = None


class _CpuAutocast(torch.autocast):
    def __init__(self, device_type: str, *args: Any, **kwargs: Any):
        super().__init__("cpu" if device_type == "cuda" else device_type, *args, **kwargs)


def visible_gpus(gpus: list[EmulatedGpu], setting: str | None) -> list[EmulatedGpu]:
    """The GPUs a process sees under ``CUDA_VISIBLE_DEVICES=setting``, in its order, as CUDA reads it.

    Unset: all of them. Otherwise the ids in the order given, up to the first one that is not a
    GPU of the machine (not a number, out of range, or listed twice): CUDA ignores it and every id
    after it, so ``"0,7,1"`` on two GPUs is GPU 0 alone and ``""`` is none.
    """
    if setting is None:
        return list(gpus)
    seen: list[EmulatedGpu] = []
    for token in setting.split(","):
        token = token.strip()
        if not token.isdigit() or int(token) >= len(gpus) or any(g is gpus[int(token)] for g in seen):
            break
        seen.append(gpus[int(token)])
    return seen


@contextlib.contextmanager
def emulated(gpus: list[EmulatedGpu] | int = 1, *, nvml_pid: int | None = None,
             patch: Any = None) -> Iterator[EmulatedCuda]:
    """Emulate ``gpus`` for the block (a count of default GPUs, or the GPUs themselves): the
    machine's GPUs, of which this process sees those ``CUDA_VISIBLE_DEVICES`` lets it see,
    renumbered from 0 as CUDA renumbers them (an id past the last raises as torch raises).

    A process group asked for on ``"nccl"`` runs on gloo (NCCL needs real GPUs): the code that
    chooses NCCL, and the ``set_device`` before it, run unchanged.

    ``patch`` is a ``pytest.MonkeyPatch`` to install the fakes with; without one a private one is
    used and undone on exit (worker processes have no fixture).
    """
    if isinstance(gpus, int):
        gpus = [EmulatedGpu(i) for i in range(gpus)]
    gpus = visible_gpus(gpus, os.environ.get("CUDA_VISIBLE_DEVICES"))
    emu = EmulatedCuda(gpus, nvml_pid=nvml_pid)
    own = patch is None
    patch = pytest.MonkeyPatch() if own else patch
    try:
        for name, fn in _functions(emu).items():
            patch.setattr(torch.cuda, name, fn)
        patch.setattr(torch, "autocast", _CpuAutocast)
        patch.setattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: _clear_cublas_workspaces(emu), raising=False)
        patch.setitem(sys.modules, "pynvml", _fake_nvml(emu))
        _charge_communicators(emu, patch)
        _book_ddp_construction(emu, patch)
        _nccl_on_gloo(patch)
        with _CudaOnCpu(emu), _Booking(emu):
            yield emu
    finally:
        if own:
            patch.undo()


def _charge_communicators(emu: EmulatedCuda, patch: Any) -> None:
    """The first collective on a GPU takes its ``nccl_bytes`` outside the allocator, as NCCL does."""
    for name in ("all_reduce", "all_gather", "broadcast", "all_gather_object", "barrier"):
        original = getattr(dist, name)

        def charged(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
            gpu = emu.gpu()
            if gpu.nccl_bytes and not gpu.charged:
                gpu.charged = gpu.nccl_bytes
            return _original(*args, **kwargs)

        patch.setattr(dist, name, charged)


def _nccl_on_gloo(patch: Any) -> None:
    """``init_process_group("nccl")`` and ``new_group(backend="nccl")`` make gloo groups."""
    for name in ("init_process_group", "new_group"):
        original = getattr(dist, name)

        def on_gloo(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
            if args and args[0] == "nccl":
                args = ("gloo", *args[1:])
            if kwargs.get("backend") == "nccl":
                kwargs["backend"] = "gloo"
            return _original(*args, **kwargs)

        patch.setattr(dist, name, on_gloo)


def _book_ddp_construction(emu: EmulatedCuda, patch: Any) -> None:
    from torch.nn.parallel import DistributedDataParallel

    original = DistributedDataParallel.__init__

    def init(self: Any, module: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        index = next((g for g in map(emu.storage_gpu, module.parameters()) if g is not None), None)
        with emu.target(index):
            original(self, module, *args, **kwargs)

    patch.setattr(DistributedDataParallel, "__init__", init)


@pytest.fixture
def emulated_cuda(monkeypatch: pytest.MonkeyPatch) -> Iterator[EmulatedCuda]:
    """One emulated 8 GiB GPU for the test (``emulated(...)`` for other shapes)."""
    with emulated(1, patch=monkeypatch) as emu:
        yield emu

"""A real CUDA device: real out-of-memory errors, peaks from the caching allocator."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from ...errors import AutobatchError
from ._base import DeviceInfo, MemoryBackend, Peak

__all__ = ["CudaBackend", "nvml_usage", "resolve_cuda_device"]


class CudaBackend(MemoryBackend):
    """Probes on ``cuda:index``.

    The capacity is what this process can still take: memory free on the device when the
    backend is made (or :meth:`remeasure` d) plus what this process's allocator already holds,
    within its per-process memory fraction. Other processes' usage comes from NVML (pynvml)
    when it is available.

    Args:
        device: a CUDA device index, name or ``torch.device``; without an index, this rank's GPU
            (see :func:`resolve_cuda_device`).
    """

    def __init__(self, device: int | str | torch.device | None = None):
        if not torch.cuda.is_available():
            raise AutobatchError(
                "the CUDA backend needs a CUDA GPU, but torch finds none on this machine; "
                "probe on a simulated budget instead (--device cpu --memory 8GiB)"
            )
        self.device = resolve_cuda_device(device)
        self._name = torch.cuda.get_device_name(self.device)
        self.remeasure()

    def remeasure(self) -> None:
        """Read the capacity now: free memory plus this process's cache, within its memory fraction."""
        gc.collect()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        self._total = total
        capacity = free + torch.cuda.memory_reserved(self.device)
        # set_per_process_memory_fraction caps what the allocator may reserve, whatever is free.
        fraction = torch.cuda.get_per_process_memory_fraction(self.device)
        self._capacity = min(capacity, int(fraction * total))

    def capacity(self) -> int:
        return self._capacity

    def info(self) -> DeviceInfo:
        free, total = torch.cuda.mem_get_info(self.device)
        return DeviceInfo(
            kind="cuda",
            name=self._name,
            index=self.device.index,
            total_bytes=total,
            free_bytes=free,
            used_by_others_bytes=nvml_usage(self.device.index),
            capacity_bytes=self._capacity,
        )

    @contextmanager
    def track(self, resident: Sequence[torch.Tensor] = ()) -> Iterator[None]:
        # The caching allocator already counts the resident tensors and raises real OOMs.
        self.reset_peak()
        yield

    def reset_peak(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> Peak:
        torch.cuda.synchronize(self.device)
        return Peak(torch.cuda.max_memory_allocated(self.device), torch.cuda.max_memory_reserved(self.device))

    def allocated_bytes(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def release(self) -> None:
        gc.collect()
        # cuBLAS keeps a workspace per handle and stream, allocated from the caching allocator,
        # that empty_cache cannot free; torch offers a call that drops them (they come back on
        # the next matmul, so every trial pays for its own).
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear is not None:
            clear()
        torch.cuda.empty_cache()

    def alloc_retries(self) -> int:
        return int(torch.cuda.memory_stats(self.device).get("num_alloc_retries", 0))

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)


def resolve_cuda_device(device: int | str | torch.device | None = None) -> torch.device:
    """The CUDA device a name means here: ``"cuda"`` without an index is this rank's GPU.

    Under a launcher that sets ``LOCAL_RANK`` an index-less device is ``cuda:<local rank>``, or
    ``cuda:0`` when the launcher left each process one visible GPU; never simply the current
    device, which is GPU 0 on every rank until someone calls ``set_device``. Without a launcher
    it is the current device. (Launchers that name the local rank otherwise, srun and mpirun, are
    read by :func:`autobatch.rank_env`, which the distributed probe uses to name the GPU outright.)

    Example:
        >>> resolve_cuda_device("cuda:1")
        device(type='cuda', index=1)
    """
    if isinstance(device, int):
        return torch.device("cuda", device)
    resolved = torch.device("cuda" if device is None else device)
    if resolved.type != "cuda":
        raise AutobatchError(f"the CUDA backend needs a cuda device, but got {str(resolved)!r}")
    if resolved.index is not None:
        return resolved
    local_rank = os.environ.get("LOCAL_RANK")
    if local_rank is None or not local_rank.isdigit():
        return torch.device("cuda", torch.cuda.current_device())
    visible = torch.cuda.device_count()
    if visible == 1:
        return torch.device("cuda", 0)
    if int(local_rank) >= visible:
        raise AutobatchError(
            f"LOCAL_RANK={local_rank} but only {visible} GPUs are visible to this process; start at most "
            f"{visible} processes per node, or name the device (--device cuda:N)"
        )
    return torch.device("cuda", int(local_rank))


def nvml_usage(index: int | None) -> int | None:
    """Bytes that other processes hold on CUDA device ``index``, or ``None`` when unknown.

    Unknown without NVML, and also when NVML does not list this process: inside a container NVML
    reports the host's PIDs, so ours cannot be told apart from the others'.
    """
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        try:
            props = torch.cuda.get_device_properties(index)
            bus_id = f"{props.pci_domain_id:08X}:{props.pci_bus_id:02X}:{props.pci_device_id:02X}.0"
            handle = pynvml.nvmlDeviceGetHandleByPciBusId(bus_id)
            me = os.getpid()
            procs = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
            if all(proc.pid != me for proc in procs):
                return None  # another PID namespace (a container): which one is us is unknown
            return sum(proc.usedGpuMemory or 0 for proc in procs if proc.pid != me)
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # NVML missing on the host, no permission, MIG: the figure is optional
        return None

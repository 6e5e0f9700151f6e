"""A real CUDA device: real out-of-memory errors, peaks from the caching allocator."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from ...errors import AutobatchError
from ._base import DeviceInfo, MemoryBackend, Peak

__all__ = ["CudaBackend", "nvml_usage"]


class CudaBackend(MemoryBackend):
    """Probes on ``cuda:index``.

    The capacity is what this process can still take: memory free on the device when the
    backend is made plus what this process's allocator already holds. Other processes' usage
    comes from NVML (pynvml) when it is available.

    Args:
        device: a CUDA device index or ``torch.device``; default the current device.
    """

    def __init__(self, device: int | str | torch.device | None = None):
        if not torch.cuda.is_available():
            raise AutobatchError(
                "the CUDA backend needs a CUDA GPU, but torch.cuda.is_available() is False; "
                "probe on a simulated budget instead (--device cpu --memory 8GiB)"
            )
        if device is None:
            device = torch.cuda.current_device()
        self.device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        gc.collect()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        self._total = total
        self._capacity = free + torch.cuda.memory_reserved(self.device)
        self._name = torch.cuda.get_device_name(self.device)

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
        torch.cuda.empty_cache()

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)


def nvml_usage(index: int | None) -> int | None:
    """Bytes that other processes hold on CUDA device ``index``, or ``None`` without NVML."""
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
            used = 0
            for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if proc.pid != me and proc.usedGpuMemory:
                    used += proc.usedGpuMemory
            return used
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # NVML missing on the host, no permission, MIG: the figure is optional
        return None

"""Memory backends: where trials run and where their memory is read."""

from __future__ import annotations

from ._base import DeviceInfo, MemoryBackend, Peak
from .cuda import CudaBackend
from .simulated import SimulatedBackend

__all__ = ["MemoryBackend", "DeviceInfo", "Peak", "CudaBackend", "SimulatedBackend"]

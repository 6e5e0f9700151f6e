"""The contract every memory backend keeps. The prober talks to nothing else."""

from __future__ import annotations

import socket
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import torch

__all__ = ["MemoryBackend", "DeviceInfo", "Peak"]


@dataclass(frozen=True)
class DeviceInfo:
    """What the device is and how much of it is ours. Sizes in bytes; ``None`` when unknown."""

    kind: str                       # "cuda" or "simulated"
    name: str                       # e.g. "NVIDIA H200" or "cpu (simulated 2.00 GiB)"
    index: int | None
    total_bytes: int | None
    free_bytes: int | None
    used_by_others_bytes: int | None  # other processes on the same GPU (pynvml)
    capacity_bytes: int             # what a training step may peak at before it runs out
    host: str = socket.gethostname()

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Peak:
    """Peaks since the last :meth:`MemoryBackend.reset_peak`, in bytes."""

    allocated: int  # live tensor memory
    reserved: int   # memory held from the device (allocator cache included): what meets capacity


class MemoryBackend(ABC):
    """A device on which the prober runs trials, and the only place it reads memory from.

    Contract (``tests/backend_suite.py`` checks every clause, for every backend):

    * ``device`` is the ``torch.device`` that models and batches are moved to.
    * ``capacity()`` is the number of bytes a trial may peak at (in the sense of
      ``Peak.reserved``) before the device runs out; it does not change while probing.
    * ``track(resident)`` is a context manager for one trial. On entry it resets the peak
      statistics; the tensors in ``resident`` (the model's parameters and buffers, already on
      ``device``) count as live. Inside the block, running out of memory raises an exception
      for which :func:`autobatch.probing.oom.is_oom_error` is true.
    * ``reset_peak()`` restarts the peak statistics from what is live now; ``peak()`` returns
      the :class:`Peak` reached since, also after an out-of-memory error (the trial reads it per
      phase: forward and backward apart from the optimizer step).
    * ``track_deferred(resident)`` is ``track`` for sharded trials: where the backend can (the
      simulated budget), running out of memory does not raise inside it, and the caller compares
      ``peak()`` with ``capacity()`` at the step's end; a real device raises as in ``track``.
    * ``allocated_bytes()`` is the tensor memory live on the device now.
    * ``release()`` gives cached memory back after a trial; once the trial's tensors are
      unreferenced, ``allocated_bytes()`` is back at the baseline before the trial.
    * ``synchronize()`` waits until queued kernels have finished, so timings are honest.
    * ``info()`` describes the device (:class:`DeviceInfo`).
    * ``alloc_retries()`` counts the times the allocator had to flush its cache and retry a
      request (0 for a backend without a cache); a trial that needed it fits only just.
    * ``remeasure()`` reads the capacity again, once, before probing starts: after the process
      group's first collective, whose buffers (NCCL's) take memory outside the allocator.
    """

    device: torch.device

    @abstractmethod
    def capacity(self) -> int: ...

    @abstractmethod
    def info(self) -> DeviceInfo: ...

    @abstractmethod
    @contextmanager
    def track(self, resident: Sequence[torch.Tensor] = ()) -> Iterator[None]: ...

    @abstractmethod
    def reset_peak(self) -> None: ...

    @abstractmethod
    def peak(self) -> Peak: ...

    @abstractmethod
    def allocated_bytes(self) -> int: ...

    @contextmanager
    def track_deferred(self, resident: Sequence[torch.Tensor] = ()) -> Iterator[None]:
        """:meth:`track`, but where the backend can, running out of memory does not raise inside it.

        Sharded trials use it: a rank that stops mid-step leaves the others in a collective, so
        they finish the step and compare :meth:`peak` with :meth:`capacity` at its end. A real
        device cannot defer its allocator's errors; the default is :meth:`track`.
        """
        with self.track(resident):
            yield

    def release(self) -> None:
        """Default: nothing cached."""

    def alloc_retries(self) -> int:
        """Default: no cache to flush, so never."""
        return 0

    def remeasure(self) -> None:
        """Default: the capacity is fixed."""

    def synchronize(self) -> None:
        """Default: the device runs synchronously."""

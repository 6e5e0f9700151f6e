"""A storage counter for the real-rank checks, written apart from autobatch's MemoryTracker.

It shares no code with autobatch: it keys storages by their data pointer, not by the Python
object; it reads a wrapper subclass's (DTensor's) local shard with ``to_local``-style attribute
lookups of its own; and it counts ``UntypedStorage.resize_`` (FSDP's free and re-gather of
unsharded parameters, which reaches no dispatch mode) by patching it for the block. Its figure is
what the CPU "device" holds: every storage allocated while it is on, plus the tensors ``hold``
is given (the wrapped model's parameters).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["StorageCounter"]


class StorageCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.sizes: dict[int, int] = {}   # data pointer -> bytes
        self.now = 0
        self.peak = 0
        self._resize: Any = None

    def hold(self, tensors: Any) -> None:
        for t in tensors:
            self._see(t)

    def __enter__(self) -> StorageCounter:
        original, counter = torch.UntypedStorage.resize_, self

        def resize_(storage: torch.UntypedStorage, size: int) -> Any:
            old = storage.data_ptr()
            result = original(storage, size)
            counter._resized(storage, old)
            return result

        self._resize = original
        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
        return super().__enter__()

    def __exit__(self, *exc: Any) -> Any:
        torch.UntypedStorage.resize_ = self._resize  # type: ignore[method-assign]
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for item in (out if isinstance(out, (tuple, list)) else [out]):
            if isinstance(item, torch.Tensor):
                self._see(item)
        return out

    def _see(self, tensor: torch.Tensor) -> None:
        inner = getattr(tensor, "_local_tensor", None)  # a DTensor holds its shard here
        if isinstance(inner, torch.Tensor):
            self._see(inner)
            return
        if tensor.layout != torch.strided or tensor.device.type == "meta":
            return
        storage = tensor.untyped_storage()
        pointer, size = storage.data_ptr(), storage.nbytes()
        if size == 0 or pointer in self.sizes:
            return
        self._add(pointer, size)
        weakref.finalize(storage, self._drop, pointer, size)

    def _resized(self, storage: torch.UntypedStorage, old: int) -> None:
        """The block at ``old`` is given back and, unless the storage is now empty, a new one taken."""
        if old in self.sizes:
            self._drop(old, self.sizes[old])
        if storage.nbytes():
            self._add(storage.data_ptr(), storage.nbytes())
            weakref.finalize(storage, self._drop, storage.data_ptr(), storage.nbytes())

    def _add(self, pointer: int, size: int) -> None:
        self.sizes[pointer] = size
        self.now += size
        self.peak = max(self.peak, self.now)

    def _drop(self, pointer: int, size: int) -> None:
        if self.sizes.get(pointer) == size:
            del self.sizes[pointer]
            self.now -= size

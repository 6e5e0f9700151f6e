"""Count the bytes of live tensor storages, op by op, like a device allocator would.

:class:`MemoryTracker` is a ``TorchDispatchMode``: every tensor an aten op returns is looked up
by its storage; a storage not seen before adds its size, and a weakref finalizer takes it off
again when the storage dies. Views share their base's storage and count once. The result is the
live tensor memory and its peak, which the simulated backend compares with a budget and the
estimator runs under fake tensors (shapes only, no real memory).

Sharded training needs two more things, both handled here:

* wrapper subclasses (``DTensor``, which FSDP2 makes every parameter) hold their data in inner
  tensors; the wrapper's own storage reports the *global* size. The tracker counts the inner
  (local) tensors instead, so a parameter sharded over W ranks costs its shard, as on a GPU;
* FSDP frees and re-allocates the gathered parameters with ``UntypedStorage.resize_``, which on
  the CPU is no aten op and never reaches a dispatch mode. While the tracker is entered,
  ``resize_`` is wrapped so each resize is counted (and checked against the budget) like an
  allocation; the original method is restored on exit.

What it cannot see: memory a kernel allocates for itself (workspaces). Allocator rounding and
caching it sees only when given a :class:`~autobatch.probing.backends.caching_allocator.CachingAllocator`
to book each storage in.
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

__all__ = ["MemoryTracker", "making_batch"]

_MAKING_BATCH = contextvars.ContextVar("autobatch_making_batch", default=False)


@contextlib.contextmanager
def making_batch() -> Iterator[None]:
    """While a workload makes its batch: a view of memory no tracker counted (``x[:b]`` of a dataset the user
    holds on the host) costs nothing, as on a GPU, where only the batch's own copy is device memory (the move
    to the device, :func:`~autobatch.probing.trial.to_device`, makes and counts it)."""
    token = _MAKING_BATCH.set(True)
    try:
        yield
    finally:
        _MAKING_BATCH.reset(token)


class MemoryTracker(TorchDispatchMode):
    """Live and peak bytes of tensor storages; optionally an out-of-memory error above ``budget``.

    Args:
        budget: bytes; when live memory would exceed it, the op raises ``torch.OutOfMemoryError``
            with the CUDA allocator's wording, so code that handles real OOMs handles this one.
        allocator: a caching-allocator model to book every storage in (it raises the OOM then);
            ``current_bytes``/``peak_bytes`` stay exact tensor bytes either way.
        device: count only tensors on this device (default: every tensor); a trace of an offloading
            wrapper keeps the GPU's tensors on ``cpu:0`` and the host's on ``cpu``.

    Example:
        >>> tracker = MemoryTracker()
        >>> with tracker:
        ...     x = torch.zeros(1024)
        >>> tracker.peak_bytes
        4096
    """

    def __init__(self, budget: int | None = None, allocator: Any = None, device: torch.device | None = None):
        super().__init__()
        self.budget = budget
        self.allocator = allocator
        # Where given, only tensors on this device count: a copy on another (a host's, offloaded) costs it nothing.
        self.device = device
        self.current_bytes = 0
        self.peak_bytes = 0
        self._live: dict[int, tuple[int, int]] = {}  # id(storage) -> (token, nbytes)
        self._blocks: dict[int, Any] = {}  # token -> the allocator's block
        self._tokens = itertools.count()
        self._resize_saved: list[Any] = []  # UntypedStorage.resize_ as it was, per nested entry
        # The op whose outputs are being counted (a log of requests keeps it: a request's kind at any batch)
        self.making: Any = None

    def add(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count tensors that exist already (the model's parameters) as resident on the device."""
        self.making = "resident"
        for tensor in tensors:
            self._register(tensor, check_budget=False)

    def reset_peak(self) -> None:
        self.peak_bytes = self.current_bytes

    def __enter__(self) -> MemoryTracker:
        original = torch.UntypedStorage.resize_
        tracker = self

        def resize_(storage: torch.UntypedStorage, size: int) -> Any:
            out = original(storage, size)
            tracker.making = "resize_"
            tracker._account(storage, check_budget=True)
            return out

        self._resize_saved.append(original)
        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
        try:
            return super().__enter__()
        except BaseException:
            torch.UntypedStorage.resize_ = self._resize_saved.pop()  # type: ignore[method-assign]
            raise

    def __exit__(self, *exc_info: Any) -> Any:
        try:
            return super().__exit__(*exc_info)
        finally:
            torch.UntypedStorage.resize_ = self._resize_saved.pop()  # type: ignore[method-assign]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.making = func
        flat, _ = tree_flatten(out)
        host_view = getattr(func, "is_view", False) and _MAKING_BATCH.get()
        for item in flat:
            if isinstance(item, torch.Tensor):
                self._register(item, check_budget=True, host_view=host_view)
        return out

    def _register(self, tensor: torch.Tensor, *, check_budget: bool, host_view: bool = False) -> None:
        if is_traceable_wrapper_subclass(tensor):
            # The wrapper's storage is a placeholder of the global size; the data is in the inner tensors.
            names, _ = tensor.__tensor_flatten__()
            for name in names:
                inner = getattr(tensor, name)
                if isinstance(inner, torch.Tensor):
                    self._register(inner, check_budget=check_budget, host_view=host_view)
            return
        if tensor.device.type == "meta":  # shapes only (ZeRO-1/2 keep a meta copy of every parameter): no memory
            return
        if self.device is not None and tensor.device != self.device:
            return
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse and other storage-less layouts
            return
        if host_view and id(storage) not in self._live:
            return  # see making_batch
        self._account(storage, check_budget=check_budget)

    def _account(self, storage: torch.UntypedStorage, *, check_budget: bool) -> None:
        key, nbytes = id(storage), storage.nbytes()
        known = self._live.get(key)
        if known is not None:
            token, old = known
            if nbytes == old:
                return
            if self.allocator is not None:  # resize_ grew or shrank the storage in place
                self.allocator.free(self._blocks.pop(token))
                self._blocks[token] = self.allocator.malloc(nbytes, force=not check_budget)
            self._live[key] = (token, nbytes)
            self.current_bytes += nbytes - old
        else:
            token = next(self._tokens)
            if self.allocator is not None:  # may raise the OOM, before anything is recorded
                self._blocks[token] = self.allocator.malloc(nbytes, force=not check_budget)
            self._live[key] = (token, nbytes)
            self.current_bytes += nbytes
            weakref.finalize(storage, self._release, key, token)
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        if check_budget and self.budget is not None and self.current_bytes > self.budget:
            raise torch.OutOfMemoryError(
                f"CUDA out of memory. Tried to allocate {nbytes} bytes "
                f"(simulated budget {self.budget} bytes, {self.current_bytes} bytes live)."
            )

    def _release(self, key: int, token: int) -> None:
        known = self._live.get(key)
        if known is not None and known[0] == token:
            del self._live[key]
            self.current_bytes -= known[1]
            if self.allocator is not None:
                self.allocator.free(self._blocks.pop(token, None))

"""The backend a trace runs on: fake tensors (no memory), with a GPU's attention, dropout and casts.

:class:`_FakeBackend` is the simulated backend's storage counter entered under ``FakeTensorMode``:
a trial costs the same at any batch and holds no data. Sharded trials run on it too
(:func:`fake_backend`), where the wrappers' reads of values are stood in for (:class:`_ZeroScalars`).
Traced for a GPU, attention takes the fused kernel (:class:`_FusedAttention`), dropout the fused
kernel's bool mask (:class:`_GpuDropout`) and mixed precision CUDA's casts (:mod:`.cuda_autocast`);
traced for CPU trials (a prior), each as the CPU runs it.
"""

from __future__ import annotations

import logging

from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from ..probing.backends import DeviceInfo, SimulatedBackend
from .cuda_autocast import cuda_policy

__all__ = ["fake_backend", "GPU_APART"]

#: The device a trace's GPU tensors take where the host's are apart (``fake_backend(host_apart=True)``).
GPU_APART = torch.device("cpu", 0)


class _FusedAttention(TorchFunctionMode):
    """Route SDPA to the fused CPU kernel, whose saved tensors have flash attention's O(seq) size.

    Under fake tensors SDPA otherwise takes the math path and keeps the O(seq²) probabilities,
    which a GPU's flash/memory-efficient kernels never store. Only calls the model makes itself
    are routed: SDPA inside another overridable function (``nn.MultiheadAttention``) stays on the
    math path, which over-counts, so the estimate errs small.
    """

    _NAMES = ("attn_mask", "dropout_p", "is_causal")

    def __init__(self, as_on_cpu: bool = False):
        super().__init__()
        # The trials run on this CPU: its fused kernel takes no dropout, so with dropout the CPU
        # runs the math path and keeps the probabilities and their mask; the trace does the same.
        self.as_on_cpu = as_on_cpu

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.nn.functional.scaled_dot_product_attention and not kwargs.get("enable_gqa", False):
            q, k, v = args[:3]
            options = {**dict(zip(self._NAMES, args[3:])), **kwargs}
            if self.as_on_cpu and options.get("dropout_p", 0.0) > 0:
                return func(*args, **kwargs)
            mask = options.get("attn_mask")
            # A mask that learns (Swin's relative position bias) needs its gradient: the CPU's fused
            # kernel has none, so it stays on the math path (a GPU's memory-efficient kernel has one).
            learned = isinstance(mask, torch.Tensor) and mask.requires_grad
            if q.shape[:-2] == k.shape[:-2] == v.shape[:-2] and not learned:  # grouped-query heads: the math path
                # Without dropout: the CPU kernel takes none on real tensors, and a GPU's fused
                # kernel keeps no dropout mask (it regenerates it), so the memory is the same.
                out, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                    q, k, v, 0.0, options.get("is_causal", False),
                    attn_mask=options.get("attn_mask"), scale=options.get("scale"),
                )
                return out
        return func(*args, **kwargs)


class _GpuDropout(TorchFunctionMode):
    """Dropout as a GPU runs it: the fused kernel, whose saved mask is one byte an element.

    ATen's ``dropout`` takes ``native_dropout`` where the fused kernel is acceptable, which is on a
    GPU (``is_fused_kernel_acceptable`` in ``aten/src/ATen/native/Dropout.cpp``: CUDA, 0 < p < 1);
    its CUDA kernel keeps a bool mask. On the CPU it multiplies by a noise tensor of the input's
    dtype and keeps that: four bytes an element in fp32, two in bf16. In-place dropout takes the
    noise path on both. Traced with the noise, gpt2's allocated peak on an H200 came out 3.3 % high;
    with the mask, within 0.06 % of the card's for gpt2 (fp32, bf16) and bert-base
    (``tests/test_dropout_on_a_gpu.py`` by hand; ``tests/test_allocator_replay.py`` against
    ``docs/benchmarks/gpu.json``).
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.dropout:
            given = {**dict(zip(("input", "p", "training", "inplace"), args)), **kwargs}
            p, training = given.get("p", 0.5), given.get("training", True)
            if training and 0 < p < 1 and not given.get("inplace", False):
                return torch.ops.aten.native_dropout(given["input"], p, True)[0]
        return func(*args, **kwargs)


class _DataOnTheGpuApart(TorchFunctionMode):
    """``torch.tensor(data, device="cpu:0")`` on :data:`GPU_APART`: made from data, a tensor is real
    before it is fake, and a real CPU tensor drops its device's index (a cache's empty ``torch.tensor([],
    device=keys.device)`` would land on the host and meet the keys on ``cpu:0``). A scalar stays on the
    host, where it meets tensors of any device and keeps its value."""

    _FROM_DATA = (torch.tensor, torch.as_tensor, torch.asarray)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self._FROM_DATA and kwargs.get("device") is not None and torch.device(kwargs["device"]) == GPU_APART:
            made = func(*args, **{**kwargs, "device": "cpu"})
            if made.dim() == 0:  # a scalar meets tensors of any device, and keeps the value a trace may read
                return made
            # A copy into a fresh tensor: a tiny one is a constant, which `to` would copy back to the host
            moved = torch.empty(made.shape, dtype=made.dtype, device=GPU_APART).copy_(made)
            return moved.requires_grad_(made.requires_grad)
        return func(*args, **kwargs)


class _ZeroScalars(TorchDispatchMode):
    """A fake tensor read as a Python value (``.item()``, ``bool(t)``) reads one, or False.

    Wrappers read their gradients' norm (is it finite?), their overflow flag and their optimizer's
    step count between steps, Adafactor its step count, weight initialisers their bounds; a trace has
    no values. One (and no for a flag: a bool, or DeepSpeed's overflow byte) takes the path of a
    normal step without overflow, whose memory is the one that counts, and divides by nothing that
    is zero. Read as one, ZeRO-1/2's overflow byte skipped every step in bf16 and fp16, so their
    estimates held no optimizer state. A model whose forward branches on a
    value is traced down the branch that value takes; the trials then correct the prior.
    """

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensor

        if func is torch.ops.aten._local_scalar_dense.default and isinstance(args[0], FakeTensor):
            dtype = args[0].dtype
            # A flag (bool, or DeepSpeed's overflow byte) reads "no": a step that overflowed is skipped,
            # and makes no optimizer state. A count or a scale reads one.
            stand_in = (False if dtype == torch.bool else 0 if dtype == torch.uint8
                        else 1.0 if dtype.is_floating_point else 1)
            try:
                value = func(*args, **(kwargs or {}))  # a tensor made from a Python number knows it
            except DataDependentOutputException:
                return stand_in
            # Under a shape environment (a trace with a symbolic batch) an unknown value is a fresh
            # symbol instead: it takes the stand-in too.
            from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

            return stand_in if free_unbacked_symbols(value) else value
        if func.namespace == "c10d":
            # On the fake group a collective moves no data: this rank's values stay what they were
            # (DeepSpeed broadcasts a list's length and reads it back to compare).
            known = [(t, t.constant) for t in args if isinstance(t, FakeTensor) and t.constant is not None]
            out = func(*args, **(kwargs or {}))
            for tensor, constant in known:
                tensor.constant = constant
            return out
        return func(*args, **(kwargs or {}))


class _WorstCaseSizes(TorchDispatchMode):
    """An output whose size its input's values set (``nonzero``, a boolean mask, ``masked_select``,
    ``unique``) takes its largest: every element selected, every value distinct. A trace has no
    values; the largest errs large, as a bound should, and its backward (an ``index_put`` at the
    same indices) has the same sizes.
    """

    _UNIQUE = (torch.ops.aten._unique2.default, torch.ops.aten.unique_dim.default,
               torch.ops.aten.unique_consecutive.default)
    _SELECT = (torch.ops.aten.nonzero.default, torch.ops.aten.masked_select.default,
               torch.ops.aten.index.Tensor, *_UNIQUE)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch._subclasses.fake_tensor import DynamicOutputShapeException

        try:
            return func(*args, **(kwargs or {}))
        except DynamicOutputShapeException:
            if func not in self._SELECT:
                raise
        if func is torch.ops.aten.nonzero.default:
            x = args[0]
            return torch.empty((x.numel(), x.dim()), dtype=torch.long, device=x.device)
        if func is torch.ops.aten.masked_select.default:
            x, mask = args[0], args[1]
            return x.new_empty((torch.broadcast_shapes(x.shape, mask.shape).numel(),))
        if func in self._UNIQUE:
            return self._unique(func, args, kwargs or {})
        # index with boolean masks: each mask as the index tensors of its every element (torch expands a
        # mask into its nonzero indices, one index tensor per dimension it spans), then indexed as usual
        x, indices = args[0], []
        for index in args[1]:
            if index is not None and index.dtype in (torch.bool, torch.uint8):
                indices.extend(torch.empty(index.numel(), dtype=torch.long, device=index.device)
                               for _ in range(index.dim()))
            else:
                indices.append(index)
        return func(x, indices)


    @staticmethod
    def _unique(func: Any, args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``unique``'s values, inverse and counts with every value distinct; the inverse and counts
        empty where not asked for, as ATen returns them (along a dimension, always both)."""
        names = {torch.ops.aten._unique2.default: ("sorted", "return_inverse", "return_counts"),
                 torch.ops.aten.unique_dim.default: ("dim", "sorted", "return_inverse", "return_counts"),
                 torch.ops.aten.unique_consecutive.default: ("return_inverse", "return_counts", "dim")}[func]
        given = {**dict(zip(names, args[1:])), **kwargs}
        x, dim = args[0], given.get("dim")
        long = dict(dtype=torch.long, device=x.device)
        if dim is None:
            n = x.numel()
            inverse = torch.empty(x.shape if given.get("return_inverse") else (0,), **long)
            return x.new_empty((n,)), inverse, torch.empty((n if given.get("return_counts") else 0,), **long)
        n = x.shape[dim]
        return x.new_empty(x.shape), torch.empty((n,), **long), torch.empty((n,), **long)


@contextmanager
def _quiet_fake_tensor_log() -> Iterator[None]:
    """torch logs an op its fake tensors cannot run (a kernel with no meta function, a dtype it
    refuses) at ERROR with the whole traceback; the trace's own failure says it in one line."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


class _FakeBackend(SimulatedBackend):
    """A backend whose trials run on fake tensors: peaks are exact storage bytes, no budget.

    The simulated backend's storage counter, entered under ``FakeTensorMode``: its
    ``reset_peak``/``peak``/``allocated_bytes`` are the simulated backend's own.
    """

    def __init__(self, fake_mode: Any, fused_attention: bool, capacity: int = 1 << 62, log: Any = None,
                 cuda_autocast: bool = True, recomputed: bool = False, host_apart: bool = False):
        # By default no budget: the search's capacity is the GPU's, not this one's. A sharded
        # trial (track_deferred) compares its peak with ``capacity`` at the step's end instead.
        super().__init__(capacity)
        self.fake_mode = fake_mode
        if host_apart:  # the GPU's tensors on cpu:0 (counted), the host's on cpu (not): see fake_backend
            self.device = self._tracker.device = GPU_APART
        # Gradient checkpointing recomputes the forward in backward, where these modes are not
        # entered: the fused attention and the GPU's dropout would save other tensors than the
        # recompute makes (torch refuses). Both keep the CPU's kernels then, which errs small.
        self.recomputed = recomputed
        self.fused_attention = fused_attention and not recomputed
        # Mixed precision casts and attention kernels as on a GPU (else as on this CPU, where the trials run).
        self.cuda_autocast = cuda_autocast
        if log is not None:  # an AllocationLog records each storage's request and free, in order
            self._tracker.allocator = log

    def info(self) -> DeviceInfo:
        return DeviceInfo("fake", "fake tensors", None, None, None, None, self.capacity())

    def _enter_modes(self, stack: ExitStack) -> None:
        """What a traced step runs under, plain or sharded: fake tensors, a stand-in where a value is
        read (Adafactor's step count, a wrapper's overflow check), a GPU's attention and casts."""
        stack.enter_context(_quiet_fake_tensor_log())
        stack.enter_context(self.fake_mode)
        stack.enter_context(_WorstCaseSizes())
        stack.enter_context(_ZeroScalars())
        if self.device == GPU_APART:
            stack.enter_context(_DataOnTheGpuApart())
        if self.fused_attention:
            stack.enter_context(_FusedAttention(as_on_cpu=not self.cuda_autocast))
        if self.cuda_autocast:
            stack.enter_context(cuda_policy())
            if not self.recomputed:
                stack.enter_context(_GpuDropout())

    @contextmanager
    def track(self, resident: Sequence[torch.Tensor] = ()) -> Iterator[None]:
        with ExitStack() as stack:
            self._enter_modes(stack)
            self._tracker.add(resident)
            self._tracker.reset_peak()
            stack.enter_context(self._tracker)
            yield

    @contextmanager
    def track_deferred(self, resident: Sequence[torch.Tensor] = ()) -> Iterator[None]:
        with ExitStack() as stack:
            self._enter_modes(stack)
            stack.enter_context(super().track_deferred(resident))
            yield


def fake_backend(model: torch.nn.Module, capacity: int, *, fused_attention: bool = True, log: Any = None,
                 cuda_autocast: bool = True, recomputed: bool = False, host_apart: bool = False,
                 ) -> SimulatedBackend | None:
    """A backend whose trials run ``model``'s step on fake tensors against ``capacity``; ``None``
    when ``model`` is not built on fake tensors (see :func:`load_fake_model`).

    Sharded trials (:func:`autobatch.probe_sharded`) on it cost no memory and the same time at
    any batch; they decide fit at the step's end from the traced peak. A ``log``
    (:class:`~autobatch.estimating.replay.AllocationLog`) records every request and free.
    ``recomputed``: the step recomputes its forward in backward (gradient checkpointing).

    ``host_apart``: the trials run on :data:`GPU_APART` (``cpu:0``), a device of their own, and only
    its tensors count; what a wrapper offloads goes to ``cpu``, the host, as it would from a GPU
    (DeepSpeed's ``offload_optimizer`` and ``offload_param``: :mod:`autobatch.distributed.zero`).
    A fake tensor keeps its device's index, so the two never mix, as a GPU's and the host's do not.
    """
    mode = _mode_of(model)
    return None if mode is None else _FakeBackend(mode, fused_attention, capacity, log=log, cuda_autocast=cuda_autocast,
                                                  recomputed=recomputed, host_apart=host_apart)


def _new_fake_mode() -> Any:
    from torch._subclasses.fake_tensor import FakeTensorMode

    # Batches are built inside the mode, so real inputs never appear; the model is converted.
    return FakeTensorMode(allow_non_fake_inputs=False)


def _mode_of(model: Any) -> Any:
    from torch._subclasses.fake_tensor import FakeTensor

    if isinstance(model, torch.nn.Module):
        for p in model.parameters():
            return p.fake_mode if isinstance(p, FakeTensor) else None
    return None

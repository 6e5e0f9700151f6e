"""CUDA's autocast policy for a step traced on the CPU: the dtypes a GPU's mixed precision makes.

A trace (and an estimate's real CPU steps) runs under ``torch.autocast("cpu")``, whose op lists
are not CUDA's: in bf16 the CPU keeps ``softmax`` and ``layer_norm`` in bf16 where CUDA computes
them in float32, so every attention probability and normalised activation saved for the backward
took half the bytes it takes on the GPU. On an H200, gpt2 at 1024 tokens in bf16 fits 93 while the
CPU-policy trace estimated 110 (``docs/benchmarks/gpu.md``).

:func:`cuda_policy` replaces, while it is entered, the CPU's autocast kernels with CUDA's rules for
the ops CUDA's autocast handles (torch's ``ATen/autocast_mode.h``: ``AT_FORALL_FP32``,
``AT_FORALL_FP32_SET_OPT_DTYPE``, ``AT_FORALL_LOWER_PRECISION_FP``; the overloads are the ones
registered for the ``AutocastCUDA`` key), and lets ``cross_entropy_loss`` decompose as it does on
CUDA (a float32 ``log_softmax``) instead of the CPU's float32 copy of the logits first. Ops only the
CPU casts to float32 (linear algebra, FFT, 3-D pooling) keep the CPU's rule: that over-counts, so
the estimate errs small. The lower-precision casts of ops the CPU does not cast are not cached
across a step as CUDA caches weight casts (those ops are rare in models: ``einsum``, ``mv``).

The kernels are registered for the whole process while any thread is inside the context (nested
entries share them); a thread outside it keeps the CPU's rules, so a trace beside real CPU trials
(:mod:`.background`) leaves the trials' casts alone.
"""

from __future__ import annotations

import functools
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["cuda_policy", "FP32", "FP32_SET_OPT_DTYPE", "LOWER_PRECISION"]

# torch's ATen/autocast_mode.h, the lists CUDA's autocast kernels are made from.
FP32 = frozenset({
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt", "sinh",
    "tan", "pow", "softplus", "layer_norm", "native_layer_norm", "rms_norm", "group_norm", "frobenius_norm",
    "nuclear_norm", "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d",
    "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss", "margin_ranking_loss",
    "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss",
    "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp", "upsample_nearest1d",
    "_upsample_nearest_exact1d", "upsample_nearest2d", "_upsample_nearest_exact2d", "upsample_nearest3d",
    "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d", "_upsample_bilinear2d_aa",
    "upsample_trilinear3d", "upsample_bicubic2d", "_upsample_bicubic2d_aa",
    "norm",  # AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE: float32 too (by an appended dtype)
})
FP32_SET_OPT_DTYPE = frozenset({
    "prod", "softmax", "log_softmax", "cumprod", "cumsum", "linalg_vector_norm", "linalg_matrix_norm", "sum",
})
LOWER_PRECISION = frozenset({
    "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d", "conv_transpose2d",
    "conv_transpose3d", "convolution", "prelu", "addmm", "addmv", "addr", "matmul", "einsum", "mm", "mv",
    "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot",
    "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
    "_scaled_dot_product_flash_attention", "scaled_dot_product_attention",
})
# Cast to float32 by the CPU's autocast, decomposed by CUDA's (into a float32 log_softmax and nll_loss).
_CPU_ONLY = ("cross_entropy_loss",)

_LOWER = (torch.float16, torch.bfloat16)
_lock = threading.Lock()
_local = threading.local()  # how deep this thread is inside cuda_policy()
_entered = 0
_library: Any = None


def _overloads(key: str) -> list[str]:
    return [name[len("aten::"):] for name in torch._C._dispatch_get_all_op_names()
            if name.startswith("aten::") and torch._C._dispatch_has_kernel_for_dispatch_key(name, key)]


def _eligible(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point() and value.device.type == "cpu" and (
        value.dtype != torch.float64)


def _cast(value: Any, dtype: torch.dtype, only_lower: bool = False) -> Any:
    """A tensor argument cast as CUDA's ``cached_cast`` casts it (a list of tensors, each)."""
    if _eligible(value) and (not only_lower or value.dtype in _LOWER) and value.dtype != dtype:
        return value.to(dtype)
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, torch.Tensor) or v is None for v in value):
        return type(value)(_cast(v, dtype, only_lower) for v in value)
    return value


def _cast_all(args: tuple[Any, ...], kwargs: dict[str, Any], dtype: torch.dtype, only_lower: bool = False):
    return (tuple(_cast(a, dtype, only_lower) for a in args),
            {k: _cast(v, dtype, only_lower) for k, v in kwargs.items()})


def _no_autocast() -> Any:
    return torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU))


def _kernel(op: Any, rule: str, cpu_rule: str):
    """The op's kernel for the ``AutocastCPU`` key: ``rule`` (CUDA's) in a thread inside
    :func:`cuda_policy`, ``cpu_rule`` (what the CPU's own kernel did) in any other thread."""
    names = [a.name for a in op._schema.arguments]
    dtype_at = names.index("dtype") if "dtype" in names else None

    def to_fp32(keyset, *args, **kwargs):
        args, kwargs = _cast_all(args, kwargs, torch.float32, only_lower=True)
        with _no_autocast():
            return op(*args, **kwargs)

    def fp32_by_dtype(keyset, *args, **kwargs):
        given = kwargs.get("dtype") if dtype_at is None or len(args) <= dtype_at else args[dtype_at]
        with _no_autocast():
            if given is None and _eligible(args[0]):
                if dtype_at is not None and len(args) > dtype_at:
                    args = (*args[:dtype_at], torch.float32, *args[dtype_at + 1:])
                else:
                    kwargs = {**kwargs, "dtype": torch.float32}
            return op(*args, **kwargs)

    def to_lower(keyset, *args, **kwargs):
        args, kwargs = _cast_all(args, kwargs, torch.get_autocast_dtype("cpu"))
        with _no_autocast():
            return op(*args, **kwargs)

    def as_is(keyset, *args, **kwargs):
        # Past the autocast key for this op alone: the ops it decomposes into are cast as usual.
        return op.redispatch(keyset.remove(torch._C.DispatchKey.AutocastCPU), *args, **kwargs)

    rules = {"fp32": to_fp32, "fp32_by_dtype": fp32_by_dtype, "lower": to_lower, "as_is": as_is}
    cuda, cpu = rules[rule], rules[cpu_rule]

    def kernel(keyset, *args, **kwargs):
        return (cuda if getattr(_local, "inside", 0) else cpu)(keyset, *args, **kwargs)

    return kernel


def _rule(overload: str, cpu_casts: set[str]) -> str | None:
    base = overload.split(".")[0]
    if base in FP32_SET_OPT_DTYPE:
        return "fp32_by_dtype"
    if base in FP32:
        return "fp32"
    if base in LOWER_PRECISION:
        return None if overload in cpu_casts else "lower"  # the CPU casts these as CUDA does
    return None  # promoted (the CPU's rule is the same) or refused by CUDA (binary_cross_entropy)


@functools.cache
def _kernels() -> tuple[tuple[str, Any], ...]:
    """Each overload to replace and its kernel: read once from the dispatcher, before any is replaced
    (the op lists do not change within a process; registering is what each entry repeats)."""
    cpu_casts = set(_overloads("AutocastCPU"))
    wanted = [(name, _rule(name, cpu_casts)) for name in _overloads("AutocastCUDA")]
    wanted += [(name, "as_is") for name in cpu_casts if name.split(".")[0] in _CPU_ONLY]
    kernels = []
    for name, rule in wanted:
        if rule is None:
            continue
        base, _, overload = name.partition(".")
        op = getattr(getattr(torch.ops.aten, base), overload or "default")
        if op._schema.is_mutable or any(a.is_out for a in op._schema.arguments):
            continue
        # Other threads keep the CPU's rule: float32 where its own kernel cast (its list has no
        # lower-precision op this replaces), else none.
        cpu_rule = "fp32" if name in cpu_casts else "as_is"
        kernels.append((name, _kernel(op, rule, cpu_rule)))
    return tuple(kernels)


def _register() -> Any:
    library = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():  # torch warns that a kernel is replaced: that is the point
        warnings.simplefilter("ignore")
        for name, kernel in _kernels():
            library.impl(name, kernel, "AutocastCPU", with_keyset=True)
    return library


@contextmanager
def cuda_policy() -> Iterator[None]:
    """While entered, ``torch.autocast("cpu")`` casts as ``torch.autocast("cuda")`` would.

    Example:
        >>> x = torch.randn(2, 8)
        >>> with torch.autocast("cpu", dtype=torch.bfloat16), cuda_policy():
        ...     torch.softmax(x @ x.T, -1).dtype
        torch.float32
    """
    global _entered, _library
    with _lock:
        if _entered == 0:
            _library = _register()
        _entered += 1
    _local.inside = getattr(_local, "inside", 0) + 1
    try:
        yield
    finally:
        _local.inside -= 1
        with _lock:
            _entered -= 1
            if _entered == 0:
                _library._destroy()
                _library = None

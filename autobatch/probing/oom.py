"""Out-of-memory detection: one tiny pure function.

Everything the probe catches goes through :func:`is_oom_error`; any exception for which it
returns ``False`` is re-raised untouched.
"""

from __future__ import annotations

__all__ = ["is_oom_error"]

# Messages of allocators that signal OOM as a plain RuntimeError instead of torch.OutOfMemoryError.
_OOM_MESSAGES = (
    "CUDA out of memory.",                                 # older torch, CUDA caching allocator
    "CUDA error: out of memory",                           # OOM inside a CUDA kernel launch
    "HIP out of memory.",                                  # ROCm
    "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED.",            # cuDNN's way of saying "no workspace"
    "CUBLAS_STATUS_ALLOC_FAILED",                          # cuBLAS handle/workspace allocation
    "CUDNN_STATUS_ALLOC_FAILED",
    "MPS backend out of memory",
    "XPU out of memory.",
    "DefaultCPUAllocator: can't allocate memory",
)


def is_oom_error(exc: BaseException) -> bool:
    """True when ``exc`` means the device ran out of memory, and nothing else.

    >>> is_oom_error(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    True
    >>> is_oom_error(ValueError("Expected more than 1 value per channel when training"))
    False
    """
    import torch

    if isinstance(exc, torch.OutOfMemoryError):
        return True
    if type(exc) is not RuntimeError or len(exc.args) != 1 or not isinstance(exc.args[0], str):
        return False
    return any(message in exc.args[0] for message in _OOM_MESSAGES)

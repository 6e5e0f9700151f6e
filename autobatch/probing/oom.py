"""Out-of-memory detection: one tiny pure function.

Everything the probe catches goes through :func:`is_oom_error`; any exception for which it
returns ``False`` is re-raised untouched. :func:`oom_message` is what every catcher does next
with one that is.
"""

from __future__ import annotations

import traceback

__all__ = ["is_oom_error", "oom_message"]

# Messages of allocators and libraries that signal OOM as a RuntimeError (or a subclass such as
# torch.AcceleratorError, which C10_CUDA_CHECK raises since torch 2.8) instead of OutOfMemoryError,
# for every accelerator torch and accelerate know (accelerate's should_reduce_batch_size lists the
# same devices). Two of accelerate's are left out on purpose: cuDNN's CUDNN_STATUS_NOT_SUPPORTED is
# an unsupported configuration, not a full device (retrying smaller hides a real error), and host
# RAM running out ("DefaultCPUAllocator: can't allocate memory") is not the device running out.
_OOM_MESSAGES = (
    "CUDA out of memory.",                                 # older torch, CUDA caching allocator
    "CUDA error: out of memory",                           # OOM inside a CUDA kernel launch
    "HIP out of memory.",                                  # ROCm
    "XPU out of memory.",                                  # Intel GPUs
    "NPU out of memory.",                                  # Ascend (torch_npu)
    "MLU out of memory.",                                  # Cambricon (torch_mlu)
    "MPS backend out of memory",                           # Apple
    "FATAL ERROR :: MODULE:PT_DEVMEM Allocation failed",   # Gaudi (HPU)
    "CUBLAS_STATUS_ALLOC_FAILED",                          # cuBLAS handle/workspace allocation
    "CUDNN_STATUS_ALLOC_FAILED",                           # cuDNN workspace allocation
)


def is_oom_error(exc: BaseException) -> bool:
    """True when ``exc`` means the device ran out of memory, and nothing else.

    A RuntimeError that wraps another exception (``torch.compile``'s and DDP's errors do, as
    ``__cause__`` or ``__context__``) is an OOM when what it wraps is one.

    >>> is_oom_error(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    True
    >>> is_oom_error(ValueError("Expected more than 1 value per channel when training"))
    False
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if _is_communication_error(current):
            return False  # a collective that failed is never "does not fit": the ranks would disagree
        if _is_oom(current):
            return True
        if not isinstance(current, RuntimeError):
            return False  # only wrappers are followed: a KeyError raised while handling an OOM is a KeyError
        current = current.__cause__ or current.__context__
    return False


def _is_oom(exc: BaseException) -> bool:
    import torch

    if isinstance(exc, torch.OutOfMemoryError):
        return True
    if not isinstance(exc, RuntimeError) or len(exc.args) != 1 or not isinstance(exc.args[0], str):
        return False
    return any(message in exc.args[0] for message in _OOM_MESSAGES)


def _is_communication_error(exc: BaseException) -> bool:
    import torch.distributed as dist

    return dist.is_available() and isinstance(exc, dist.DistError)


def oom_message(exc: BaseException, limit: int = 300) -> str:
    """The first line of an out-of-memory error, once its traceback's frames are cleared.

    The frames hold the failed step's tensors: they must go before anything is measured or tried
    again. Call it only for an ``exc`` that :func:`is_oom_error` accepted.
    """
    traceback.clear_frames(exc.__traceback__)
    return str(exc).splitlines()[0][:limit] if str(exc) else type(exc).__name__

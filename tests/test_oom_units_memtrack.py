from __future__ import annotations

import pytest
import torch

from autobatch import AutobatchError, MemoryTracker, format_bytes, is_oom_error, parse_bytes


@pytest.mark.parametrize(
    "exc, expected",
    [
        (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), True),
        (RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB"), True),
        (RuntimeError("CUDA error: out of memory"), True),
        # cuDNN's "not supported" is a configuration it cannot run, not a full device: accelerate retries
        # smaller on it, which hides the real error; it is re-raised untouched here.
        (RuntimeError("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a non-contiguous input."), False),
        # Every accelerator torch and accelerate know, in the words their allocators use.
        (RuntimeError("HIP out of memory. Tried to allocate 2.00 GiB"), True),
        (RuntimeError("XPU out of memory. Tried to allocate 2.00 GiB"), True),
        (RuntimeError("NPU out of memory. Tried to allocate 2.00 GiB (NPU 0; 60.00 GiB total capacity)"), True),
        (RuntimeError("MLU out of memory. Tried to allocate 2.00 GiB"), True),
        (RuntimeError("MPS backend out of memory (MPS allocated: 17.00 GB, other allocations: 1.00 GB)"), True),
        (RuntimeError("FATAL ERROR :: MODULE:PT_DEVMEM Allocation failed for size::2147483648 (2048)MB"), True),
        (RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"), True),
        (RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"), True),
        # The host's RAM is not the device's memory (the simulated backend reports it apart).
        (RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
                      "you tried to allocate 1 bytes. Error code 12 (Cannot allocate memory)"), False),
        (ValueError("Expected more than 1 value per channel when training"), False),
        (RuntimeError("mat1 and mat2 shapes cannot be multiplied"), False),
        (RuntimeError("CUDA out of memory.", "second arg"), False),
        (KeyError("CUDA out of memory."), False),
    ],
)
def test_is_oom_error(exc, expected):
    assert is_oom_error(exc) is expected


def _raised(make):
    try:
        make()
    except BaseException as exc:  # noqa: BLE001 - the test wants the exception object as raised
        return exc
    raise AssertionError("nothing raised")


def _wrapped_oom_explicitly():
    try:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB")
    except torch.OutOfMemoryError as oom:
        raise RuntimeError("backend='inductor' raised: compiled graph failed") from oom


def _wrapped_oom_implicitly():
    try:
        raise torch.AcceleratorError("CUDA error: out of memory")
    except RuntimeError:
        raise RuntimeError("DDP reducer: error while running the backward hook")


def _key_error_while_handling_an_oom():
    try:
        raise torch.OutOfMemoryError("CUDA out of memory.")
    except torch.OutOfMemoryError:
        raise KeyError("labels")


@pytest.mark.parametrize(
    "make, expected",
    [
        # torch >= 2.8 raises AcceleratorError (a RuntimeError subclass) from C10_CUDA_CHECK.
        (lambda: torch.AcceleratorError(
            "CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported at some other API call"), True),
        (lambda: torch.AcceleratorError("CUDA error: an illegal memory access was encountered"), False),
        (lambda: torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity"), True),
        (lambda: torch.cuda.OutOfMemoryError("CUDA out of memory."), True),
        (lambda: RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"), True),
        (lambda: RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"), True),
        (lambda: RuntimeError("CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasSgemm`"), False),
        (lambda: RuntimeError("cuDNN error: CUDNN_STATUS_BAD_PARAM"), False),
        # A collective's failure is the ranks' business, whatever its text says.
        (lambda: torch.distributed.DistBackendError(
            "NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled cuda error, NCCL version 2.21.5\n"
            "Last error:\nCuda failure 'out of memory' CUDA out of memory."), False),
        (lambda: torch.distributed.DistBackendError("[Rank 1] Watchdog caught collective operation timeout"), False),
        (lambda: _raised(_wrapped_oom_explicitly), True),
        (lambda: _raised(_wrapped_oom_implicitly), True),
        (lambda: _raised(_key_error_while_handling_an_oom), False),
        (lambda: RuntimeError("out of memory"), False),
        (lambda: MemoryError(), False),
        (lambda: ValueError("CUDA out of memory."), False),
    ],
)
def test_is_oom_error_on_real_torch_exceptions(make, expected):
    assert is_oom_error(make()) is expected


def test_parse_and_format_bytes():
    assert parse_bytes("2GiB") == 2 * 1024**3
    assert parse_bytes("1.5G") == int(1.5 * 1024**3)
    assert parse_bytes("500MB") == 500_000_000
    assert parse_bytes(1024) == 1024
    assert format_bytes(3 * 1024**3) == "3.00 GiB"
    # from 1000 to 1023 of a unit, a whole number, not '1.02e+03 KiB' (tried as a new user would)
    assert [format_bytes(n * 1024) for n in (99.5, 512, 999.7, 1020)] == ["99.50 KiB", "512 KiB", "1000 KiB", "1020 KiB"]
    assert format_bytes(2**20 - 1) == "1.00 MiB" and format_bytes(2**20 - 1024) == "1023 KiB"
    with pytest.raises(AutobatchError, match="memory must be a number with an optional unit"):
        parse_bytes("lots")
    with pytest.raises(AutobatchError, match="memory must be positive"):
        parse_bytes("0GiB")


def test_tracker_counts_storages_once_and_frees_them():
    tracker = MemoryTracker()
    with tracker:
        x = torch.zeros(256)
        view = x[:10]  # noqa: F841  (a view shares the storage)
        y = x + 1
    assert tracker.current_bytes == 2 * 1024
    del y
    assert tracker.current_bytes == 1024
    assert tracker.peak_bytes == 2 * 1024


def test_tracker_budget_raises_a_cuda_style_oom():
    tracker = MemoryTracker(budget=1000)
    with pytest.raises(torch.OutOfMemoryError) as info:
        with tracker:
            torch.zeros(1000)
    assert is_oom_error(info.value) and "CUDA out of memory." in str(info.value)


def test_oom_message_is_the_first_line_and_frees_the_failed_steps_frames() -> None:
    import gc
    import weakref

    from autobatch.probing.oom import oom_message

    def step() -> None:
        activations = torch.zeros(1000)
        held.append(weakref.ref(activations))
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore detail")

    held: list = []
    try:
        step()
    except Exception as exc:
        assert oom_message(exc) == "CUDA out of memory. Tried to allocate 2.00 GiB"
        gc.collect()
        assert held[0]() is None  # the frame's tensor is gone while the error is still in hand

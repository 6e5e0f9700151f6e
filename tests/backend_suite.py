"""The contract of :class:`autobatch.probing.backends.MemoryBackend`, as tests every backend must pass.

A backend's test module subclasses :class:`BackendContract` and provides ``backend`` (a fresh
backend whose capacity a small MLP step at batch 512 fits in). The batch that must not fit is
derived from the capacity (:func:`failing_batch`), so the suite holds on a GPU of any size.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from autobatch import DeviceInfo, MemoryBackend, Workload, is_oom_error
from autobatch.probing.trial import run_trial
from tests.tiny import mlp, mlp_workload


def failing_batch(backend: MemoryBackend) -> int:
    """A batch of the MLP whose inputs alone (64 fp32 values a sample) exceed the device's capacity."""
    return backend.capacity() // (64 * 4) + 1


def on_the_device(work: Workload, backend: MemoryBackend) -> Workload:
    """``work`` with its batches made on the backend's device: a batch larger than a 141 GB card
    is refused there, where made in host memory first it took the host's 128 GiB and the
    kernel killed the run (seen on an H200)."""
    return replace(work, make_batch=lambda b: (torch.randn(b, 64, device=backend.device),
                                               torch.randint(0, 10, (b,), device=backend.device)))


class BackendContract:
    @pytest.fixture
    def backend(self) -> MemoryBackend:  # pragma: no cover - overridden
        raise NotImplementedError

    @pytest.fixture
    def model(self, backend):
        return mlp().to(backend.device)

    def test_capacity_is_positive_and_stable(self, backend):
        assert backend.capacity() > 0
        assert backend.capacity() == backend.capacity()

    def test_info_describes_the_device(self, backend):
        info = backend.info()
        assert isinstance(info, DeviceInfo)
        assert info.capacity_bytes == backend.capacity()
        assert info.name and info.kind in ("cuda", "simulated")
        assert set(info.to_dict()) >= {"name", "total_bytes", "free_bytes", "used_by_others_bytes", "host"}

    def test_peak_counts_resident_tensors_and_grows_with_batch(self, backend, model):
        work = mlp_workload(model)
        small = run_trial(work, model, backend, 8)
        large = run_trial(work, model, backend, 512)
        params = sum(p.numel() * p.element_size() for p in model.parameters())
        assert small.fits and large.fits
        assert small.peak_bytes >= params
        assert large.peak_bytes > small.peak_bytes
        assert large.forward_backward_bytes > small.forward_backward_bytes
        assert small.reserved_bytes >= small.peak_bytes

    def test_the_forward_end_holds_the_resident_memory_and_the_activations(self, backend, model):
        # What the backward will use, read between the forward and the backward: above what stays between
        # steps, below the step's peak (the backward adds gradients), and growing with the batch.
        work = mlp_workload(model)
        small, large = run_trial(work, model, backend, 8), run_trial(work, model, backend, 512)
        for trial in (small, large):
            assert trial.resident_bytes < trial.forward_bytes <= trial.peak_bytes
        assert large.forward_bytes - large.resident_bytes > 32 * (small.forward_bytes - small.resident_bytes)
        failed = run_trial(on_the_device(work, backend), model, backend, failing_batch(backend))
        assert not failed.fits and failed.forward_bytes == 0  # a failed trial's figures are not a curve's

    def test_running_out_raises_an_oom_error_inside_track(self, backend):
        with pytest.raises(Exception) as info:
            with backend.track():
                torch.empty(backend.capacity() + (1 << 20), dtype=torch.uint8, device=backend.device)
        assert is_oom_error(info.value)

    def test_peak_is_readable_after_an_oom_and_resets(self, backend):
        with backend.track():
            backend.reset_peak()
            x = torch.ones(1 << 20, dtype=torch.uint8, device=backend.device)
            assert backend.peak().allocated >= (1 << 20)
            del x
            backend.reset_peak()
            assert backend.peak().allocated < (1 << 20) + backend.allocated_bytes() + 1

    def test_failed_trial_returns_memory_to_baseline(self, backend, model):
        work = on_the_device(mlp_workload(model), backend)
        assert run_trial(work, model, backend, 4).fits  # the model is now known to the device
        baseline = backend.allocated_bytes()
        trial = run_trial(work, model, backend, failing_batch(backend))
        assert not trial.fits and trial.error
        assert backend.allocated_bytes() == baseline
        assert run_trial(work, model, backend, 4).fits
        assert backend.allocated_bytes() == baseline

    def test_non_oom_errors_propagate_untouched(self, backend, model):
        def broken(_model, _batch):
            raise KeyError("labels")

        work = mlp_workload(model)
        work = type(work)(work.model, work.make_batch, loss_fn=broken)
        with pytest.raises(KeyError, match="labels"):
            run_trial(work, model, backend, 4)

    def test_deferred_tracking_counts_the_same_and_either_defers_or_raises_an_oom(self, backend):
        # A sharded trial compares the peak with capacity at the step's end; a backend that cannot
        # defer (a real GPU) raises as track() does.
        size = backend.capacity() + (1 << 20)
        try:
            with backend.track_deferred():
                x = torch.empty(size, dtype=torch.uint8, device=backend.device)
                assert backend.peak().allocated >= size
                del x
        except Exception as exc:  # noqa: BLE001 - the contract allows a real OOM here
            assert is_oom_error(exc)
        else:
            assert backend.peak().reserved > backend.capacity()

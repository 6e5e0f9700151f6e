"""The CUDA backend's own code on an emulated GPU (tests/emulated_cuda.py), in the default CPU run."""

from __future__ import annotations

import os

import pytest
import torch

from autobatch import AutobatchError, CudaBackend, NoBatchFitsError, Workload, probe
from autobatch.probing.backends.cuda import nvml_usage
from autobatch.distributed import probe_distributed, process_group
from autobatch.distributed.agreement import comm_device
from autobatch.probing.preserve import borrowed_model
from autobatch.probing.probe import make_backend
from autobatch.probing.trial import run_trial
from tests.backend_suite import BackendContract
from tests.emulated_cuda import EmulatedGpu, emulated, emulated_cuda  # noqa: F401 - a fixture
from tests.tiny import mlp, mlp_workload

MIB, GIB = 1 << 20, 1 << 30
pytestmark = pytest.mark.usefixtures("frozen_suite_heap")  # the backend collects garbage per probe


class TestEmulatedCudaBackend(BackendContract):
    @pytest.fixture
    def backend(self, monkeypatch):
        with emulated([EmulatedGpu(0, total_bytes=64 * MIB, context_bytes=0)], patch=monkeypatch):
            yield CudaBackend()


def test_the_emulation_books_device_tensors_and_only_those(emulated_cuda):
    host = torch.ones(1000)
    assert torch.cuda.memory_allocated() == 0
    device = host.to("cuda")
    assert torch.cuda.memory_allocated() == 4096 and torch.cuda.memory_reserved() == 2 * MIB
    doubled = device * 2                      # made from a GPU tensor: on the GPU
    back = doubled.cpu() + 1                  # a copy to the host, and host arithmetic: not booked
    assert torch.cuda.memory_allocated() == 2 * 4096
    del device, doubled
    assert torch.cuda.memory_allocated() == 0 and torch.cuda.memory_reserved() == 2 * MIB
    torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved() == 0 and back.sum().item() == 3000


@pytest.mark.parametrize("local_rank", range(8))
def test_an_index_less_cuda_under_a_launcher_is_the_local_ranks_gpu(monkeypatch, local_rank):
    for name, value in (("RANK", local_rank), ("LOCAL_RANK", local_rank), ("WORLD_SIZE", 8)):
        monkeypatch.setenv(name, str(value))
    with emulated(8, patch=monkeypatch):
        backend = make_backend("cuda")
        assert backend.device == torch.device("cuda", local_rank)
        assert backend.info().index == local_rank
        assert torch.cuda.current_device() == 0  # resolved without touching the current device


def test_an_index_less_cuda_with_one_visible_gpu_per_task_is_that_gpu(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "5")  # e.g. SLURM: each task sees one GPU, as cuda:0
    with emulated(1, patch=monkeypatch):
        assert make_backend("cuda").device == torch.device("cuda", 0)


def test_a_local_rank_beyond_the_visible_gpus_is_one_clear_error(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "9")
    with emulated(8, patch=monkeypatch):
        with pytest.raises(AutobatchError, match="LOCAL_RANK=9 but only 8 GPUs are visible"):
            make_backend("cuda")


def test_capacity_honours_the_per_process_memory_fraction(monkeypatch):
    with emulated([EmulatedGpu(0, total_bytes=GIB, context_bytes=100 * MIB)], patch=monkeypatch):
        assert CudaBackend().capacity() == GIB - 100 * MIB
        torch.cuda.set_per_process_memory_fraction(0.25, 0)
        assert CudaBackend().capacity() == GIB // 4


def test_nvml_counts_only_other_processes_and_says_unknown_in_another_pid_namespace(monkeypatch):
    gpu = dict(total_bytes=GIB, others_bytes=256 * MIB)
    with emulated([EmulatedGpu(0, **gpu)], patch=monkeypatch):
        assert CudaBackend().info().used_by_others_bytes == 256 * MIB
    # In a container NVML lists host PIDs: ours is not among them, so nothing can be told apart.
    with emulated([EmulatedGpu(0, **gpu)], nvml_pid=os.getpid() + 100_000, patch=monkeypatch):
        assert nvml_usage(0) is None
        assert CudaBackend().info().used_by_others_bytes is None


def test_after_a_probe_the_gpu_is_back_at_its_baseline(emulated_cuda):
    result = probe(mlp_workload(), CudaBackend(), max_batch=64)
    assert result.max_batch == 64
    # cuBLAS's workspace survives empty_cache; the backend releases it too.
    assert (torch.cuda.memory_allocated(), torch.cuda.memory_reserved()) == (0, 0)


def test_the_optimizer_phase_figure_leaves_out_the_forward_backward_cache(emulated_cuda):
    model, backend = mlp(), CudaBackend()
    work = mlp_workload(model)
    with borrowed_model(model, backend.device) as lent:
        small = run_trial(work, lent, backend, 8)
        large = run_trial(work, lent, backend, 4096)
    assert large.forward_backward_bytes > small.forward_backward_bytes
    # Parameters, gradients and optimizer state: the same at any batch, whatever the cache holds.
    assert large.optimizer_bytes == small.optimizer_bytes
    assert large.reserved_bytes >= large.peak_bytes >= large.optimizer_bytes
    # The forward's end, read from torch.cuda.memory_allocated between the forward and the backward: the
    # tensors the MLP saves (tests/test_backend_simulated.py counts them by hand: the input, two ReLU
    # outputs, the log-softmax, the labels, two scalars), each rounded up to the allocator's 512 bytes.
    def saved(b: int) -> int:
        return sum(-(-n // 512) * 512 for n in (256 * b, 1024 * b, 1024 * b, 40 * b, 8 * b, 4, 4))

    for trial in (small, large):
        assert trial.resident_bytes < trial.forward_bytes <= trial.peak_bytes
        assert trial.forward_bytes - trial.resident_bytes == saved(trial.batch)


def _no_launcher(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)


def test_capacity_is_read_after_the_communicator_has_taken_its_buffers(monkeypatch):
    _no_launcher(monkeypatch)
    gpu = EmulatedGpu(0, total_bytes=256 * MIB, context_bytes=0, nccl_bytes=96 * MIB)
    with emulated([gpu], patch=monkeypatch):
        backend = CudaBackend()
        assert backend.capacity() == 256 * MIB  # no collective has run yet
        with process_group("gloo", timeout_s=30):
            result = probe_distributed(mlp_workload(), backend, max_batch=8)
    assert result.capacity_bytes == 160 * MIB
    assert result.ranks[0].device.capacity_bytes == 160 * MIB


def test_the_agreement_runs_on_the_probed_gpu_not_the_current_one(monkeypatch):
    monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: "nccl")
    with emulated(4, patch=monkeypatch):
        backend = CudaBackend("cuda:3")
        assert torch.cuda.current_device() == 0
        assert comm_device(backend) == torch.device("cuda", 3)


def test_weights_that_do_not_fit_are_no_batch_fits_and_the_model_is_untouched(monkeypatch):
    with emulated([EmulatedGpu(0, total_bytes=8 * MIB, context_bytes=0)], patch=monkeypatch):
        model = torch.nn.Linear(1024, 4096)  # 16 MiB of weights
        before = {k: v.clone() for k, v in model.state_dict().items()}
        work = Workload(model, lambda b: (torch.randn(b, 1024), torch.randint(0, 4096, (b,))))
        with pytest.raises(NoBatchFitsError, match=r"the model's weights alone do not fit on NVIDIA Emulated GPU "
                                                   r"\(capacity 8.00 MiB\): CUDA out of memory. Tried to allocate 16.00 MiB;"):
            probe(work, CudaBackend())
        assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
        assert torch.cuda.memory_allocated() == 0


@pytest.mark.parametrize("total_gib", [8, 80, 141])
def test_the_backend_suites_failing_batch_cannot_fit_on_a_card_of_any_size(monkeypatch, total_gib):
    # The suite used batch 10**6 (its inputs ~0.25 GB, its trial ~4 GiB), which fits on a large GPU;
    # the batch it uses now is derived from the capacity, so its inputs alone exceed it.
    from tests.backend_suite import failing_batch

    with emulated([EmulatedGpu(0, total_bytes=total_gib << 30)], patch=monkeypatch):
        backend = make_backend("cuda:0")
        batch = failing_batch(backend)
        assert batch * 64 * 4 > backend.capacity()
        assert 10**6 * 64 * 4 < backend.capacity()  # what the old fixed batch asked for fits

from __future__ import annotations

import pytest
import torch

from autobatch import CudaBackend
from tests.backend_suite import BackendContract




@pytest.mark.gpu
class TestCudaBackend(BackendContract):
    @pytest.fixture
    def backend(self):
        return CudaBackend(0)


def test_cuda_backend_needs_a_gpu_message():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    from autobatch import AutobatchError

    with pytest.raises(AutobatchError, match="needs a CUDA GPU"):
        CudaBackend()

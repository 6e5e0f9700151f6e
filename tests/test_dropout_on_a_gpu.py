"""Dropout traced as a GPU runs it (a bool mask), checked by hand (against the H200: tests/test_allocator_replay.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from autobatch import Workload
from autobatch.estimating.estimate import fake_model, trace_trial
from autobatch.estimating.fake_backends import _new_fake_mode


class _Dropped(torch.nn.Module):
    def __init__(self, inplace: bool = False):
        super().__init__()
        self.up, self.down = torch.nn.Linear(64, 256), torch.nn.Linear(256, 1)
        self.drop = torch.nn.Dropout(0.1, inplace=inplace)

    def forward(self, x):
        return self.down(self.drop(self.up(x)))


def _forward_backward_peak(model: type, batch: int, gpu: bool, **kwargs) -> int:
    mode = _new_fake_mode()
    work = Workload(lambda: model(**kwargs), lambda b: torch.randn(b, 64), loss_fn=lambda m, x: m(x).sum())
    work = replace(work, model=fake_model(work.model, mode))
    return trace_trial(work, work.model, batch, fake_mode=mode, cuda_autocast=gpu).forward_backward_bytes


@pytest.mark.parametrize("batch", [100, 1000])
def test_a_gpus_dropout_keeps_a_byte_an_element_where_the_cpus_keeps_the_noise_in_its_dtype(batch):
    # the saved mask: bool on a GPU, float32 noise on the CPU: three bytes less an element
    gpu, cpu = _forward_backward_peak(_Dropped, batch, True), _forward_backward_peak(_Dropped, batch, False)
    assert cpu - gpu == 3 * 256 * batch
    # in place, both take the noise
    assert _forward_backward_peak(_Dropped, batch, True, inplace=True) == _forward_backward_peak(
        _Dropped, batch, False, inplace=True)

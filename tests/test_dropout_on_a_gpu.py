"""Dropout traced as a GPU runs it (a bool mask), checked by hand and against the allocated peaks an H200 measured."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from autobatch import Workload
from autobatch.estimating.estimate import fake_model, load_fake_model, trace_batches, trace_trial
from autobatch.estimating.fake_backends import _new_fake_mode

RECORD = Path(__file__).resolve().parents[1] / "docs/benchmarks/gpu.json"


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


# (record run, model, dtype, sequence length): find on the H200, whose trials hold the card's allocated peaks
CARD = [(0, "gpt2", None, 1024), (1, "gpt2", "bf16", 1024), (2, "bert-base", "bf16", 512)]


@pytest.mark.parametrize("run,name,dtype,seq_len", CARD, ids=["gpt2-fp32", "gpt2-bf16", "bert-base-bf16"])
def test_the_traced_allocated_peak_is_the_cards_at_every_batch_that_fit(run, name, dtype, seq_len):
    trials = [t for t in json.loads(RECORD.read_text())["runs"][run]["json"]["probe"]["trials"]
              if t["fits"] and t["batch"] > 1]
    work = load_fake_model(name, seq_len=seq_len).to_workload(dtype=dtype)
    curve = trace_batches(work, work.model, fake_mode=next(work.model.parameters()).fake_mode)
    for trial in trials:  # tensor bytes, no overheads: the caching allocator's max_memory_allocated
        traced = curve.trial(trial["batch"]).peak_bytes
        assert abs(traced / trial["peak_bytes"] - 1) < 0.001, (trial["batch"], traced, trial["peak_bytes"])

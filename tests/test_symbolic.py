"""One trace with the batch a symbol: its figures at every batch equal the trace at that batch, field by field."""

from __future__ import annotations

from dataclasses import replace

import importlib

import pytest
import torch

from autobatch import Workload
from autobatch.estimating.estimate import estimate, fake_model, load_fake_model, trace_batches, trace_trial
from autobatch.estimating.fake_backends import _new_fake_mode
from autobatch.estimating.overheads import Overheads
from tests.tiny import cnn_workload, lm_workload, mlp_workload

estimating = importlib.import_module("autobatch.estimating.estimate")  # the module (the package exports the function)
FIELDS = ("peak_bytes", "reserved_bytes", "forward_backward_bytes", "optimizer_bytes", "resident_bytes")
SMALL = {"mlp": mlp_workload, "lm": lm_workload, "cnn": cnn_workload}


def _fake(work: Workload) -> tuple[Workload, object]:
    mode = _new_fake_mode()
    return replace(work, model=fake_model(work.model, mode)), mode


def _same_at_every_batch(work: Workload, mode: object, batches=(2, 3, 7, 13)) -> None:
    curve = trace_batches(work, work.model, fake_mode=mode)
    assert curve is not None
    for batch in batches:
        assert curve.answers(batch), (batch, curve.guards)
        read, traced = curve.trial(batch), trace_trial(work, work.model, batch, fake_mode=mode)
        assert [getattr(read, f) for f in FIELDS] == [getattr(traced, f) for f in FIELDS], batch


@pytest.mark.parametrize("settings", [{}, {"dtype": "bf16"}, {"grads_held": True}], ids=["fp32", "bf16", "held"])
@pytest.mark.parametrize("name", list(SMALL))
def test_the_curve_equals_the_trace_at_each_batch(name, settings):
    work, mode = _fake(replace(SMALL[name](), **settings))
    _same_at_every_batch(work, mode)


@pytest.mark.parametrize("name,dtype", [("tiny-gpt2", None), ("tiny-llama", "bf16"), ("tiny-bert", None)])
def test_the_curve_equals_the_trace_for_transformers_models(name, dtype):
    work = load_fake_model(name).to_workload(dtype=dtype)
    _same_at_every_batch(work, next(work.model.parameters()).fake_mode, batches=(2, 5, 17))


class _Branchy(torch.nn.Module):
    """A step whose path the batch picks: a wider layer from 12 samples on."""

    def __init__(self):
        super().__init__()
        self.narrow, self.wide = torch.nn.Linear(64, 64), torch.nn.Linear(64, 4096)

    def forward(self, x):
        return self.narrow(x) if x.shape[0] < 12 else self.wide(x)


class _Halves(torch.nn.Module):
    """A size that is no polynomial in the batch (an even number of samples kept)."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(64, 64)

    def forward(self, x):
        return self.layer(x[: x.shape[0] // 2 * 2])


def _work(model: type) -> Workload:
    return Workload(model, lambda b: torch.randn(b, 64), loss_fn=lambda m, x: m(x).sum(), name=model.__name__)


def test_a_batch_the_trace_branched_on_is_traced_at_its_own_size_and_the_answer_is_the_same(monkeypatch):
    work, mode = _fake(_work(_Branchy))
    curve = trace_batches(work, work.model, fake_mode=mode)
    assert [curve.answers(b) for b in (1, 2, 11, 12, 40)] == [False, True, True, False, False]
    with_curve = estimate(_work(_Branchy), gpu_memory="1GiB", overheads=Overheads.none(), headroom=0)
    monkeypatch.setattr(estimating, "trace_batches", lambda *a, **k: None)
    per_batch = estimate(_work(_Branchy), gpu_memory="1GiB", overheads=Overheads.none(), headroom=0)
    assert [(t.batch, t.peak_bytes) for t in with_curve.trials] == [(t.batch, t.peak_bytes) for t in per_batch.trials]
    read = with_curve.extra["traced_once_for"]
    assert all(2 <= b < 12 for b in read)  # past the branch, each batch was traced at its size


def test_a_size_no_polynomial_in_the_batch_falls_back_to_a_trace_per_batch():
    work, mode = _fake(_work(_Halves))
    assert trace_batches(work, work.model, fake_mode=mode) is None
    result = estimate(_work(_Halves), gpu_memory="600MiB", overheads=Overheads.none())
    assert result.max_batch > 0 and result.extra["traced_once_for"] == []


# the batches read off the curve: all but 1 (size one broadcasts, so torch guards it out); the conv
# net's CPU convolution picks its path by the batch below 16, so from there each is traced alone
@pytest.mark.parametrize("name,read", [("lm", lambda b: b > 1), ("cnn", lambda b: 1 < b < 16)])
def test_an_estimate_read_off_the_curve_takes_the_same_trials_as_one_traced_batch_by_batch(name, read, monkeypatch):
    make = SMALL[name]
    with_curve = estimate(make(), gpu_memory="600MiB")
    monkeypatch.setattr(estimating, "trace_batches", lambda *a, **k: None)
    per_batch = estimate(make(), gpu_memory="600MiB")
    # read off the curve, the search starts at its smallest batch; traced batch by batch, at 1
    assert (with_curve.max_batch, with_curve.safe_batch) == (per_batch.max_batch, per_batch.safe_batch)
    by_batch = {t.batch: t.to_dict() for t in per_batch.trials}
    both = [t for t in with_curve.trials if t.batch in by_batch]
    assert len(both) >= 2 and all(t.to_dict() == by_batch[t.batch] for t in both)  # booked alike, byte for byte
    assert with_curve.extra["traced_once_for"] == [t.batch for t in with_curve.trials if read(t.batch)]
    assert len(with_curve.extra["traced_once_for"]) >= 1


def test_a_value_read_in_the_symbolic_trace_takes_the_stand_in_as_in_a_trace_at_one_size():
    # Adafactor reads its step count; under a shape environment an unknown value is a fresh symbol,
    # which takes the stand-in (one) as a trace at one size does, so the curve is still made.
    work, mode = _fake(replace(mlp_workload(), optimizer="adafactor"))
    _same_at_every_batch(work, mode, batches=(2, 9))


def test_a_trace_asked_for_batches_a_guard_leaves_out_stops_at_the_next_torch_call(monkeypatch):
    # the conv net's CPU convolution guards the batch below 16 in its forward: asked to answer 2, 4, 16
    # and 64 (the batches the per-batch prior traces), the trace stops there, before the backward
    work, mode = _fake(cnn_workload())
    backwards = []
    monkeypatch.setattr(torch.Tensor, "backward", lambda self, *a, **k: backwards.append(1))
    assert trace_batches(work, work.model, fake_mode=mode, cuda_autocast=False, needs=(2, 4, 16, 64)) is None
    assert backwards == []
    monkeypatch.undo()
    # asked for none, it answers the batches the guard keeps
    curve = trace_batches(work, work.model, fake_mode=mode, cuda_autocast=False)
    assert curve is not None and [curve.answers(b) for b in (2, 15, 16)] == [True, True, False]

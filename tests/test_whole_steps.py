"""What the symbolic trace makes from its prime instead of tracing (autobatch/estimating/made_log.py):
the same requests and frees, and the same figures, as traced.

The optimizer's steady step of torch's own optimizers is their first (the prime's) without the state
it makes (``made_log.steady_step``): the optimizer is stepped once, not twice. The allocator's model
books a trial's first step before its steady ones (the blocks the first leaves are the ones the next
reuse), so the estimate's log is of whole steps. Traced, that is a second forward and backward; made
from the primed trace (``made_log.whole_steps``) it is half the tracing. Each must be the same log,
request for request, once the tokens are named alike.
"""

from __future__ import annotations

import importlib
from dataclasses import replace

import pytest
import torch

from autobatch import Workload
from autobatch.estimating.estimate import estimate, fake_model, load_fake_model, trace_batches, training_copy
from autobatch.estimating.fake_backends import _new_fake_mode
from autobatch.probing.workload import OPTIMIZERS
from tests.tiny import cnn_workload, lm_workload, mlp_workload

symbolic = importlib.import_module("autobatch.estimating.symbolic")
SMALL = {"mlp": mlp_workload, "lm": lm_workload, "cnn": cnn_workload}


def _named_alike(log):
    """The log with each token named by the order of its request: two logs of the same requests compare equal."""
    names: dict[int, int] = {}
    out = []
    for token, size in log:
        if size is not None:
            names[token] = len(names)
        out.append((names.get(token, ("before", token)), size))
    return out


def _counted(monkeypatch) -> list[int]:
    """Counts the forward and backward passes the traces run."""
    calls: list[int] = []
    real = symbolic.forward_backward

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(symbolic, "forward_backward", counting)
    return calls


def _both(work: Workload, mode, monkeypatch):
    """The curve made from one steady step, and the one of the whole steps traced; the passes each ran."""
    calls = _counted(monkeypatch)
    made = trace_batches(work, work.model, fake_mode=mode, primed=False)
    made_calls = len(calls)
    with monkeypatch.context() as patched:
        patched.setattr(symbolic, "whole_steps", lambda *args: None)  # refused: the steps are traced whole
        traced = trace_batches(work, work.model, fake_mode=mode, primed=False)
    return made, traced, made_calls, len(calls) - made_calls


def _assert_same(made, traced) -> None:
    assert _named_alike(made.log) == _named_alike(traced.log)
    assert (made.forward_backward, made.optimizer, made.resident) == (
        traced.forward_backward, traced.optimizer, traced.resident)


@pytest.mark.parametrize("name,settings", [("mlp", {}), ("mlp", {"steps": 3}), ("mlp", {"optimizer": "sgd"}),
                                           ("mlp", {"optimizer": "adafactor"}), ("lm", {"dtype": "bf16"}), ("cnn", {})],
                         ids=["mlp", "mlp-3-steps", "mlp-sgd", "mlp-adafactor", "lm-bf16", "cnn"])
def test_the_log_made_from_one_step_is_the_whole_steps_traced(name, settings, monkeypatch):
    work = replace(SMALL[name](), **settings)
    mode = _new_fake_mode()
    work = replace(work, model=fake_model(work.model, mode))
    made, traced, made_calls, traced_calls = _both(work, mode, monkeypatch)
    _assert_same(made, traced)
    # made: one forward and backward; refused, the primed one and then the whole steps
    assert (made_calls, traced_calls) == (1, 1 + max(2, work.steps))


@pytest.mark.parametrize("name,dtype,checkpointed", [("tiny-llama", "bf16", True)])
def test_the_log_made_from_one_step_is_the_whole_steps_traced_for_transformers_models(name, dtype, checkpointed,
                                                                                      monkeypatch):
    work = replace(load_fake_model(name).to_workload(dtype=dtype), grad_checkpointing=checkpointed)
    mode = next(work.model.parameters()).fake_mode
    work = replace(work, model=training_copy(work, mode))
    made, traced, made_calls, _ = _both(work, mode, monkeypatch)
    _assert_same(made, traced)
    assert made_calls == 1


class _Keeps(torch.nn.Module):
    """A forward that keeps a tensor on the module past its step: a first step would differ from the next."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(64, 64)
        self.kept = None

    def forward(self, x):
        out = self.layer(x)
        self.kept = out.detach() * 2
        return out


def test_a_step_that_keeps_a_tensor_is_traced_whole_and_the_estimate_is_the_same(monkeypatch):
    mode = _new_fake_mode()
    work = Workload(_Keeps, lambda b: torch.randn(b, 64), loss_fn=lambda m, x: m(x).sum(), name="keeps")
    fake = replace(work, model=fake_model(work.model, mode))
    calls = _counted(monkeypatch)
    curve = trace_batches(fake, fake.model, fake_mode=mode, primed=False)
    assert curve is not None and len(calls) == 1 + 2  # the primed step, refused; then two whole ones
    held = replace(mlp_workload(), grads_held=True)  # held gradients: the first backward makes them, the next adds
    held = replace(held, model=fake_model(held.model, mode))
    calls.clear()
    assert trace_batches(held, held.model, fake_mode=mode, primed=False) is not None and len(calls) == 2
    # the estimate, booked through the allocator's model, is the same with the log made or traced
    made = estimate(lm_workload(), gpu_memory="600MiB")
    monkeypatch.setattr(symbolic, "whole_steps", lambda *args: None)
    traced = estimate(lm_workload(), gpu_memory="600MiB")
    assert [t.to_dict() for t in made.trials] == [t.to_dict() for t in traced.trials]
    assert made.extra["traced_once_for"] == traced.extra["traced_once_for"] != []


class _Stepped(torch.optim.SGD):
    """SGD under a name of its own: an optimizer the steady step is not made for."""


@pytest.mark.parametrize("name,optimizer,held", [("mlp", o, h) for o in sorted(OPTIMIZERS) for h in (False, True)]
                         + [("lm", "adamw", False)])
def test_the_steady_optimizer_step_made_from_the_prime_is_the_one_traced(name, optimizer, held, monkeypatch):
    mode = _new_fake_mode()
    work = replace(SMALL[name](), optimizer=optimizer, grads_held=held, dtype="bf16")
    work = replace(work, model=fake_model(work.model, mode))
    made = trace_batches(work, work.model, fake_mode=mode)  # primed: the exact bytes' one steady step
    monkeypatch.setattr(symbolic, "STEADY", ())  # no optimizer's step is made: each is traced
    traced = trace_batches(work, work.model, fake_mode=mode)
    _assert_same(made, traced)


def test_another_optimizers_steady_step_is_traced_and_torchs_own_is_made(monkeypatch):
    mode = _new_fake_mode()
    base = replace(mlp_workload(), model=fake_model(mlp_workload().model, mode))
    calls = []
    real = torch.optim.SGD.step
    monkeypatch.setattr(torch.optim.SGD, "step", lambda self, closure=None: calls.append(type(self).__name__)
                        or real(self, closure))
    for factory in (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), lambda p: _Stepped(p, lr=0.1, momentum=0.9)):
        assert trace_batches(replace(base, optimizer=factory), base.model, fake_mode=mode) is not None
    assert calls == ["SGD", "_Stepped", "_Stepped"]  # SGD's steady step made from its prime; the other's traced

from __future__ import annotations

import pytest

from autobatch import SimulatedBackend
from tests.backend_suite import BackendContract


class TestSimulatedBackend(BackendContract):
    @pytest.fixture
    def backend(self):
        return SimulatedBackend("16MiB")


def test_budget_accepts_text_and_bytes():
    assert SimulatedBackend("2GiB").capacity() == 2 * 1024**3
    assert SimulatedBackend(4096).capacity() == 4096


def test_a_batch_sliced_from_data_already_in_memory_costs_the_batch_not_the_data():
    # x[:b] of a 256 KiB dataset made before the probe counted the whole dataset as device memory: 46 where
    # the same batches made by indexing answered 209 (a GPU copies the batch, never the dataset)
    import torch

    import autobatch
    from autobatch.integrations._common import probe_eval_batch

    net = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 4))
    x, y = torch.randn(2048, 32), torch.randint(0, 4, (2048,))

    def loss(m, b):
        return torch.nn.functional.cross_entropy(m(b[0]), b[1])

    answers = {}
    for name, make in (("index", lambda b: (x[torch.arange(b)], y[torch.arange(b)])),
                       ("slice", lambda b: (x[:b], y[:b])), ("slice, cloned", lambda b: (x[:b].clone(), y[:b].clone()))):
        work = autobatch.Workload(net, make, loss_fn=loss)
        answers[name] = autobatch.probe(work, SimulatedBackend("400KiB"), headroom=0).max_batch
    assert answers["slice"] == answers["slice, cloned"] == answers["index"] > 150, answers
    evaluated = {name: probe_eval_batch(net, make, SimulatedBackend("400KiB"), loss_fn=loss)
                 for name, make in (("index", lambda b: (x[torch.arange(b)], y[torch.arange(b)])),
                                    ("slice", lambda b: (x[:b], y[:b])),
                                    ("slice, cloned", lambda b: (x[:b].clone(), y[:b].clone())))}
    assert len(set(evaluated.values())) == 1 and evaluated["slice"] > 300, evaluated  # the forward-only probe alike


def test_the_forward_end_is_the_resident_memory_and_the_saved_activations_counted_by_hand():
    # The MLP 64 → 256 → 256 → 10 in fp32: at the forward's end a sample holds its input (64 values, saved by
    # the first Linear), both ReLU outputs (256 each, saved by ReLU and the next Linear), the log-softmax
    # (10, saved by the loss) and its label (one int64): 2,352 bytes; and the loss and nll_loss's total
    # weight, two fp32 scalars. The first Linear's and the logits' outputs are freed by then.
    from autobatch.probing.trial import run_trial
    from tests.tiny import mlp, mlp_workload

    model = mlp()
    backend, work = SimulatedBackend("64MiB"), mlp_workload(model)
    for batch in (8, 512, 513):
        trial = run_trial(work, model, backend, batch)
        assert trial.forward_bytes - trial.resident_bytes == 2352 * batch + 8, batch

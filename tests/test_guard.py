"""The guard: a step that runs out of memory on a rare long batch is split, and trains to the same weights.

The budget is simulated (``SimulatedBackend``: a CUDA-worded ``torch.OutOfMemoryError`` when live
tensors pass it); the reference loop runs the same data on a budget that fits every batch whole.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch

from autobatch import SimulatedBackend
from autobatch.checking.accumulation import token_cross_entropy
from autobatch.errors import AutobatchError
from autobatch.guard import OOMGuard, split_batch

VOCAB, SHORT, LONG, BATCH = 64, 16, 64, 8


class LM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, 32)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.GELU(), torch.nn.Linear(128, 32))
        self.head = torch.nn.Linear(32, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        return self.head(h + self.mlp(h))


def data(steps: int = 10) -> list[dict[str, torch.Tensor]]:
    """One batch in ten is 4× longer; labels end in padding (-100) of random lengths."""
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(steps):
        seq = LONG if i % 10 == 3 else SHORT
        ids = torch.randint(0, VOCAB, (BATCH, seq), generator=g)
        labels = ids.clone()
        for row, pad in enumerate(torch.randint(0, seq // 2, (BATCH,), generator=g).tolist()):
            labels[row, seq - pad:] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def loss_fn(model: torch.nn.Module, batch: dict[str, torch.Tensor]):
    return token_cross_entropy(model(batch["input_ids"]), batch["labels"], shift=True)


def train(budget: str, guarded: bool) -> tuple[torch.nn.Module, OOMGuard | None]:
    torch.manual_seed(0)
    model = LM()
    backend = SimulatedBackend(budget)
    guard = OOMGuard(model, loss_fn, shift=True) if guarded else None
    with backend.track(list(model.parameters())):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for batch in data():
            if guard is not None:
                guard.backward(batch)
            else:  # the plain mean over the batch's tokens: the update the split steps must equal
                losses, mask = loss_fn(model, batch)
                (losses[mask].sum() / mask.sum()).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        del optimizer
    return model, guard


def test_a_rare_long_batch_is_split_and_trains_to_the_same_weights(caplog) -> None:
    with pytest.raises(torch.OutOfMemoryError, match="CUDA out of memory"):
        train("600KiB", guarded=False)  # the long batch does not fit whole on this budget
    reference, _ = train("8MiB", guarded=False)
    with caplog.at_level(logging.WARNING, logger="autobatch.guard"):
        model, guard = train("600KiB", guarded=True)
    assert [(s.step, s.pieces, s.attempts) for s in guard.history] == [(4, 4, 3)]
    assert guard.steps == 10
    assert "step 4 went through as 4 micro-batches per batch after 3 attempt(s)" in caplog.text
    for (name, a), b in zip(reference.named_parameters(), model.parameters()):
        rel = ((a - b).norm() / a.norm()).item()
        assert rel <= 1e-5, f"{name}: relative difference {rel:.2e}"


def _ddp_worker(budgets: tuple[str, str]) -> tuple[list[tuple[int, int, int]], dict[str, torch.Tensor]]:
    """One rank of two: half of each batch, its own budget, the model under DDP."""
    import torch.distributed as dist

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = LM()
    backend = SimulatedBackend(budgets[rank])
    net = torch.nn.parallel.DistributedDataParallel(model)
    guard = OOMGuard(net, loss_fn, shift=True)
    with backend.track(list(model.parameters())):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for batch in data(5):
            guard.backward({k: v[rank::2] for k, v in batch.items()})
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        del optimizer
    histories: list = [None, None]
    dist.all_gather_object(histories, [(s.step, s.pieces, s.attempts) for s in guard.history])
    assert histories[0] == histories[1], histories
    return histories[0], {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.skipif(not os.environ.get("AUTOBATCH_SLOW_TESTS"), reason="two-process gloo DDP run (~20 s alone, "
                    "a minute on a shared CPU); set AUTOBATCH_SLOW_TESTS=1 to include it")
def test_every_rank_splits_the_same_step_and_ddp_trains_like_one_big_batch() -> None:
    from autobatch.distributed import spawn_local

    # Only rank 1's budget is too small for the long batch: rank 0 must split that step too.
    history, weights = spawn_local(_ddp_worker, (("8MiB", "400KiB"),), nprocs=2, backend="gloo", timeout_s=60)
    assert history == [(4, 4, 3)]
    torch.manual_seed(0)
    reference = LM()
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for batch in data(5):
        losses, mask = loss_fn(reference, batch)
        (losses[mask].sum() / mask.sum()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    for name, a in reference.state_dict().items():
        assert ((a - weights[name]).norm() / a.norm()).item() <= 1e-5, name


def test_a_step_that_never_fits_stops_with_a_clear_error() -> None:
    torch.manual_seed(0)
    model = LM()
    guard = OOMGuard(model, loss_fn, shift=True, max_splits=2)
    batch = data(4)[3]
    with SimulatedBackend("300KiB").track(list(model.parameters())):
        with pytest.raises(torch.OutOfMemoryError, match=r"step 1 still runs out of memory cut into 2 micro-batch\(es\)"):
            guard.backward(batch)
    assert all(p.grad is None for p in model.parameters())


def test_gradients_must_be_cleared_and_the_loss_unreduced() -> None:
    model = LM()
    batch = data(1)[0]
    guard = OOMGuard(model, lambda m, b: loss_fn(m, b)[0].mean())
    with pytest.raises(AutobatchError, match="must return unreduced losses"):
        guard.backward(batch)
    model.zero_grad(set_to_none=True)
    OOMGuard(model, loss_fn, shift=True).backward(batch)
    with pytest.raises(AutobatchError, match="needs the gradients cleared"):
        OOMGuard(model, loss_fn, shift=True).backward(batch)
    model.zero_grad(set_to_none=True)
    with pytest.raises(AutobatchError, match="the loss counted .* but the labels hold"):
        OOMGuard(model, loss_fn, shift=False).backward(batch)  # the loss shifts, the count does not


def test_split_batch_cuts_every_tensor_on_dim_0_and_keeps_the_container() -> None:
    batch = {"input_ids": torch.arange(10).view(5, 2), "labels": torch.arange(5), "scale": 3}
    parts = split_batch(batch, 2)
    assert [p["labels"].tolist() for p in parts] == [[0, 1, 2], [3, 4]]
    assert [p["scale"] for p in parts] == [3, 3]
    pairs = split_batch((torch.zeros(4, 3), torch.arange(4)), 4)
    assert [type(p) for p in pairs] == [tuple] * 4 and [p[1].item() for p in pairs] == [0, 1, 2, 3]



def test_accumulate_adds_to_earlier_gradients_and_a_failed_step_leaves_them_as_they_were() -> None:
    torch.manual_seed(0)
    model = LM()
    short, long = data(4)[0], data(4)[3]
    reference = LM()
    reference.load_state_dict(model.state_dict())
    for batch in (short, long):  # the plain sum of the two steps' gradients
        losses, mask = loss_fn(reference, batch)
        (losses[mask].sum() / mask.sum()).backward()
    guard = OOMGuard(model, loss_fn, shift=True, accumulate=True)
    guard.backward(short)
    earlier = [p.grad.clone() for p in model.parameters()]
    with SimulatedBackend("300KiB").track(list(model.parameters()) + [p.grad for p in model.parameters()]), \
            pytest.raises(torch.OutOfMemoryError, match="still runs out of memory"):
        OOMGuard(model, loss_fn, shift=True, accumulate=True, max_splits=2).backward(long)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), earlier))  # put back untouched
    with SimulatedBackend("600KiB").track(list(model.parameters()) + [p.grad for p in model.parameters()]):
        assert guard.backward(long).pieces == 4
    for a, b in zip(reference.parameters(), model.parameters()):
        assert ((a.grad - b.grad).norm() / a.grad.norm()).item() <= 1e-5


def test_a_list_of_tensors_is_one_batch_as_a_dataloader_collates_it():
    # a TensorDataset's loader yields [x, y]: it was read as two micro-batches, x and y, and refused as no (inputs, labels) pair
    from autobatch.guard import OOMGuard

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 3)
    x, y = torch.randn(6, 8), torch.randint(0, 3, (6,))

    def loss(m, b):
        return torch.nn.functional.cross_entropy(m(b[0]), b[1], reduction="none")

    grads = []
    for batch in ([x, y], (x, y), [(x[:3], y[:3]), (x[3:], y[3:])]):  # one list batch, one pair, two micro-batches
        model.zero_grad(set_to_none=True)
        done = OOMGuard(model, loss).backward(batch)
        grads.append(model.weight.grad.clone())
        assert done.samples == 6
    assert torch.allclose(grads[0], grads[1]) and torch.allclose(grads[0], grads[2], atol=1e-6)

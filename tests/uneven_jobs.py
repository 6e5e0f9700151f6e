"""Per-rank jobs of the uneven-plan tests (module level, so spawned ranks can run them)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist

import autobatch
from autobatch.probing.backends import SimulatedBackend
from tests.ranks import gathered
from tests.sharded_jobs import batch, blocks, wide_batch, wide_blocks


def own_limits_job(strategies: tuple[str | None, ...], budgets: tuple[str, ...], each_rank: bool,
                   allocator: str = "exact") -> list[Any]:
    """Each strategy probed in lockstep, rank r on the r-th budget; the agreed answer and every rank's own limits.

    The exact allocator uses the four small blocks; the caching-allocator model, which runs out of
    memory mid-step as a GPU does, the six wide ones (its 2 MiB segments need tens of MiB to matter)."""
    from autobatch.distributed.lockstep import probe_distributed

    work = autobatch.Workload(blocks, batch) if allocator == "exact" else autobatch.Workload(wide_blocks, wide_batch)
    out = {}
    for name in strategies:
        result = probe_distributed(work, SimulatedBackend(budgets[dist.get_rank()], allocator=allocator),
                                   strategy=name, timeout_s=60, each_rank=each_rank, headroom=0)
        out[str(name)] = {"max_batch": result.max_batch, "safe_batch": result.safe_batch,
                          "own": None if result.own_limits is None else [
                              (lim.max_batch, lim.safe_batch, lim.step_seconds) for lim in result.own_limits]}
    return gathered(out)


# --- training with a plan per rank: the same weights as one process on the whole batch -------------------

STEPS, SEED = 3, 7


def mlp() -> torch.nn.Module:
    torch.manual_seed(SEED)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))


def mlp_batch(b: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(b, 16), torch.randint(0, 4, (b,))


def mlp_data(n: int = 400) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(n, 16, generator=gen), torch.randint(0, 4, (n,), generator=gen)


def lm() -> torch.nn.Module:
    torch.manual_seed(SEED)
    return torch.nn.Sequential(torch.nn.Embedding(32, 16), torch.nn.Linear(16, 32))


def lm_data(n: int = 400, length: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded sequences of random lengths: labels -100 past each one's end."""
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(1, 32, (n, length), generator=gen)
    lengths = torch.randint(1, length + 1, (n, 1), generator=gen)
    return ids, ids.masked_fill(torch.arange(length) >= lengths, -100)


def sample_losses(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(model(x), y, reduction="none")


def token_losses(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = model(ids)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none",
                                             ignore_index=-100).view_as(labels)


def train_uneven(kind: str, pairs: list[tuple[int, int]]) -> dict[str, torch.Tensor]:
    """This rank's share of every step under DDP: no_sync until its last micro-step, the uneven loss scale."""
    from torch.nn.parallel import DistributedDataParallel

    from autobatch import count_loss_tokens
    from autobatch.training import UnevenBatchSampler

    model = mlp() if kind == "mean" else lm()
    net = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.5, momentum=0.9)
    x, y = mlp_data() if kind == "mean" else lm_data()
    sampler = UnevenBatchSampler(len(x), pairs, seed=SEED)
    micro = iter(sampler)
    for _ in range(STEPS):
        batches = [next(micro) for _ in range(sampler.grad_accum)]
        norm = sampler.normaliser() if kind == "mean" else count_loss_tokens([y[i] for i in batches])
        for j, idx in enumerate(batches):
            with net.no_sync() if j < len(batches) - 1 else contextlib.nullcontext():
                if kind == "mean":
                    loss = norm.sample_loss(sample_losses(net, x[idx], y[idx]))
                else:
                    loss = norm.token_loss(token_losses(net, x[idx], y[idx]), y[idx] != -100)
                loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def train_whole_batch(kind: str, target: int) -> dict[str, torch.Tensor]:
    """One process, the whole global batch of each step, the plain mean (over samples or tokens)."""
    from autobatch.training import UnevenBatchSampler

    model = mlp() if kind == "mean" else lm()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    x, y = mlp_data() if kind == "mean" else lm_data()
    steps = iter(UnevenBatchSampler(len(x), [(target, 1)], rank=0, seed=SEED))
    for _ in range(STEPS):
        idx = next(steps)
        if kind == "mean":
            loss = sample_losses(model, x[idx], y[idx]).mean()
        else:
            mask = y[idx] != -100
            loss = token_losses(model, x[idx], y[idx])[mask].mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def probe_then_train(target: int, budgets: str) -> list[Any]:
    """Each rank probes its own budget (find --uneven as a user runs it), then trains with the plan."""
    from autobatch import Request, answer

    report = answer(Request(model=mlp, make_batch=mlp_batch, target=target, uneven=True, device="cpu",
                            memory=budgets, headroom=0, trace_prior=False, timeout=60))
    pairs = [(r.micro_batch, r.grad_accum) for r in report.uneven.ranks]
    limits = [(r.max_batch, r.safe_batch) for r in report.uneven.ranks]
    trained = {kind: train_uneven(kind, pairs) for kind in ("mean", "token")}
    return gathered({"pairs": pairs, "limits": limits, "trained": trained})

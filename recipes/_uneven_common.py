# What the three uneven recipes share (recipes/uneven_plain.py, uneven_accelerate.py, uneven_lightning.py):
# the model and data, the plan per rank (probed by every rank, or read from `find --uneven --json`),
# and the check that the trained weights are those of one process trained on each whole step.
#
# Not run by itself: the recipes import it (python puts the script's folder on sys.path).
from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist

import autobatch

SEED = 7


def parser(what: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=what)
    p.add_argument("--target", type=int, default=100, help="samples per optimizer step, on all ranks together")
    p.add_argument("--memory", default=None,
                   help="one simulated budget per rank, e.g. 48KiB,36KiB (CPU); leave out on GPUs")
    p.add_argument("--plan", default=None, help="read the plan per rank from `autobatch find --uneven --json` output")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--check", action="store_true",
                   help="rank 0 trains the whole batch of every step in one process and compares the weights")
    return p


def make_model() -> torch.nn.Module:
    torch.manual_seed(SEED)  # the same initial weights on every rank
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))


def make_batch(b: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(b, 16), torch.randint(0, 4, (b,))


def dataset(n: int = 1000) -> torch.utils.data.TensorDataset:
    gen = torch.Generator().manual_seed(1)
    return torch.utils.data.TensorDataset(torch.randn(n, 16, generator=gen), torch.randint(0, 4, (n,), generator=gen))


def per_rank_plan(args: argparse.Namespace) -> list[dict]:
    """Every rank probes its own device (here: its own simulated budget) and plans its share of the target."""
    if args.plan is not None:
        with open(args.plan) as f:
            return json.load(f)["per_rank"]
    on_cpu = {"device": "cpu", "memory": args.memory} if args.memory else {}
    report = autobatch.answer(autobatch.Request(model=make_model, make_batch=make_batch, target=args.target,
                                                uneven=True, headroom=0, trace_prior=False, **on_cpu))
    if dist.get_rank() == 0:
        print(report.uneven.describe())
    return report.uneven.to_dict()["per_rank"]


def sample_losses(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(model(x), y, reduction="none")


def optimizer_for(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)


def check(trained: torch.nn.Module, plan: list[dict], steps: int) -> None:
    """Rank 0: the same steps in one process, each on its whole global batch with the plain mean loss."""
    if dist.get_rank() != 0:
        return
    data, model = dataset(), make_model()
    optimizer = optimizer_for(model)
    target = sum(r["micro_batch"] * r["grad_accum"] for r in plan)
    whole = iter(autobatch.UnevenBatchSampler(data, [(target, 1)], rank=0, seed=SEED))
    for _ in range(steps):
        x, y = data[next(whole)]
        sample_losses(model, x, y).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    mine = {k: v.detach().cpu() for k, v in trained.state_dict().items()}
    gap = max((mine[k] - v).abs().max().item() for k, v in model.state_dict().items())
    print(f"{'PASS' if gap < 1e-5 else 'FAIL'}: max |Δweight| {gap:.2e} against one process on the whole batch")

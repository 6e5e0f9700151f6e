"""The helper under real data parallelism: 2 CPU processes, gloo, DDP.

Each rank takes its shard of the GA micro-batches, counts tokens with ``count_loss_tokens``
(all-reduced over the ranks), accumulates with ``no_sync`` and lets DDP average the gradients.
Rank 0 compares with the single-process big batch. The same file is the worker: the test runs
``python this_file.py RANK STORE OUT`` twice, with a hard timeout so that it can never hang.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from autobatch.checking.accumulation import count_loss_tokens, token_cross_entropy
from autobatch.checking.ga_batches import padded_lm_batch, split_batch

WORLD, GA, MICRO, VOCAB, SEQ = 2, 2, 2, 29, 12  # 2 micro * 2 GA * 2 ranks = 8 samples
TIMEOUT_S = 45
pytestmark = pytest.mark.slow  # two subprocesses that each import torch


class TinyLM(torch.nn.Module):
    def __init__(self, vocab: int = VOCAB, dim: int = 16):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(input_ids).cumsum(1) / torch.arange(1, input_ids.shape[1] + 1)[None, :, None]
        return self.head(torch.tanh(h))


def flat_grad(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def big_batch_grad(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    torch.manual_seed(0)
    model = TinyLM()
    losses, mask = token_cross_entropy(model(batch["input_ids"]), batch["labels"], shift=True)
    (losses[mask].sum() / mask.sum()).backward()
    return flat_grad(model)


def rank_step(rank: int, batch: dict[str, torch.Tensor], case: str) -> tuple[torch.Tensor, int, int]:
    """One optimizer step's gradients on this rank, the way a training loop would do it."""
    torch.manual_seed(0)
    model = TinyLM()
    shard = split_batch(batch, MICRO)[rank * GA:(rank + 1) * GA]
    if case == "ddp-mean":
        net: torch.nn.Module = torch.nn.parallel.DistributedDataParallel(model)
        norm = count_loss_tokens(shard, shift=True)  # all-reduced; world_size factor for DDP's averaging
    else:
        net = model
        norm = count_loss_tokens(shard, shift=True, grad_reduction="sum")
    for i, mb in enumerate(shard):
        last = i == len(shard) - 1
        sync = contextlib.nullcontext() if last or case != "ddp-mean" else net.no_sync()  # type: ignore[operator]
        with sync:
            losses, mask = token_cross_entropy(net(mb["input_ids"]), mb["labels"], shift=True)
            if case == "naive":  # mean over this micro-batch's tokens, / GA, then averaged over ranks
                loss = losses[mask].mean() / GA
            else:
                loss = norm.token_loss(losses, mask)
            loss.backward()
    grad = flat_grad(model)
    if case == "sum":  # our own gradient reduction: a plain sum over ranks
        dist.all_reduce(grad, op=dist.ReduceOp.SUM)
    elif case == "naive":  # what DDP would do to the naive loss: average over ranks
        dist.all_reduce(grad, op=dist.ReduceOp.SUM)
        grad /= WORLD
    return grad, norm.total, norm.world_size


def worker(rank: int, store: str, out: str) -> None:
    # A file store, not a TCP port: nothing another test run could take in the meantime.
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD, timeout=timedelta(seconds=20)
    )
    try:
        batch = padded_lm_batch(MICRO * GA * WORLD, SEQ, VOCAB, seed=0)  # the same global batch on every rank
        results = {}
        for case in ("ddp-mean", "sum", "naive"):
            grad, total, world = rank_step(rank, batch, case)
            if rank == 0:
                big = big_batch_grad(batch)
                results[case] = {
                    "rel_error": float((grad - big).norm() / big.norm()),
                    "total": total,
                    "world_size": world,
                    "expected_total": int((batch["labels"][:, 1:] != -100).sum()),
                }
        if rank == 0:
            Path(out).write_text(json.dumps(results))
        gc.collect()  # free the DDP objects (reference cycles) before gloo goes; see the recipe
        dist.barrier()  # no rank tears gloo down while another still talks to it
    finally:
        dist.destroy_process_group()


# --- the test side --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, float]]:
    if not dist.is_available():
        pytest.skip("torch.distributed is not available in this torch build")
    work = tmp_path_factory.mktemp("ddp")
    out, store = work / "rank0.json", work / "store"
    env = {**os.environ, "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"), "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen([sys.executable, __file__, str(rank), str(store), str(out)], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for rank in range(WORLD)
    ]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=TIMEOUT_S)[0])
    except subprocess.TimeoutExpired:
        pytest.fail(f"the {WORLD} gloo workers did not finish within {TIMEOUT_S} s")
    finally:
        for p in procs:  # only the processes this test started
            if p.poll() is None:
                p.kill()
                p.wait()
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)
    return json.loads(out.read_text())


def test_token_count_is_all_reduced_over_ranks(results: dict[str, dict[str, float]]) -> None:
    r = results["ddp-mean"]
    assert r["total"] == r["expected_total"]
    assert r["world_size"] == WORLD  # DDP averages, so each rank's loss carries world_size / total


def test_ddp_with_the_helper_equals_the_single_process_big_batch(results: dict[str, dict[str, float]]) -> None:
    assert results["ddp-mean"]["rel_error"] <= 1e-5


def test_summed_gradients_with_grad_reduction_sum_equal_the_big_batch(results: dict[str, dict[str, float]]) -> None:
    assert results["sum"]["world_size"] == 1
    assert results["sum"]["rel_error"] <= 1e-5


def test_naive_loss_under_ddp_is_a_mean_of_means(results: dict[str, dict[str, float]]) -> None:
    assert results["naive"]["rel_error"] > 0.05


if __name__ == "__main__":
    worker(int(sys.argv[1]), sys.argv[2], sys.argv[3])

"""Probe every rank's device in lockstep and print the per-rank report (rank 0 only).

Under a launcher, one process per GPU (or per CPU rank with gloo):

    python -m torch.distributed.run --nproc-per-node 2 docs/examples/distributed_probe.py

Without one, the script starts one worker per visible GPU itself (``--nproc`` to choose):

    python docs/examples/distributed_probe.py --nproc 2

With no GPU each rank trains on the CPU under a simulated budget, rank r getting
4 MiB - r x 512 KiB, so that the ranks differ the way a busier or smaller GPU would.
"""

from __future__ import annotations

import argparse

import torch

from autobatch import SimulatedBackend, Workload
from autobatch.distributed import is_launched, probe_distributed, process_group, rank_env, spawn_local
from autobatch.distributed.launch import exit_rank
from autobatch.pipeline import trace_prior_for
from autobatch.probing.probe import make_backend


class TinyLM(torch.nn.Module):
    def __init__(self, vocab: int = 128, dim: int = 32):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.block = torch.nn.TransformerEncoderLayer(dim, 2, 64, dropout=0.0, batch_first=True)
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.emb(x)))


def lm_loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())


def job():
    """What every rank runs: its own device, the same workload, the lockstep probe."""
    env = rank_env()
    if torch.cuda.is_available():
        backend = make_backend(f"cuda:{env.local_rank}")
    else:
        backend = SimulatedBackend(4 * 2**20 - env.rank * 512 * 2**10)
    work = Workload(TinyLM, lambda b: (torch.randint(0, 128, (b, 32)), torch.randint(0, 128, (b, 32))),
                    loss_fn=lm_loss, name="tiny-lm")
    # The fake-tensor trace leads the search, booked as this rank's device books memory.
    return probe_distributed(work, backend, prior=trace_prior_for(work, backend))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=None, help="workers to start without a launcher")
    args = parser.parse_args()
    if is_launched():
        with process_group():  # NCCL with GPUs, gloo without
            result = job()
            if rank_env().is_main:  # only rank 0 prints and writes
                print(result)
        exit_rank(0)  # skip torch's native teardown, which can abort a finished rank
    else:
        nprocs = args.nproc or torch.cuda.device_count() or 1
        print(spawn_local(job, nprocs=nprocs))


if __name__ == "__main__":
    main()

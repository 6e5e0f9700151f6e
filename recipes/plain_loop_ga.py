# Gradient accumulation that equals the big batch, in a plain PyTorch loop.
#
# Run (one process, CPU, a few seconds):
#     python recipes/plain_loop_ga.py --steps 30 --micro-batch 2 --grad-accum 4 --verify
# Run with DDP (2 processes; gloo on CPU, nccl on GPUs):
#     torchrun --standalone --nproc-per-node 2 recipes/plain_loop_ga.py --steps 30 --micro-batch 2 --grad-accum 2
#
# What it shows: each optimizer step takes grad_accum micro-batches of padded, variable-length
# sequences; autobatch.count_loss_tokens counts the non-padding target tokens of all of them
# (all-reduced over ranks) before the first backward, and every micro-batch's loss is its summed
# token loss times world_size / that count. No "loss / grad_accum": the normaliser holds it.
# --verify first runs autobatch.verify_ga on one global batch and prints PASS/FAIL for the
# naive loss and for this one.
from __future__ import annotations

import argparse
import contextlib
import gc
import os

import torch
import torch.distributed as dist

from autobatch.checking.accumulation import count_loss_tokens, token_cross_entropy
from autobatch.checking.verify_ga import verify_ga

VOCAB = 64


class TinyLM(torch.nn.Module):
    """A one-layer GRU language model: small enough for CPU, real enough to learn."""

    def __init__(self, vocab: int = VOCAB, dim: int = 64):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.rnn = torch.nn.GRU(dim, dim, batch_first=True)
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(self.emb(input_ids))[0])


def batches(micro_batch: int, seq_len: int, seed: int):
    """Endless right-padded batches of counting sequences (next = previous + 1) of random length."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        start = torch.randint(1, VOCAB, (micro_batch, 1), generator=gen)
        ids = (start + torch.arange(seq_len)) % (VOCAB - 1) + 1  # ids 1..VOCAB-1; 0 is padding
        lengths = torch.randint(2, seq_len + 1, (micro_batch, 1), generator=gen)
        mask = torch.arange(seq_len) < lengths
        yield {"input_ids": ids * mask, "labels": ids.masked_fill(~mask, -100)}


def token_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return token_cross_entropy(model(batch["input_ids"]), batch["labels"], shift=True)


def verify(model: torch.nn.Module, data, micro_batch: int, grad_accum: int) -> None:
    """Check on one global batch that accumulation reproduces it, naively and with the helper."""
    micro = [next(data) for _ in range(grad_accum)]
    batch = {k: torch.cat([mb[k] for mb in micro]) for k in micro[0]}
    for mode in ("naive", "normalised"):
        result = verify_ga(model, batch, micro_batch=micro_batch, grad_accum=grad_accum,
                           token_loss_fn=token_loss, mode=mode)
        print(result, end="\n\n")


def main() -> None:
    parser = argparse.ArgumentParser(description="GA that equals the big batch, with autobatch's loss normaliser.")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--grad-accum", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=24)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--verify", action="store_true", help="run autobatch.verify_ga before training")
    args = parser.parse_args()

    distributed = "RANK" in os.environ  # set by torchrun
    if distributed:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else torch.device("cpu")

    torch.manual_seed(0)  # the same initial weights on every rank
    model = TinyLM().to(device)
    data = batches(args.micro_batch, args.seq_len, seed=1000 + rank)  # each rank its own shard
    if args.verify and rank == 0:
        verify(model, batches(args.micro_batch, args.seq_len, seed=1), args.micro_batch, args.grad_accum)
    net = torch.nn.parallel.DistributedDataParallel(model) if distributed else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    if rank == 0:
        print(f"# {args.micro_batch} micro batch * {args.grad_accum} grad accum * {world} rank{'s' if world > 1 else ''} "
              f"= {args.micro_batch * args.grad_accum * world} sequences per step")

    for step in range(1, args.steps + 1):
        micro = [{k: v.to(device) for k, v in next(data).items()} for _ in range(args.grad_accum)]
        # Up front, over all GA micro-batches (and all ranks): the divisor of the big-batch mean.
        norm = count_loss_tokens(micro, shift=True)
        step_loss = torch.zeros((), device=device)
        for i, mb in enumerate(micro):
            # DDP: synchronise gradients only on the last micro-batch; it averages them over ranks,
            # which the normaliser's world_size factor anticipates.
            last = i == len(micro) - 1
            with contextlib.nullcontext() if last or not distributed else net.no_sync():
                loss = norm.token_loss(*token_cross_entropy(net(mb["input_ids"]), mb["labels"], shift=True))
                loss.backward()
            step_loss += loss.detach()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if distributed:  # each rank holds world/N × its tokens' sum; the mean over ranks is the big-batch loss
            dist.all_reduce(step_loss)
            step_loss /= world
        if rank == 0 and (step == 1 or step % 10 == 0 or step == args.steps):
            print(f"step {step:4d}  loss {step_loss.item():.4f}  ({norm.total} target tokens)")

    if distributed:
        # Free DDP now (its reducer sits in reference cycles, so `del` alone leaves it for the
        # garbage collector) and let every rank get here before gloo is torn down; otherwise a rank
        # can abort at exit with "terminate called without an active exception".
        del net
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

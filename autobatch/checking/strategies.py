"""Whether the configs train with the strategy the micro batch was probed under (``check --strategy``).

Each config a setup holds (a DeepSpeed file, accelerate's plugins, HF ``TrainingArguments``) says
how it shards, read into a :class:`Read`; :func:`check_strategy` compares each with the probe's
and says which way a mismatch errs. Every FSDP probe shards fully, so an FSDP config that does
not is a mismatch of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import AutobatchError
from ..strategy import Strategy, parse_strategy
from .problems import _Collector

__all__ = ["Read", "check_strategy"]

_KEEPS = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3, "fsdp1": 3, "fsdp2": 3}  # how much is sharded
_OFFLOADS = {None: 0, "optimizer": 1, "params": 2}  # how much leaves the GPU
# What FSDP keeps on each GPU where it does not shard fully, and the strategy whose memory is alike.
_SHARDING = {
    "SHARD_GRAD_OP": ("the parameters gathered from forward to backward", "zero2"),
    "HYBRID_SHARD_ZERO2": ("the parameters gathered from forward to backward, the rest sharded within a node only", None),
    "HYBRID_SHARD": ("every state sharded within a node only, not over every GPU", None),
    "NO_SHARD": ("every parameter, gradient and optimizer state whole, as DDP", "ddp"),
}


@dataclass(frozen=True)
class Read:
    """How one config trains: its ``label`` (the file), the strategy, and for FSDP its sharding, as
    the file says it (``said``: ``"fsdp_reshard_after_forward: false"``) and the key that sets it
    (``key``) with the value that shards fully (``full``)."""

    label: str
    strategy: Strategy
    sharding: str = "FULL_SHARD"
    said: str = ""
    key: str = ""
    full: str = ""


def check_strategy(c: _Collector, probed: str | Strategy, reads: list[Read]) -> None:
    """A problem for each config that trains otherwise than the micro batch was probed, a note for each that agrees."""
    try:
        probed = parse_strategy(probed)
    except AutobatchError as exc:
        c.add("strategy", str(exc), "name the strategy find --strategy probed")
        return
    if not reads:
        c.note(f"the configs do not say how training shards; the micro batch was probed under {probed.label}")
        return
    for read in reads:
        if read.sharding != "FULL_SHARD":
            _sharded_otherwise(c, probed, read)
            continue
        configured, label = read.strategy, read.label
        if (configured.name, configured.offload) == (probed.name, probed.offload):
            c.note(f"{label} trains with {configured.label}, as the micro batch was probed")
            continue
        sharded = (_KEEPS[configured.name], _OFFLOADS[configured.offload])
        probed_as = (_KEEPS[probed.name], _OFFLOADS[probed.offload])
        if configured.name == probed.name and sharded > probed_as:  # the same wrapper, more on the host: it fits
            c.note(f"{label} trains with {configured.label}, which keeps less state on each GPU than {probed.label}, "
                   f"as the micro batch was probed: it fits, and a larger one may (find --strategy {configured.name} "
                   f"--offload {configured.offload})")
            continue
        keeps = ("keeps more state on each GPU: the micro batch may run out of memory" if sharded < probed_as else
                 "keeps less state on each GPU: a larger micro batch may fit" if sharded > probed_as else
                 "shards as much but holds it otherwise (its buffers, its gathers): its peak is not the probe's")
        c.add(
            "strategy-mismatch",
            f"the micro batch was probed under {probed.label}, but {label} trains with {configured.label}, which "
            + keeps,
            f"probe again with find --strategy {configured.name}"
            + (f" --offload {configured.offload}" if configured.offload else "")
            + f", or train with {probed.label}",
            probed=probed.label, configured=configured.label,
        )


def _sharded_otherwise(c: _Collector, probed: Strategy, read: Read) -> None:
    """An FSDP config that does not shard fully: a problem, or a note where the probed strategy holds alike."""
    keeps, alike = _SHARDING[read.sharding]
    if alike is not None and (probed.name, probed.offload) == (alike, None):
        c.note(f"{read.label} trains FSDP with {read.said}, which holds on each GPU about what {alike} holds, as the "
               "micro batch was probed")
        return
    name = read.strategy.name
    c.add(
        "strategy-mismatch",
        f"the micro batch was probed under {probed.label}, but {read.label} trains FSDP with {read.said}, which "
        f"keeps {keeps}; every FSDP probe shards fully, so the micro batch may not fit",
        f"set {read.key} to {read.full}" + ("" if probed.name == name else f" and probe with find --strategy {name}")
        + (f", or probe the strategy that holds alike: find --strategy {alike}" if alike else ""),
        probed=probed.label, sharding=read.sharding,
    )

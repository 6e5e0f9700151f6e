"""Was the micro batch probed at the sequence length it will train at?

Memory grows with the sequence length, so a micro batch that fits at 1024 tokens says nothing
about 4096. ``check --model … --seq-len N`` passes the lengths the cache holds for the model
(:func:`autobatch.tuning.probed.probed_lengths`); this module turns them into problems and notes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .problems import _Collector

__all__ = ["check_probed_length"]


def _listing(probes: Sequence[Mapping[str, Any]]) -> str:
    return ", ".join(f"{p['seq_len']} (max {p['max_batch']} on {p['device']})" for p in probes)


def check_probed_length(c: _Collector, micro: int | None, seq_len: int | None,
                        probes: Sequence[Mapping[str, Any]] | None, stated: bool = True) -> None:
    """Add a problem when ``micro`` was never probed at ``seq_len`` (or longer), or exceeds what was.
    ``stated=False``: ``seq_len`` is the model's own length, not the user's, so probes at other lengths
    only are a note (the job may train at one of them)."""
    if seq_len is None or probes is None:
        return
    if not stated and probes and all(p["seq_len"] != seq_len for p in probes):
        c.note(f"no --seq-len given: compared at the model's own length {seq_len}, where no probe is cached "
               f"({_listing(probes)}); pass --seq-len with the length you train at to compare there")
        return
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1:
        c.add("invalid-value", f"seq_len must be a positive integer, but got seq_len={seq_len!r}",
              "set --seq-len to the longest sequence you train on", seq_len=seq_len)
        return
    if not probes:
        if not stated:  # the length was not asked about: nothing cached is nothing to say
            return
        c.note(f"no cached probe of this model: nothing to compare at seq_len {seq_len} "
               f"(run autobatch find --model … --seq-len {seq_len})")
        return
    at = [p for p in probes if p["seq_len"] == seq_len]
    longer = [p for p in probes if p["seq_len"] > seq_len]
    if not at and not longer:
        shown = f"micro batch {micro}" if micro is not None else "no micro batch"
        c.add(
            "unprobed-length",
            f"{shown} was never probed at seq_len {seq_len}: the cached probes of this model are at shorter "
            f"lengths only, {_listing(probes)}, and memory grows with the length",
            f"probe that length first: autobatch find --model … --seq-len {seq_len} "
            f"(or several at once: --seq-len {','.join(str(p['seq_len']) for p in probes[-1:])},{seq_len})",
            seq_len=seq_len, probed=sorted({p["seq_len"] for p in probes}),
        )
        return
    if micro is None:
        return
    if at:
        if all(micro > p["max_batch"] for p in at):
            c.add(
                "over-probed-max",
                f"micro batch {micro} is above the largest batch probed at seq_len {seq_len}: {_listing(at)}",
                f"use a micro batch of at most {max(p['safe_batch'] for p in at)} (the safe batch) and more accumulation",
                micro_batch=micro, seq_len=seq_len,
            )
        elif all(micro > p["safe_batch"] for p in at):
            c.note(f"micro batch {micro} is above the safe batch probed at seq_len {seq_len} "
                   f"({', '.join(str(p['safe_batch']) for p in at)}): it fits, with less than the headroom free")
        return
    c.note(f"seq_len {seq_len} was not probed itself, but longer lengths were ({_listing(longer)}), "
           "which bound its memory")

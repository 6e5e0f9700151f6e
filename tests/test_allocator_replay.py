"""The estimate against what an H200 measured (docs/benchmarks/gpu.json): allocated peaks, the allocator's
bookings, and the answers, for gpt2 (fp32, bf16) and bert-base (bf16)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tests.ranks import slow

from autobatch.estimating.estimate import estimate, load_fake_model, trace_batches
from autobatch.estimating.overheads import Overheads
from autobatch.estimating.replay import book

RECORD = json.loads((Path(__file__).resolve().parents[1] / "docs/benchmarks/gpu.json").read_text())
# (record run, model, dtype, sequence length, the estimate's answer): find on the H200 fit 74, 93 and 348;
# the gpt2 rows' bookings at 74 and 75, 93 and 94 are that answer already (the whole estimates: docs/benchmarks/gpu.md)
# gpt2 runs with AUTOBATCH_SLOW_TESTS set: tests/test_peaks_on_the_card.py checks its trace against the card by default
CARD = [pytest.param(1, "gpt2", None, 1024, None, marks=slow("gpt2, whose peaks test_peaks_on_the_card checks (~5 s)")),
        pytest.param(2, "gpt2", "bf16", 1024, None, marks=slow("gpt2 again, in bf16 (~4 s)")),
        (3, "bert-base", "bf16", 512, 349)]


@pytest.mark.parametrize("run,name,dtype,seq_len,answer", CARD, ids=["gpt2-fp32", "gpt2-bf16", "bert-base-bf16"])
def test_the_trace_booked_through_the_allocator_is_what_the_card_measured(run, name, dtype, seq_len, answer):
    probe = RECORD["runs"][run]["json"]["probe"]
    capacity = probe["capacity_bytes"]  # what the card had beside its CUDA context
    work = load_fake_model(name, seq_len=seq_len).to_workload(dtype=dtype)
    made = work.make_batch  # the record's batches carried a padding mask of ones, as the built-ins' did then
    work = replace(work, make_batch=lambda b: {**made(b), "attention_mask": torch.ones(b, seq_len, dtype=torch.long)})
    curve = trace_batches(work, work.model, fake_mode=next(work.model.parameters()).fake_mode, primed=False)
    for trial in probe["trials"]:
        if trial["batch"] == 1:
            continue
        booking = book(curve.requests(trial["batch"]), capacity)
        if trial["fits"]:
            # tensor bytes: the card's max_memory_allocated. Two runs of the card (two records) differ: in
            # this one it was up to 166 MB above the trace at batches far below the edge (1.1 % for bert-base
            # at 37), a per-shape term the trace lacks; at the edge within 0.1 %. Booked: its max_memory_reserved.
            assert abs(curve.trial(trial["batch"]).peak_bytes / trial["peak_bytes"] - 1) < 0.012, trial["batch"]
            if not trial["alloc_retries"]:  # a card that flushed its cache reserved less than it would have
                assert abs(booking.peak_reserved / trial["reserved_bytes"] - 1) < 0.001, trial["batch"]
            assert booking.fits, trial["batch"]
        elif trial["batch"] != 349:  # bert-base's edge: the model serves 349 with a retry where the card failed
            assert not booking.fits, trial["batch"]
    if answer is not None:  # the whole estimate, on that card's memory: 349 where the card fit 348
        result = estimate(work, gpu_memory=capacity, overheads=Overheads(context_bytes=0), headroom=0)
        assert result.max_batch == answer


def test_llama_1b_is_traced_as_the_card_ran_it_without_a_padding_mask_of_ones():
    # On real tensors transformers drops a mask of all ones before fused attention; a trace cannot read
    # the mask, so the built-in batches carry none. With the mask the trace held 0.69 GiB a sample more
    # than the card, and the estimate answered 14 where the card fit 15.
    probe = RECORD["runs"][0]["json"]["probe"]
    assert RECORD["runs"][0]["command"].startswith("autobatch find --model llama-1b --dtype bf16")
    work = load_fake_model("llama-1b").to_workload(dtype="bf16")
    assert "attention_mask" not in load_fake_model("tiny-llama").make_batch(2)
    curve = trace_batches(work, work.model, fake_mode=next(work.model.parameters()).fake_mode, primed=False)
    for trial in probe["trials"]:
        assert book(curve.requests(trial["batch"]), probe["capacity_bytes"]).fits == trial["fits"], trial["batch"]
        if trial["fits"]:
            assert abs(curve.trial(trial["batch"]).peak_bytes / trial["peak_bytes"] - 1) < 0.003, trial["batch"]

"""Sharded probes on one CPU: the real wrappers as rank 0 of W on the fake group, against a simulated budget.

The model (tests/sharded_jobs.py) has 66,560 bytes of fp32 parameters; AdamW's state is twice
that. Unsharded (DDP: parameters, gradients, gradient buckets, two moments) that is 333 KB
before any activation.
"""

from __future__ import annotations

import gc
import time

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor

import autobatch
from autobatch.distributed.sharding import fsdp_units
from autobatch.distributed.simulated_world import probe_sharded
from autobatch.distributed.zero import auto_bucket_sizes, zero_config
from autobatch.errors import AutobatchError, NoBatchFitsError
from autobatch.estimating import background
from autobatch.pipeline import TURNED_OFF, find_plan
from autobatch.probing.workload import default_loss
from autobatch.probing.backends import SimulatedBackend
from autobatch.strategy import Strategy
from tests import sharded_jobs
from tests.extras import need

BUDGET = "320KiB"


def assert_exact(result: autobatch.ProbeResult) -> None:
    """The max trained, and the batch above it ran out of memory (an exact boundary, proven by trials)."""
    fits = {t.batch for t in result.trials if t.fits}
    fails = {t.batch for t in result.trials if not t.fits}
    assert result.max_batch in fits and result.max_batch + 1 in fails
    assert all(b <= result.max_batch for b in fits) and all(b > result.max_batch for b in fails)


def test_states_that_do_not_fit_unsharded_fit_under_fsdp2_and_zero3() -> None:
    with pytest.raises(NoBatchFitsError, match="under ddp on 4 rank"):
        probe_sharded(sharded_jobs.workload(), SimulatedBackend(BUDGET), "ddp", 4)
    fsdp2 = probe_sharded(sharded_jobs.workload(), SimulatedBackend(BUDGET), "fsdp2", 4)
    assert_exact(fsdp2)
    assert fsdp2.max_batch >= 8
    per_rank = fsdp2.extra["sharding"]["per_rank"]
    assert per_rank["parameters"] == 66_560 // 4
    assert per_rank["optimizer_state"] == 2 * 66_560 // 4 + 8 * 4  # two moments and a step counter each
    assert fsdp2.extra["sharding"]["world_size"] == 4
    need("deepspeed")
    zero3 = probe_sharded(sharded_jobs.workload(), SimulatedBackend(BUDGET), "zero3", 4)
    assert_exact(zero3)
    assert zero3.extra["sharding"]["per_rank"]["parameters"] == 66_560 // 4
    assert zero3.extra["sharding"]["deepspeed_zero_optimization"]["reduce_bucket_size"] == 64 * 64


def test_every_zero_stage_answers_above_ddp_and_zero2_never_below_zero1() -> None:
    # Back in the default run: its four probes took ~20 s while each trial's gc.collect() walked the
    # whole test process; with the heap frozen (autobatch/probing/heap.py) they take about a second.
    # ZeRO-3 is not ordered against ZeRO-2 here: on a model this small its gathered units and
    # persistent parameters outweigh what it shards (real ranks agree: tests/test_real_ranks.py).
    need("deepspeed")
    budget = "400KiB"
    maxima = {}
    for name in ("ddp", "zero1", "zero2", "zero3"):
        result = probe_sharded(sharded_jobs.workload(), SimulatedBackend(budget), name, 4)
        assert_exact(result)
        maxima[name] = result.max_batch
    assert maxima["ddp"] < min(maxima["zero1"], maxima["zero2"], maxima["zero3"]), maxima
    assert maxima["zero1"] <= maxima["zero2"], maxima


@pytest.mark.parametrize("name", ["ddp", "fsdp2", "zero2", "zero3"])
def test_the_per_rank_terms_add_up_to_the_peak_each_counted_once(name) -> None:
    if name.startswith("zero"):
        need("deepspeed")
    result = probe_sharded(sharded_jobs.workload(), SimulatedBackend("400KiB"), name, 4, max_batch=4)
    terms = dict(result.extra["sharding"]["per_rank"])
    peak = terms.pop("peak")
    assert sum(terms.values()) == peak == result.max_trial.reserved_bytes, terms
    if name == "ddp":  # the gradients backward leaves are their own term, not inside the activations
        assert terms["gradients"] == terms["parameters"] == 66_560 and terms["buffers"] == 66_560  # DDP's buckets


def test_a_model_passed_in_is_bit_identical_and_the_rng_untouched() -> None:
    model = sharded_jobs.blocks()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    probe_sharded(autobatch.Workload(model, sharded_jobs.batch), SimulatedBackend(BUDGET), "fsdp2", 2, max_batch=2)
    assert torch.equal(torch.rand(3), expected)
    assert gc.get_freeze_count() == 0  # the collector too: frozen_heap gives the heap back as it was
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(type(p) is torch.nn.Parameter for p in model.parameters())


def test_find_answers_for_w_ranks_from_one_cpu() -> None:
    plan = autobatch.find(sharded_jobs.blocks, sharded_jobs.batch, target=64, device="cpu", memory=BUDGET,
                          gpus_per_node=4, strategy="fsdp2", headroom=0, use_trace_prior=False)
    assert plan.world_size == 4 and plan.micro_batch * plan.grad_accum * 4 == 64


def _dear_steps(loss_fn_of_fakes: bool):
    # a real step (or a traced one, on fake tensors) of half a second, where the other does not wait: dear
    # enough that the other's work on a loaded machine (the whole suite on two cores) stays well within it
    def loss_fn(model, x):
        if isinstance(x, FakeTensor) == loss_fn_of_fakes:
            time.sleep(0.5)
        return default_loss(model, x)
    return loss_fn


def test_the_sharded_step_traced_on_fake_tensors_leads_the_search_where_the_trials_cost_more(monkeypatch) -> None:
    # The trace wraps a fake copy as FSDP2 wraps it, on the probe's own fake group of four, and replays
    # it at any batch; it runs between the trials, each batch whole, never once they have taken less.
    # Its windows here are the first trial's time, about a second: begun in any of them (the
    # shortest window a trace is begun in is tested in tests/test_trace_beside.py), so that what the
    # trials cost decides, not where that time falls against the floor.
    monkeypatch.setattr(background, "FIRST_WINDOW", 0.0)
    def trials(loss_fn=None, **options):
        work = autobatch.Workload(sharded_jobs.blocks, sharded_jobs.batch, **({"loss_fn": loss_fn} if loss_fn else {}))
        finding = find_plan(work, backend=SimulatedBackend("600KiB"), strategy="fsdp2", gpus_per_node=4, headroom=0,
                            **options)
        said = finding.probe.trace_record  # and the result says so, or why not
        led = said["traced_batches"] if said["led"] else said["reason"]
        return finding.probe.max_batch, [(t.batch, t.fits) for t in finding.probe.trials], led, said

    alone = [(1, True), (6, True), (21, False), (12, True), (17, True), (18, True), (19, False)]
    assert trials(use_trace_prior=False)[:3] == (18, alone, TURNED_OFF)
    # Dear trials: the trace is done after the first and leads to the answer from there
    best, tried, led, said = trials(_dear_steps(False))
    assert best == 18 and said["between"] and said["from_trial"] == 1 and led == [2, 4, 16, 64], said
    assert tried == [(1, True), (18, True), (19, False)]
    # A dear trace: its first batch, begun in the first trial's time, outlasts the trials that follow;
    # at its pace the three batches left cost more than two trials, so it is given up, and the search is
    # the trials' alone (it had waited for all four; then run as long as the trials had)
    best, tried, led, said = trials(_dear_steps(True))
    assert (best, tried) == (18, alone) and said["traced_batches"] == [2], said
    assert led.startswith("the trace would have cost more than the trials it saves: "), led


def test_fsdp_units_are_the_transformer_blocks() -> None:
    transformers = need("transformers")
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=32, n_layer=3, n_head=2, vocab_size=64))
    assert [type(u).__name__ for u in fsdp_units(model)] == ["GPT2Block"] * 3
    assert len(fsdp_units(sharded_jobs.blocks())) == 4
    assert [type(u).__name__ for u in fsdp_units(sharded_jobs.blocks(), "Linear")] == ["Linear"] * 4
    with pytest.raises(AutobatchError, match="the FSDP unit must be a module class in the model, but 'Nope'"):
        fsdp_units(model, "Nope")


def test_deepspeed_buckets_are_sized_from_the_model_or_taken_from_the_users_file() -> None:
    model = sharded_jobs.blocks()
    assert auto_bucket_sizes(model, 2) == {"reduce_bucket_size": 4096}
    config = zero_config(model, Strategy("zero3"), batch=2, world_size=8, dtype="bf16",
                         user_config={"zero_optimization": {"reduce_bucket_size": 1000, "stage3_prefetch_bucket_size": "auto"}})
    zero = config["zero_optimization"]
    assert zero == {"reduce_bucket_size": 1000, "stage3_prefetch_bucket_size": 3686,
                    "stage3_param_persistence_threshold": 640, "stage": 3}
    assert config["train_batch_size"] == 16 and config["bf16"] == {"enabled": True}


def test_offload_cannot_be_probed_on_the_cpu() -> None:
    with pytest.raises(AutobatchError, match="offload='optimizer' moves state to host memory"):
        probe_sharded(sharded_jobs.workload(), SimulatedBackend(BUDGET), Strategy("zero3", offload="optimizer"), 4)


def test_under_a_launcher_every_rank_runs_sharded_trials_and_the_ranks_agree() -> None:
    """Two gloo ranks with different budgets probe FSDP2 in lockstep: one answer, the smaller rank's."""
    from autobatch.distributed.launch import spawn_local

    ranks = spawn_local(sharded_jobs.launched_job, nprocs=2, backend="gloo", timeout_s=240)
    first, second = ranks
    assert first["max_batch"] == second["max_batch"] > 0
    assert first["trials"] == second["trials"]
    assert first["limiting"] == second["limiting"] == (1,)
    assert first["wrapped"] == "fsdp2"
    assert first["sharding"]["world_size"] == 2 and first["sharding"]["simulated_world"] is False
    tried = dict(first["trials"])
    assert tried[first["max_batch"]] is True and tried[first["max_batch"] + 1] is False
    # rank 0, with more memory, fitted the batch that ended the search on rank 1
    assert dict(first["own"][0])[first["max_batch"] + 1] is True
    # one process as rank 0 of 2 on the fake group answers the same for the smaller budget (within
    # the one-unit difference docs/sharding.md describes between the fake group and real ranks)
    faked = probe_sharded(sharded_jobs.workload(), SimulatedBackend("700KiB"), "fsdp2", 2)
    assert abs(faked.max_batch - first["max_batch"]) <= 1


def test_fsdp_and_zero_on_fake_tensors_take_the_same_trials_as_real_steps() -> None:
    """`estimate --strategy` traces FSDP and ZeRO on fake tensors: byte for byte what real steps measure."""
    # fsdp1, zero1 and zero2 were measured equal too (docs/sharding.md); budgets where batch 1
    # fits and 2 does not keep this to two trials a side
    for strategy, budget in (("fsdp2", 140 << 10), ("zero3", 215 << 10)):
        if strategy == "zero3":
            need("deepspeed")
        _, real = sharded_jobs.fake_and_real(strategy, budget)
        assert [(t.batch, t.fits) for t in real.trials] == [(1, True), (2, False)]


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_zero2_in_low_precision_on_fake_tensors_steps_its_optimizer_as_real_steps_do(dtype) -> None:
    """ZeRO-1/2 read an overflow byte before each step; a trace read it as one and skipped every step,
    so the estimate held no optimizer state and answered 7 where 5 is the largest that fits.

    In fp16 DeepSpeed's CPU accelerator refused the config outright ("Type fp16 is not supported on
    your device"), so neither a trace nor a simulated budget could run the fp16 path a GPU runs
    (loss scaler, fp32 master shards): both run it now, alike byte for byte, and the accelerator
    says what it said before once the trial is over."""
    need("deepspeed")
    from deepspeed.accelerator import get_accelerator

    supported = get_accelerator().is_fp16_supported()
    fake, real = sharded_jobs.fake_and_real("zero2", 200_000, dtype=dtype)
    assert real.max_batch == fake.max_batch == 7  # 5 under an autocast DeepSpeed's frameworks never run
    assert fake.extra["sharding"]["per_rank"]["optimizer_state"] > 0
    assert get_accelerator().is_fp16_supported() == supported


def test_a_sharded_estimate_takes_the_allocator_overheads_off_the_card_as_one_gpus_does() -> None:
    # A traced step books exact tensor bytes; a GPU's caching allocator reserves more (its rounding and
    # cache), and the libraries keep 64 MiB of workspaces. By default each trial's requests are booked
    # through the allocator's model on the card, after the workspaces, as one GPU's estimate books them;
    # with --fragmentation a multiplier takes the allocator off the card instead.
    from autobatch import Overheads, Request, answer
    from autobatch.estimating.gpus import custom_gpu

    def probe(**overheads):
        return answer(Request(model="tiny-mlp", gpu_memory="600MiB", gpus_per_node=4, strategy="fsdp2",
                              estimate=True, **overheads)).finding.probe

    usable = custom_gpu("600MiB").usable_bytes
    booked, multiplied, bare = probe(), probe(fragmentation=1.1), probe(fragmentation=1.0, workspace=1)
    budget = Overheads(fragmentation=1.10, workspace_bytes=64 << 20).allocatable(usable)
    assert booked.capacity_bytes == usable and multiplied.capacity_bytes == budget
    assert bare.capacity_bytes == usable - 1  # one byte: the least a size may be
    top = {t.batch: t for t in booked.trials}
    edge = top[booked.max_batch]
    assert edge.peak_bytes <= edge.reserved_bytes <= usable and not top[booked.max_batch + 1].fits
    top = {t.batch: t for t in multiplied.trials}
    assert top[multiplied.max_batch].reserved_bytes <= budget < top[multiplied.max_batch + 1].reserved_bytes
    assert max(booked.max_batch, multiplied.max_batch) < bare.max_batch


class _Seen(torch.nn.Module):
    """Two blocks that note, at each forward, whether autocast is on and what dtype their input is."""

    seen: list = []

    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Sequential(sharded_jobs.Block(), sharded_jobs.Block())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _Seen.seen.append((torch.is_autocast_enabled("cpu"), x.dtype))
        return self.inner(x)


@pytest.mark.parametrize("strategy, dtype, autocast, given", [
    ("zero2", "bf16", False, torch.bfloat16), ("zero3", "fp16", False, torch.float16),
    ("fsdp2", "bf16", True, torch.bfloat16)])
def test_deepspeed_trains_its_precision_as_its_engine_with_no_autocast(strategy, dtype, autocast, given) -> None:
    """accelerate, the HF Trainer and Lightning run DeepSpeed's bf16/fp16 as the engine's weights in that dtype,
    with no autocast, and cast the batch's floats to it; FSDP's mixed precision runs under autocast (its policy
    casts the inputs). Under an autocast the engine never has, softmax, norms and losses save float32
    activations it does not."""
    if strategy != "fsdp2":
        need("deepspeed")
    _Seen.seen.clear()
    result = probe_sharded(autobatch.Workload(_Seen, sharded_jobs.batch, dtype=dtype), SimulatedBackend(400_000),
                           strategy, 2, max_batch=2)
    assert result.max_batch == 2 and _Seen.seen
    assert set(_Seen.seen) == {(autocast, given)}

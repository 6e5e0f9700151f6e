from __future__ import annotations

import copy
import statistics

import pytest
import torch

from autobatch import (
    AutobatchError,
    MinimumBatchError,
    NoBatchFitsError,
    SimulatedBackend,
    Workload,
    probe,
)
from autobatch.probing.trial import run_trial
from autobatch.estimating import trace_prior
from tests.tiny import TinyLM, cnn, cnn_workload, lm_workload, mlp, mlp_workload

CASES = [
    (mlp_workload, "2200KiB"),
    (mlp_workload, "3MiB"),
    (cnn_workload, "1MiB"),
    (cnn_workload, "2MiB"),
    (lm_workload, "1MiB"),
    (lm_workload, "2MiB"),
]


def scan(workload, budget, start, stop):
    """Largest batch that fits by trying every batch from ``start`` (an independent model each time)."""
    model = workload.model()
    backend = SimulatedBackend(budget)
    best = 0
    for b in range(start, stop):
        if not run_trial(workload, model, backend, b).fits:
            return best
        best = b
    raise AssertionError("scan range too small")


@pytest.mark.parametrize("make, budget", [case for case in CASES if case != (mlp_workload, "3MiB")])
def test_max_equals_an_exhaustive_scan(make, budget):
    workload = make()
    result = probe(workload, SimulatedBackend(budget))
    start = 2 if make is cnn_workload else 1
    assert result.max_batch == scan(workload, budget, start, result.max_batch + 50)
    assert result.limited_by == "memory"
    assert 0 < result.safe_batch <= result.max_batch
    assert result.safe_peak_bytes <= result.capacity_bytes - result.headroom_bytes


def test_median_trials_at_most_five_over_the_cases_without_a_prior():
    # Without a prior the second trial stays within 1.5× of what a curve growing as b² from the
    # resident memory would allow (the chord could be the square of the answer), which costs
    # these nearly affine cases a trial or two; the trace as a prior brings them to three.
    counts = [len(probe(make(), SimulatedBackend(budget)).trials) for make, budget in CASES]
    assert statistics.median(counts) <= 5, counts


def test_large_max_is_exact_at_its_boundary():
    # A full scan to ~485 costs minutes; the scans above cover the exhaustive claim, this the edge.
    result = probe(mlp_workload(), SimulatedBackend("3MiB"))
    assert scan(mlp_workload(), "3MiB", result.max_batch - 3, result.max_batch + 3) == result.max_batch


def test_exact_sequence_of_batches_for_a_fixed_case():
    result = probe(lm_workload(), SimulatedBackend("2MiB"))
    assert [(t.batch, t.fits) for t in result.trials] == [(1, True), (10, True), (19, True), (20, False)]


def test_the_trace_as_prior_goes_straight_to_the_boundary():
    work = lm_workload()
    result = probe(work, SimulatedBackend("2MiB"), prior=trace_prior(work, device_type="cpu"))
    assert [(t.batch, t.fits) for t in result.trials] == [(1, True), (19, True), (20, False)]


def test_batchnorm_model_starts_at_two():
    result = probe(cnn_workload(), SimulatedBackend("1MiB"))
    assert result.min_batch == 2 and result.trials[0].batch == 2


def test_batchnorm_at_batch_one_is_a_minimum_batch_not_a_crash():
    # Field report 4: BatchNorm1d sees one value per channel at batch 1 and raises ValueError.
    def bn_mlp():
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 2))

    work = Workload(bn_mlp, lambda b: (torch.randn(b, 8), torch.randint(0, 2, (b,))))
    with pytest.raises(MinimumBatchError, match="at least 2") as info:
        probe(work, SimulatedBackend("1MiB"), min_batch=1)
    assert info.value.min_batch == 2
    assert probe(work, SimulatedBackend("1MiB"), max_batch=8).max_batch == 8


def test_non_oom_errors_propagate_untouched():
    def loss(_model, _batch):
        raise ZeroDivisionError("user bug")

    with pytest.raises(ZeroDivisionError, match="user bug"):
        probe(Workload(mlp, lambda b: torch.randn(b, 64), loss_fn=loss), SimulatedBackend("8MiB"))


def test_max_batch_cap_is_reported():
    result = probe(lm_workload(), SimulatedBackend("64MiB"), max_batch=10)
    assert result.max_batch == 10 and result.limited_by == "max_batch"
    assert "limited by the --max-micro / max_batch= cap" in str(result)
    # with no cap given, the probe's own: named as its own, not as a --max-micro the user never passed
    import dataclasses

    from autobatch.probing.search import HARD_MAX_BATCH

    own = dataclasses.replace(result, max_batch=HARD_MAX_BATCH, safe_batch=HARD_MAX_BATCH)
    assert "limited by the probe's own cap, as memory never ran out" in str(own) and "--max-micro / max_batch= cap)" not in str(own)


def test_nothing_fits_is_one_clear_error():
    with pytest.raises(NoBatchFitsError, match="even a batch of 1 runs out of memory"):
        probe(lm_workload(), SimulatedBackend("64KiB"))


def test_headroom_as_memory():
    tight = probe(lm_workload(), SimulatedBackend("2MiB"), headroom=0)
    roomy = probe(lm_workload(), SimulatedBackend("2MiB"), headroom="512KiB")
    assert tight.safe_batch == tight.max_batch
    assert roomy.headroom_bytes == 512 * 1024 and roomy.safe_batch < roomy.max_batch
    with pytest.raises(AutobatchError, match=r"headroom as a fraction of memory must be in \[0, 1\)"):
        probe(lm_workload(), SimulatedBackend("2MiB"), headroom=1.5)


@pytest.mark.parametrize("factory", [TinyLM, cnn])
def test_model_passed_in_is_bit_identical_afterwards(factory):
    torch.manual_seed(0)
    model = factory()
    model.eval()
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.5)
    before = copy.deepcopy(model.state_dict())
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    ids = {n: id(p) for n, p in model.named_parameters()}
    rng = torch.get_rng_state()
    workload = (lm_workload if factory is TinyLM else cnn_workload)(model)
    result = probe(workload, SimulatedBackend("2MiB"))
    assert result.max_batch > 0
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(torch.equal(grads[n], p.grad) for n, p in model.named_parameters())
    assert {n: id(p) for n, p in model.named_parameters()} == ids
    assert not model.training
    assert torch.equal(rng, torch.get_rng_state())


def test_bad_arguments_are_one_line_errors():
    with pytest.raises(AutobatchError, match="max_batch must be a positive integer, but got max_batch=0"):
        probe(lm_workload(), SimulatedBackend("2MiB"), max_batch=0)
    with pytest.raises(AutobatchError, match="steps must be an integer ≥ 2"):
        Workload(mlp, lambda b: b, steps=1)
    with pytest.raises(AutobatchError, match="optimizer must be one of"):
        Workload(mlp, lambda b: b, optimizer="lion")


def test_a_trial_runs_two_full_steps_so_optimizer_state_counts():
    model = mlp()
    backend = SimulatedBackend("64MiB")
    trial = run_trial(mlp_workload(model), model, backend, 4)
    params = sum(p.numel() * 4 for p in model.parameters())
    # AdamW keeps two moments per parameter: resident memory is params + 2 × params (+ step counters).
    assert trial.resident_bytes >= 3 * params
    assert trial.seconds_per_step is not None and trial.seconds_per_step > 0


def test_autocast_dtype_is_used():
    seen = []

    def loss(model, batch):
        x, y = batch
        out = model(x)
        seen.append(out.dtype)
        return torch.nn.functional.cross_entropy(out.float(), y)

    work = Workload(mlp, lambda b: (torch.randn(b, 64), torch.randint(0, 10, (b,))), loss_fn=loss, dtype="bf16")
    probe(work, SimulatedBackend("4MiB"), max_batch=4)
    assert set(seen) == {torch.bfloat16}


def test_default_loss_shapes():
    from autobatch.probing.workload import default_loss

    linear = torch.nn.Linear(4, 3)
    assert default_loss(linear, torch.randn(2, 4)).shape == ()
    assert default_loss(linear, (torch.randn(2, 4), torch.tensor([0, 2]))).shape == ()

    class Returns(torch.nn.Module):
        def forward(self, x):
            return {"logits": x}

    with pytest.raises(AutobatchError, match="default_loss needs model\\(batch\\) to return a tensor or an object with a loss"):
        default_loss(Returns(), torch.randn(2, 4))


def test_a_trial_that_ran_out_of_memory_in_backward_leaves_nothing_behind():
    # The engine kept a failed backward's tasks (and their saved tensors) until the next
    # backward: the next trial started with them counted and failed where it fits.
    from benchmarks.cases import Case

    work = Case("clip", "2MiB").workload()
    backend, model = SimulatedBackend("2MiB"), work.model()
    assert run_trial(work, model, backend, 1).fits
    baseline = backend.allocated_bytes()
    assert not run_trial(work, model, backend, 300).fits
    assert backend.allocated_bytes() == baseline
    assert run_trial(work, model, backend, 230).fits


def test_memory_that_grows_faster_than_the_batch_is_said_by_its_slope_not_a_negative_fixed_part():
    # A contrastive loss's batch × batch logits: the line through the trials nearest the boundary crosses zero
    # at a positive batch, and "memory ≈ -312 KiB + 6.11 KiB per sample" was printed (tried as a new user would).
    def loss_fn(model, batch):
        logits = model(batch["a"]) @ model(batch["b"]).t()
        return torch.nn.functional.cross_entropy(logits, torch.arange(len(logits)))

    work = Workload(lambda: torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16)),
                    lambda b: {"a": torch.randn(b, 16), "b": torch.randn(b, 16)}, loss_fn=loss_fn, name="contrastive")
    result = probe(work, SimulatedBackend("2MiB"))
    assert result.fixed_bytes < 0 < result.bytes_per_sample  # the line's own figures, kept in --json
    line = result.memory_line()
    assert line.startswith("memory grows faster than the batch: ≈ ") and f"near batch {result.max_batch}" in line
    assert "-" not in line and line in str(result)
    assert probe(mlp_workload(), SimulatedBackend("2MiB")).memory_line().startswith("memory ≈ ")  # affine: as before

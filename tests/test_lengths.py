"""Tables over sequence lengths on the simulated budget: exact rows, the fit, the token budget,
the evaluation batch, and fewer trials than one probe per length (issue 17)."""

from __future__ import annotations

import pytest
import torch

from autobatch import AutobatchError, SimulatedBackend, Workload, probe, probe_lengths
from autobatch.probing.evaluation import run_eval_trial
from autobatch.probing.preserve import borrowed_model
from autobatch.probing.trial import run_trial
from docs.examples.causal_lm import TinyCausalLM, make_batch, next_token_loss, workload

LENGTHS = [32, 64, 128, 256]


def at(seq_len: int) -> Workload:
    return Workload(TinyCausalLM, lambda b: make_batch(b, seq_len), loss_fn=next_token_loss)


def scan(run, seq_len: int, budget: str, start: int = 1) -> int:
    """The largest batch that fits, trying every batch from ``start`` up to the first failure."""
    backend = SimulatedBackend(budget)
    model = TinyCausalLM()
    with borrowed_model(model, backend.device) as lent:
        b = start
        while run(at(seq_len), lent, backend, b).fits:
            b += 1
    return b - 1


@pytest.fixture(scope="module")
def small_table():
    return probe_lengths(workload(), [32, 48, 64], SimulatedBackend("384KiB"), evaluation=True)


@pytest.fixture(scope="module")
def table():
    return probe_lengths(workload(), LENGTHS, SimulatedBackend("4MiB"))


def test_every_row_is_exact_against_an_exhaustive_scan(small_table):
    for row in small_table.rows:
        assert row.max_batch == scan(run_trial, row.seq_len, "384KiB"), row.seq_len
        assert row.train.limited_by == "memory" and 0 < row.safe_batch <= row.max_batch


def test_eval_batch_is_exact_and_at_least_the_training_batch(small_table):
    for row in small_table.rows:
        assert row.eval.max_batch >= row.max_batch
        assert row.eval.max_batch == scan(run_eval_trial, row.seq_len, "384KiB", start=row.max_batch)
        tried = {t.batch: t.fits for t in row.eval.trials}
        assert tried[row.eval.max_batch] and tried[row.eval.max_batch + 1] is False


def test_later_lengths_are_guided_and_the_table_costs_fewer_trials_than_separate_probes(table):
    separate = [probe(at(s), SimulatedBackend("4MiB")) for s in LENGTHS]
    rows = {row.seq_len: row for row in table.rows}
    assert [rows[s].max_batch for s in LENGTHS] == [result.max_batch for result in separate]
    assert table.trials < sum(len(result.trials) for result in separate), (table.trials, separate)
    # Longest first. 128 starts from a fit of one length (no quadratic term yet, so its guess is
    # low and it re-aims once); from then on the fit holds and each length is predicted exactly.
    assert rows[256].predicted is None and len(rows[128].train.trials) <= 4
    assert [(rows[s].predicted, len(rows[s].train.trials)) for s in (64, 32)] == [(54, 2), (163, 2)]
    assert f"trials: {table.trials} in all" in str(table)


def test_fit_predicts_an_unprobed_length_within_five_percent(table):
    exact = probe(at(96), SimulatedBackend("4MiB")).max_batch
    predicted = table.fit.max_batch(96, SimulatedBackend("4MiB").capacity())
    assert abs(predicted - exact) <= 0.05 * exact, (predicted, exact)


def test_token_budget_is_safe_at_every_probed_length(table):
    tokens = table.max_tokens
    assert tokens is not None and tokens >= max(LENGTHS)
    backend = SimulatedBackend("4MiB")
    limit = backend.capacity() - table.rows[0].train.headroom_bytes
    model = TinyCausalLM()
    with borrowed_model(model, backend.device) as lent:
        for row in table.rows:
            batch = tokens // row.seq_len
            assert 1 <= batch <= row.safe_batch
            trial = run_trial(at(row.seq_len), lent, backend, batch)
            assert trial.fits and trial.reserved_bytes <= limit, (row.seq_len, batch)
    # One more token than the budget breaks the rule at the length that sets it.
    s = table.tokens.seq_len
    assert (tokens + 1) // s > table.tokens.safe_batch
    assert f"max_tokens {tokens:,}" in str(table)


def test_json_has_a_row_per_length_and_the_token_budget(table):
    data = table.to_dict()
    assert [r["seq_len"] for r in data["lengths"]] == LENGTHS
    assert set(data["lengths"][0]) >= {"seq_len", "max_batch", "safe_batch", "trials"}
    assert data["max_tokens"] == table.max_tokens and data["train_seq_len"] == 256


def test_plan_is_for_the_longest_length_unless_told():
    t = probe_lengths(workload(), [32, 64], SimulatedBackend("1MiB"), train_seq_len=32, headroom=0)
    assert t.train_row.seq_len == 32 and t.plan().micro_batch == t.row(32).safe_batch
    with pytest.raises(AutobatchError, match="train_seq_len must be one of the lengths probed"):
        probe_lengths(workload(), [32, 64], SimulatedBackend("1MiB"), train_seq_len=48)


def test_estimate_mode_on_fake_tensors_is_exact_per_row():
    t = probe_lengths(workload(), [64, 128], gpu_memory="2GiB", headroom=0)
    assert t.estimated
    for row in t.rows:
        tried = {b.batch: b.fits for b in row.train.trials}
        assert tried[row.max_batch] and tried[row.max_batch + 1] is False


def test_dataset_sample_probes_its_longest_sequence():
    sample = [torch.randint(0, 16, (4, 40)), torch.randint(0, 16, (2, 72)), torch.randint(0, 16, (8, 24))]
    t = probe_lengths(workload(), backend=SimulatedBackend("1MiB"), batches=sample)
    assert [row.seq_len for row in t.rows] == [72] and t.longest.batch_index == 1
    assert "longest sequence in the sample: 72 tokens" in str(t)
    # The model alone: trained on copies of that real sample.
    alone = probe_lengths(TinyCausalLM(), backend=SimulatedBackend("1MiB"), batches=iter(sample))
    assert alone.rows[0].seq_len == 72


def test_dataset_sample_reports_real_tokens_under_the_mask():
    ids = torch.randint(0, 16, (3, 50))
    mask = torch.ones(3, 50, dtype=torch.long)
    mask[0, 30:] = 0
    mask[2, 45:] = 0
    from autobatch.probing.samples import longest_sample

    found = longest_sample([{"input_ids": ids, "attention_mask": mask}])
    assert (found.seq_len, found.real_tokens, found.row) == (50, 50, 1)


def test_bad_inputs_are_one_clear_line():
    with pytest.raises(AutobatchError, match="make_batch\\(b, seq_len\\)"):
        probe_lengths(Workload(TinyCausalLM, lambda b: make_batch(b, 8)), [8], SimulatedBackend("1MiB"))
    with pytest.raises(AutobatchError, match="every sequence length must be a positive integer"):
        probe_lengths(workload(), [32, 0], SimulatedBackend("1MiB"))
    with pytest.raises(AutobatchError, match="seq_lens or batches, not both"):
        probe_lengths(workload(), [32], SimulatedBackend("1MiB"), batches=[torch.zeros(1, 4, dtype=torch.long)])


def test_the_fit_line_writes_its_sign_once_and_no_negative_zero():
    # "+ -0.00 B·s²" was printed for a fit whose quadratic term rounds to nothing
    from autobatch.lengths.table import _fit_text
    from autobatch.probing.lengthfit import LengthFit

    assert _fit_text(LengthFit(1000.0, 10.0, -0.001, lengths=(8, 16))).endswith("10 B·s + 0.00 B·s²)")
    assert _fit_text(LengthFit(1000.0, 10.0, -5.0, lengths=(8, 16))).endswith("10 B·s − 5.00 B·s²)")
    assert _fit_text(LengthFit(1000.0, 10.0, 0.5, lengths=(8, 16))).endswith("10 B·s + 0.50 B·s²)")

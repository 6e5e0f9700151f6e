"""verify_ga: naive mean of means FAILS, the helper PASSES, BatchNorm is FLAGGED, the model is untouched."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from autobatch.errors import AutobatchError, ConfigError
from autobatch.checking.ga_batches import lm_token_loss, padded_lm_batch, split_batch
from autobatch.checking.ga_sources import verify_model_source
from autobatch.checking.verify_ga import GAVerification, verify_ga
from tests.extras import need

VOCAB, SEQ = 97, 32


@pytest.fixture(scope="module")
def gpt2() -> torch.nn.Module:
    transformers = need("transformers")
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=64, bos_token_id=None, eos_token_id=None
    )  # default dropout 0.1 on purpose: verify_ga must switch it off
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


@pytest.fixture(scope="module")
def lm_batch() -> dict[str, torch.Tensor]:
    return padded_lm_batch(8, SEQ, VOCAB)


def hf_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The user's loss as written: HF's mean over this batch's non-padding tokens."""
    return model(**batch).loss


def ce_loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def xy(n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(n, 4, generator=gen), torch.randint(0, 3, (n,), generator=gen)


# --- the acceptance criteria of issue 7 -----------------------------------------------------


@pytest.mark.parametrize("micro, accum", [(1, 8), (2, 4)])
def test_naive_mean_of_means_fails_by_a_clear_margin(gpt2, lm_batch, micro: int, accum: int) -> None:
    result = verify_ga(gpt2, lm_batch, micro_batch=micro, grad_accum=accum, loss_fn=hf_loss)
    assert result.status == "FAIL" and not result.passed and result.exit_code == 1
    assert result.rel_error > 0.1  # four orders of magnitude above the fp32 noise
    assert "mean of means" in result.likely_cause
    assert result.item_kind == "tokens" or result.item_kind == "samples"


@pytest.mark.parametrize("micro, accum", [(1, 8), (2, 4)])
def test_helper_passes_within_1e_5_in_fp32(gpt2, lm_batch, micro: int, accum: int) -> None:
    result = verify_ga(gpt2, lm_batch, micro_batch=micro, grad_accum=accum, token_loss_fn=lm_token_loss(),
                       mode="normalised")
    assert result.status == "PASS" and result.exit_code == 0
    assert result.rel_error <= 1e-5
    assert result.min_cosine > 1 - 1e-6
    assert result.loss_accumulated == pytest.approx(result.loss_big, rel=1e-5)
    assert result.likely_cause is None


def test_naive_token_form_gives_the_same_verdict_as_the_hf_loss(gpt2, lm_batch) -> None:
    ours = verify_ga(gpt2, lm_batch, micro_batch=1, grad_accum=8, token_loss_fn=lm_token_loss())
    theirs = verify_ga(gpt2, lm_batch, micro_batch=1, grad_accum=8, loss_fn=hf_loss)
    assert ours.status == theirs.status == "FAIL"
    assert ours.rel_error == pytest.approx(theirs.rel_error, rel=1e-4)
    # The cause names the token counts that make the means unequal.
    assert ours.items_per_micro_batch == tuple(int((mb["labels"][:, 1:] != -100).sum())
                                               for mb in split_batch(lm_batch, 1))
    assert "between 1 and 31 tokens" in ours.likely_cause


def test_simulated_ranks_pass_with_the_helper_and_fail_naively(gpt2, lm_batch) -> None:
    kw = dict(micro_batch=1, grad_accum=4, world_size=2, token_loss_fn=lm_token_loss())
    assert verify_ga(gpt2, lm_batch, mode="normalised", **kw).rel_error <= 1e-5
    assert verify_ga(gpt2, lm_batch, mode="naive", **kw).status == "FAIL"


def test_a_token_mean_checked_per_sample_names_a_fix_that_runs_where_the_user_is(gpt2, lm_batch) -> None:
    # It said "pass token_loss_fn(...)", which `verify-ga --normalised` on your own model cannot take
    result = verify_ga(gpt2, lm_batch, micro_batch=2, grad_accum=4, loss_fn=hf_loss, mode="normalised")
    assert result.status == "FAIL" and "mean over samples" in result.likely_cause
    assert "autobatch.verify_ga(model, batch, token_loss_fn=...)" in result.likely_cause
    assert "the command line's --normalised weighs your own loss per sample" in result.likely_cause


def test_equal_sized_samples_pass_naively() -> None:
    """A mean over samples with equal micro-batches is the big batch: no false alarm."""
    torch.manual_seed(0)
    result = verify_ga(torch.nn.Linear(4, 3), xy(), micro_batch=2, grad_accum=4, loss_fn=ce_loss)
    assert result.status == "PASS" and result.item_kind == "samples"


def test_a_summed_loss_is_reported_as_a_scale_error() -> None:
    torch.manual_seed(0)
    summed = lambda m, b: F.cross_entropy(m(b[0]), b[1], reduction="sum")  # noqa: E731
    result = verify_ga(torch.nn.Linear(4, 3), xy(), micro_batch=2, grad_accum=4, loss_fn=summed)
    assert result.status == "FAIL"
    assert result.cosine > 1 - 1e-6 and result.grad_norm_ratio == pytest.approx(0.25, rel=1e-4)
    assert "grad_accum = 4" in result.likely_cause


# --- BatchNorm, randomness ------------------------------------------------------------------


def bn_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


def test_batchnorm_is_flagged_with_an_explanation_not_a_crash() -> None:
    result = verify_ga(bn_model(), xy(), micro_batch=1, grad_accum=8, loss_fn=ce_loss)
    assert result.status == "FLAGGED" and result.exit_code == 3 and not result.passed
    assert "BatchNorm" in result.likely_cause and "by design" in result.likely_cause
    assert "rest of the step matches" in result.likely_cause
    assert any("Expected more than 1 value per channel" in n for n in result.notes)


def test_batchnorm_with_micro_batch_2_reports_the_training_mode_difference() -> None:
    result = verify_ga(bn_model(), xy(), micro_batch=2, grad_accum=4, loss_fn=ce_loss)
    assert result.status == "FLAGGED"
    assert any("own mean and variance" in n for n in result.notes)


class FunctionalDropout(torch.nn.Module):
    """Dropout that no module switch can find: the reproducibility check must catch it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(self.lin(x), 0.5, training=self.training)


def test_randomness_left_on_is_flagged() -> None:
    torch.manual_seed(0)
    result = verify_ga(FunctionalDropout(), xy(), micro_batch=2, grad_accum=4, loss_fn=ce_loss)
    assert result.status == "FLAGGED" and result.repro_error > 1e-3
    assert "does not reproduce its own gradient" in result.likely_cause


def test_dropout_layers_and_attention_dropout_floats_are_switched_off() -> None:
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(d_model=8, nhead=2, dim_feedforward=16, dropout=0.3, batch_first=True)
    x = torch.randn(8, 5, 8)
    result = verify_ga(layer, x, micro_batch=2, grad_accum=4, loss_fn=lambda m, b: m(b).pow(2).mean())
    assert result.status == "PASS", str(result)
    assert any("dropout switched off" in n for n in result.notes)


# --- the user's model is never changed ------------------------------------------------------


def snapshot(model: torch.nn.Module) -> dict[str, object]:
    return {
        "state": {k: v.clone() for k, v in model.state_dict().items()},
        "grads": {k: None if p.grad is None else p.grad.clone() for k, p in model.named_parameters()},
        "training": [m.training for m in model.modules()],
        "rng": torch.get_rng_state(),
    }


def assert_unchanged(model: torch.nn.Module, before: dict[str, object]) -> None:
    after = snapshot(model)
    assert before["state"].keys() == after["state"].keys()
    for k, v in before["state"].items():
        assert torch.equal(v, after["state"][k]), k
    for k, g in before["grads"].items():
        assert (g is None and after["grads"][k] is None) or torch.equal(g, after["grads"][k]), k
    assert before["training"] == after["training"]
    assert torch.equal(before["rng"], after["rng"])


def test_the_model_passed_in_is_bit_identical_afterwards(gpt2, lm_batch) -> None:
    gpt2.eval()  # a flag verify_ga must not flip
    hf_loss(gpt2, split_batch(lm_batch, 2)[0]).backward()  # an existing .grad must survive too
    before = snapshot(gpt2)
    verify_ga(gpt2, lm_batch, micro_batch=2, grad_accum=4, token_loss_fn=lm_token_loss(), mode="normalised")
    assert_unchanged(gpt2, before)
    gpt2.zero_grad(set_to_none=True)
    gpt2.train()


def test_batchnorm_running_statistics_of_the_model_passed_in_are_untouched() -> None:
    model = bn_model()
    before = snapshot(model)
    verify_ga(model, xy(), micro_batch=2, grad_accum=4, loss_fn=ce_loss)
    assert_unchanged(model, before)


# --- the result object ----------------------------------------------------------------------


def test_result_is_frozen_and_serialises_to_json(gpt2, lm_batch) -> None:
    result = verify_ga(gpt2, lm_batch, micro_batch=1, grad_accum=8, loss_fn=hf_loss)
    assert isinstance(result, GAVerification)
    with pytest.raises(AttributeError):
        result.status = "PASS"  # type: ignore[misc]
    d = json.loads(json.dumps(result.to_dict()))
    assert d["status"] == "FAIL" and d["passed"] is False and d["exit_code"] == 1 and d["global_batch"] == 8
    assert {"name", "numel", "rel_error", "cosine"} <= set(d["parameters"][0])
    assert d["likely_cause"].startswith("your loss averages per micro-batch means")


def test_str_shows_the_arithmetic_and_the_worst_parameters(gpt2, lm_batch) -> None:
    text = str(verify_ga(gpt2, lm_batch, micro_batch=2, grad_accum=4, loss_fn=hf_loss))
    assert text.startswith("verify-ga: FAIL")
    assert "# 2 micro batch * 4 grad accum * 1 rank = 8 samples, against one batch of 8" in text
    assert "worst parameters:" in text and "likely cause: your loss averages per micro-batch means" in text


def test_an_all_padding_micro_batch_is_explained() -> None:
    batch = padded_lm_batch(4, 8, 50)
    batch["labels"][0] = -100  # one sample with no target at all
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(50, 8), torch.nn.Linear(8, 50))
    result = verify_ga(model, batch, micro_batch=1, grad_accum=4, token_loss_fn=lm_token_loss())
    assert result.status == "FAIL" and "0/0" in result.likely_cause
    json.dumps(result.to_dict(), allow_nan=False)
    assert verify_ga(model, batch, micro_batch=1, grad_accum=4, token_loss_fn=lm_token_loss(),
                     mode="normalised").passed


# --- input checking -------------------------------------------------------------------------


def test_every_bad_argument_is_reported_together() -> None:
    with pytest.raises(ConfigError, match="micro_batch must be a positive integer.*grad_accum.*mode must be") as info:
        verify_ga(torch.nn.Linear(4, 3), xy(), micro_batch=0, grad_accum=-1, mode="mean", loss_fn=ce_loss)
    assert len(info.value.problems) == 3


def test_a_loss_is_required() -> None:
    with pytest.raises(ConfigError, match="pass loss_fn"):
        verify_ga(torch.nn.Linear(4, 3), xy(), micro_batch=2, grad_accum=4)


def test_the_batch_must_match_the_arithmetic() -> None:
    with pytest.raises(AutobatchError, match=r"2 \* 4 \* 2 = 16 samples, but it holds 8"):
        verify_ga(torch.nn.Linear(4, 3), xy(), micro_batch=2, grad_accum=4, world_size=2, loss_fn=ce_loss)


def test_padded_lm_batch_spreads_lengths_and_masks_padding() -> None:
    b = padded_lm_batch(4, 8, 50, seed=3)
    assert sorted(b["attention_mask"].sum(1).tolist()) == [2, 4, 6, 8]
    assert torch.equal(b["labels"] == -100, b["attention_mask"] == 0)
    with pytest.raises(AutobatchError, match="seq_len must be at least"):
        padded_lm_batch(4, 1, 50)


# --- built-in model sources (the objects autobatch.models.load_model returns) -----------------


class PlainLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = torch.nn.Embedding(VOCAB, 16), torch.nn.Linear(16, VOCAB)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.emb(input_ids).cumsum(1)))


def test_language_model_sources_get_a_padded_batch_and_token_losses() -> None:
    torch.manual_seed(0)
    source = SimpleNamespace(model=PlainLM(), task="causal-lm", vocab_size=VOCAB, seq_len=16)
    assert verify_model_source(source, micro_batch=1, grad_accum=4).status == "FAIL"
    assert verify_model_source(source, micro_batch=1, grad_accum=4, mode="normalised").status == "PASS"


def test_other_sources_use_their_own_batches_and_loss() -> None:
    torch.manual_seed(0)
    source = SimpleNamespace(model=bn_model(), task="classification", make_batch=lambda b: xy(b), loss_fn=ce_loss)
    assert verify_model_source(source, micro_batch=2, grad_accum=2).status == "FLAGGED"


# --- the example on docs/gradient-accumulation.md -------------------------------------------


def test_docs_example_prints_what_the_page_shows(capsys: pytest.CaptureFixture[str]) -> None:
    need("transformers")
    page = (Path(__file__).resolve().parents[1] / "docs" / "gradient-accumulation.md").read_text()
    section = page.split("## What the check measures", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    shown = section.split("```text\n", 1)[1].split("```", 1)[0].splitlines()
    exec(compile(code, "docs/gradient-accumulation.md", "exec"), {"__name__": "docs_example"})
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == len(shown) == 4
    for got, want in zip(printed, shown):
        if " PASS " in want:  # fp32 rounding differs between CPUs; the verdict and the bound do not
            assert " PASS " in got and float(got.split("rel error ")[1].split()[0]) <= 1e-5
            assert got.split("cosine")[1] == want.split("cosine")[1]
        else:
            assert got == want


def test_docstring_examples_run() -> None:
    import doctest
    import importlib

    # The module, not the function autobatch/__init__.py re-exports under the same name.
    module = importlib.import_module("autobatch.checking.verify_ga")
    assert doctest.testmod(module).failed == 0

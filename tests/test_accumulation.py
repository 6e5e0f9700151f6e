"""The loss-normalisation helpers: counting, scaling, and GA that equals the big batch."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from autobatch.checking.accumulation import LossNormaliser, count_loss_samples, count_loss_tokens, token_cross_entropy
from autobatch.errors import AutobatchError
from autobatch.checking.ga_batches import padded_lm_batch, split_batch
from tests.extras import need

VOCAB, SEQ = 29, 12


class TinyLM(torch.nn.Module):
    """Embedding, a causal running mean over positions, a head: tokens of a sequence interact."""

    def __init__(self, vocab: int = VOCAB, dim: int = 16):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(input_ids).cumsum(1) / torch.arange(1, input_ids.shape[1] + 1)[None, :, None]
        return self.head(torch.tanh(h))


def grads(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def big_batch_grad(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    losses, mask = token_cross_entropy(model(batch["input_ids"]), batch["labels"], shift=True)
    (losses[mask].sum() / mask.sum()).backward()
    return grads(model)


def accumulated_grad(model: torch.nn.Module, batch: dict[str, torch.Tensor], micro: int, helper: bool) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    micro_batches = split_batch(batch, micro)
    norm = count_loss_tokens(micro_batches, shift=True)
    for mb in micro_batches:
        losses, mask = token_cross_entropy(model(mb["input_ids"]), mb["labels"], shift=True)
        if helper:
            loss = norm.token_loss(losses, mask)
        else:  # the bug: mean over this micro-batch's tokens, then / grad_accum
            loss = losses[mask].mean() / len(micro_batches)
        loss.backward()
    return grads(model)


# --- LossNormaliser -------------------------------------------------------------------------


def test_factor_is_world_size_over_total() -> None:
    norm = LossNormaliser(total=40, world_size=4)
    assert norm.factor == 0.1
    assert float(norm(torch.tensor(5.0))) == pytest.approx(0.5)


@pytest.mark.parametrize("total", [0, -3, 2.5, True])
def test_total_must_be_a_positive_count(total: object) -> None:
    with pytest.raises(AutobatchError, match="at least one non-ignored item"):
        LossNormaliser(total=total)  # type: ignore[arg-type]


def test_world_size_must_be_positive() -> None:
    with pytest.raises(AutobatchError, match="world_size must be a positive integer"):
        LossNormaliser(total=3, world_size=0)


def test_token_loss_ignores_masked_positions_even_when_they_are_not_finite() -> None:
    norm = LossNormaliser(total=2)
    loss = norm.token_loss(torch.tensor([1.0, 3.0, float("nan"), float("inf")]), torch.tensor([1, 1, 0, 0]))
    assert float(loss) == 2.0


def test_token_loss_checks_the_mask_shape() -> None:
    with pytest.raises(AutobatchError, match=r"mask must have the shape.*\(3,\).*\(2,\)"):
        LossNormaliser(total=2).token_loss(torch.ones(2), torch.ones(3))


def test_rescale_mean_turns_a_micro_batch_mean_into_its_share() -> None:
    norm = LossNormaliser(total=8)
    assert float(norm.rescale_mean(torch.tensor(2.0), 3)) == pytest.approx(0.75)


# --- counting -------------------------------------------------------------------------------


def test_count_loss_tokens_accepts_tensors_mappings_and_masks() -> None:
    labels = torch.tensor([[1, 2, -100], [3, -100, -100]])
    assert count_loss_tokens([labels]).total == 3
    assert count_loss_tokens([{"labels": labels}, {"labels": labels}]).total == 6
    assert count_loss_tokens([labels != -100]).total == 3
    assert count_loss_tokens([labels], shift=True).total == 1  # position 0 is never a target
    assert count_loss_tokens([{"y": labels}], label_key="y", ignore_index=3).total == 5


def test_count_loss_tokens_without_process_group_uses_world_size_one() -> None:
    assert count_loss_tokens([torch.tensor([1, 2])], grad_reduction="mean").world_size == 1


def test_count_loss_tokens_says_which_key_is_missing() -> None:
    with pytest.raises(AutobatchError, match="micro-batch 1 has no 'labels' key"):
        count_loss_tokens([{"labels": torch.ones(2)}, {"input_ids": torch.ones(2)}])


def test_count_loss_tokens_rejects_other_types() -> None:
    with pytest.raises(AutobatchError, match="must be a label tensor.*got list"):
        count_loss_tokens([[1, 2, 3]])  # type: ignore[list-item]


def test_all_padding_everywhere_is_an_error_not_a_division_by_zero() -> None:
    with pytest.raises(AutobatchError, match="total=0"):
        count_loss_tokens([torch.full((2, 3), -100)])


def test_grad_reduction_is_checked() -> None:
    with pytest.raises(AutobatchError, match="grad_reduction must be 'mean'"):
        count_loss_tokens([torch.ones(2)], grad_reduction="avg")  # type: ignore[arg-type]


def test_count_loss_samples_accepts_counts_tensors_mappings_and_tuples() -> None:
    x = torch.zeros(3, 5)
    assert count_loss_samples([2, x, {"x": x, "flag": True}, (x, torch.zeros(3))]).total == 11


def test_count_loss_samples_rejects_what_it_cannot_size() -> None:
    with pytest.raises(AutobatchError, match="cannot tell how many samples micro-batch 0"):
        count_loss_samples([{"name": "a"}])


# --- token_cross_entropy --------------------------------------------------------------------


def test_token_cross_entropy_mean_equals_pytorch_mean_over_non_ignored_tokens() -> None:
    torch.manual_seed(0)
    logits, labels = torch.randn(2, 5, 7), torch.tensor([[1, 2, 3, -100, -100], [4, 5, 6, 0, -100]])
    losses, mask = token_cross_entropy(logits, labels, shift=True)
    assert losses.shape == mask.shape == (2, 4)
    expected = F.cross_entropy(logits[:, :-1].reshape(-1, 7), labels[:, 1:].reshape(-1))
    helper = LossNormaliser(total=int(mask.sum())).token_loss(losses, mask)
    assert torch.allclose(helper, expected)


# --- the point of it all: GA equals the big batch -------------------------------------------


@pytest.mark.parametrize("micro", [1, 2, 4])
def test_helper_accumulation_equals_the_big_batch(micro: int) -> None:
    torch.manual_seed(0)
    model, batch = TinyLM(), padded_lm_batch(8, SEQ, VOCAB)
    big = big_batch_grad(model, batch)
    assert rel_error(accumulated_grad(model, batch, micro, helper=True), big) <= 1e-5


def test_mean_of_means_differs_from_the_big_batch() -> None:
    torch.manual_seed(0)
    model, batch = TinyLM(), padded_lm_batch(8, SEQ, VOCAB)
    big = big_batch_grad(model, batch)
    assert rel_error(accumulated_grad(model, batch, 1, helper=False), big) > 0.05


def test_sample_helper_with_unequal_micro_batches_equals_the_big_batch() -> None:
    torch.manual_seed(0)
    model, x, y = torch.nn.Linear(4, 3), torch.randn(8, 4), torch.randint(0, 3, (8,))
    F.cross_entropy(model(x), y).backward()
    big = grads(model)
    parts = [(x[:5], y[:5]), (x[5:], y[5:])]  # a short last micro-batch, as at the end of an epoch

    model.zero_grad(set_to_none=True)
    norm = count_loss_samples(parts)
    for xb, yb in parts:
        norm.sample_loss(F.cross_entropy(model(xb), yb, reduction="none")).backward()
    assert rel_error(grads(model), big) <= 1e-6

    model.zero_grad(set_to_none=True)
    for xb, yb in parts:
        (F.cross_entropy(model(xb), yb) / len(parts)).backward()
    assert rel_error(grads(model), big) > 0.01


# --- the integrations the docs show ---------------------------------------------------------


def tiny_gpt2():  # type: ignore[no-untyped-def]
    transformers = need("transformers", "accelerate")
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=97, n_positions=64, bos_token_id=None, eos_token_id=None,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,  # dropout would make the two runs differ
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def test_hf_num_items_in_batch_is_the_helpers_count() -> None:
    """docs: HF models divide their summed loss by ``num_items_in_batch``, our shifted token count."""
    model, batch = tiny_gpt2(), padded_lm_batch(4, 16, 97)
    micro_batches = split_batch(batch, 2)
    norm = count_loss_tokens(micro_batches, shift=True)
    for mb in micro_batches:
        ours = norm.token_loss(*token_cross_entropy(model(**mb).logits, mb["labels"], shift=True))
        theirs = model(**mb, num_items_in_batch=norm.total).loss
        assert torch.allclose(ours, theirs, rtol=1e-6, atol=0)


def compute_loss_func(outputs, labels, num_items_in_batch=None):  # type: ignore[no-untyped-def]
    """docs: Trainer(compute_loss_func=...). Trainer already summed the count over GA and devices,
    and multiplies by the process count itself, so world_size stays 1 here."""
    norm = LossNormaliser(total=int(num_items_in_batch))
    return norm.token_loss(*token_cross_entropy(outputs.logits, labels, shift=True))


def helper_trainer_class():  # type: ignore[no-untyped-def]
    from transformers import Trainer

    class HelperTrainer(Trainer):
        """docs: a compute_loss override; the base class's ×num_processes is not applied, so we do it."""

        loss_is_scaled_for_ga = True  # normalised over the whole accumulated batch: no "/ GA" by Trainer

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):  # type: ignore[no-untyped-def]
            labels = inputs.pop("labels")
            outputs = model(**inputs)
            norm = LossNormaliser(total=int(num_items_in_batch), world_size=self.accelerator.num_processes)
            loss = norm.token_loss(*token_cross_entropy(outputs.logits, labels, shift=True))
            return (loss, outputs) if return_outputs else loss

    return HelperTrainer


def trainer_step_error(model: torch.nn.Module, batch: dict[str, torch.Tensor], tmp_path, path: str) -> float:  # type: ignore[no-untyped-def]
    """One real Trainer step (SGD, lr 1, no clipping) of 2 per device × GA 4: -Δparams is the gradient."""
    transformers = need("transformers", "accelerate")
    reference = copy.deepcopy(model)
    reference(**batch).loss.backward()
    big = grads(reference)
    before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])

    class Rows(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 8

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {k: v[i] for k, v in batch.items()}

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=4, max_steps=1,
        optim="sgd", learning_rate=1.0, max_grad_norm=0.0, lr_scheduler_type="constant", weight_decay=0.0,
        report_to=[], save_strategy="no", logging_strategy="no", use_cpu=True, disable_tqdm=True,
    )
    cls = helper_trainer_class() if path == "subclass" else transformers.Trainer
    extra = {"compute_loss_func": compute_loss_func} if path == "compute_loss_func" else {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: extra threads only fight over a shared CPU
    try:
        cls(model=model, args=args, train_dataset=Rows(), **extra).train()
    finally:
        torch.set_num_threads(threads)
    step = before - torch.cat([p.detach().flatten() for p in model.parameters()])
    return rel_error(step, big)


def tiny_llama():  # type: ignore[no-untyped-def]
    transformers = need("transformers", "accelerate")
    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
        vocab_size=97, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


@pytest.mark.slow
@pytest.mark.parametrize("path", ["default", "compute_loss_func", "subclass"])
def test_hf_trainer_under_ga_matches_the_big_batch(tmp_path, path: str) -> None:  # type: ignore[no-untyped-def]
    """docs: the model's own loss, compute_loss_func and a compute_loss override, in a real Trainer step."""
    assert trainer_step_error(tiny_llama(), padded_lm_batch(8, 32, 97), tmp_path, path) <= 1e-5


@pytest.mark.slow
def test_hf_trainer_counts_gpt2_labels_unshifted_unless_loss_type_is_set(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """docs: GPT2LMHeadModel has no loss_type, so Trainer over-counts num_items_in_batch by one per sequence."""
    batch = padded_lm_batch(8, 32, 97)
    shifted, unshifted = int((batch["labels"][:, 1:] != -100).sum()), int((batch["labels"] != -100).sum())
    error = trainer_step_error(tiny_gpt2(), batch, tmp_path, "compute_loss_func")
    assert error == pytest.approx(1 - shifted / unshifted, rel=1e-3)  # a pure scale: 128 / 136 here
    model = tiny_gpt2()
    model.loss_type = "ForCausalLM"  # the fix the docs give
    assert trainer_step_error(model, batch, tmp_path, "compute_loss_func") <= 1e-5


def test_accelerate_loop_from_the_docs_matches_the_big_batch() -> None:
    """docs: accelerate's ``backward`` divides by gradient_accumulation_steps; multiplying undoes it."""
    accelerate = need("accelerate")
    torch.manual_seed(0)
    model, batch = TinyLM(), padded_lm_batch(8, SEQ, VOCAB)
    big = big_batch_grad(model, batch)
    model.zero_grad(set_to_none=True)

    accelerator = accelerate.Accelerator(gradient_accumulation_steps=4, cpu=True)
    model = accelerator.prepare(model)
    micro_batches = split_batch(batch, 2)
    norm = count_loss_tokens(micro_batches, shift=True)
    for mb in micro_batches:
        with accelerator.accumulate(model):
            losses, mask = token_cross_entropy(model(mb["input_ids"]), mb["labels"], shift=True)
            accelerator.backward(norm.token_loss(losses, mask) * accelerator.gradient_accumulation_steps)
    assert rel_error(grads(model), big) <= 1e-5


def test_docstring_examples_run() -> None:
    import doctest
    import importlib

    assert doctest.testmod(importlib.import_module("autobatch.checking.accumulation")).failed == 0


@pytest.mark.parametrize("micro, groups", [(1, 2), (2, 2), (1, 4), (2, 4), (3, 2)])
def test_micro_batches_of_a_padded_batch_never_all_hold_the_same_tokens(micro, groups):
    # One shuffle in three paired lengths 2 with 64 and 23 with 43: equal token counts, and a naive loss passed
    for seed in range(60):
        batch = padded_lm_batch(micro * groups, 64, 50, seed=seed, groups=groups)
        tokens = [int(m["attention_mask"].sum()) for m in split_batch(batch, micro)]
        assert len(set(tokens)) > 1, (seed, tokens)
    alike = padded_lm_batch(4, 2, 50, groups=2)  # every length 2: nothing can tell the parts apart
    assert alike["attention_mask"].sum(1).tolist() == [2, 2, 2, 2]

"""A probe with gradient checkpointing gives the model back as it came: no hook left on any module
(transformers' checkpointing registers an input-grads hook on the embeddings) and no attribute added."""

from __future__ import annotations

import torch

import autobatch

from .extras import need

transformers = need("transformers")


def state(model: torch.nn.Module) -> dict[str, tuple[set[str], dict[str, list]]]:
    return {name: (set(vars(module)), {k: list(v) for k, v in vars(module).items() if "hook" in k and isinstance(v, dict)})
            for name, module in model.named_modules()}


def test_checkpointing_leaves_no_hook_and_no_attribute_behind():
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=32)
    model = transformers.GPT2LMHeadModel(config)
    model.transformer.wte.weight.requires_grad_(False)  # a frozen embedding, as under LoRA

    def make(b):
        x = torch.randint(0, 100, (b, 16))
        return {"input_ids": x, "labels": x}

    before = state(model)
    autobatch.probe(autobatch.Workload(model, make, grad_checkpointing=True), autobatch.SimulatedBackend("64MiB"),
                    max_batch=4)
    assert state(model) == before
    assert not hasattr(model, "_require_grads_hook")
    # With the hook left on, a frozen embedding's output would require grad in every later forward.
    assert not model.transformer.wte(torch.tensor([[1]])).requires_grad


def test_hooks_the_user_registered_stay():
    model = torch.nn.Linear(8, 2)
    seen = []
    model.register_forward_hook(lambda module, args, out: seen.append(out.shape[0]))
    before = state(model)
    autobatch.probe(autobatch.Workload(model, lambda b: (torch.randn(b, 8), torch.zeros(b, dtype=torch.long))),
                    autobatch.SimulatedBackend("256KiB"), max_batch=4)
    assert state(model) == before and seen  # the user's own hook ran in the trials and is still there

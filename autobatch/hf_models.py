"""transformers models built from configs, for :mod:`autobatch.models` (imported only when one is built)."""

from __future__ import annotations

from typing import Any

import torch

from .errors import AutobatchError, MissingDependencyError

__all__ = ["ATTENTION", "import_transformers", "hf_model", "max_positions"]

# transformers' attention implementations a model can be built with: "sdpa" fuses (a GPU keeps O(seq) per
# layer), "eager" keeps the probabilities (O(seq²)); the model's own default when none is asked for
ATTENTION = ("eager", "sdpa")


def import_transformers() -> Any:
    """transformers, quiet, or one line saying which extra installs it."""
    try:
        import transformers
    except ImportError:
        raise MissingDependencyError(
            "this model needs transformers, which is not installed; pip install 'autobatch[hf]'"
        ) from None
    transformers.logging.set_verbosity_error()
    return transformers


def hf_model(config: Any, family: str, trust_remote_code: bool = False,
             attention: str | None = None) -> tuple[torch.nn.Module, str]:
    """The model for ``config`` with a causal or masked language-model head, and which it is."""
    tf = import_transformers()
    options: dict[str, Any] = {"trust_remote_code": trust_remote_code}
    if attention is not None:
        options["attn_implementation"] = attention
    if family == "bert" or getattr(config, "model_type", "") in ("bert", "roberta", "distilbert", "deberta-v2"):
        return tf.AutoModelForMaskedLM.from_config(config, **options), "masked-lm"
    try:
        return tf.AutoModelForCausalLM.from_config(config, **options), "causal-lm"
    except ValueError:
        pass
    try:
        return tf.AutoModelForMaskedLM.from_config(config, **options), "masked-lm"
    except ValueError:
        kind = getattr(config, "model_type", type(config).__name__)
        raise AutobatchError(
            f"hf: models train as causal or masked language models here, but {kind!r} is neither (a seq2seq, "
            "vision or other head); build it in your own file and pass --model file.py:fn returning an "
            "autobatch.Workload with its batches and loss") from None


def max_positions(config: Any) -> int | None:
    """The longest sequence ``config`` allows, where it says."""
    for key in ("n_positions", "max_position_embeddings"):
        value = getattr(config, key, None)
        if isinstance(value, int):
            return value
    return None

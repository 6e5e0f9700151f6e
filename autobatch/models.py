"""Models by name: built-in configs (random weights, no download), ``hf:NAME_OR_DIR``, or your own.

* built-in names (``autobatch models`` lists them): ``gpt2`` … ``gpt2-xl``, ``llama-1b``, ``llama-7b``,
  ``llama-70b``, ``bert-base``
  and tiny variants for tests and CPU runs;
* ``hf:NAME_OR_DIR``: a transformers config (a local directory works offline; remote code only
  with ``trust_remote_code=True``), trained with the head its ``architectures`` names
  (:data:`~autobatch.hf_models.HEADS`), else as a causal or masked language model;
* ``path/to/file.py:fn`` or ``package.module:fn``: ``fn()`` returns an ``nn.Module`` (trained as a
  classifier on random inputs of ``input_shape``) or a complete :class:`~autobatch.Workload`. The
  file or module is imported, so its code runs, as ``python file.py`` would run it.
"""

from __future__ import annotations

import importlib
import inspect
import math
import importlib.util
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from .errors import AutobatchError, option
from .hf_models import ATTENTION, hf_model, image_batches, import_transformers, max_positions, token_batches
from .probing.samples import default_seq_len, takes_seq_len
from .probing.workload import Workload, default_loss, weights_in

__all__ = ["ModelSource", "BUILTIN_MODELS", "MAX_SAMPLE_ELEMENTS", "load_model", "load_layers", "layers_and_length", "list_models", "count_parameters"]

MAX_SAMPLE_ELEMENTS = 2**40  # one sample past this holds more than any GPU: a typo, not a shape


@dataclass(frozen=True)
class ModelSource:
    """A model and the batches it trains on, as a probe needs them."""

    name: str
    model: torch.nn.Module
    make_batch: Callable[[int], Any]
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor] = default_loss
    task: str = "causal-lm"          # "causal-lm", "masked-lm", "classification", or an hf: head's (hf_models.HEADS)
    seq_len: int | None = None
    vocab_size: int | None = None
    input_shape: tuple[int, ...] | None = None
    workload: Workload | None = None  # when the user's function returned a whole Workload
    make_batch_at: Callable[[int, int], Any] | None = None  # make_batch(b, seq_len), when lengths vary
    max_positions: int | None = None

    def to_workload(self, **settings: Any) -> Workload:
        """A :class:`Workload` with these settings (optimizer, dtype, grad_checkpointing, …)."""
        if self.workload is not None:
            return Workload(**{**self.workload.__dict__, **settings})
        return Workload(self.model, self.make_batch, loss_fn=self.loss_fn, name=self.name, **settings)

    def to_length_workload(self, seq_lens: Sequence[int], **settings: Any) -> Workload:
        """A :class:`Workload` whose ``make_batch(b, seq_len)`` builds batches at each of ``seq_lens``.

        Language models, and workloads whose own ``make_batch`` takes a length, qualify; every
        length is checked against the model's positions before anything runs.
        """
        if self.make_batch_at is None:
            raise AutobatchError(
                f"{self.name} takes no sequence length ({self.task} model), so it cannot be probed at "
                f"several {option('seq_len')} values; use a language model, or a workload whose make_batch(b, seq_len) takes one"
            )
        if self.max_positions is not None and max(seq_lens) > self.max_positions:
            raise AutobatchError(
                f"{option('seq_len')} must be at most the model's {self.max_positions} positions, but got {max(seq_lens)}; "
                "drop the longer lengths"
            )
        return replace(self.to_workload(**settings), make_batch=self.make_batch_at)


@dataclass(frozen=True)
class _Builtin:
    family: str                 # "gpt2", "llama", "bert", "mlp", "cnn"
    config: dict[str, Any]
    seq_len: int                # default worst-case sequence length
    description: str
    parameters: int             # what count_parameters() returns (a test checks it), so listing builds nothing


_LLAMA_1B = dict(
    hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
    num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072, tie_word_embeddings=True,
    rope_theta=500000.0,
)
BUILTIN_MODELS: dict[str, _Builtin] = {
    "gpt2": _Builtin("gpt2", {}, 1024, "GPT-2 small, 124M", 124_439_808),
    "gpt2-medium": _Builtin("gpt2", dict(n_embd=1024, n_layer=24, n_head=16), 1024, "GPT-2 medium, 355M", 354_823_168),
    "gpt2-large": _Builtin("gpt2", dict(n_embd=1280, n_layer=36, n_head=20), 1024, "GPT-2 large, 774M", 774_030_080),
    "gpt2-xl": _Builtin("gpt2", dict(n_embd=1600, n_layer=48, n_head=25), 1024, "GPT-2 XL, 1.5B", 1_557_611_200),
    "llama-1b": _Builtin("llama", _LLAMA_1B, 2048, "Llama-3.2-1B-style decoder (GQA, RoPE, SwiGLU)", 1_235_814_400),
    "llama-7b": _Builtin("llama", dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                                       num_attention_heads=32, num_key_value_heads=32, vocab_size=32000,
                                       max_position_embeddings=4096), 4096, "Llama-2-7B-style decoder", 6_738_415_616),
    "llama-70b": _Builtin("llama", dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                                        num_attention_heads=64, num_key_value_heads=8, vocab_size=32000,
                                        max_position_embeddings=4096), 4096, "Llama-2-70B-style decoder (GQA)",
                          68_976_648_192),
    "bert-base": _Builtin("bert", {}, 512, "BERT base encoder, masked LM", 109_514_298),
    "tiny-gpt2": _Builtin("gpt2", dict(n_embd=32, n_layer=2, n_head=2, vocab_size=256, n_positions=128), 64,
                          "2-layer GPT-2 for tests and CPU runs", 37_760),
    "tiny-llama": _Builtin("llama", dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                         max_position_embeddings=128), 64, "2-layer Llama-style decoder", 34_976),
    "tiny-bert": _Builtin("bert", dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                       intermediate_size=64, vocab_size=256, max_position_embeddings=128), 64,
                          "2-layer BERT encoder", 30_880),
    "tiny-mlp": _Builtin("mlp", {}, 0, "3-layer MLP classifier on 64 features", 85_002),
    "tiny-cnn": _Builtin("cnn", {}, 0, "conv net with BatchNorm on 3×32×32 images (needs batch ≥ 2)", 5_514),
}


def _hf_config(spec: _Builtin) -> Any:
    tf = import_transformers()
    cls = {"gpt2": tf.GPT2Config, "llama": tf.LlamaConfig, "bert": tf.BertConfig}[spec.family]
    return cls(**spec.config)


def _lm_source(name: str, config: Any, family: str, seq_len: int | None, default_seq: int,
               trust_remote_code: bool = False, attention: str | None = None) -> ModelSource:
    seq = default_seq if seq_len is None else seq_len
    limit = max_positions(config)
    if seq < 1 or (limit is not None and seq > limit):
        fix = "; pass a shorter --seq-len" if seq >= 1 else ""
        raise AutobatchError(f"seq_len must be between 1 and the model's {limit} positions, but got seq_len={seq}{fix}")
    model, task = hf_model(config, family, trust_remote_code, attention)
    if task == "image-classification":
        if seq_len is not None:
            raise AutobatchError(_no_sequence(name))
        return ModelSource(name, model, image_batches(config), task=task)
    vocab = config.vocab_size

    def make_batch_at(b: int, seq_len: int) -> dict[str, torch.Tensor]:
        return token_batches(config, seq_len, task)(b)

    return ModelSource(name, model, token_batches(config, seq, task), task=task, seq_len=seq, vocab_size=vocab,
                       make_batch_at=make_batch_at, max_positions=limit)


def _classifier(name: str, model: torch.nn.Module, input_shape: tuple[int, ...], num_classes: int) -> ModelSource:
    def make_batch(b: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(b, *input_shape), torch.randint(0, num_classes, (b,))

    return ModelSource(name, model, make_batch, task="classification", input_shape=input_shape)


def _bind_length(spec: str, make_batch_at: Callable[[int, int], Any], seq_len: int | None) -> Callable[[int], Any]:
    def make_batch(b: int) -> Any:
        if seq_len is None:
            raise AutobatchError(f"{spec}'s make_batch takes a sequence length (b, seq_len); pass {option('seq_len')}")
        return make_batch_at(b, seq_len)

    return make_batch


def _tiny_mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                               torch.nn.ReLU(), torch.nn.Linear(256, 10))


def _tiny_cnn() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
        torch.nn.Conv2d(16, 32, 3, padding=1, stride=2), torch.nn.BatchNorm2d(32), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(32, 10),
    )


def _parse_shape(input_shape: str | tuple[int, ...] | None) -> tuple[int, ...] | None:
    if input_shape is None or isinstance(input_shape, tuple):
        return input_shape
    try:
        shape = tuple(int(part) for part in input_shape.replace("x", ",").split(",") if part.strip())
    except ValueError:
        shape = ()
    if not shape or min(shape) < 1:
        raise AutobatchError(
            f"input_shape must be positive integers separated by commas, but got {input_shape!r}; write e.g. 3,224,224"
        )
    if math.prod(shape) > MAX_SAMPLE_ELEMENTS:
        raise AutobatchError(
            f"input_shape must hold at most 2**40 elements per sample (more than any GPU holds), but "
            f"{input_shape!r} holds {math.prod(shape):.3g}; pass the shape of one sample, e.g. 3,224,224"
        )
    return shape


def _import_function(spec: str) -> Callable[[], Any]:
    target, _, attr = spec.rpartition(":")
    if not target.strip() or not attr.strip():
        raise AutobatchError(f"{option('model')} {spec!r} must be file.py:function or package.module:function, with both "
                             "parts; e.g. train.py:build_model")
    try:
        if target.endswith(".py") or "/" in target:
            path = Path(target)
            if not path.is_file():
                raise AutobatchError(f"model file {target!r} does not exist; pass path/to/file.py:function")
            module_name = f"autobatch_user_{abs(hash(path.resolve()))}"
            module_spec = importlib.util.spec_from_file_location(module_name, path)
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[module_name] = module
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(target)
    except ModuleNotFoundError as exc:
        module_path = target.replace("/", ".").removesuffix(".py")
        if exc.name and not (module_path.endswith(exc.name) or module_path.startswith(exc.name + ".")):
            raise  # the file imports a module that is not installed: the user's code, said with its line
        raise AutobatchError(f"cannot import {target!r} for {option('model')} {spec!r}: {exc}; check the module path") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise AutobatchError(f"{target!r} has no function {attr!r}; {option('model')} takes module:function or file.py:function")
    required = [p.name for p in inspect.signature(fn).parameters.values()
                if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if required:
        raise AutobatchError(f"{option('model')} {spec!r} is called with no arguments, but {attr}() needs "
                             f"{', '.join(required)}; give them defaults, or wrap it in a function that takes none")
    return fn


def _user_model(spec: str) -> tuple[torch.nn.Module, Workload | None]:
    """Import and call ``file.py:fn`` or ``module:fn``: its model, and the Workload if it returned one."""
    built = _import_function(spec)()
    if isinstance(built, Workload):
        return (built.model if isinstance(built.model, torch.nn.Module) else built.model()), built
    if not isinstance(built, torch.nn.Module):
        raise AutobatchError(
            f"{spec} must return a torch.nn.Module or an autobatch.Workload, but returned {type(built).__name__}"
        )
    return built, None


def load_layers(spec: str, *, trust_remote_code: bool = False) -> torch.nn.Module:
    """The model named by ``spec`` built on the meta device: its layers, with no memory and no input.

    What ``autobatch check --model`` needs to find BatchNorm: unlike :func:`load_model` it never
    asks for an input shape or a sequence length (``file.py:fn`` and ``module:fn`` still run ``fn``).

    Example:
        >>> type(load_layers("tiny-cnn")[1]).__name__
        'BatchNorm2d'
    """
    return layers_and_length(spec, trust_remote_code=trust_remote_code)[0]


def layers_and_length(spec: str, *, trust_remote_code: bool = False) -> tuple[torch.nn.Module, int | None]:
    """:func:`load_layers`, and the length ``find`` trains the model at when no ``seq_len`` is given
    (``None`` where it takes none, or where the user's own code builds its batches).

    Example:
        >>> layers_and_length("tiny-gpt2")[1], layers_and_length("tiny-cnn")[1]
        (64, None)
    """
    with torch.device("meta"):  # only the layers matter: no weights in memory, even for gpt2-xl
        if ":" in spec and not spec.startswith("hf:"):
            return _user_model(spec)[0], None
        source = load_model(spec, trust_remote_code=trust_remote_code)
        return source.model, source.seq_len


def load_model(
    spec: str,
    *,
    seq_len: int | None = None,
    input_shape: str | tuple[int, ...] | None = None,
    num_classes: int = 10,
    trust_remote_code: bool = False,
    attention: str | None = None,
    weights: torch.dtype | None = None,
) -> ModelSource:
    """Build the model named by ``spec`` with random weights, and its batches.

    Args:
        spec: a built-in name, ``hf:NAME_OR_DIR``, ``file.py:fn`` or ``module:fn`` (imported and run).
        seq_len: tokens per sample for language models (default: the model's usual length).
        input_shape: per-sample input shape for your own ``nn.Module`` (e.g. ``"3,224,224"``).
        num_classes: classes for the classification loss of your own ``nn.Module``.
        trust_remote_code: allow transformers to run code shipped with an ``hf:`` model.
        attention: the attention implementation a built-in transformer or ``hf:`` model is built
            with, ``"sdpa"`` (fused) or ``"eager"`` (keeps the probabilities); default the model's own.
        weights: the dtype the weights are built in (``torch.bfloat16`` for pure bf16 training,
            ``--dtype bf16-true``); default torch's default dtype.

    Example:
        >>> source = load_model("tiny-gpt2", seq_len=16)
        >>> source.make_batch(2)["input_ids"].shape
        torch.Size([2, 16])
    """
    with weights_in(weights):
        return _built(spec, seq_len, input_shape, num_classes, trust_remote_code, attention)


def _built(spec: str, seq_len: int | None, input_shape: str | tuple[int, ...] | None, num_classes: int,
           trust_remote_code: bool, attention: str | None) -> ModelSource:
    if input_shape is not None and (spec in BUILTIN_MODELS or spec.startswith("hf:")):
        raise AutobatchError(_own_batches(spec))
    if attention is not None and attention not in ATTENTION:
        raise AutobatchError(f"attention must be one of {', '.join(ATTENTION)}, but got {attention!r}")
    own_code = not spec.startswith("hf:") and (spec not in BUILTIN_MODELS
                                                or BUILTIN_MODELS[spec].family in ("mlp", "cnn"))
    if attention is not None and own_code:
        raise AutobatchError(f"attention picks the attention transformers builds a built-in or hf: model with, but "
                             f"{spec} is built by its own code; drop --attention (set it where that model is built)")
    if spec in BUILTIN_MODELS:
        builtin = BUILTIN_MODELS[spec]
        if seq_len is not None and builtin.family in ("mlp", "cnn"):
            raise AutobatchError(_no_sequence(spec))
        if builtin.family == "mlp":
            return _classifier(spec, _tiny_mlp(), (64,), 10)
        if builtin.family == "cnn":
            return _classifier(spec, _tiny_cnn(), (3, 32, 32), 10)
        return _lm_source(spec, _hf_config(builtin), builtin.family, seq_len, builtin.seq_len, attention=attention)
    if spec.startswith("hf:"):
        name = spec[3:]
        if name.startswith((".", "/", "~")) and not Path(name).expanduser().is_dir():
            raise AutobatchError(f"hf:{name} names a local directory, which must hold a transformers config.json, "
                                 f"but {name!r} is no directory; check the path (or name a hub model, e.g. hf:gpt2)")
        tf = import_transformers()
        try:
            config = tf.AutoConfig.from_pretrained(name, trust_remote_code=trust_remote_code)
        except (OSError, ValueError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise AutobatchError(
                f"cannot read a transformers config from {name!r} ({first}); pass a local directory with "
                "config.json (works offline), and --trust-remote-code only for code you trust"
            ) from None
        return _lm_source(spec, config, getattr(config, "model_type", ""), seq_len, min(max_positions(config) or 1024, 1024),
                          trust_remote_code, attention)
    if ":" in spec:
        if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1:
            raise AutobatchError(f"num_classes must be a positive integer, but got num_classes={num_classes!r}; "
                                 "pass the number of classes your model outputs (--num-classes)")
        model, workload = _user_model(spec)
        if workload is not None and input_shape is not None:
            raise AutobatchError(_own_batches(spec))
        if workload is not None:
            if takes_seq_len(workload.make_batch):  # make_batch(b, seq_len): bound to --seq-len for one length
                at = workload.make_batch
                seq_len = seq_len if seq_len is not None else default_seq_len(at)  # make_batch(b, seq_len=512)
                bound = replace(workload, make_batch=_bind_length(spec, at, seq_len))
                return ModelSource(spec, model, bound.make_batch, workload.loss_fn, task="custom", seq_len=seq_len,
                                   workload=bound, make_batch_at=at)
            return ModelSource(spec, model, workload.make_batch, workload.loss_fn, task="custom", workload=workload)
        shape = _parse_shape(input_shape)
        if seq_len is not None:
            raise AutobatchError(_no_sequence(spec))
        if shape is None:
            raise AutobatchError(
                f"{spec} returned an nn.Module, so the input shape per sample is needed; pass --input-shape, e.g. 3,224,224"
            )
        return _classifier(spec, model, shape, num_classes)
    raise AutobatchError(
        f"unknown model {spec!r}; built-in models are {', '.join(BUILTIN_MODELS)}; "
        "or pass hf:NAME_OR_DIR, path/to/file.py:function or package.module:function"
    )


def _no_sequence(spec: str) -> str:
    return (f"seq_len is the tokens per sample of a language model, but {spec} takes no sequence length; "
            "drop --seq-len (or let the make_batch of your --model function take the length as its second argument)")


def _own_batches(spec: str) -> str:
    return (f"input_shape describes the samples of a --model function that returns an nn.Module, but {spec} "
            "builds its own batches; drop --input-shape")


def count_parameters(name: str) -> int:
    """Parameters of a built-in model, counted on the meta device (no memory, no download)."""
    builtin = BUILTIN_MODELS[name]
    if builtin.family == "mlp":
        model = _tiny_mlp()
    elif builtin.family == "cnn":
        model = _tiny_cnn()
    else:
        with torch.device("meta"):
            model, _ = hf_model(_hf_config(builtin), builtin.family)
    return sum(p.numel() for p in model.parameters())


def list_models() -> list[dict[str, Any]]:
    """Name, family, default sequence length, parameter count and description of each built-in.

    Instant: the counts are stored with each model (nothing is built, transformers is not imported).
    """
    return [
        {"name": name, "family": b.family, "seq_len": b.seq_len or None, "parameters": b.parameters,
         "description": b.description}
        for name, b in BUILTIN_MODELS.items()
    ]

"""The other commands, each one public function: ``check``, ``tune_plans`` and the cache's listing.

``check`` builds a model named by a string (its layers only) and reads what ``find`` cached of
it; ``tune_plans`` times the exact plans of a :class:`~autobatch.Request`; ``cache_listing`` and
``clear_cache`` are ``autobatch cache list`` and ``clear``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..checking.problems import CheckResult
from ..checking.setup import check_setup
from ..errors import RequestError, option
from ..probing.probe import make_backend
from ..tuning.tune import TuneResult, tune
from .request import Request
from .rows import workload_of

__all__ = ["CacheListing", "check", "tune_plans", "cache_listing", "clear_cache"]


def check(*, model: str | torch.nn.Module | None = None, seq_len: int | None = None, trust_remote_code: bool = False,
          strategy: str | None = None, offload: str | None = None, **setup: Any) -> CheckResult:
    """Every batch-size problem of a setup, before launch: :func:`~autobatch.check_setup` (``setup``
    takes its keywords: ``target``, ``micro_batch``, ``grad_accum``, ``gpus_per_node``, ``nodes``,
    ``model_parallel``, ``deepspeed``, ``accelerate``, ``hf``, ``batchnorm``) with a model named as
    ``--model`` names it (only its layers are built, on the meta device), and the lengths ``find``
    probed it at (from the cache) to compare ``seq_len`` with. ``strategy`` and ``offload``: how the
    micro batch was probed (``find --strategy zero3 --offload optimizer``), which the configs must match.

    Example:
        >>> import autobatch
        >>> autobatch.check(target=224, micro_batch=7, grad_accum=2, gpus_per_node=16).ok
        True
    """
    if offload is not None and strategy is None:
        raise RequestError([f"{option('offload')} on check says how the micro batch was probed, with "
                            f"{option('strategy')}; add {option('strategy')} (e.g. zero3)"])
    if strategy is not None:  # a misspelt name is refused before anything is read
        from ..strategy import parse_strategies, parse_strategy

        parse_strategies(strategy)
        strategy = parse_strategy(strategy, offload)  # as find probed it: --strategy zero3 --offload optimizer
    module, stated = model, seq_len is not None
    if isinstance(model, str):
        from ..models import layers_and_length

        module, own_length = layers_and_length(model, trust_remote_code=trust_remote_code)
        seq_len = own_length if seq_len is None else seq_len  # find's length where none is given, as find takes it
    probed = None
    if seq_len is not None:
        if module is None:
            raise RequestError([f"{option('seq_len')} on check compares with the cached probes of a model, which "
                                f"needs {option('model')}; add {option('model')}"])
        from ..tuning.probed import probed_lengths

        probed = probed_lengths(module)
    return check_setup(**setup, model=module, seq_len=seq_len, probed=probed, probed_strategy=strategy,
                       seq_len_stated=stated)


def tune_plans(request: Request, *, trials: int = 20, timed_steps: int = 3, checkpointing: Sequence[bool] | None = None,
               seed: int | None = 0, on_trial: Callable[[Any], None] | None = None) -> TuneResult:
    """Time the exact plans for ``request.target`` (micro × accumulation × checkpointing), keep the fastest.

    :func:`~autobatch.tune` on the request's model, device and limits; ``request.plot`` draws the
    study. ``checkpointing`` is the settings to try (default both, where the model supports them).
    """
    if request.model is None or request.target is None:
        raise RequestError([f"tune times the plans of a model for a target: pass {option('model')} and "
                            f"{option('target')}"])
    backend = make_backend(request.device or ("cpu" if request.memory is not None else None), request.memory)
    result = tune(workload_of(request), request.target, backend, n_trials=trials, gpus_per_node=request.gpus_here(),
                  nodes=request.nodes, timed_steps=timed_steps, checkpointing=checkpointing, headroom=request.headroom,
                  max_batch=request.max_micro, min_micro=request.min_micro, multiple_of=request.multiple_of, seed=seed,
                  use_cache=request.cache, on_trial=on_trial)
    if request.plot is None:
        return result
    from ..tuning.plot import plot_tune

    plot_tune(result, request.plot)
    return replace(result, plot=str(request.plot))


@dataclass(frozen=True)
class CacheListing:
    """What the cache holds: probe results, newest first, and the tuning studies."""

    cache_dir: str
    entries: tuple[Any, ...]
    studies: tuple[dict[str, Any], ...]

    def to_dict(self) -> dict[str, Any]:
        return {"cache_dir": self.cache_dir, "entries": [{**e.__dict__, "path": str(e.path)} for e in self.entries],
                "studies": list(self.studies)}

    def lines(self) -> list[str]:
        count = len(self.entries)
        return [f"cache: {self.cache_dir}", f"{count} cached probe{'s' if count != 1 else ''}",
                *(f"  {entry}" for entry in self.entries),
                *(f"  study {study['name']}: {study['trials']} trials" for study in self.studies)]


def cache_listing() -> CacheListing:
    """The cached probe results, newest first, and the tuning studies: ``autobatch cache list``."""
    from ..tuning.cache import cache_dir, list_entries
    from ..tuning.tune import list_studies

    return CacheListing(str(cache_dir()), tuple(list_entries()), tuple(list_studies()))


def clear_cache() -> tuple[int, str]:
    """Delete every cached probe result and tuning study: how many files, and from where."""
    from ..tuning.cache import cache_dir, clear

    return clear(), str(cache_dir())

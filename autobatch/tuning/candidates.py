"""The plans tuning may choose between, and timing one of them with real steps."""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import AutobatchError, NoBatchFitsError
from ..planning.plan import Plan, require_positive_int
from ..planning.solver import exact_plans, solve
from ..probing.backends import MemoryBackend
from ..probing.preserve import borrowed_model
from ..probing.probe import DEFAULT_HEADROOM
from ..probing.result import ProbeResult
from ..probing.trial import forward_backward
from ..probing.workload import Workload, make_optimizer
from .cache import cached_probe
from .fingerprint import _build_for_signature

__all__ = ["Candidate", "Measurement", "time_plan", "candidate_plans"]


@dataclass(frozen=True)
class Candidate:
    """One plan to time: micro batch × accumulation × world size, with or without checkpointing."""

    plan: Plan
    grad_checkpointing: bool

    @property
    def label(self) -> str:
        """The optuna choice for this candidate, readable in optuna-dashboard."""
        gc = "on" if self.grad_checkpointing else "off"
        return f"micro={self.plan.micro_batch} ga={self.plan.grad_accum} checkpointing={gc}"


@dataclass(frozen=True)
class Measurement:
    """A candidate's throughput as measured (``state`` is optuna's: COMPLETE, PRUNED or FAIL)."""

    candidate: Candidate
    state: str
    samples_per_second: float | None
    seconds_per_step: float | None
    trial_number: int
    earlier_run: bool = False  # timed by an earlier run of the study: another process, not compared with this run's
    spread: float | None = None  # half the range of its timed steps' seconds over their median (None: one step)

    def to_dict(self) -> dict[str, Any]:
        return {
            "trial": self.trial_number, "state": self.state, "micro_batch": self.candidate.plan.micro_batch,
            "grad_accum": self.candidate.plan.grad_accum, "grad_checkpointing": self.candidate.grad_checkpointing,
            "samples_per_second": self.samples_per_second, "seconds_per_step": self.seconds_per_step,
            "spread": self.spread, "earlier_run": self.earlier_run,
        }


def time_plan(
    workload: Workload,
    model: torch.nn.Module,
    backend: MemoryBackend,
    plan: Plan,
    *,
    steps: int = 3,
    on_step: Callable[[int, float], None] | None = None,
    spread: list[float] | None = None,
) -> tuple[float, float]:
    """Time ``plan`` on ``backend``: ``(samples per second, seconds per optimizer step)``.

    One untimed warm-up (optimizer state, kernel selection), then ``steps`` timed micro steps and
    optimizer steps; a step takes ``grad_accum ×`` the median micro step plus the median optimizer
    step. Only a few micro steps run whatever the accumulation, so timing costs seconds.
    ``spread``, where given, gets how far the timed steps swung: half the range of their seconds
    (each as ``grad_accum ×`` its micro step plus its optimizer step) over their median, once
    there are two; a difference between plans smaller than their spreads is noise.
    ``on_step(i, samples_per_second_so_far)`` after each timed step may raise to stop early
    (optuna's pruning does). The model is lent and given back unchanged; ``workload.grad_checkpointing``
    is applied while it is lent.

    Example:
        >>> from autobatch import SimulatedBackend, Workload
        >>> work = Workload(torch.nn.Linear(8, 2), lambda b: (torch.randn(b, 8), torch.zeros(b, dtype=torch.long)))
        >>> sps, seconds = time_plan(work, work.model, SimulatedBackend("1MiB"), Plan(4, 2), steps=2)
        >>> sps > 0 and seconds > 0
        True
    """
    steps = require_positive_int("steps", steps, fix="time at least one step, e.g. 3")
    device = backend.device
    micro: list[float] = []
    optim: list[float] = []
    whole: list[float] = []
    rate = seconds = 0.0
    with borrowed_model(model, device, grad_checkpointing=workload.grad_checkpointing) as lent:
        params = list(lent.parameters())
        backend.release()
        with backend.track(params + list(lent.buffers())):
            optimizer = make_optimizer(workload.optimizer, [p for p in params if p.requires_grad])
            try:
                for i in range(steps + 1):
                    backend.synchronize()
                    start = time.perf_counter()
                    forward_backward(workload, lent, plan.micro_batch, device)
                    backend.synchronize()
                    middle = time.perf_counter()
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                    backend.synchronize()
                    if i == 0:
                        continue  # warm-up: optimizer state appears here
                    micro.append(middle - start)
                    optim.append(time.perf_counter() - middle)
                    whole.append(plan.grad_accum * micro[-1] + optim[-1])
                    seconds = plan.grad_accum * statistics.median(micro) + statistics.median(optim)
                    rate = plan.global_batch / seconds
                    if on_step is not None:
                        on_step(i - 1, rate)
            finally:
                del optimizer
                lent.zero_grad(set_to_none=True)
    backend.release()
    if spread is not None and len(whole) > 1:
        spread.append((max(whole) - min(whole)) / 2 / statistics.median(whole))
    return rate, seconds


def _supports_checkpointing(workload: Workload) -> bool:
    return callable(getattr(_build_for_signature(workload.model), "gradient_checkpointing_enable", None))


def candidate_plans(
    workload: Workload,
    target: int,
    backend: MemoryBackend,
    *,
    gpus_per_node: int = 1,
    nodes: int = 1,
    checkpointing: Sequence[bool] | None = None,
    headroom: float | int | str = DEFAULT_HEADROOM,
    max_batch: int | None = None,
    min_micro: int | None = None,
    multiple_of: int | None = None,
    use_cache: bool = True,
    root: Path | None = None,
) -> tuple[list[Candidate], dict[bool, ProbeResult]]:
    """Every exact plan for ``target`` under each checkpointing setting, largest micro first.

    Each setting is probed once (through the cache) for its safe micro batch; a setting where
    nothing fits is left out. ``checkpointing=None`` tries both when the model has
    ``gradient_checkpointing_enable()``, else only off.
    """
    settings = list(checkpointing) if checkpointing is not None else (
        [False, True] if _supports_checkpointing(workload) else [False])
    if not settings:
        raise AutobatchError("checkpointing must list at least one setting, but got none; pass [False], [True] or both")
    world = gpus_per_node * nodes
    candidates: list[Candidate] = []
    probes: dict[bool, ProbeResult] = {}
    failures: list[str] = []
    for gc in dict.fromkeys(bool(s) for s in settings):
        variant = dataclasses.replace(workload, grad_checkpointing=gc)
        try:
            result, _ = cached_probe(variant, backend, headroom=headroom, max_batch=max_batch, min_batch=min_micro,
                                     world_size=world, use_cache=use_cache, root=root)
        except NoBatchFitsError as exc:
            failures.append(f"checkpointing {'on' if gc else 'off'}: {exc}")
            continue
        probes[gc] = result
        if result.safe_batch < result.min_batch:
            continue
        for plan in exact_plans(target, gpus_per_node, nodes, result.safe_batch,
                                min_micro=result.min_batch, multiple_of=multiple_of):
            candidates.append(Candidate(plan, gc))
    if not probes:
        raise NoBatchFitsError("; ".join(failures))
    if not candidates:
        gc, result = next(iter(probes.items()))
        # solve() raises the error that lists the nearest reachable batches and world sizes
        solve(target, gpus_per_node, nodes, max(result.safe_batch, result.min_batch), min_micro=result.min_batch,
              multiple_of=multiple_of)
    return candidates, probes

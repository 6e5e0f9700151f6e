"""One adapter per tool, all against the same out-of-memory oracle, and the exhaustive truth.

The oracle: real training steps on the CPU under :class:`autobatch.SimulatedBackend`, whose
tracker raises ``torch.OutOfMemoryError("CUDA out of memory. …")`` the moment live tensor bytes
exceed the budget. That message passes accelerate's ``should_reduce_batch_size`` (a
``RuntimeError`` whose one argument contains ``" out of memory."``) and Lightning's
``is_oom_error`` (one argument containing ``"CUDA"`` and ``"out of memory"``), so each tool
handles it as it would handle a real GPU's.

Every adapter returns a :class:`ToolRun`: the batch it returned, how many trials (distinct
batch sizes attempted, in order) and training steps (steps started, a step that ran out of
memory included) it spent, and its wall time.
"""

from __future__ import annotations

import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from autobatch import SimulatedBackend, Workload, probe
from autobatch.estimating import trace_prior
from autobatch.modelinfo import min_batch_for
from autobatch.probing.trial import run_trial

__all__ = [
    "ToolRun", "Truth", "TOOLS", "ACCELERATE_START", "run_autobatch", "run_autobatch_traced", "run_lightning",
    "run_accelerate", "true_max",
]

ACCELERATE_START = 1024  # above every true maximum here; accelerate's own default is 128
_WINDOW = 8              # batches scanned past the first failure (full scan) or around the boundary (window)


@dataclass(frozen=True)
class ToolRun:
    tool: str
    returned: int | None          # the batch the tool hands back; None when it gave up
    trials: int                   # distinct batch sizes attempted
    steps: int                    # training steps started
    seconds: float
    tried: tuple[tuple[int, bool], ...] = ()  # (batch, fitted) in the order tried
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Truth:
    max_batch: int
    fits: dict[int, bool] = field(default_factory=dict)  # every batch the scan ran
    method: str = "full"
    seconds: float = 0.0


class _Counter:
    """Wraps the workload's loss: each call is one training step started, at the batch it saw."""

    def __init__(self, workload: Workload):
        self.workload = workload
        self.steps: list[int] = []

    def loss(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        self.steps.append(_batch_len(batch))
        return self.workload.loss_fn(model, batch)

    def counted(self) -> Workload:
        return replace(self.workload, loss_fn=self.loss)

    def trials(self) -> list[int]:
        runs: list[int] = []
        for b in self.steps:
            if not runs or runs[-1] != b:
                runs.append(b)
        return runs


def _batch_len(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return batch.shape[0]
    if isinstance(batch, dict):
        return _batch_len(next(iter(batch.values())))
    return _batch_len(batch[0])


def run_autobatch(workload: Workload, budget: str) -> ToolRun:
    """``autobatch.probe`` with its defaults (2 steps per trial, no cap)."""
    counter = _Counter(workload)
    start = time.perf_counter()
    result = probe(counter.counted(), SimulatedBackend(budget))
    seconds = time.perf_counter() - start
    tried = tuple((t.batch, t.fits) for t in result.trials)
    return ToolRun("autobatch", result.max_batch, len(result.trials), len(counter.steps), seconds, tried)


def run_autobatch_traced(workload: Workload, budget: str) -> ToolRun:
    """``autobatch.probe`` with the fake-tensor trace as its search's prior (the trace's time counts)."""
    counter = _Counter(workload)
    start = time.perf_counter()
    # The trace runs the loss on fake tensors: not a training step, so the uncounted workload.
    result = probe(counter.counted(), SimulatedBackend(budget), prior=trace_prior(workload, device_type="cpu"))
    seconds = time.perf_counter() - start
    tried = tuple((t.batch, t.fits) for t in result.trials)
    return ToolRun("autobatch-trace", result.max_batch, len(result.trials), len(counter.steps), seconds, tried)


def _trial_oracle(workload: Workload, budget: str) -> tuple[Callable[[int], None], _Counter, list[tuple[int, bool]]]:
    """A training function that raises the CUDA-style OOM when ``run_trial`` ran out of memory."""
    counter = _Counter(workload)
    counted = counter.counted()
    model = workload.model() if not isinstance(workload.model, torch.nn.Module) else workload.model
    backend = SimulatedBackend(budget)
    tried: list[tuple[int, bool]] = []

    def train(batch_size: int) -> None:
        trial = run_trial(counted, model, backend, batch_size)
        tried.append((batch_size, trial.fits))
        if not trial.fits:
            raise torch.OutOfMemoryError(trial.error or "CUDA out of memory.")

    return train, counter, tried


def run_accelerate(workload: Workload, budget: str, starting_batch_size: int | None = None) -> ToolRun:
    """accelerate's ``find_executable_batch_size``: start high, multiply by 0.9 after each OOM.

    The decorated function trains ``workload.steps`` (2) steps, exactly as an autobatch trial.
    ``starting_batch_size`` defaults to :data:`ACCELERATE_START`, read when called.
    """
    from accelerate.utils import find_executable_batch_size

    if starting_batch_size is None:
        starting_batch_size = ACCELERATE_START
    train, counter, tried = _trial_oracle(workload, budget)

    @find_executable_batch_size(starting_batch_size=starting_batch_size)
    def attempt(batch_size: int) -> int:
        train(batch_size)
        return batch_size

    start = time.perf_counter()
    note = ""
    try:
        returned: int | None = attempt()
    except RuntimeError as exc:  # "No executable batch size found, reached zero."
        returned, note = None, str(exc)
    seconds = time.perf_counter() - start
    return ToolRun("accelerate", returned, len(tried), len(counter.steps), seconds, tuple(tried), note)


def run_lightning(workload: Workload, budget: str, mode: str) -> ToolRun:
    """Lightning's ``Tuner.scale_batch_size`` with its defaults: ``steps_per_trial=3``,
    ``init_val=2``, ``max_trials=25``, ``margin=0.05`` (binsearch), ``max_val=8192``.

    The LightningModule's data loader yields only the batch size; the batch itself is made
    inside the step, as in an autobatch trial, so no prefetched batch counts against the budget.
    Gradients are zeroed (set to ``None``) after the optimizer step rather than before backward,
    again as in an autobatch trial: both tools then see the same bytes at every moment of a step.
    """
    import lightning.pytorch as pl
    from lightning.pytorch.tuner import Tuner

    counter = _Counter(workload)
    backend = SimulatedBackend(budget)
    model = workload.model() if not isinstance(workload.model, torch.nn.Module) else workload.model
    outcomes: list[tuple[int, bool]] = []

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = model
            self.batch_size = 2

        def train_dataloader(self) -> torch.utils.data.DataLoader:
            # The dataset must outgrow every batch tried: Lightning stops when batch ≥ dataset length.
            return torch.utils.data.DataLoader(range(1 << 20), batch_size=self.batch_size, collate_fn=len)

        def training_step(self, batch: int, batch_idx: int) -> torch.Tensor:
            return counter.loss(self.net, workload.make_batch(batch))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            from autobatch.probing.workload import make_optimizer

            return make_optimizer(workload.optimizer, self.net.parameters())

        def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Any) -> None:
            pass  # zeroed after the step below

        def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
            resident = [*self.net.parameters(), *self.net.buffers()]
            batch = self.batch_size
            try:
                with backend.track(resident):
                    optimizer.step(closure=optimizer_closure)
                    optimizer.zero_grad(set_to_none=True)
            except RuntimeError:
                self.net.zero_grad(set_to_none=True)
                _record(outcomes, batch, False)
                raise
            _record(outcomes, batch, True)

    module = Module()
    with tempfile.TemporaryDirectory() as root, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = pl.Trainer(
            accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, default_root_dir=root, max_epochs=1,
        )
        start = time.perf_counter()
        returned = Tuner(trainer).scale_batch_size(module, mode=mode)
        seconds = time.perf_counter() - start
    fitted = _fitted(outcomes)
    note = ""
    if mode == "binsearch" and returned is not None and fitted and returned < max(fitted):
        note = f"largest batch that trained: {max(fitted)}; the default 5% margin returns {returned}"
    tried = tuple(_per_trial(outcomes))
    return ToolRun(f"lightning-{mode}", returned, len(tried), len(counter.steps), seconds, tried, note)


def _record(outcomes: list[tuple[int, bool]], batch: int, ok: bool) -> None:
    outcomes.append((batch, ok))


def _per_trial(outcomes: list[tuple[int, bool]]) -> list[tuple[int, bool]]:
    # Consecutive steps at one batch are one trial (no tool retries a batch straight away);
    # it fitted when none of its steps ran out of memory.
    trials: list[tuple[int, bool]] = []
    for batch, ok in outcomes:
        if trials and trials[-1][0] == batch:
            trials[-1] = (batch, trials[-1][1] and ok)
        else:
            trials.append((batch, ok))
    return trials


def _fitted(outcomes: list[tuple[int, bool]]) -> list[int]:
    return [b for b, ok in _per_trial(outcomes) if ok]


def true_max(workload: Workload, budget: str, *, method: str = "full", around: int | None = None) -> Truth:
    """The largest batch that trains under ``budget``, by running trials one batch at a time.

    ``full``: every batch from the model's smallest allowed (2 with BatchNorm, else 1) up to
    the first that runs out of memory, then ``_WINDOW`` more past it, which must all fail (a
    fit there would mean memory is not monotone and the search tools' premise broke).
    ``window``: for models too slow to scan from the bottom, every batch within ``_WINDOW`` of
    ``around`` (a candidate boundary): the answer is the largest fit below the first failure,
    and the window must contain both a fit and a failure.
    """
    model = workload.model() if not isinstance(workload.model, torch.nn.Module) else workload.model
    backend = SimulatedBackend(budget)
    lowest = min_batch_for(model)
    fits: dict[int, bool] = {}
    start = time.perf_counter()
    if method == "full":
        b = lowest
        while True:
            fits[b] = run_trial(workload, model, backend, b).fits
            if not fits[b]:
                break
            b += 1
        for extra in range(b + 1, b + 1 + _WINDOW):
            fits[extra] = run_trial(workload, model, backend, extra).fits
    elif method == "window":
        if around is None:
            raise ValueError("the window scan needs around=<a candidate boundary>")
        for b in range(max(lowest, around - _WINDOW), around + _WINDOW + 1):
            fits[b] = run_trial(workload, model, backend, b).fits
    else:
        raise ValueError(f"method must be 'full' or 'window', but got {method!r}")
    first_fail = min((b for b, ok in fits.items() if not ok), default=None)
    if first_fail is None or (method == "window" and first_fail == min(fits)):
        raise RuntimeError(f"the scan did not bracket the boundary: {sorted(fits.items())}")
    if any(ok for b, ok in fits.items() if b > first_fail):
        raise RuntimeError(f"memory is not monotone in the batch here: {sorted(fits.items())}")
    return Truth(first_fail - 1, fits, method, time.perf_counter() - start)


TOOLS: dict[str, Callable[[Workload, str], ToolRun]] = {
    "autobatch": run_autobatch,
    "autobatch-trace": run_autobatch_traced,
    "lightning-power": lambda w, b: run_lightning(w, b, "power"),
    "lightning-binsearch": lambda w, b: run_lightning(w, b, "binsearch"),
    "accelerate": run_accelerate,
}

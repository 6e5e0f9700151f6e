"""Choose the plan by measured throughput, not by the largest micro batch.

The largest micro batch that fits is not always the fastest way to reach a global batch: a
smaller micro batch with more accumulation can run faster (better kernels, less allocator
pressure), and gradient checkpointing trades compute for a larger micro batch. :func:`tune`
lists every exact plan for the target under each checkpointing setting (each setting probed
once, through the cache), times each plan with a few real micro steps, and lets optuna's TPE
sampler choose which plan to time next. Plans clearly slower than the best so far are pruned
after their first timed step. The study lives in SQLite next to the probe cache, named from the
fingerprint, so an interrupted run resumes and ``optuna-dashboard sqlite:///…/tune.db`` shows it.

Throughput is per optimizer step: ``grad_accum`` micro steps (forward and backward) and one
optimizer step, ``samples/s = global batch / step time``; ranks run in parallel, so the world
size multiplies samples, not time (communication is not measured on one device).
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import AutobatchError, MissingDependencyError
from ..planning.plan import require_positive_int
from ..probing.backends import MemoryBackend
from ..probing.oom import is_oom_error, oom_message
from ..probing.probe import DEFAULT_HEADROOM, make_backend
from ..probing.result import ProbeResult
from ..probing.workload import Workload
from .cache import CacheWarning, cache_dir
from .candidates import Candidate, Measurement, candidate_plans, time_plan
from .fingerprint import fingerprint

__all__ = ["TuneResult", "SlowerThanBestPruner", "tune", "list_studies"]


def _optuna() -> Any:
    try:
        import optuna
    except ImportError:
        raise MissingDependencyError(
            "autobatch tune needs optuna, which is not installed; pip install 'optuna>=3.4'"
        ) from None
    return optuna


@dataclass(frozen=True)
class TuneResult:
    """The fastest plan found, and how it compares with the largest-micro plan ``find`` would pick.

    ``speedup`` is ``best / baseline`` samples per second (1.0 when the largest micro batch is
    the fastest), both timed in this run: a resumed study times its baseline again, since timings
    from another process are not comparable. ``measurements`` holds every timed trial of the
    study, earlier runs included.
    """

    best: Measurement
    baseline: Measurement
    measurements: tuple[Measurement, ...]
    candidates: tuple[Candidate, ...]
    study_name: str
    storage: str
    target: int
    probes: dict[bool, ProbeResult] = field(default_factory=dict, compare=False)
    plot: str | None = None  # the PNG drawn of this study, when one was asked for
    trials_run: int = 0  # optuna trials this run, repeats included
    repeats: int = 0  # of them, plans proposed again after their timing in this run (the first timing stands)
    trials_asked: int = 0  # n_trials; fewer run when every candidate plan was timed before the last

    @property
    def speedup(self) -> float:
        return (self.best.samples_per_second or 0.0) / (self.baseline.samples_per_second or float("inf"))

    @property
    def within_spread(self) -> bool:
        """Whether the best plan's lead is no larger than how far the two plans' timed steps swung:
        on a busy or warming device that lead may be noise. False where either was timed on one step."""
        if self.best.candidate == self.baseline.candidate or self.best.spread is None or self.baseline.spread is None:
            return False
        return self.speedup - 1 <= self.best.spread + self.baseline.spread

    def to_dict(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "best": {**self.best.to_dict(), "plan": self.best.candidate.plan.to_dict()},
            "baseline": {**self.baseline.to_dict(), "plan": self.baseline.candidate.plan.to_dict()},
            "speedup": self.speedup,
            "within_spread": self.within_spread,
            "study_name": self.study_name,
            "storage": self.storage,
            "candidates": [c.label for c in self.candidates],
            "measurements": [m.to_dict() for m in self.measurements],
            "max_micro": {("on" if gc else "off"): p.safe_batch for gc, p in self.probes.items()},
            "trials_asked": self.trials_asked, "trials_run": self.trials_run, "repeats": self.repeats,
            **({"plot": self.plot} if self.plot else {}),
        }

    def __str__(self) -> str:
        def line(m: Measurement) -> str:
            swing = "" if m.spread is None else f" ± {_percent(m.spread)} over its steps"
            return f"{m.candidate.plan} checkpointing {'on' if m.candidate.grad_checkpointing else 'off'}: " \
                   f"{m.samples_per_second:,.1f} samples/s ({m.seconds_per_step:.4f} s/step{swing})"

        done = sum(m.state == "COMPLETE" for m in self.measurements)
        pruned = sum(m.state == "PRUNED" for m in self.measurements)
        if self.best.candidate == self.baseline.candidate:
            verdict = "the largest micro batch is also the fastest plan measured"
        else:
            verdict = f"{self.speedup:.2f}× the throughput of the largest-micro plan"
            if self.within_spread:
                verdict += (f", no more than the two plans' steps swung (± {_percent(self.best.spread)} and "
                            f"± {_percent(self.baseline.spread)}): time more steps (--timed-steps 10) on a quiet "
                            "device before taking one over the other")
        earlier = sum(m.earlier_run for m in self.measurements)
        note = ([f"(best and baseline timed in this run; the study's {earlier} timing(s) from earlier runs are in "
                 "--json as earlier_run, not compared: another process, another load)"] if earlier else [])
        spent = []
        if self.repeats:
            spent.append(f"{self.repeats} of this run's {self.trials_run} trials proposed a plan timed already in it "
                         "(its first timing stands, nothing ran)")
        if self.trials_run < self.trials_asked:
            spent.append(f"every candidate plan was timed after {self.trials_run} of the {self.trials_asked} trials "
                         "asked, so the study stopped there")
        return "\n".join([
            f"best:     {line(self.best)}",
            f"baseline: {line(self.baseline)} (largest micro batch)",
            f"speed-up: {verdict}",
            *note,
            f"study {self.study_name} in {self.storage}: {len(self.candidates)} candidate plan"
            f"{'s' if len(self.candidates) != 1 else ''}, "
            f"{done} timed, {pruned} pruned" + "".join(f"; {part}" for part in spent),
        ])


def _percent(fraction: float | None) -> str:
    return f"{100 * (fraction or 0.0):.1f} %"


def _pruner_base() -> type:
    return _optuna().pruners.BasePruner


class SlowerThanBestPruner:
    """Prune a trial whose throughput so far is below ``ratio ×`` the best completed trial's.

    "Clearly slower" is a ratio, not a median: with a dozen candidate plans a median pruner
    would stop half of them, while one noisy first step should not stop a plan that is close.
    Built as an optuna pruner by :meth:`create`.
    """

    def __init__(self, ratio: float = 0.5):
        if not 0 < ratio < 1:
            raise AutobatchError(f"prune ratio must be in (0, 1), but got {ratio!r}; 0.5 prunes plans at half the best")
        self.ratio = ratio
        self.since = 0  # the first trial of this run: earlier runs' timings are another process's

    def prune(self, study: Any, trial: Any) -> bool:
        optuna = _optuna()
        step = trial.last_step
        if step is None:
            return False
        done = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
        best = max((t.value for t in done if t.value is not None and t.number >= self.since), default=None)
        return best is not None and trial.intermediate_values[step] < self.ratio * best

    @classmethod
    def create(cls, ratio: float = 0.5) -> Any:
        """An instance that is also an ``optuna.pruners.BasePruner``."""
        pruner_type = type("SlowerThanBestPruner", (cls, _pruner_base()), {})
        return pruner_type(ratio)


class _PlanOutOfMemory(Exception):
    """A plan ran out of memory while being timed: the trial fails, the study goes on."""


def _measurements(study: Any, by_label: dict[str, Candidate], first_now: int = 0) -> list[Measurement]:
    result = []
    for t in study.get_trials(deepcopy=False):
        candidate = by_label.get(t.params.get("plan"))
        if candidate is None or t.state.name not in ("COMPLETE", "PRUNED", "FAIL") or "repeat_of" in t.user_attrs:
            continue
        value = t.value if t.state.name == "COMPLETE" else (
            t.intermediate_values[t.last_step] if t.last_step is not None else None)
        seconds = t.user_attrs.get("seconds_per_step")
        result.append(Measurement(candidate, t.state.name, value, seconds, t.number, earlier_run=t.number < first_now,
                                  spread=t.user_attrs.get("spread")))
    return result


def tune(
    workload: Workload,
    target: int,
    backend: MemoryBackend | None = None,
    *,
    n_trials: int = 20,
    gpus_per_node: int = 1,
    nodes: int = 1,
    timed_steps: int = 3,
    checkpointing: Sequence[bool] | None = None,
    headroom: float | int | str = DEFAULT_HEADROOM,
    max_batch: int | None = None,
    min_micro: int | None = None,
    multiple_of: int | None = None,
    prune_ratio: float = 0.5,
    seed: int | None = 0,
    use_cache: bool = True,
    root: Path | str | None = None,
    storage: str | None = None,
    on_trial: Callable[[Measurement], None] | None = None,
) -> TuneResult:
    """Find the fastest exact plan for ``target`` among micro batch × accumulation × checkpointing.

    Args:
        workload: what to train (its ``grad_checkpointing`` is replaced by each setting tried).
        target: the global batch per optimizer step.
        backend: where to probe and time; default the current CUDA device.
        n_trials: optuna trials in this run; a resumed study adds them to those it holds.
        gpus_per_node, nodes: the data-parallel world the plans are for.
        timed_steps: timed micro steps per trial (after one warm-up step).
        checkpointing: settings to try; default both when the model supports it.
        headroom, max_batch, min_micro, multiple_of: as for ``find`` (``max_batch`` caps the probes).
        prune_ratio: a trial slower than this fraction of the best so far is stopped.
        seed: TPE sampler seed (``None``: random).
        use_cache: read probes from the cache (``False`` probes again; the study is kept).
        root: the cache directory (default :func:`autobatch.tuning.cache.cache_dir`); the study lives
            in ``root/tune.db`` unless ``storage`` names another optuna storage URL.
        on_trial: called with each new :class:`Measurement`.

    Example:
        >>> import tempfile
        >>> from autobatch import SimulatedBackend, Workload
        >>> work = Workload(torch.nn.Linear(8, 2), lambda b: (torch.randn(b, 8), torch.zeros(b, dtype=torch.long)))
        >>> result = tune(work, 16, SimulatedBackend("64KiB"), n_trials=3, timed_steps=1, root=tempfile.mkdtemp())
        >>> result.best.candidate.plan.global_batch
        16
    """
    optuna = _optuna()
    target = require_positive_int("target", target, fix="pass the global batch you want, e.g. 224")
    n_trials = require_positive_int("n_trials", n_trials, fix="run at least one trial, e.g. --trials 20")
    timed_steps = require_positive_int("timed_steps", timed_steps, fix="time at least one step, e.g. --timed-steps 3")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32):
        raise AutobatchError(f"seed must be a whole number from 0 to {2**32 - 1} (optuna's sampler takes no other), "
                             f"but got seed={seed!r}")
    backend = backend if backend is not None else make_backend()
    folder = Path(root) if root is not None else cache_dir()
    if storage is None:
        storage = f"sqlite:///{(folder / 'tune.db').resolve()}"
        with _storage_errors(storage):
            folder.mkdir(parents=True, exist_ok=True)
    with _storage_errors(storage):  # before any probe: a study that cannot be written costs nothing yet
        study_storage = optuna.storages.get_storage(storage)
    candidates, probes = candidate_plans(
        workload, target, backend, gpus_per_node=gpus_per_node, nodes=nodes, checkpointing=checkpointing,
        headroom=headroom, max_batch=max_batch, min_micro=min_micro, multiple_of=multiple_of,
        use_cache=use_cache, root=folder,
    )
    by_label = {c.label: c for c in candidates}
    labels = list(by_label)
    # The baseline is what `find` picks: the largest micro batch, checkpointing off when that fits.
    baseline = next((c for c in candidates if not c.grad_checkpointing), candidates[0])

    fp = fingerprint(dataclasses.replace(workload, grad_checkpointing=False), backend.info(),
                     world_size=gpus_per_node * nodes,
                     settings={"tune": 1, "target": target, "gpus_per_node": gpus_per_node, "nodes": nodes,
                               "headroom": headroom, "max_batch": max_batch, "min_micro": min_micro, "multiple_of": multiple_of,
                               "timed_steps": timed_steps, "candidates": "|".join(labels)})
    study_name = f"autobatch-tune-{workload.name}-{fp.short}"
    verbosity = optuna.logging.get_verbosity()
    # One line per trial is ours to print; optuna would also log each failed trial's traceback
    # at WARNING, before the one-line error the CLI prints.
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    try:
        with _storage_errors(storage):
            pruner = SlowerThanBestPruner.create(prune_ratio)
            study = optuna.create_study(
                storage=study_storage, study_name=study_name, direction="maximize", load_if_exists=True,
                sampler=optuna.samplers.TPESampler(seed=seed), pruner=pruner,
            )
            study.set_user_attr("target", target)
            # Timings from an earlier run (another process, a cold or busy device) are not compared
            # with this run's: the baseline is timed again first, the pruner and the speed-up use this
            # run's trials, and the sampler's seed moves on so a resumed study explores other plans.
            first_now = pruner.since = len(study.get_trials(deepcopy=False))
            if first_now and seed is not None:
                study.sampler = optuna.samplers.TPESampler(seed=seed + first_now)
            study.enqueue_trial({"plan": baseline.label})
        models: dict[str, torch.nn.Module] = {}

        def objective(trial: Any) -> float:
            candidate = by_label[trial.suggest_categorical("plan", labels)]
            trial.set_user_attr("micro_batch", candidate.plan.micro_batch)
            trial.set_user_attr("grad_accum", candidate.plan.grad_accum)
            trial.set_user_attr("grad_checkpointing", candidate.grad_checkpointing)
            states = optuna.trial.TrialState
            done = [t for t in study.get_trials(deepcopy=False, states=(states.COMPLETE, states.PRUNED, states.FAIL))
                    if t.params.get("plan") == candidate.label and t.number >= first_now
                    and "repeat_of" not in t.user_attrs]
            if done:  # TPE proposes plans again; a second timing would only add noise: the first one stands
                first = done[0]
                trial.set_user_attr("repeat_of", first.number)
                if first.state == states.PRUNED:
                    raise optuna.TrialPruned(f"pruned already in this run (trial {first.number})")
                if first.state == states.FAIL:
                    raise _PlanOutOfMemory(first.user_attrs.get("error", f"out of memory (trial {first.number})"))
                trial.set_user_attr("seconds_per_step", first.user_attrs.get("seconds_per_step"))
                trial.set_user_attr("spread", first.user_attrs.get("spread"))
                return float(first.value)
            if "model" not in models:
                models["model"] = workload.model if isinstance(workload.model, torch.nn.Module) else workload.model()
            variant = dataclasses.replace(workload, grad_checkpointing=candidate.grad_checkpointing)

            def report(step: int, rate: float) -> None:
                trial.report(rate, step)
                # the baseline is this run's yardstick: it always runs to the end, however busy the device
                if candidate != baseline and trial.should_prune():
                    raise optuna.TrialPruned(f"{rate:.1f} samples/s is below {prune_ratio:.0%} of the best")

            swing: list[float] = []
            try:
                rate, seconds = time_plan(variant, models["model"], backend, candidate.plan,
                                          steps=timed_steps, on_step=report, spread=swing)
            except Exception as exc:
                if is_oom_error(exc):
                    message = oom_message(exc)
                    trial.set_user_attr("error", message)
                    raise _PlanOutOfMemory(message) from None
                raise
            trial.set_user_attr("seconds_per_step", seconds)
            trial.set_user_attr("spread", swing[0] if swing else None)
            return rate

        def callback(study: Any, frozen: Any) -> None:
            tried = {t.params.get("plan") for t in study.get_trials(deepcopy=False)[first_now:]
                     if t.state.is_finished() and "repeat_of" not in t.user_attrs}
            if tried >= set(labels):  # the sampler would only propose repeats from here on
                study.stop()
            if on_trial is not None:
                for m in _measurements(study, by_label, first_now):
                    if m.trial_number == frozen.number:
                        on_trial(m)

        study.optimize(objective, n_trials=n_trials, catch=(_PlanOutOfMemory,), callbacks=[callback])
    finally:
        optuna.logging.set_verbosity(verbosity)
    measurements = _measurements(study, by_label, first_now)
    complete = [m for m in measurements if m.state == "COMPLETE" and m.samples_per_second is not None
                and not m.earlier_run]
    base = next((m for m in complete if m.candidate == baseline), None)
    if not complete or base is None:
        raise AutobatchError(
            f"no plan could be timed for target {target} (the largest-micro plan {baseline.label} did not complete); "
            "rerun with more --trials, or lower the micro batch with --headroom"
        )
    best = max(complete, key=lambda m: m.samples_per_second or 0.0)
    this_run = study.get_trials(deepcopy=False)[first_now:]
    return TuneResult(best=best, baseline=base, measurements=tuple(measurements), candidates=tuple(candidates),
                      study_name=study_name, storage=storage, target=target, probes=probes, trials_run=len(this_run),
                      repeats=sum("repeat_of" in t.user_attrs for t in this_run), trials_asked=n_trials)


@contextlib.contextmanager
def _storage_errors(storage: str) -> Iterator[None]:
    """A study store that cannot be created or written (a read-only cache) as one line."""
    try:
        yield
    except AutobatchError:
        raise
    except Exception as exc:  # OSError, or the database library's own error classes
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        if "not a database" in first or "malformed" in first:
            raise AutobatchError(f"tune keeps its study in {storage}, which is damaged ({first}); `autobatch cache "
                                 "clear` removes it (and the cached probes), or point AUTOBATCH_CACHE_DIR elsewhere") from None
        raise AutobatchError(
            f"tune keeps its study in {storage}, which must be writable, but it failed: {first}; "
            "point AUTOBATCH_CACHE_DIR at a writable folder"
        ) from None


def list_studies(root: Path | str | None = None) -> list[dict[str, Any]]:
    """The tuning studies in ``root/tune.db``: name and number of trials (empty when there is none)."""
    path = (Path(root) if root is not None else cache_dir()) / "tune.db"
    if not path.is_file():
        return []
    optuna = _optuna()
    try:
        summaries = optuna.get_all_study_summaries(storage=f"sqlite:///{path.resolve()}")
    except Exception as exc:  # a damaged database must not break `cache list`; `cache clear` fixes it
        warnings.warn(f"autobatch cache: cannot read {path} ({type(exc).__name__}); `autobatch cache clear` removes it",
                      CacheWarning, stacklevel=2)
        return []
    return [{"name": s.study_name, "trials": s.n_trials} for s in summaries]

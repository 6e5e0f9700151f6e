"""The search on synthetic memory curves: every family real models make, thousands of curves, in seconds.

Run from the repository root (no extra needed)::

    python -m benchmarks.curves

It writes ``docs/benchmarks/curves.md``: one table per curve family, for ``search_max`` with the
trace as a prior, without it, and for doubling + bisection on the same curves.

Each curve is a pure-Python oracle that returns the :class:`~autobatch.trial.Trial` fields
``run_trial`` fills: the reserved peak of the forward+backward phase and of the optimizer step,
the allocated peak, the resident bytes after a step that fits (``None`` after one that fails),
what is allocated at the forward's end (the resident memory and the activations: the curve's
batch-dependent part, or on the two regimes the activations' piece), and for a trial that runs
out of memory the figures reached before the allocation that failed (activations are allocated
in sixteen chunks; the one that would cross the capacity raises), so a failed trial never
reports more than the capacity — as on a device.

A curve is ``peak(b) = R + B·shape(b / T)`` with ``R`` the resident memory (a share of the
capacity), ``B`` the rest, ``shape(1) = 1`` and ``T`` between the true maximum and one more.
The prior is what the fake-tensor trace predicts for it: the same shape with its batch-dependent
terms off by up to ±10 % each (independently: a kernel the trace does not model), a constant
workspace it misses, and no allocator rounding.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

from autobatch.probing.search import SearchOutcome, search_max
from autobatch.probing.trial import Trial

__all__ = [
    "Curve", "FAMILIES", "SEARCHES", "SMOOTH", "curves", "oracle", "true_max", "doubling_bisection", "measure", "Stats",
    "wrong_priors", "measure_wrong", "wrong_markdown",
    "markdown", "main",
]

GIB, MIB = 1 << 30, 1 << 20
CAPACITIES = (24 * GIB, 80 * GIB)
STATIC = (0.01, 0.1, 0.3, 0.6, 0.9)  # resident memory, share of the capacity
_CHUNKS = 16  # a step allocates its activations in this many pieces


def _round_block(n: float) -> int:
    """The caching allocator's rounding: 512 B below 1 MiB, 2 MiB segments above."""
    n = int(math.ceil(n))
    unit = 512 if n < MIB else 2 * MIB
    return -(-n // unit) * unit


@dataclass(frozen=True)
class Curve:
    """One memory curve: its family, parameters, and the device it runs on."""

    family: str
    variant: str
    capacity: int
    resident: int
    min_batch: int
    scale: float            # T: the shape reaches the capacity at b = T
    shape: Callable[[float], float] = field(repr=False)       # forward+backward, share of B above R
    optimizer: float = 0.0  # the optimizer step's (flat) peak, share of B above R
    tensors: int = 0        # activations split into this many tensors, each rounded (0: no rounding)
    prior_shape: Callable[[float], float] | None = field(default=None, repr=False)
    missed: float = 0.0     # workspace the trace does not see, share of B
    # Staircases: a kernel's own tensor, a share of the activations, that only the device
    # allocates (> 0) or only the trace does (< 0); the trace books its tensors as the allocator.
    unseen: float = 0.0
    smooth_prior: bool = False  # the staircase's prior without the allocator model (for comparison)
    activations: Callable[[float], float] | None = field(default=None, repr=False)  # live at the forward's end, share of B

    def forward(self, b: int) -> int:
        """Allocated at the end of the forward at batch ``b``: the resident memory and the activations."""
        share = self.activations(b / self.scale) if self.activations else self.shape(b / self.scale) - self.shape(0.0)
        return self.resident + int(self.budget * share)

    @property
    def budget(self) -> int:
        return self.capacity - self.resident

    def forward_backward(self, b: int) -> tuple[int, int]:
        """Allocated and reserved peak of the forward+backward phase at batch ``b``."""
        share = self.shape(b / self.scale)
        allocated = self.resident + int(self.budget * share)
        if not self.tensors:
            return allocated, allocated
        kernel = max(0.0, self.kernel(b))
        return allocated + int(kernel), self._rounded(b) + _round_block(kernel)

    def _rounded(self, b: int) -> int:
        """The forward+backward peak of the tensors both the device and the trace allocate, rounded.

        The batch-free part (gradients) is one block; activations are tensors of unequal sizes.
        """
        share, fixed = self.shape(b / self.scale), self.shape(0.0)
        total = sum(range(1, self.tensors + 1))
        acts = self.budget * (share - fixed)
        blocks = sum(_round_block(acts * i / total) for i in range(1, self.tensors + 1))
        return self.resident + _round_block(self.budget * fixed) + blocks

    def kernel(self, b: int) -> float:
        """The unseen kernel's tensor at ``b`` (bytes; negative: one only the trace allocates)."""
        return self.unseen * self.budget * (self.shape(b / self.scale) - self.shape(0.0))

    def prior(self, b: int) -> int:
        """The trace's prediction of the step's peak at ``b``."""
        floor = self.resident + int(self.budget * self.optimizer)
        if self.tensors and not self.smooth_prior:
            # The trace books the tensors it sees in the allocator model: their rounding is known.
            return max(self._rounded(b) + _round_block(max(0.0, -self.kernel(b))), floor) - int(self.budget * self.missed)
        shape = self.prior_shape or self.shape
        return self.resident + int(self.budget * (max(shape(b / self.scale), self.optimizer) - self.missed))


def oracle(curve: Curve) -> Callable[[int], Trial]:
    """``run(b)`` for ``curve``, with the fields a real trial reports."""
    capacity, resident = curve.capacity, curve.resident
    optimizer = resident + int(curve.budget * curve.optimizer)

    def run(b: int) -> Trial:
        allocated, reserved = curve.forward_backward(b)
        if max(reserved, optimizer) <= capacity:
            return Trial(b, True, max(allocated, optimizer), max(reserved, optimizer), reserved, optimizer,
                         resident_bytes=resident, seconds_per_step=0.05 + b * 1e-5, forward_bytes=curve.forward(b))
        base = resident + int(curve.budget * curve.shape(0.0))
        chunk = max(1, (reserved - base) // _CHUNKS)
        reached = max(resident, min(capacity, base + max(0, capacity - base) // chunk * chunk))
        return Trial(b, False, reached, reached, reached, 0,
                     error=f"CUDA out of memory. Tried to allocate {chunk} bytes")

    return run


def true_max(curve: Curve) -> int:
    """The largest batch that fits, by the oracle itself (galloping, then bisection)."""
    run = oracle(curve)
    lo, hi = curve.min_batch - 1, curve.min_batch
    while run(hi).fits:
        lo, hi = hi, 2 * hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if run(mid).fits else (lo, mid)
    return lo


def doubling_bisection(run: Callable[[int], Trial], capacity: int, *, min_batch: int = 1, prior=None) -> SearchOutcome:
    """The reference: double from ``min_batch`` until a failure, then bisect."""
    trials = [run(min_batch)]
    lo, hi = (min_batch, None) if trials[-1].fits else (0, min_batch)
    while hi is None:
        trials.append(run(2 * lo))
        lo, hi = (2 * lo, None) if trials[-1].fits else (lo, 2 * lo)
    while lo and hi - lo > 1:
        mid = (lo + hi) // 2
        trials.append(run(mid))
        lo, hi = (mid, hi) if trials[-1].fits else (lo, mid)
    return SearchOutcome(lo, "memory", tuple(trials))


# --- the families -----------------------------------------------------------------------------


def _poly(g: float, lin: float, quad: float) -> Callable[[float], float]:
    return lambda x: g + lin * x + quad * x * x


def _families(t: float, rng: random.Random) -> Iterator[tuple[str, str, dict]]:
    """(family, variant, Curve keyword arguments) for a curve whose shape reaches 1 at b = t."""
    e1, e2 = rng.uniform(-0.1, 0.1), rng.uniform(-0.1, 0.1)
    miss = rng.uniform(0.0, 0.03)  # workspace the trace does not see
    for family, variant, kwargs in _shapes(t, e1, e2):
        yield family, variant, {**kwargs, "missed": miss}


def _shapes(t: float, e1: float, e2: float) -> Iterator[tuple[str, str, dict]]:
    def traced(g: float, lin: float, curved: Callable[[float], float] = lambda x: 0.0):
        return lambda x: g + lin * (1 + e1) * x + (1 + e2) * curved(x)

    for g in (0.0, 0.1, 0.4):
        yield "affine", f"a − R = {g:g}·B", dict(shape=_poly(g, 1 - g, 0), prior_shape=traced(g, 1 - g))
    for g, k in ((0.0, 3), (0.2, 3), (0.0, 40), (0.2, 40)):
        yield "staircase", f"{k} tensors, a − R = {g:g}·B", dict(
            shape=_poly(g, 1 - g, 0), tensors=k, optimizer=g / 2, prior_shape=traced(g, 1 - g), unseen=e1)
    for g, o in ((0.3, 0.5), (0.6, 0.2), (0.1, 0.7)):
        shape = (lambda g: lambda x: max(g + 0.03 * x, x))(g)
        prior = (lambda g: lambda x: max(g + 0.03 * x, (1 + e1) * x))(g)
        yield "two regimes", f"gradients {g:g}·B, optimizer {o:g}·B", dict(shape=shape, optimizer=o, prior_shape=prior,
                                                                          activations=lambda x: x)
    for g, lin in ((0.0, 0.0), (0.1, 0.3), (0.05, 0.85), (0.3, 0.1)):
        quad = 1 - g - lin
        yield "superlinear", f"{g:g} + {lin:g}x + {quad:g}x²", dict(
            shape=_poly(g, lin, quad), prior_shape=traced(g, lin, lambda x, q=quad: q * x * x))
    log_t = math.log1p(t)
    blogb = lambda x: 0.9 * x * math.log1p(x * t) / log_t  # noqa: E731
    yield "b·log b, kinks", "0.1 + 0.9·b·log b", dict(shape=lambda x: 0.1 + blogb(x), prior_shape=traced(0.1, 0, blogb))
    for g, m, at in ((0.1, 3.0, 0.6), (0.05, 1.5, 0.2)):
        norm = 1 + (m - 1) * (1 - at)
        kink = (lambda g, m, at, norm: lambda x: (1 - g) * (x + (m - 1) * max(0.0, x - at)) / norm)(g, m, at, norm)
        yield "b·log b, kinks", f"slope ×{m:g} from {at:g}·b*", dict(shape=lambda x, k=kink, g=g: g + k(x),
                                                                    prior_shape=traced(g, 0, kink))
    step = lambda x: 0.9 * (x + 0.15 * (x >= 0.5)) / 1.15  # noqa: E731  (a kernel's workspace from b*/2)
    yield "b·log b, kinks", "+0.15·B workspace from b*/2", dict(shape=lambda x: 0.1 + step(x),
                                                               prior_shape=traced(0.1, 0, step))


FAMILIES = ("affine", "staircase", "two regimes", "superlinear", "b·log b, kinks")


def _maxima(coarse: bool) -> list[int]:
    if coarse:
        return [1, 2, 3, 5, 9, 17, 40, 130, 777, 4_321, 29_000, 100_000]
    logs = [round(10 ** (i / 12)) for i in range(61)]  # 1 … 100,000, twelve a decade
    return sorted(set(range(1, 11)) | set(logs))


def curves(coarse: bool = False) -> Iterator[Curve]:
    """The grid: true maxima 1–100,000, resident memory 1–90 % of capacity, min batch 1 and 2."""
    for capacity in CAPACITIES[-1:] if coarse else CAPACITIES:
        for static in STATIC[::2] if coarse else STATIC:
            for target in _maxima(coarse):
                for min_batch in (1, 2):
                    if target < min_batch:
                        continue
                    rng = random.Random(hash((capacity, static, target, min_batch)) & 0xFFFF_FFFF)
                    scale = target + rng.uniform(0.05, 0.95)
                    for family, variant, kwargs in _families(scale, rng):
                        yield Curve(family, variant, capacity, int(capacity * static), min_batch, scale, **kwargs)


def wrong_priors(curve: Curve) -> dict[str, Callable[[int], float]]:
    """Priors wrong as a trace can be wrong, for the staircase and kink families: 10 % low or high, the
    constant term half missed, a kink missed (the trace's slope without the algorithm's switch), the
    allocator model off by a 2 MiB block at some batches, its steps a batch early."""
    prior = curve.prior
    wrong: dict[str, Callable[[int], float]] = {
        "10% low": lambda b: 0.9 * prior(b),
        "10% high": lambda b: 1.1 * prior(b),
        "no constant": lambda b, c=prior(1): max(1.0, prior(b) - 0.5 * c),
    }
    if curve.family == "b·log b, kinks" and curve.variant != "0.1 + 0.9·b·log b":
        wrong["missed kink"] = replace(curve, prior_shape=lambda x: 0.1 + 0.9 * x).prior
    if curve.family == "staircase":
        wrong["2 MiB off"] = lambda b: prior(b) + 2 * MIB * ((b * 7919) % 3)
        wrong["steps early"] = lambda b: prior(b + 1)
    return wrong


def measure_wrong(coarse: bool = True) -> dict[str, Stats]:
    """``search_max`` led by each wrong prior on the staircase and kink curves: stats by kind of error."""
    results: dict[str, Stats] = {}
    for curve in curves(coarse):
        if curve.family not in ("staircase", "b·log b, kinks"):
            continue
        truth = true_max(curve)
        reference = len(doubling_bisection(oracle(curve), curve.capacity, min_batch=curve.min_batch).trials)
        for name, prior in wrong_priors(curve).items():
            outcome = search_max(oracle(curve), curve.capacity, min_batch=curve.min_batch, prior=prior)
            results.setdefault(f"{curve.family}: {name}", Stats()).add(outcome, truth, reference)
    return results


# --- measuring --------------------------------------------------------------------------------


@dataclass
class Stats:
    """What one search cost on one family of curves."""

    curves: int = 0
    exact: int = 0
    trials: list[int] = field(default_factory=list)
    ooms: list[int] = field(default_factory=list)
    tried_over_answer: list[float] = field(default_factory=list)
    worst_overshoot: float = 0.0  # largest batch tried ÷ answer
    beyond_reference: int = 0     # curves where it took more than one trial beyond doubling + bisection

    def add(self, outcome: SearchOutcome, truth: int, reference: int) -> None:
        tried = [t.batch for t in outcome.trials]
        self.curves += 1
        self.exact += outcome.max_batch == truth and {truth, truth + 1} <= set(tried)
        self.trials.append(len(tried))
        self.ooms.append(sum(not t.fits for t in outcome.trials))
        self.tried_over_answer.append(sum(tried) / truth)
        self.worst_overshoot = max(self.worst_overshoot, max(tried) / truth)
        self.beyond_reference += len(tried) > reference + 1

    def row(self) -> dict[str, float]:
        return {
            "curves": self.curves,
            "exact %": 100 * self.exact / self.curves,
            "median trials": statistics.median(self.trials),
            "p90": statistics.quantiles(self.trials, n=10, method="inclusive")[-1],
            "max": max(self.trials),
            "mean OOM trials": statistics.fmean(self.ooms),
            "Σ tried ÷ answer": statistics.fmean(self.tried_over_answer),
            "largest tried ÷ answer": self.worst_overshoot,
            "> reference + 1": self.beyond_reference,
        }


def _with_prior(run, capacity, *, min_batch, prior):
    return search_max(run, capacity, min_batch=min_batch, prior=prior)


def _without_prior(run, capacity, *, min_batch, prior):
    return search_max(run, capacity, min_batch=min_batch)


SMOOTH = "search_max, trace prior without the allocator model"
SEARCHES: dict[str, Callable[..., SearchOutcome]] = {
    "search_max, trace prior": _with_prior,
    SMOOTH: _with_prior,  # the staircases' prior as smooth as the trace's tensor bytes: what the model buys
    "search_max, trials only": _without_prior,
    "doubling + bisection": doubling_bisection,
}


def measure(coarse: bool = False, searches: dict[str, Callable[..., SearchOutcome]] = SEARCHES) -> dict[str, dict[str, Stats]]:
    """``{search: {family: Stats}}`` over the grid (coarse: a few hundred curves, for the tests)."""
    out = {name: {family: Stats() for family in FAMILIES} for name in searches}
    for curve in curves(coarse):
        truth = true_max(curve)
        reference = len(doubling_bisection(oracle(curve), curve.capacity, min_batch=curve.min_batch).trials)
        for name, search in searches.items():
            prior = replace(curve, smooth_prior=True).prior if name == SMOOTH else curve.prior
            outcome = search(oracle(curve), curve.capacity, min_batch=curve.min_batch, prior=prior)
            out[name][curve.family].add(outcome, truth, reference)
    return out


def markdown(results: dict[str, dict[str, Stats]], first: str = "family") -> str:
    """The tables of ``docs/benchmarks/curves.md``; ``first`` heads the column that names each row."""
    lines = []
    for name, families in results.items():
        header = [first, *next(iter(families.values())).row()]
        lines += [f"### {name}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for family, stats in families.items():
            row = stats.row()
            cells = [f"{v:.0f}" if k in ("curves", "max", "> reference + 1") else f"{v:.1f}" if "%" in k
                     else f"{v:g}" if k in ("median trials", "p90") else f"{v:.2f}" for k, v in row.items()]
            lines.append(f"| {family} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--coarse", action="store_true", help="the tests' small grid")
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks/curves.md"))
    args = parser.parse_args(argv)
    results = measure(coarse=args.coarse)
    tables = markdown(results) + "\n" + wrong_markdown(measure_wrong(coarse=args.coarse))
    text = args.out.read_text() if args.out.exists() else ""
    marker = "<!-- measured: python -m benchmarks.curves -->"
    head = text.split(marker)[0] if text else "# The search on synthetic memory curves\n\n"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(head + marker + "\n\n" + tables)
    print(tables)
    return 0


def wrong_markdown(wrong: dict[str, Stats]) -> str:
    """The table of ``search_max`` led by priors wrong as a trace can be (:func:`measure_wrong`)."""
    return markdown({"search_max, trace prior wrong as a trace can be": wrong}, first="curves: prior")


if __name__ == "__main__":
    raise SystemExit(main())

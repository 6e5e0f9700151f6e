"""PNG figures of a probe and of a tuning run: memory against batch, throughput against micro batch.

matplotlib is an optional extra (``pip install 'autobatch[plot]'``), imported only when a
figure is drawn, with the non-interactive Agg backend so it works on headless training nodes.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import AutobatchError, MissingDependencyError
from ..units import format_bytes

if TYPE_CHECKING:
    from ..probing.result import ProbeResult
    from .tune import TuneResult

__all__ = ["check_plot_path", "plot_probe", "plot_tune"]

_GIB = 1024**3


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise MissingDependencyError(
            "--plot needs matplotlib, which is not installed; pip install 'autobatch[plot]'"
        ) from None
    matplotlib.use("Agg", force=True)  # no display on a training node; never open a window
    import matplotlib.pyplot as plt

    return plt


def _scale(capacity: int) -> tuple[float, str]:
    # Axis unit from the capacity: GiB for real GPUs, KiB/MiB for the simulated budgets of tests.
    for factor, unit in ((_GIB, "GiB"), (1024**2, "MiB"), (1024, "KiB")):
        if capacity >= 4 * factor:
            return float(factor), unit
    return 1.0, "bytes"


def _memory_panel(ax: Any, result: ProbeResult, chosen: int | None, label: str = "", color: str = "C0",
                  limits: bool = True) -> None:
    factor, unit = _scale(result.capacity_bytes)
    fits = [t for t in result.trials if t.fits]
    ooms = [t for t in result.trials if not t.fits]
    suffix = f" ({label})" if label else ""
    ax.scatter([t.batch for t in fits], [t.reserved_bytes / factor for t in fits], color=color, zorder=3,
               label=f"measured peak{suffix}")
    if ooms:
        ax.scatter([t.batch for t in ooms], [t.reserved_bytes / factor for t in ooms], color=color, marker="x",
                   zorder=3, label=f"out of memory{suffix}")
    if result.bytes_per_sample and result.fixed_bytes is not None:
        top = max([t.batch for t in result.trials] + [result.max_batch + 1])
        ax.plot([0, top], [result.fixed_bytes / factor, (result.fixed_bytes + result.bytes_per_sample * top) / factor],
                color=color, linestyle="--", linewidth=1,
                label=f"fit{suffix}: {format_bytes(result.fixed_bytes)} + {format_bytes(result.bytes_per_sample)}/sample")
    if limits:  # the device's lines, drawn once however many probes share the panel
        ax.axhline(result.capacity_bytes / factor, color="black", linewidth=1, label="capacity")
        ax.axhline((result.capacity_bytes - result.headroom_bytes) / factor, color="grey", linestyle=":",
                   linewidth=1, label=f"capacity − headroom ({format_bytes(result.headroom_bytes)})")
    if chosen is not None:
        ax.axvline(chosen, color="C3", linewidth=1.5, label=f"chosen batch {chosen}")
    ax.set_xlabel("batch per device")
    ax.set_ylabel(f"peak memory ({unit})")
    ax.set_ylim(bottom=0)
    ax.set_xlim(left=0)


def check_plot_path(path: str | Path) -> Path:
    """``path`` as a PNG path that can be written, or a one-line error; also checks matplotlib is there.

    Called before a probe, so that a typo does not cost the probe it would have drawn.
    """
    path = Path(path)
    if path.is_dir():
        raise AutobatchError(f"--plot must name a PNG file, but {str(path)!r} is a directory; pass e.g. {str(path / 'probe.png')!r}")
    if path.suffix.lower() != ".png":
        raise AutobatchError(f"--plot writes a PNG, so its name must end in .png, but got {str(path)!r}; "
                             f"pass e.g. {str(path.with_suffix('.png'))!r}")
    parent = next((p for p in path.parents if p.exists()), None)
    if parent is not None and not parent.is_dir():
        raise AutobatchError(f"--plot must be inside a folder, but {str(parent)!r} is a file; pick another path")
    _pyplot()
    return path


def _save(fig: Any, path: str | Path) -> Path:
    path = check_plot_path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.tight_layout()
        fig.savefig(path, dpi=120, format="png")
    except OSError as exc:
        raise AutobatchError(f"--plot must be a writable path, but writing {str(path)!r} failed: {exc}; pick another path") from None
    return path


def plot_probe(result: ProbeResult, path: str | Path, chosen: int | None = None) -> Path:
    """Draw a probe: peak memory against batch, and samples per second against batch.

    Args:
        result: the probe.
        path: the PNG to write (folders are created).
        chosen: the batch to mark; default ``result.safe_batch``.

    Example:
        >>> import tempfile, torch
        >>> from autobatch import SimulatedBackend, Workload, probe
        >>> work = Workload(torch.nn.Linear(8, 2), lambda b: (torch.randn(b, 8), torch.zeros(b, dtype=torch.long)))
        >>> png = plot_probe(probe(work, SimulatedBackend("64KiB")), Path(tempfile.mkdtemp()) / "probe.png")
        >>> png.stat().st_size > 0
        True
    """
    plt = _pyplot()
    fig, (mem, speed) = plt.subplots(1, 2, figsize=(11, 4.2))
    try:
        _memory_panel(mem, result, result.safe_batch if chosen is None else chosen)
        mem.set_title(f"{result.workload} on {result.device.name}")
        mem.legend(fontsize=7, loc="upper left")
        timed = sorted((t.batch, t.batch / t.seconds_per_step) for t in result.trials if t.fits and t.seconds_per_step)
        if timed:
            speed.plot(*zip(*timed), marker="o")
        speed.set_xlabel("batch per device")
        speed.set_ylabel("samples / s (probe steps)")
        speed.set_title("throughput during the probe")
        speed.set_xlim(left=0)
        speed.set_ylim(bottom=0)
        return _save(fig, path)
    finally:
        plt.close(fig)


def plot_tune(result: TuneResult, path: str | Path) -> Path:
    """Draw a tuning run: memory against batch per checkpointing setting, throughput against micro batch.

    The throughput panel shows each timed plan (pruned ones hollow) for each checkpointing
    setting, with the best plan and the largest-micro baseline marked.

    Args:
        result: from :func:`autobatch.tune`.
        path: the PNG to write.
    """
    plt = _pyplot()
    fig, (mem, speed) = plt.subplots(1, 2, figsize=(11, 4.2))
    try:
        best = result.best.candidate
        for i, (gc, probe) in enumerate(sorted(result.probes.items())):
            chosen = best.plan.micro_batch if best.grad_checkpointing == gc else None
            _memory_panel(mem, probe, chosen, label=f"checkpointing {'on' if gc else 'off'}", color=f"C{i}",
                          limits=i == 0)
        if result.probes:
            mem.set_title(next(iter(result.probes.values())).device.name)
        mem.legend(fontsize=6, loc="upper left")
        for i, gc in enumerate(sorted({m.candidate.grad_checkpointing for m in result.measurements})):
            for state, fill in (("COMPLETE", f"C{i}"), ("PRUNED", "none")):
                points = sorted((m.candidate.plan.micro_batch, m.samples_per_second) for m in result.measurements
                                if m.candidate.grad_checkpointing == gc and m.state == state and m.samples_per_second)
                if points:
                    speed.scatter(*zip(*points), facecolors=fill, edgecolors=f"C{i}", zorder=3,
                                  label=f"checkpointing {'on' if gc else 'off'}{' (pruned)' if state == 'PRUNED' else ''}")
        for m, marker, name in ((result.baseline, "s", "largest micro"), (result.best, "*", "best")):
            speed.scatter([m.candidate.plan.micro_batch], [m.samples_per_second], marker=marker, s=160,
                          facecolors="none", edgecolors="C3", zorder=4, label=f"{name}: {m.candidate.label}")
        speed.set_xlabel("micro batch per device")
        speed.set_ylabel(f"samples / s for global batch {result.target}")
        speed.set_title(f"throughput: {result.speedup:.2f}× the largest-micro plan")
        speed.set_xlim(left=0)
        speed.set_ylim(bottom=0)
        speed.legend(fontsize=6, loc="lower right")
        return _save(fig, path)
    finally:
        plt.close(fig)

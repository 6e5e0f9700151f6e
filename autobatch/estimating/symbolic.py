"""One trace for every batch: the step traced once with the batch size a symbol, its bytes a polynomial in it.

A fake tensor's shape may hold a symbolic integer (torch's ``ShapeEnv``, the machinery
``torch.compile`` traces dynamic shapes with). With the batch size such a symbol ``b``, every
tensor the step makes has a size that is a polynomial in ``b`` (activations grow with it, weights
and optimizer state do not), and :class:`SymbolicTracker` keeps the live bytes as one. The peak
of a phase is the largest of the live totals it went through, so it is kept as the set of those
polynomials (dominated ones dropped): ``max(p(b) for p in phase)`` is the phase's peak at any
batch, read without tracing again.

Where the step's path depends on the batch (a branch on its size, a kernel that reads a size as
a plain int), torch records a *guard* on the symbol. The curve answers only batches that satisfy
every guard and sizes that stayed polynomials; any other batch, and a step torch cannot trace
with a symbolic batch, is traced at its own size as before (:func:`~.estimate.trace_trial`).
``tests/test_symbolic.py`` checks that the curve equals the per-batch trace field by field.
"""

from __future__ import annotations

import logging
import os
import sys
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from ..probing.memtrack import MemoryTracker
from ..probing.progress import working
from ..probing.trial import Trial, forward_backward
from ..probing.workload import Workload, make_optimizer
from .made_log import STEADY, Coefficients, shifted, steady_step, whole_steps, window

__all__ = ["BatchCurve", "SymbolicTracker", "trace_curve", "NotWhole", "BatchGuarded"]

_HINT = 8  # the value torch assumes for the batch symbol where it must pick a branch (recorded as a guard)
_PRUNE_AT = 4096  # candidate peaks kept before the dominated ones are dropped


def _value(coefficients: Coefficients, batch: int) -> int:
    return sum(c * batch ** k for k, c in enumerate(coefficients))


def _envelope(candidates: Iterable[Coefficients]) -> tuple[Coefficients, ...]:
    """The candidates no other one bounds from above at every batch ≥ 0 (each coefficient at least as large)."""
    ordered = sorted(set(candidates), reverse=True)
    kept: list[Coefficients] = []
    for c in ordered:
        width = max(len(c), *(len(k) for k in kept)) if kept else len(c)
        padded = c + (0,) * (width - len(c))
        if not any(all(a >= b for a, b in zip(k + (0,) * (width - len(k)), padded)) for k in kept):
            kept.append(c)
    return tuple(kept)


class NotWhole(Exception):
    """A traced step the log of whole steps cannot be made from (:func:`~.made_log.whole_steps`): trace them whole."""


class NotABatchPolynomial(Exception):
    """A size the symbolic trace cannot keep as a polynomial in the batch (another symbol, a division)."""


class BatchGuarded(Exception):
    """Torch guarded the batch symbol so that the curve cannot answer a batch it must: pinned to its hint
    (``batch == hint``: ``len()`` of a batch-sized tensor, a size read as a plain int), or, where the
    trace was asked to answer some batches (``needs``), a branch that leaves one of them out."""


class SymbolicTracker(MemoryTracker):
    """:class:`MemoryTracker` whose live bytes are a polynomial in the batch symbol.

    ``windows`` holds, for each span between two ``reset_peak`` calls, the polynomials the live
    total went through (its envelope); ``current`` is the live total now. ``current_bytes`` and
    ``peak_bytes`` read them at the symbol's hint, for code that expects numbers. ``log`` is every
    request and free in order, ``(token, size)`` and ``(token, None)``, to book through an
    allocator model at any batch (:meth:`BatchCurve.requests`).
    """

    def __init__(self, symbol: Any, hint: int):
        super().__init__()
        self.symbol, self.hint = symbol, hint
        self.current: Coefficients = (0,)
        self.windows: list[tuple[Coefficients, ...]] = []
        self._window: set[Coefficients] = {self.current}
        self._known: dict[Any, Coefficients] = {}
        self.log: list[tuple[int, Coefficients | None]] = []

    def coefficients(self, nbytes: Any) -> Coefficients:
        if isinstance(nbytes, int):
            return (nbytes,)
        expr = nbytes.node.expr
        known = self._known.get(expr)
        if known is None:
            import sympy

            if expr.free_symbols - {self.symbol}:
                raise NotABatchPolynomial(f"a size depends on more than the batch: {expr}")
            try:
                poly = sympy.Poly(sympy.expand(expr), self.symbol)
            except sympy.PolynomialError as exc:
                raise NotABatchPolynomial(f"a size is not a polynomial in the batch: {expr}") from exc
            values = list(reversed(poly.all_coeffs()))
            if not all(v.is_integer for v in values):
                raise NotABatchPolynomial(f"a size has fractional coefficients in the batch: {expr}")
            known = self._known[expr] = tuple(int(v) for v in values)
        return known

    def _shift(self, by: Coefficients, sign: int) -> None:
        self.current = shifted(self.current, by, sign)

    def _account(self, storage: torch.UntypedStorage, *, check_budget: bool) -> None:
        key, size = id(storage), self.coefficients(storage.nbytes())
        known = self._live.get(key)
        if known is not None:  # resize_ grew or shrank the storage in place: booked as a free and a request
            token, old = known
            if size == old:
                return
            self._shift(old, -1)
            self.log.append((token, None))
        token = next(self._tokens)
        self._live[key] = (token, size)
        self.log.append((token, size))
        weakref.finalize(storage, self._release, key, token)
        self._shift(size, 1)
        self._window.add(self.current)
        if len(self._window) > _PRUNE_AT:
            self._window = set(_envelope(self._window))

    def _release(self, key: int, token: int) -> None:
        known = self._live.get(key)
        if known is not None and known[0] == token:
            del self._live[key]
            self._shift(known[1], -1)
            self.log.append((token, None))

    def token(self, tensor: torch.Tensor) -> int | None:
        """The log's token of the storage ``tensor`` lives in, or ``None`` where it is not counted."""
        known = self._live.get(id(tensor.untyped_storage()))
        return None if known is None else known[0]

    def reset_peak(self) -> None:
        self.windows.append(_envelope(self._window))
        self._window = {self.current}

    # Read at the hint; the base class's own assignments (0 on creation) are the polynomials' to make.
    @property  # type: ignore[override]
    def current_bytes(self) -> int:
        return _value(self.current, self.hint)

    @current_bytes.setter
    def current_bytes(self, value: int) -> None:
        pass

    @property  # type: ignore[override]
    def peak_bytes(self) -> int:
        return max(_value(c, self.hint) for c in self._window)

    @peak_bytes.setter
    def peak_bytes(self, value: int) -> None:
        pass

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.constant_pad_nd.default:
            # The CPU kernel reads the input's sizes as plain ints, which would pin the batch to
            # its hint; torch's reference allocates the same one padded output.
            from torch._refs import constant_pad_nd

            out = constant_pad_nd(*args, **(kwargs or {}))
            self._register(out, check_budget=True)
            return out
        return super().__torch_dispatch__(func, types, args, kwargs)


_OURS = (os.path.dirname(os.path.abspath(torch.__file__)), os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _calling() -> str:
    """The line that called torch: the innermost frame outside torch and autobatch (the model's, or the
    loss's), as ``file:line in function``."""
    frame = sys._getframe(1)
    while frame is not None:
        name = os.path.abspath(frame.f_code.co_filename)
        if not name.startswith(_OURS) and not frame.f_code.co_filename.startswith("<"):
            return f"{name}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return "torch's own code"


class _StopOnceGuarded(TorchFunctionMode):
    """Raise :class:`BatchGuarded` at the first torch call after the batch symbol is pinned, or after a
    guard leaves out a batch of ``needs``, and at every call after it, saying where it was first (the
    unwinding's own calls, a ``finally``'s ``zero_grad``, would say theirs). Checked where the model calls
    torch, never inside one of torch's own kernels (an exception raised in a convolution's dispatch aborts
    the process)."""

    def __init__(self, env: Any, symbol: Any, needs: tuple[int, ...]):
        super().__init__()
        self.env, self.symbol, self.needs = env, symbol, needs
        self._checked = 0  # the env's guards checked so far
        self._stopped: str | None = None  # why, and where, it stopped

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self._stopped is None and getattr(self.env.replacements.get(self.symbol), "is_number", False):
            self._stopped = (f"torch pinned the batch to {self.env.replacements[self.symbol]} at {_calling()}, where "
                             "len() or int() read a batch-sized dimension")
        guards = self.env.guards
        if self._stopped is None and self.needs and len(guards) > self._checked:
            import sympy

            for guard in guards[self._checked:]:
                left_out = [b for b in self.needs if guard.expr.xreplace({self.symbol: b}) is sympy.false]
                if left_out:
                    self._stopped = f"a guard ({guard.expr}) leaves out batch {left_out[0]}, at {_calling()}"
                    break
            self._checked = len(guards)
        if self._stopped is not None:
            raise BatchGuarded(self._stopped)
        return func(*args, **(kwargs or {}))


@dataclass(frozen=True)
class BatchCurve:
    """A traced step's figures at any batch its guards allow: what :func:`~.estimate.trace_trial` gives there."""

    forward_backward: tuple[Coefficients, ...]
    optimizer: tuple[Coefficients, ...]
    resident: Coefficients
    guards: tuple[Any, ...]   # sympy conditions on the batch symbol, each must hold
    symbol: Any
    smallest: int             # the smallest batch the symbol's range allows
    log: tuple[tuple[int, Coefficients | None], ...] = ()  # the step's requests and frees, in order
    forward: tuple[Coefficients, ...] = ()  # allocated at each step's forward end (Trial.forward_bytes)

    def answers(self, batch: int) -> bool:
        """Whether the traced step is the step at ``batch`` (every guard holds there)."""
        if batch < self.smallest:
            return False
        at = {self.symbol: batch}
        return all(bool(g.xreplace(at)) for g in self.guards)

    def requests(self, batch: int) -> list[tuple[int, int | None]]:
        """The step's requests and frees at ``batch``, in order: ``(token, bytes)``, ``(token, None)``."""
        sizes: dict[Coefficients, int] = {}
        out = []
        for token, size in self.log:
            if size is not None:
                known = sizes.get(size)
                if known is None:
                    known = sizes[size] = _value(size, batch)
                out.append((token, known))
            else:
                out.append((token, None))
        return out

    def trial(self, batch: int) -> Trial:
        fb = max(_value(c, batch) for c in self.forward_backward)
        opt = max(_value(c, batch) for c in self.optimizer)
        peak = max(fb, opt)
        return Trial(batch=batch, fits=True, peak_bytes=peak, reserved_bytes=peak, forward_backward_bytes=fb,
                     optimizer_bytes=opt, resident_bytes=_value(self.resident, batch),
                     forward_bytes=max((_value(c, batch) for c in self.forward), default=0))


def trace_curve(workload: Workload, model: torch.nn.Module, backend: Any, steps: int = 1,
                whole: int = 0, primed: bool = False, needs: tuple[int, ...] = (),
                why: Callable[[str], None] | None = None) -> BatchCurve | None:
    """Trace ``steps`` steps of ``model`` (fake, under ``backend.fake_mode``) with a symbolic batch.

    ``backend`` is the :class:`~.fake_backends._FakeBackend` a per-batch trace would run on, and
    ``workload.optimizer`` the optimizer it would make (primed for one step, see
    :func:`~.estimate.trace_batches`): the steps are the same, their sizes symbolic. Each phase's
    peak is the largest over the steps, as a trial's. ``None`` where torch cannot trace it so (the
    caller traces batch by batch).

    ``primed``: the optimizer was primed (its state made by a step on zero gradients); for torch's own
    optimizers the steady step is then made from that step, not traced (:func:`~.made_log.steady_step`).
    ``whole``: the log as that many whole steps (:func:`~.made_log.whole_steps`), made from the one
    steady step traced after a primed optimizer; :class:`NotWhole` where the step is not one the log
    can be made of. ``needs``: batches the curve must answer; the trace stops (``None``) once a guard
    leaves one out, as it does once torch pins the batch to the symbol's hint (:class:`BatchGuarded`).
    ``why``: called with the reason, in one line, where it returns ``None``.
    """
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    mode = backend.fake_mode
    env = ShapeEnv(specialize_zero_one=False)
    symbol = env.create_symbol(_HINT, ConstantSource("batch"), dynamic_dim=DimDynamic.DYNAMIC)
    batch = env.create_symintnode(symbol, hint=_HINT)
    tracker = SymbolicTracker(symbol, _HINT)
    saved = mode.shape_env, mode.static_shapes
    mode.shape_env, mode.static_shapes = env, False
    params = [p for p in model.parameters()]
    original = backend._tracker
    backend._tracker = tracker
    try:
        with working(f"tracing {workload.name} once for every batch on fake tensors"), backend.track(
                params + [b for b in model.buffers()]), _StopOnceGuarded(env, symbol, needs):
            trained = [p for p in params if p.requires_grad]
            sizes = [p.numel() * p.element_size() for p in trained]
            marks = [len(tracker.log)]  # where the prime (if any), the forward, the optimizer step, the rest begin
            opt = make_optimizer(workload.optimizer, trained)
            try:
                phases: dict[str, set[Coefficients]] = {"forward_backward": set(), "optimizer": set(), "forward": set()}
                for _ in range(steps):
                    tracker.reset_peak()
                    marks.append(len(tracker.log))
                    forward_backward(workload, model, batch, backend.device,
                                     lambda: phases["forward"].add(tracker.current))
                    marks.append(len(tracker.log))
                    grads = [tracker.token(p.grad) if p.grad is not None else None for p in trained]
                    tracker.reset_peak()
                    phases["forward_backward"].update(tracker.windows[-1])
                    made = (steady_step(tracker.log, marks[0], marks[1], sizes, grads)
                            if primed and type(opt) in STEADY else None)
                    start = tracker.current
                    if made is None:
                        opt.step()
                    opt.zero_grad(set_to_none=not workload.grads_held)
                    tracker.reset_peak()
                    if made is None:
                        phases["optimizer"].update(tracker.windows[-1])
                    else:  # the step made from the prime's, in place of the gradients' frees just logged
                        del tracker.log[marks[-1]:]
                        tracker.log.extend(made)
                        phases["optimizer"].update(window(start, made, tracker.log))
                marks.append(len(tracker.log))
                resident = tracker.current
            finally:
                del opt
                model.zero_grad(set_to_none=True)
    except Exception as exc:  # noqa: BLE001 - the per-batch trace runs the same step and raises what is the model's
        # A size that is no polynomial in the batch, a value read from data, an op torch cannot run
        # with a symbolic size: the caller traces each batch at its own size instead.
        logging.getLogger(__name__).debug("no symbolic trace of %s: %s", workload.name, exc)
        if why is not None:
            why(" ".join(f"{type(exc).__name__}: {exc}".split()) if not isinstance(exc, BatchGuarded) else str(exc))
        return None
    finally:
        backend._tracker = original
        mode.shape_env, mode.static_shapes = saved
    log = tuple(tracker.log)
    if whole:
        made = whole_steps(log, marks, sizes, grads, whole)
        if made is None:
            logging.getLogger(__name__).debug("the whole steps traced: %s keeps or frees more", workload.name)
            raise NotWhole(f"{workload.name}: its step keeps or frees more than its own tensors and gradients")
        log = made
    low = env.var_to_range[symbol].lower
    return BatchCurve(forward_backward=_envelope(phases["forward_backward"]), optimizer=_envelope(phases["optimizer"]),
                      resident=resident, guards=tuple(g.expr for g in env.guards), symbol=symbol,
                      smallest=max(1, int(low)), log=log, forward=_envelope(phases["forward"]))

"""The allocator's log made from a primed trace: the optimizer's steady step, and whole steps.

A symbolic trace (:func:`~.symbolic.trace_curve`) primes the optimizer with a step on zero
gradients, which makes its state, then traces one steady step. Two parts of what the allocator's
model books are made from that prime instead of traced again, each request for request what a
trace gives (``tests/test_whole_steps.py``):

* :func:`steady_step`: the steady optimizer step of torch's own optimizers (and ``adamw8bit``) is
  their first step without the state it makes, so the prime's step, its temporaries named anew and
  its gradients the traced backward's, is the steady one: the optimizer is stepped once, not twice;
* :func:`whole_steps`: the first of the whole steps a trial runs (the blocks it leaves are the
  ones the next reuses) is the steady step's forward and backward again, then the prime's step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..probing.eight_bit import EightBitAdamW

__all__ = ["Coefficients", "Log", "STEADY", "steady_step", "whole_steps", "window", "shifted"]

Coefficients = tuple[int, ...]  # bytes as c0 + c1·b + c2·b² + … in the batch b
Event = tuple[int, Coefficients | None]  # a request (token, bytes) or a free (token, None)
Log = tuple[Event, ...]  # the requests and frees in order
# Optimizers whose steady step is their first without the state it makes: the step on every
# built-in name (tests/test_whole_steps.py); another optimizer's step is traced.
STEADY = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adafactor, EightBitAdamW)


def _zeros(prime: Log, sizes: list[int], grads: list[int | None]) -> list[int] | None:
    """The prime's gradients of zeros (its first requests, one a trained parameter of ``sizes`` bytes),
    or ``None`` where they are not, or the traced backward left a parameter without one (``grads``)."""
    n = len(sizes)
    zeros = [token for token, _ in prime[:n]]
    if (len(prime) < n or any(size != (nbytes,) for (_, size), nbytes in zip(prime, sizes))
            or None in grads or len(set(grads)) != n or len(set(zeros)) != n):
        return None
    return zeros


def steady_step(log: Sequence[Event], prime_at: int, forward_at: int, sizes: list[int],
                grads: list[int | None]) -> Log | None:
    """The optimizer's steady step and the gradients freed (or zeroed), made from the prime's step.

    ``log[prime_at:forward_at]`` is the prime: a gradient of zeros for each trained parameter (of
    ``sizes`` bytes, in order), the optimizer's first step on them, the gradients freed; ``grads``
    are the tokens of the gradients the traced backward left. What the first step requested and
    never freed is the state; without it, its temporaries named anew and its gradients the
    backward's, the step is the steady one. ``None`` where the prime is not so.
    """
    prime = tuple(log[prime_at:forward_at])
    zeros = _zeros(prime, sizes, grads)
    if zeros is None:
        return None
    rest = prime[len(sizes):]
    state = {token for token, size in rest if size is not None} - {token for token, size in rest if size is None}
    to_grads = dict(zip(zeros, grads))
    fresh = iter(range(max(token for token, _ in log) + 1, 1 << 62))
    names: dict[int, int] = {}
    out = []
    for token, size in rest:
        if token in state:
            continue
        if size is not None:
            names[token] = next(fresh)
        out.append((names.get(token, to_grads.get(token, token)), size))
    return tuple(out)


def shifted(total: Coefficients, by: Coefficients, sign: int) -> Coefficients:
    """``total`` plus ``sign`` times ``by``, as polynomials in the batch (no trailing zero coefficient)."""
    width = max(len(total), len(by))
    out = [(total[k] if k < len(total) else 0) + sign * (by[k] if k < len(by) else 0) for k in range(width)]
    while len(out) > 1 and out[-1] == 0:
        out.pop()
    return tuple(out)


def window(start: Coefficients, part: Sequence[Event], log: Sequence[Event]) -> set[Coefficients]:
    """The live totals ``part`` goes through from ``start`` (after each request, as a tracker keeps a
    phase's window), the sizes of what it frees read from ``log``."""
    sizes = {token: size for token, size in log if size is not None}
    current, seen = start, {start}
    for token, size in part:
        current = shifted(current, size, 1) if size is not None else shifted(current, sizes[token], -1)
        if size is not None:
            seen.add(current)
    return seen


def whole_steps(log: Log, marks: list[int], sizes: list[int], grads: list[int | None], steps: int) -> Log | None:
    """The log of ``steps`` whole steps, made from one traced after the optimizer was primed.

    ``log`` is: the resident tensors; the prime (a gradient of zeros for each trained parameter, in
    order, of ``sizes`` bytes; the optimizer's step on them, which makes its state; the gradients
    freed); one steady step (its forward and backward, which leave the gradients ``grads``; its
    optimizer step); what the trace freed after. ``marks`` are where the prime, the forward, the
    optimizer step and the rest begin. A first step is its forward and backward again, then the
    prime's optimizer step on that backward's gradients: the same requests as the first step a
    trial runs, which the allocator's model must book before the steady ones (the blocks it leaves
    are the ones they reuse), for half the tracing. ``None`` where the forward and backward keep
    or free anything but their own tensors and the gradients, so a first one could differ.
    """
    prime_at, forward_at, optimizer_at, rest_at = marks
    prime, forward, optimizer = log[prime_at:forward_at], log[forward_at:optimizer_at], log[optimizer_at:rest_at]
    n = len(sizes)
    zeros = _zeros(prime, sizes, grads)
    if zeros is None:
        return None
    made = {token for token, size in forward if size is not None}
    freed = [token for token, size in forward if size is None]
    if not set(freed) <= made or made - set(freed) != set(grads) or len(freed) != len(set(freed)):
        return None  # a forward that frees what came before it, or keeps more than the gradients
    fresh = iter(range(max(token for token, _ in log) + 1, 1 << 62))

    def renamed(part: Log, own: set[int]) -> tuple[Log, dict[int, int]]:
        names: dict[int, int] = {}
        out = []
        for token, size in part:
            if size is not None and token in own:
                names[token] = next(fresh)
            out.append((names.get(token, token), size))
        return tuple(out), names

    first, names = renamed(forward, made)
    to_grads = {zero: names[grad] for zero, grad in zip(zeros, grads)}
    rest = prime[n:]
    if any(size is not None and token in to_grads for token, size in rest) or \
            sorted(token for token, size in rest if size is None and token in to_grads) != sorted(to_grads):
        return None
    stepped = tuple((to_grads.get(token, token), size) for token, size in rest)
    again: Log = ()
    if steps > 2:  # the steady step more than once: its own tensors renamed in each but the last
        own = made | {token for token, size in optimizer if size is not None}
        if any(size is None and token not in own for token, size in optimizer):
            return None
        for _ in range(steps - 2):
            again += renamed(forward + optimizer, own)[0]
    return log[:prime_at] + first + stepped + again + forward + optimizer + log[rest_at:]

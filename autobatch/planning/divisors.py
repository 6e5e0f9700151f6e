"""Divisors of a batch-sized integer, fast for any value below :data:`MAX_INT` (2**64), and which
micro batches the solver's constraints allow among them (:class:`AllowedMicros`).

Solving micro × accumulation × world = target lists the divisors of the samples per GPU.
Trial division up to √n never ends for a target like 10**19 + 1; here ``n`` is factored with
deterministic Miller–Rabin and Pollard's rho (Brent's variant), which takes milliseconds below
2**64. Larger values are refused by the callers with that bound: no training batch is near it.
"""

from __future__ import annotations

import math
import random

__all__ = ["MAX_INT", "AllowedMicros", "divisors", "factorize", "is_prime", "fuller_targets"]

MAX_INT = 2**64
# Deterministic Miller–Rabin witnesses for every n < 3.3 × 10**24 (covers MAX_INT).
_WITNESSES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)
# Up to this many allowed micro batches are tried one by one; beyond, the divisors are listed.
_LISTED = 4096
_SMALL_PRIMES = tuple(p for p in range(2, 1000) if all(p % q for q in range(2, math.isqrt(p) + 1)))


def is_prime(n: int) -> bool:
    """Deterministic primality for ``n`` < 3.3 × 10**24."""
    if n < 2:
        return False
    for p in _WITNESSES:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d //= 2
        s += 1
    for a in _WITNESSES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def _rho(n: int, rng: random.Random) -> int:
    """A non-trivial factor of the composite odd ``n`` (Brent's cycle finding, batched gcds)."""
    while True:
        y, c, m = rng.randrange(1, n), rng.randrange(1, n), 128
        g = r = q = 1
        x = ys = y
        while g == 1:
            x = y
            for _ in range(r):
                y = (y * y + c) % n
            k = 0
            while k < r and g == 1:
                ys = y
                for _ in range(min(m, r - k)):
                    y = (y * y + c) % n
                    q = q * abs(x - y) % n
                g = math.gcd(q, n)
                k += m
            r *= 2
        if g == n:
            g = 1
            while g == 1:
                ys = (ys * ys + c) % n
                g = math.gcd(abs(x - ys), n)
        if g != n:
            return g


def factorize(n: int) -> dict[int, int]:
    """Prime factorisation ``{prime: exponent}`` of ``1 ≤ n < MAX_INT``."""
    if not 1 <= n < MAX_INT:
        raise ValueError(f"n must be in [1, 2**64), got {n}")
    factors: dict[int, int] = {}
    for p in _SMALL_PRIMES:
        while n % p == 0:
            factors[p] = factors.get(p, 0) + 1
            n //= p
    stack = [n] if n > 1 else []
    rng = random.Random(0)  # a private generator: the global random state is never touched
    while stack:
        m = stack.pop()
        if is_prime(m):
            factors[m] = factors.get(m, 0) + 1
            continue
        d = _rho(m, rng)
        stack += [d, m // d]
    return dict(sorted(factors.items()))


def divisors(n: int) -> list[int]:
    """Every divisor of ``1 ≤ n < MAX_INT``, ascending.

    Example:
        >>> divisors(12)
        [1, 2, 3, 4, 6, 12]
    """
    result = [1]
    for p, e in factorize(n).items():
        result = [d * p**k for d in result for k in range(e + 1)]
    return sorted(result)


class AllowedMicros:
    """Which micro batches the constraints allow: min ≤ m ≤ max and m a multiple of ``multiple_of``."""

    def __init__(self, min_micro: int, max_micro: int | None, multiple_of: int | None):
        self.min_micro = min_micro
        self.max_micro = max_micro
        self.multiple_of = multiple_of or 1

    def __call__(self, m: int) -> bool:
        return m >= self.min_micro and (self.max_micro is None or m <= self.max_micro) and m % self.multiple_of == 0

    @property
    def smallest(self) -> int:
        """The smallest allowed micro batch (the solver checks it is within ``max_micro``)."""
        return -(-self.min_micro // self.multiple_of) * self.multiple_of

    def _few(self) -> range | None:
        """Every allowed micro batch, when ``max_micro`` keeps them few enough to list."""
        if self.max_micro is None:
            return None
        count = max(0, (self.max_micro - self.smallest) // self.multiple_of + 1)  # len() overflows past 2**63
        return range(self.smallest, self.max_micro + 1, self.multiple_of) if count <= _LISTED else None

    def micros_dividing(self, per_rank: int) -> list[int]:
        few = self._few()
        if few is not None:
            return [m for m in few if per_rank % m == 0]
        return [m for m in divisors(per_rank) if self(m)]

    def divides_some(self, k: int) -> bool:
        """Whether some allowed micro batch divides ``k`` (without listing them when that is obvious)."""
        if k % self.multiple_of or k < self.smallest:
            return False  # every allowed micro is a multiple of multiple_of and at least the smallest
        if self.max_micro is None or k <= self.max_micro:
            return True  # k itself is allowed
        few = self._few()
        if few is not None:
            return any(k % m == 0 for m in few)
        return bool(self.micros_dividing(k))

    def describe(self) -> str:
        if self.max_micro == self.min_micro and self.multiple_of == 1:
            return f"= {self.min_micro}"
        parts = [f"≥ {self.min_micro}" if self.min_micro > 1 else "", f"≤ {self.max_micro}" if self.max_micro else ""]
        if self.multiple_of > 1:
            parts.append(f"a multiple of {self.multiple_of}")
        return ", ".join(p for p in parts if p) or "any size"


def fuller_targets(per_rank: int, world: int, micro: int, allowed: AllowedMicros) -> str:
    """A note for a plan that accumulates a micro batch under half the largest allowed (a prime target: 997 = 1 × 997):
    the nearest global batches on ``world`` ranks, below and above, whose samples per GPU some micro batch over
    that half divides, each with its plan; empty when the plan is not so or the allowed micro batches are too
    many to list.

    Example:
        >>> fuller_targets(997, 1, 1, AllowedMicros(1, 64, None))
        '; 997 per GPU leaves micro 1 of the 64 allowed: 992 (62 × 16) or 999 (37 × 27) would fill more of it'
    """
    few = allowed._few()
    if micro == per_rank or few is None or not few or 2 * micro > few[-1]:
        return ""
    full = [m for m in few if 2 * m > few[-1]]
    below = max((per_rank // m * m for m in full if per_rank // m), default=0)
    above = min(-(-per_rank // m) * m for m in full)

    def plan(k: int) -> str:
        m = max(m for m in full if k % m == 0)
        return f"{k * world} ({m} × {k // m}{f' × {world}' if world > 1 else ''})"

    options = " or ".join(plan(k) for k in (below, above) if k)
    return f"; {per_rank} per GPU leaves micro {micro} of the {few[-1]} allowed: {options} would fill more of it"

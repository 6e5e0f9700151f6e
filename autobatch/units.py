"""Byte sizes as people write them: ``2GiB``, ``512MB``, ``1.5G``."""

from __future__ import annotations

import re

from .errors import AutobatchError

__all__ = ["parse_bytes", "format_bytes"]

_UNITS = {
    "": 1, "b": 1,
    "k": 1024, "kb": 1000, "kib": 1024,
    "m": 1024**2, "mb": 1000**2, "mib": 1024**2,
    "g": 1024**3, "gb": 1000**3, "gib": 1024**3,
    "t": 1024**4, "tb": 1000**4, "tib": 1024**4,
}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str | int | float, *, zero: bool = False) -> int:
    """Parse a memory size; bare ``K``/``M``/``G`` are binary (as GPU vendors print them). ``zero``: 0 is
    a size too (an overhead that may be none), else it must be positive.

    >>> parse_bytes("2GiB"), parse_bytes("1.5G"), parse_bytes("500MB"), parse_bytes("0B", zero=True)
    (2147483648, 1610612736, 500000000, 0)
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        if isinstance(text, float) and not text.is_integer():  # 1.5 was taken as 1 byte
            raise AutobatchError(f"memory as a number is whole bytes, but got {text!r}; write a size with its unit "
                                 "as text, e.g. '1.5GiB'")
        value, unit = float(text), ""
    else:
        match = _PATTERN.match(str(text))
        if match is None or match.group(2).lower() not in _UNITS:
            raise AutobatchError(
                f"memory must be a number with an optional unit (B, KiB, MiB, GiB, TiB, KB, MB, GB, TB), "
                f"but got {text!r}; write e.g. 2GiB or 512MiB"
            )
        value, unit = float(match.group(1)), match.group(2).lower()
    result = int(value * _UNITS[unit])
    if result < 0 or (result == 0 and not zero):
        raise AutobatchError(f"memory must be {'0 or more' if zero else 'positive'}, but got {text!r}; write e.g. 2GiB")
    return result


def format_bytes(n: int | float | None) -> str:
    """Binary units: two decimals below 100 of a unit, whole numbers from 100 up to 1023.

    ``format_bytes(3 * 2**30) == '3.00 GiB'``, ``format_bytes(1020 * 2**10) == '1020 KiB'``
    (never ``1.02e+03 KiB``, nor ``1024 KiB`` for a byte short of ``1.00 MiB``).
    """
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1023.5 or unit == "TiB":  # 1023.5 and up would print as 1024: one of the next unit
            return f"{n:.0f} {unit}" if unit == "B" or abs(n) >= 100 else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")

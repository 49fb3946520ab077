"""Human-readable sizes: ``parse_size("64GiB")`` and ``format_size(n)``."""

from __future__ import annotations

import re

_UNITS = {
    "": 1,
    "B": 1,
    "K": 1000,
    "KB": 1000,
    "M": 1000**2,
    "MB": 1000**2,
    "G": 1000**3,
    "GB": 1000**3,
    "T": 1000**4,
    "TB": 1000**4,
    "KIB": 1024,
    "MIB": 1024**2,
    "GIB": 1024**3,
    "TIB": 1024**4,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")


def parse_size(text: str) -> int:
    """Bytes in ``text`` such as ``"1GiB"``, ``"500MB"``, ``"4096"`` or ``"1.5 GiB"``.

    Decimal units (KB, MB, GB, TB) are powers of 1000, binary units (KiB ... TiB) powers of
    1024. Raises ValueError naming the accepted forms on anything else.
    """
    match = _SIZE.match(text)
    unit = match.group(2).upper() if match else ""
    if match is None or unit not in _UNITS:
        raise ValueError(
            f"bad size {text!r}: use a number with an optional unit, e.g. 512MiB, 2GB, 1TiB"
        )
    return int(float(match.group(1)) * _UNITS[unit])


def format_size(num_bytes: float) -> str:
    """``num_bytes`` in the largest binary unit that keeps the number >= 1, e.g. ``"1.5 GiB"``."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.3g} {unit}"
        value /= 1024
    return f"{value:.3g} TiB"

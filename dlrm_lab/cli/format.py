"""Human-readable numbers and consoles for terminal output (Parquet keeps the raw values)."""

from __future__ import annotations

import sys

from rich.console import Console


def human_count(n: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.0f}" if float(n).is_integer() else f"{n:.3g}"


def human_bytes(n: float) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def console(stderr: bool = False) -> Console:
    """A rich console; when piped (not a terminal) it is 120 columns, not rich's 80,
    so that tables stay readable in logs."""
    stream = sys.stderr if stderr else sys.stdout
    return Console(stderr=stderr, width=None if stream.isatty() else 120)

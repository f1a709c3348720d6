"""What every plot shares: limits, saving, number handling."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.figure import Figure

MAX_CURVES = 12
MAX_BARS = 40
MAX_LABELS = 20  # roofline points annotated with their name
MAX_PANELS = 12  # sweep metrics drawn
DPI = 100


def as_text(s: Any) -> str:
    return str(s).replace("$", r"\$")  # a pair of $ would start matplotlib's mathtext


def save_figure(fig: Figure, out: Path) -> Path:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=DPI)
    return out


def as_number(v: Any) -> float | None:
    """A finite float, or None (null, NaN, infinite)."""
    if v is None:
        return None
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if np.isfinite(f) else None

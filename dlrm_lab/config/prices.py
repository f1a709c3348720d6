"""What a price given to the lab must be: checked where options are read (`config`), used where costs are worked
out (`metrics.cost`)."""

from __future__ import annotations

import math
import re
from typing import Any

from dlrm_lab.errors import UserError


def check_price(value: Any, option: str = "PER_HOUR") -> float:
    """A price per hour: a finite number > 0 (a free machine would make every cost 0, silently)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise UserError(f"{option} {value!r}: must be a finite number > 0")
    return float(value)


def check_currency(value: Any, option: str = "--currency") -> str:
    """A 3-letter currency code (ISO 4217), upper-cased."""
    if not isinstance(value, str) or not re.fullmatch(r"[A-Za-z]{3}", value):
        raise UserError(f"{option} {value!r}: must be a 3-letter currency code such as USD or EUR")
    return value.upper()


def check_energy_price(value: Any, option: str = "--energy-per-kwh") -> float:
    """A price per kWh: a finite number >= 0 (0: energy is free here, as opposed to not priced)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise UserError(f"{option} {value!r}: must be a finite number >= 0")
    return float(value)

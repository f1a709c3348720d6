"""What a price given to the lab must be: checked where options are read (`config`), used where costs are worked
out (`metrics.cost`)."""

from __future__ import annotations

import math
import re
from typing import Any

from dlrm_lab.errors import UserError

# The dearest machine-hour taken: far above any cloud's (an 8-GPU node rents for ~100 USD an hour), and low enough
# that every cost derived from it (per 1M inferences at one query an hour) stays a finite float
MAX_PRICE_PER_HOUR = 1e9
MAX_ENERGY_PRICE = 1e9  # per kWh


def in_range(value: Any, low: float, high: float, low_open: bool = False) -> bool:
    """`value` a real number (not a bool) in [low, high], or (low, high] with `low_open`: what every price is."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return False
    return (low < value if low_open else low <= value) and value <= high


def check_price(value: Any, option: str = "PER_HOUR") -> float:
    """A price per hour: a number in (0, MAX_PRICE_PER_HOUR] (a free machine would make every cost 0, silently; a
    price near the float limit makes them infinite)."""
    if not in_range(value, 0, MAX_PRICE_PER_HOUR, low_open=True):
        raise UserError(f"{option} {value!r}: must be a number in (0, {MAX_PRICE_PER_HOUR:g}]")
    return float(value)


def check_currency(value: Any, option: str = "--currency") -> str:
    """A 3-letter currency code (ISO 4217), upper-cased."""
    if not isinstance(value, str) or not re.fullmatch(r"[A-Za-z]{3}", value):
        raise UserError(f"{option} {value!r}: must be a 3-letter currency code such as USD or EUR")
    return value.upper()


def check_energy_price(value: Any, option: str = "--energy-per-kwh") -> float:
    """A price per kWh: a number in [0, MAX_ENERGY_PRICE] (0: energy is free here, as opposed to not priced; a price
    near the float limit makes every energy cost infinite)."""
    if not in_range(value, 0, MAX_ENERGY_PRICE):
        raise UserError(f"{option} {value!r}: must be a number in [0, {MAX_ENERGY_PRICE:g}]")
    return float(value)

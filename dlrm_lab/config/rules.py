"""Value rules shared by the model specs and the preset parser, and the one wording of their errors."""

from __future__ import annotations

import math
from typing import Any

from dlrm_lab.errors import UserError


def bad(where: str, field: str, value: Any, rule: str) -> UserError:
    """The error of a field breaking a rule: `where: field = value: rule`."""
    return UserError(f"{where}: {field} = {value!r}: {rule}")


def is_name(value: Any) -> bool:
    return isinstance(value, str) and bool(value)


def is_positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def is_number(value: Any) -> bool:
    """A finite int or float (not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def int_list_problem(value: Any) -> str | None:
    """What is wrong with a list of layer sizes or rows, or None."""
    if not isinstance(value, (list, tuple)) or not value:
        return "must be a non-empty list of integers >= 1"
    for v in value:
        if not is_positive_int(v):
            return f"entry {v!r} must be an integer >= 1"
    return None

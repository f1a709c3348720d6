"""Value rules shared by the model specs and the preset parser, and the one wording of their errors."""

from __future__ import annotations

import math
from collections.abc import Callable
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


def row_scaler(where: str, table_scale: Any, max_rows: Any) -> tuple[float, Callable[[int], int]]:
    """`--table-scale` and `--max-rows` checked, and what they do to a table of `rows` rows: multiplied
    (rounded up, at least 1 row), then capped. Returns (the scale, rows -> scaled rows)."""
    scale = 1.0 if table_scale is None else table_scale
    if not (is_number(scale) and scale > 0):
        raise bad(where, "table_scale", table_scale, "must be a number > 0")
    if max_rows is not None and not is_positive_int(max_rows):
        raise bad(where, "max_rows", max_rows, "must be an integer >= 1")

    def scaled(rows: int) -> int:
        out = max(1, math.ceil(rows * scale))
        return out if max_rows is None else min(out, max_rows)

    return float(scale), scaled

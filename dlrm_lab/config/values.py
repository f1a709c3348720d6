"""What a dict holds where its keys are a file's or a command's, not a table's (a table's rows are
`metrics.columns.Row`s, checked against its columns):

- `JsonObject`: a JSON object as the lab writes or reads it (a manifest's section, a machine profile's entry, a
  plan, a TOML table): its values are JSON's (null, true/false, a number, a string, an array, an object);
- `OptionValues`: a command's option values by name, as the command line or a sweep's TOML gives them.

Named here, low, because every room reads or writes them; Python checks neither at run time (JSON's own encoder and
the options' declarations do), so these say what a value may be to the reader.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Union

# One level deep: the nested values are JSON's too, but a recursive alias would make typing.get_type_hints of
# every config holding one resolve a forward reference in that config's module.
JsonValue = Union[None, bool, int, float, str, list[Any], dict[str, Any]]
JsonObject = dict[str, JsonValue]
OptionValue = Union[None, bool, int, float, str, list[Any], tuple[Any, ...]]
OptionValues = dict[str, OptionValue]
Log = Callable[[str], None]  # where a lab's one-line messages go (a console, a list in a test)


def section(record: Any, *keys: str) -> JsonObject:
    """`record[key][...]` where each step is an object, else {}: a manifest or profile edited by hand, or damaged
    (a `hardware` that is a string), reads as one that says nothing there, never as a traceback in a report."""
    for key in keys:
        record = record.get(key) if isinstance(record, dict) else None
    return record if isinstance(record, dict) else {}


def env_seconds(name: str, default: float, *, minimum: float = 0.0, above: bool = False,
                maximum: float = 7 * 24 * 3600) -> float:  # fmt: skip
    """Seconds from the environment variable `name` (`default` where unset or empty): a finite number in
    [minimum, maximum] (`above`: > minimum). Anything else is one line naming the variable, never a traceback."""
    import math
    import os

    from dlrm_lab.errors import UserError

    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    low_ok = value > minimum if above else value >= minimum
    if not (math.isfinite(value) and low_ok and value <= maximum):
        bound = f"> {minimum:g}" if above else f">= {minimum:g}"
        raise UserError(
            f"{name}={raw!r}: must be a number of seconds {bound} (at most {maximum:g}; unset: {default:g})"
        )
    return value

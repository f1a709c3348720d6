"""The column registry's mechanism: what a column is (`Column`), how a table declares its columns in file order
(`col`, `column_group`, `register_table`), and how readers ask for them (`table_columns`, `schema_of`, `column`,
`fmt`). The declarations themselves are data, in the modules beside this one; import the registry as
`dlrm_lab.metrics.columns`, which holds every table once imported.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

HIGHER, LOWER = "higher", "lower"

# The phases of a training step, in order: forward phases, then backward and the optimizer.
PHASES = (
    "data_wait",
    "input_dist",
    "embedding_lookup",
    "embedding_all_to_all",
    "dense_forward",
    "backward",
    "embedding_all_to_all_backward",
    "optimizer",
)
PHASE_LABELS = {
    "data_wait": "data wait",
    "input_dist": "input distribution",
    "embedding_lookup": "embedding lookup",
    "embedding_all_to_all": "pooled-embedding all-to-all",
    "dense_forward": "dense forward",
    "backward": "backward (table update, all-reduce)",
    "embedding_all_to_all_backward": "pooled-embedding all-to-all, backward",
    "optimizer": "dense optimizer",
}
# The stages of a batch on its instance (`infer.instance` times them).
BATCH_STAGES = ("assembly", "lookup", "dense", "interaction")
# The stages of a query's trip over a network that a server in this process does not have (`serve.remote`).
TRANSFER_STAGES = ("serialise", "network", "server_parse", "server_respond", "deserialise")
# A served query's latency, cut into parts that add up to it (`infer.records.latency_parts`,
# docs/metrics.md): the load generator's issue lag; queueing and batching; the batch that finished it
# at the roofline, its warm time beyond the roof, and its in-service slowdown over that warm time; the
# result's trip back; and the network where a transport carries the query (null in process).
LATENCY_PARTS = ("issue", "queue", "roof", "beyond_roof", "slowdown", "completion", "transport")


@dataclass(frozen=True)
class Column:
    """One column: `label` in words, `unit` ("" for none), `fmt` a format spec, `better`
    HIGHER, LOWER or None (not a quantity to rank), `short` a narrow terminal heading, `type`
    its Arrow type (None for a name no table registers, as `column` makes up).
    A flag's `fmt` is its two words, "true|false"."""

    name: str
    label: str
    unit: str = ""
    fmt: str = ",.4g"
    better: str | None = None
    short: str = ""
    type: pa.DataType | None = None

    @property
    def heading(self) -> str:
        return f"{self.label} ({self.unit})" if self.unit else self.label

    @property
    def narrow(self) -> str:
        return self.short or self.label

    @property
    def tables(self) -> tuple[str, ...]:
        """The tables that write this column."""
        return tuple(t for t in _LAYOUTS if self in table_columns(t))

    def format(self, value: Any) -> str:
        """The value as the registry writes it; "-" for missing."""
        if value is None or (isinstance(value, float) and value != value):  # null or NaN
            return "-"
        if isinstance(value, bool):
            yes, _, no = (self.fmt if "|" in self.fmt else "yes|no").partition("|")
            return yes if value else no
        if not isinstance(value, (int, float)):
            return str(value)
        try:
            return format(value, self.fmt)
        except ValueError:  # an int format given a float, or the reverse
            return format(value, ",.4g")


# Units read off a column's name by the conventions of docs/metrics.md (first match wins): the unit of
# a registered column given none, and of a name the registry does not know (sweep aggregates).
_SUFFIX_UNITS = (
    ("samples_per_s_per_w", "samples/s/W"),
    ("flops_per_s_per_w", "FLOP/s/W"),
    ("samples_per_s", "samples/s"),
    ("queries_per_s", "queries/s"),
    ("flops_per_s", "FLOP/s"),
    ("bytes_per_s", "B/s"),
    ("_ms", "ms"),
    ("_j", "J"),
    ("_w", "W"),
    ("_mb", "MB"),
    ("_s", "s"),
    ("_share", "fraction"),
    ("fraction", "fraction"),
    ("efficiency", "fraction"),
)


def _unit_by_name(name: str) -> str:
    return next((u for suffix, u in _SUFFIX_UNITS if name.endswith(suffix)), "")


# ----------------------------------------------------------------------------- tables
# Every table a run writes, its columns in file order. A column is defined (`col`: name, Arrow type,
# what a reader shows) where it first appears, and named by the tables after; `schema_of` derives
# each Parquet schema from this, `run_id` aside (every writer puts it first).

STR, BOOL, I32, I64, F64 = pa.string(), pa.bool_(), pa.int32(), pa.int64(), pa.float64()

COLUMNS: dict[str, Column] = {}  # every column a table writes, by name
_LAYOUTS: dict[str, list[Column]] = {}  # every table's columns, in file order
_EXTENDS: dict[str, str] = {}  # a table that is another's columns followed by its own
LAYOUT_CHANGES = [0]  # how many times a table's layout changed (`rows` caches each table's names until the next)


@dataclass(frozen=True)
class LocalColumn:
    """A column of one table only, whose name a column of other tables also has (with another type)."""

    column: Column


def col(
    name: str,
    type: pa.DataType,
    label: str = "",
    unit: str | None = None,
    fmt: str = ",.4g",
    better: str | None = None,
    short: str = "",
) -> Column:
    """A column's one definition; the label defaults to its name, the unit to its name's (`_SUFFIX_UNITS`)."""
    return Column(name, label or name, _unit_by_name(name) if unit is None else unit, fmt, better, short, type)


define = col  # a column's one definition, for a model family's own columns (`register_columns`)


def _resolve(table: str, entries: Sequence[Column | str | LocalColumn], again: bool = False) -> list[Column]:
    """A table's entries as columns: a Column defines one (once; `again` lets the same definition be
    given twice), a name places one defined before."""
    out = []
    for e in entries:
        if isinstance(e, LocalColumn):
            out.append(e.column)
        elif isinstance(e, str):
            if e not in COLUMNS:
                raise ValueError(f"table {table!r}: column {e!r} is not defined")
            out.append(COLUMNS[e])
        elif e.name in COLUMNS and not (again and COLUMNS[e.name] == e):
            raise ValueError(f"table {table!r}: column {e.name!r} is defined twice; name it after its definition")
        else:
            out.append(COLUMNS.setdefault(e.name, e))
    return out


def column_group(*columns: Column) -> tuple[str, ...]:
    """Columns several tables write side by side: defined here, named in each table."""
    return tuple(c.name for c in _resolve("a group", columns))


def register_table(name: str, *entries: Column | str | LocalColumn, extends: str | None = None) -> None:
    _LAYOUTS[name] = _resolve(name, entries)
    LAYOUT_CHANGES[0] += 1
    if extends is not None:
        _EXTENDS[name] = extends


def table_columns(table: str) -> list[Column]:
    """The table's columns in file order."""
    if table not in _LAYOUTS:
        raise KeyError(f"no table {table!r} in the column registry: {', '.join(_LAYOUTS)}")
    base = table_columns(_EXTENDS[table]) if table in _EXTENDS else []
    return [*base, *_LAYOUTS[table]]


def schema_of(table: str) -> pa.Schema:
    """The table's Parquet schema (`run_id` aside: the writers put it first). Read it when the table is
    opened, not at import: a family's columns (`register_columns`) are in it from their registration on."""
    return pa.schema([pa.field(c.name, c.type) for c in table_columns(table)])


def names_of(table: str) -> tuple[str, ...]:
    return tuple(c.name for c in table_columns(table))


def register_columns(table: str, columns: Sequence[Column | str], *, after: str | None = None) -> None:
    """A model family's own columns in a shared table, placed after column `after` (at the end without it).

    A Column defines one (registering the same definition again changes nothing), a name places one
    the registry defines. Every registered family's columns are in the table, null in the rows of
    other families' models, so a table has the same columns whichever models a run served.
    """
    layout = _LAYOUTS[table] if table in _LAYOUTS else table_columns(table)  # KeyError names the tables
    new = [c for c in _resolve(table, columns, again=True) if c not in layout]
    at = len(layout)
    if after is not None:
        names = [c.name for c in layout]
        if after not in names:
            raise ValueError(f"table {table!r} has no column {after!r} to place {[c.name for c in new]} after")
        at = names.index(after) + 1
    layout[at:at] = new
    LAYOUT_CHANGES[0] += 1


def column(name: str) -> Column:
    """The registered column, or one made up from its name (unit by suffix, no direction, no type)."""
    found = COLUMNS.get(name)
    if found is not None:
        return found
    return Column(name, name, _unit_by_name(name))


def unit_of(name: str) -> str:
    return column(name).unit


def fmt(name: str, value: Any) -> str:
    return column(name).format(value)

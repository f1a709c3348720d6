"""Rows typed by their table: a row that crosses rooms (a query, a step, a run's or a load point's summary) is a
`Row` of one registered table, a dict whose every key is checked against that table's columns where it is written,
so a misspelt or unregistered key fails at the line that wrote it, not silently at the Parquet writer (which keeps
only the schema's columns) or never.

A dict, not a dataclass: a family registers its own columns in a shared table at import (`register_columns`), so
a table's columns are known only at run time, and every reader (Arrow's `from_pylist`, the printers, JSON) takes a
mapping. The check at construction is one C-level subset test; a write after it, one set lookup.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

from dlrm_lab.metrics.columns.registry import LAYOUT_CHANGES, names_of

_NAMES: dict[str, tuple[int, frozenset[str]]] = {}  # table -> (the registry's change count, its names)
_LEAD = frozenset({"run_id"})  # every writer puts the run's id first (`metrics.tables`)


def columns_of(table: str) -> frozenset[str]:
    """The names a row of `table` may have: its registered columns, and `run_id`."""
    cached = _NAMES.get(table)
    if cached is None or cached[0] != LAYOUT_CHANGES[0]:
        cached = _NAMES[table] = (LAYOUT_CHANGES[0], frozenset(names_of(table)) | _LEAD)
    return cached[1]


class Row(dict[str, Any]):
    """A row of the table its subclass names (`class QueryRow(Row, table="queries")`); columns not set are null
    when written. A key the table does not have is a KeyError naming the table, the key and the row's type."""

    __slots__ = ()
    table: ClassVar[str]

    def __init_subclass__(cls, table: str = "", **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if table:
            names_of(table)  # a table the registry does not have fails at the class statement
            cls.table = table

    def __init__(self, values: Mapping[str, Any] | Iterable[tuple[str, Any]] = (), /, **columns: Any) -> None:
        super().__init__(values, **columns)
        if not columns_of(self.table).issuperset(self):
            self._refuse(self)

    def _refuse(self, keys: Iterable[str]) -> None:
        unknown = sorted(set(keys) - columns_of(self.table))
        raise KeyError(
            f"{type(self).__name__}: table {self.table!r} has no column {unknown[0]!r}"
            + (f" (nor {', '.join(map(repr, unknown[1:]))})" if len(unknown) > 1 else "")
        )

    def __setitem__(self, key: str, value: Any) -> None:
        if key not in columns_of(self.table):
            self._refuse([key])
        super().__setitem__(key, value)

    # one signature for every form dict.update takes (MutableMapping spells them as five overloads)
    def update(  # type: ignore[override]
        self, values: Mapping[str, Any] | Iterable[tuple[str, Any]] = (), /, **columns: Any
    ) -> None:
        more = dict(values, **columns)
        if not columns_of(self.table).issuperset(more):
            self._refuse(more)
        super().update(more)

    def setdefault(self, key: str, default: Any = None) -> Any:
        if key not in self:
            self[key] = default
        return self[key]

    def __ior__(self, values: Any) -> Row:  # type: ignore[override,misc]
        self.update(values)
        return self

    def copy(self) -> Row:
        return type(self)(self)

    def __reduce__(self) -> tuple[Any, ...]:  # pickled between processes as its type and its items
        return type(self), (dict(self),)


class QueryRow(Row, table="queries"):
    """A served query: `infer.sut.query_row`."""


class StepRow(Row, table="steps"):
    """A training step on one rank: `train.records.step_row`."""


class EvalRow(Row, table="eval"):
    """A held-out evaluation."""


class TrainSummaryRow(Row, table="train summary"):
    """A training run's summary: `train.records`."""


class InferSummaryRow(Row, table="infer summary"):
    """A model at one load point of `infer run`: `infer.records.summarize`."""


class SearchSummaryRow(Row, table="search summary"):
    """A probe's repeat of `infer search`."""


class FrontierRow(Row, table="frontier"):
    """A serving configuration of `infer search`'s frontier."""


class ScaleRow(Row, table="scale summary"):
    """A rank count of `scale`."""


class ScaleGapRow(Row, table="scale gap"):
    """An item of the per-rank step beyond one rank's at a rank count of `scale`: `scaling`."""


class ProfileRow(Row, table="profile"):
    """An operator of `train --profile-steps` on one rank: `train.profile`."""


class PointRow(Row, table="sweep points"):
    """A sweep's point and repeat."""

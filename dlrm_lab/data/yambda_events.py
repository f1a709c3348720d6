"""Yambda's published files (Yandex Music, 2025: Hugging Face `yandex/yambda`), read and checked: the events
as the conversion (`data/yambda.py`) streams them, batch by batch, and the item mapping as each item's category.
Bad input is refused in one line naming the file, row group, row and column.

Input: the flat `multi_event.parquet` of any size (50m, 500m, 5b): one row per event, sorted by uid then
timestamp, columns uid, timestamp, item_id, is_organic, event_type (listen, like, dislike, unlike,
undislike) and played_ratio_pct (null for all but listens); and one item mapping,
`artist_item_mapping.parquet` (item_id, artist_id) or `album_item_mapping.parquet` (item_id, album_id),
whose id becomes each item's category (an item in several: the smallest id). Timestamps are seconds on
5-second boundaries (the DLRMv4 reference's preprocessing: "1 unit = 1 second"); `timestamp_unit_s`
scales another unit.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from dlrm_lab.errors import UserError

EVENT_TYPES = ("listen", "like", "dislike", "unlike", "undislike")  # codes 0..4, the reference's encoding
LISTEN, LIKE, DISLIKE, UNLIKE, UNDISLIKE = range(len(EVENT_TYPES))
EVENT_COLUMNS = ("uid", "timestamp", "item_id", "is_organic", "event_type", "played_ratio_pct")
CATEGORY_COLUMNS = {"artist_id": "artist", "album_id": "album"}
# Item and category ids index their tables' rows (and the category lookup, 8 bytes per item id): an id this large
# is a table of 2^27 rows, 14x Yambda's catalogue, and 1 GiB of lookup
MAX_ITEM_ID = 1 << 27


def open_events_file(path: Path, what: str) -> pq.ParquetFile:
    if not path.is_file():
        raise UserError(f"{path}: no such file ({what})")
    try:
        return pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as exc:
        raise UserError(f"{path}: not a readable Parquet file ({str(exc).splitlines()[0]})") from None


def _is_text(t: pa.DataType) -> bool:
    if pa.types.is_dictionary(t):
        t = t.value_type
    return pa.types.is_string(t) or pa.types.is_large_string(t)


def check_columns(path: Path, schema: pa.Schema, columns: tuple[str, ...], what: str) -> None:
    missing = [c for c in columns if c not in schema.names]
    if missing:
        raise UserError(f"{path}: column {', '.join(missing)} missing ({what} needs {', '.join(columns)})")
    for c in columns:
        t = schema.field(c).type
        ok = _is_text(t) if c == "event_type" else pa.types.is_integer(t)
        if not ok:
            want = "a string (listen, like, dislike, unlike, undislike)" if c == "event_type" else "an integer"
            raise UserError(f"{path}: column {c} has type {t}; expected {want} (Yambda's published schema)")


def row_group_batches(
    pf: pq.ParquetFile, rg: int, rows: int, columns: list[str], path: Path
) -> Iterator[pa.RecordBatch]:
    try:
        yield from pf.iter_batches(batch_size=rows, row_groups=[rg], columns=columns)
    except (pa.ArrowException, OSError) as exc:
        raise UserError(f"{path}: row group {rg} unreadable ({str(exc).splitlines()[0]})") from None


def _no_nulls(arr: pa.Array, where: str, column: str) -> None:
    if arr.null_count:
        row = int(np.argmax(arr.is_null().to_numpy(zero_copy_only=False)))
        raise UserError(f"{where}, column {column}: null at row {row}")


@dataclass(frozen=True)
class Categories:
    """A Yambda item mapping: each item id's category (-1: none), their kind and the category table's rows."""

    of_item: np.ndarray
    kind: str  # "artist" or "album"
    rows: int  # the largest category id in the mapping, plus one


def load_categories(path: str | Path, batch_rows: int = 1 << 20) -> Categories:
    """A Yambda item mapping, streamed by batches. An item in several artists or albums takes the smallest id."""
    path = Path(path)
    pf = open_events_file(path, "an item mapping")
    names = pf.schema_arrow.names
    found = [c for c in CATEGORY_COLUMNS if c in names]
    if len(found) != 1:
        raise UserError(f"{path}: column artist_id or album_id missing (an item mapping: item_id and one of them)")
    column = found[0]
    check_columns(path, pf.schema_arrow, ("item_id", column), "an item mapping")
    lookup: np.ndarray = np.full(0, np.iinfo(np.int64).max, dtype=np.int64)
    rows = 0
    for rg in range(pf.num_row_groups):
        row0 = 0
        for batch in row_group_batches(pf, rg, batch_rows, ["item_id", column], path):
            where = f"{path}: row group {rg}"
            items, cats = batch.column("item_id"), batch.column(column)
            _no_nulls(items, where, "item_id")
            _no_nulls(cats, where, column)
            items, cats = items.to_numpy().astype(np.int64), cats.to_numpy().astype(np.int64)
            for name, v in (("item_id", items), (column, cats)):
                if v.size and v.min() < 0:
                    row = int(np.argmax(v < 0))
                    raise UserError(f"{where}, column {name}: {int(v[row])} at row {row0 + row} is negative")
                if v.size and v.max() >= MAX_ITEM_ID:
                    row = int(np.argmax(v >= MAX_ITEM_ID))
                    raise UserError(
                        f"{where}, column {name}: {int(v[row])} at row {row0 + row} is beyond the "
                        f"largest id a table row can take here ({MAX_ITEM_ID - 1:,}; Yambda's are below "
                        "10M): renumber the ids densely"
                    )
            if items.size and items.max() >= lookup.size:
                grown: np.ndarray = np.full(
                    max(2 * lookup.size, int(items.max()) + 1), np.iinfo(np.int64).max, dtype=np.int64
                )
                grown[: lookup.size] = lookup
                lookup = grown
            np.minimum.at(lookup, items, cats)
            rows = max(rows, int(cats.max()) + 1 if cats.size else 0)
            row0 += batch.num_rows
    if not lookup.size:
        raise UserError(f"{path}: no rows (an empty item mapping)")
    mapped = lookup != np.iinfo(np.int64).max
    lookup = np.where(mapped, lookup, -1)[: int(np.flatnonzero(mapped)[-1]) + 1]
    return Categories(lookup, CATEGORY_COLUMNS[column], rows)


@dataclass
class Events:
    """One batch of events as numpy arrays (int64 but `code`, `organic`, `played`)."""

    uid: np.ndarray
    ts: np.ndarray
    item: np.ndarray
    cat: np.ndarray
    code: np.ndarray  # int8, index in EVENT_TYPES
    organic: np.ndarray  # bool
    played: np.ndarray  # int64, -1 where null

    def take(self, sel: Any) -> Events:
        return Events(*(getattr(self, f.name)[sel] for f in fields(self)))


def decode_events(batch: pa.RecordBatch, where: str, row0: int, lookup: np.ndarray) -> Events:
    """Decode and check one batch: nulls, event types, played_ratio_pct of listens, items with a category."""
    for c in ("uid", "timestamp", "item_id", "is_organic", "event_type"):
        _no_nulls(batch.column(c), where, c)
    kinds = batch.column("event_type")
    if pa.types.is_dictionary(kinds.type):
        kinds = kinds.dictionary_decode()
    code = pc.index_in(kinds, value_set=pa.array(EVENT_TYPES))
    if code.null_count:
        row = int(np.argmax(code.is_null().to_numpy(zero_copy_only=False)))
        raise UserError(
            f"{where}, column event_type: {kinds[row].as_py()!r} at row {row0 + row}; allowed: {', '.join(EVENT_TYPES)}"
        )
    code = code.to_numpy().astype(np.int8)
    ratio = batch.column("played_ratio_pct")
    played = pc.fill_null(ratio, 0).to_numpy().astype(np.int64)
    played[ratio.is_null().to_numpy(zero_copy_only=False)] = -1
    bad = (code == LISTEN) & (played < 0)
    if bad.any():
        raise UserError(f"{where}, column played_ratio_pct: null for the listen at row {row0 + int(np.argmax(bad))}")
    item = batch.column("item_id").to_numpy().astype(np.int64)
    cat = np.full(item.size, -1, dtype=np.int64)
    known = (item >= 0) & (item < lookup.size)
    cat[known] = lookup[item[known]]
    uid, ts = (batch.column(c).to_numpy().astype(np.int64) for c in ("uid", "timestamp"))
    return Events(uid, ts, item, cat, code, batch.column("is_organic").to_numpy().astype(bool), played)


def check_order(ev: Events, last: tuple[int, int] | None, where: str, row0: int) -> None:
    """The flat files are sorted by uid, then timestamp: refuse a uid or a user's timestamp that goes back."""
    uid, ts = ev.uid, ev.ts
    if last is not None:
        uid, ts = np.concatenate([[last[0]], uid]), np.concatenate([[last[1]], ts])
        row0 -= 1
    du, dt = np.diff(uid), np.diff(ts)
    back = np.flatnonzero(du < 0)
    if back.size:
        i = int(back[0])
        raise UserError(
            f"{where}, column uid: {int(uid[i + 1])} at row {row0 + i + 1} follows {int(uid[i])} "
            "(the flat files are sorted by uid, then timestamp)"
        )
    back = np.flatnonzero((du == 0) & (dt < 0))
    if back.size:
        i = int(back[0])
        raise UserError(
            f"{where}, column timestamp: user {int(uid[i])}'s timestamp goes back from {int(ts[i])} "
            f"to {int(ts[i + 1])} at row {row0 + i + 1} (the flat files are sorted by uid, then "
            "timestamp)"
        )

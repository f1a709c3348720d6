"""Parquet tables of a run that survive crashes.

A table is buffered in memory and flushed every `flush_rows` rows or `flush_seconds`
as a complete Parquet part file under `<run>/_parts/<table>/`. A part file is readable
on its own the moment it is renamed into place, so a crash (even SIGKILL) loses at
most the unflushed buffer (and a load point's query rows, written once its load ended unless
DLRM_LAB_FLUSH_SECONDS is set: `infer.load_point`). `close()` (or `consolidate_run` on a crashed run) merges
the parts into `<run>/<table>.parquet` atomically and removes them.

pyarrow's ParquetWriter is not used for the live file because a Parquet file without
its footer (what a killed writer leaves) cannot be read at all.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from dlrm_lab.config.values import env_seconds
from dlrm_lab.errors import DiskFull, is_disk_full

PARTS_DIR = "_parts"
Derived = dict[str, Callable[[pa.Table], Any]]  # column -> its values from the merged table (`derive_on_close`)


@contextlib.contextmanager
def atomic_file(path: Path) -> Iterator[Path]:
    """A temporary name to write `path` under, renamed to `path` when the block ends: readers
    never see half a file. On an error the partial temporary file is removed (freeing what
    it held), and a full disk raises `DiskFull` naming the file."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        if is_disk_full(exc):
            raise DiskFull.at(path, exc) from None
        raise


@functools.cache
def _initialise_parquet_writer() -> None:
    """Write one empty table to memory, once per process (every TableWriter asks): pyarrow's
    first Parquet write sets itself up for ~350 ms (2-core EPYC), which would otherwise fall
    inside the first flush of a measurement (a serving process stalled a third of a second
    into its first load point)."""
    pq.write_table(pa.schema([pa.field("x", pa.int64())]).empty_table(), pa.BufferOutputStream())


def atomic_write_parquet(table: pa.Table, path: Path) -> None:
    with atomic_file(path) as tmp:
        pq.write_table(table, tmp)


FLUSH_SECONDS_ENV = "DLRM_LAB_FLUSH_SECONDS"
CONVERT_ROWS = 256  # rows converted to Arrow in one call (TableWriter.flush)


def _batch(rows: list[dict[str, Any]], schema: pa.Schema) -> pa.RecordBatch:
    """`rows` as Arrow, in `schema`; a client's text UTF-8 cannot hold (a lone surrogate) escaped, not fatal."""
    try:
        return pa.RecordBatch.from_pylist(rows, schema=schema)
    except UnicodeEncodeError:
        return pa.RecordBatch.from_pylist([_encodable(r) for r in rows], schema=schema)


def _encodable(row: dict[str, Any]) -> dict[str, Any]:
    """`row` with every string UTF-8 can hold: what it cannot (a lone surrogate) as a backslash escape."""
    return {
        k: v.encode("utf-8", "backslashreplace").decode("utf-8") if isinstance(v, str) else v for k, v in row.items()
    }


def flush_interval_s() -> float:
    """Seconds between a table's flushes: 5, or DLRM_LAB_FLUSH_SECONDS (a bad value is refused)."""
    return env_seconds(FLUSH_SECONDS_ENV, 5.0, above=True)


def flush_interval_asked() -> bool:
    """DLRM_LAB_FLUSH_SECONDS is set: rows a writer would otherwise hold for a while (a load point's, until its load
    ended: `infer.load_point`) are to be written at that interval, what a SIGKILL may lose bounded before all else."""
    return os.environ.get(FLUSH_SECONDS_ENV) is not None


class TableWriter:
    """Append-only writer of one Parquet table (`steps`, `queries`, ...) of a run.

    Every row gets `run_id`; columns follow `schema` (extra keys are refused, missing
    ones are null) so that the same table reads identically across runs.
    """

    def __init__(
        self,
        run_dir: Path,
        name: str,
        schema: pa.Schema,
        run_id: str,
        flush_rows: int = 10_000,
        flush_seconds: float | None = None,
        rank: int = 0,
    ) -> None:
        if "run_id" not in schema.names:
            schema = pa.schema([pa.field("run_id", pa.string()), *schema])
        self.run_dir = Path(run_dir)
        self.name = name
        self.schema = schema
        self._names = frozenset(schema.names)
        self.run_id = run_id
        self.flush_rows = flush_rows
        # the most a SIGKILL can lose, in seconds of rows: 5 unless DLRM_LAB_FLUSH_SECONDS says
        self.flush_seconds = flush_seconds if flush_seconds is not None else flush_interval_s()
        self._rows: list[dict[str, str | float | bool | None]] = []
        self._parts_dir = self.run_dir / PARTS_DIR / name
        self._parts_dir.mkdir(parents=True, exist_ok=True)
        self._prefix = f"part-r{rank:05d}-"  # ranks of one job write side by side
        self._next_part = len(list(self._parts_dir.glob(f"{self._prefix}*.parquet")))
        self._last_flush = time.monotonic()
        self._closed = False
        self._derived: Derived = {}
        self.rows_written = 0
        _initialise_parquet_writer()

    def append(self, row: dict[str, str | float | bool | None]) -> None:
        if not self._names.issuperset(row):  # once a row: the set of names is built once (a serving hot path)
            raise KeyError(f"table {self.name}: columns not in schema: {sorted(set(row) - self._names)}")
        self._rows.append({"run_id": self.run_id, **row})
        if len(self._rows) >= self.flush_rows or time.monotonic() - self._last_flush >= self.flush_seconds:
            self.flush()

    def extend(self, rows: list[dict[str, str | float | bool | None]]) -> None:
        for row in rows:
            self.append(row)

    def flush(self) -> None:
        self._last_flush = time.monotonic()
        if not self._rows:
            return
        # In slices: one call converts while holding the GIL (10,000 query rows: tens of ms in which a serving
        # process's completion thread could not run, measured as tail latency); between slices it can
        table = pa.Table.from_batches(
            [_batch(self._rows[i : i + CONVERT_ROWS], self.schema) for i in range(0, len(self._rows), CONVERT_ROWS)],
            schema=self.schema,
        )
        atomic_write_parquet(table, self._parts_dir / f"{self._prefix}{self._next_part:06d}.parquet")
        self._next_part += 1
        self.rows_written += len(self._rows)
        self._rows = []

    def derive_on_close(self, column: str, values: Callable[[pa.Table], Any]) -> None:
        """Compute `column` of the merged table from the table itself as it is merged: for a value known only once
        every row is written (training's warm-up flag), so that it is written with the table once, not patched in."""
        self._derived[column] = values

    def close(self, merge: bool = True) -> Path:
        """Flush, then merge the parts into `<run>/<name>.parquet` (also when empty).

        Ranks other than 0 close with `merge=False`; rank 0 merges every rank's parts
        once all have flushed.
        """
        if not self._closed:
            self.flush()
            if merge:
                _merge_parts(self.run_dir, self.name, self.schema, self._derived)
            self._closed = True
        return self.run_dir / f"{self.name}.parquet"


def _merge_parts(run_dir: Path, name: str, schema: pa.Schema | None = None, derived: Derived | None = None) -> None:
    parts_dir = run_dir / PARTS_DIR / name
    parts = sorted(parts_dir.glob("part-*.parquet")) if parts_dir.is_dir() else []
    final = run_dir / f"{name}.parquet"
    tables = [pq.read_table(p) for p in parts]
    if final.exists() and parts:  # resumed after a crash that had merged some parts
        tables.insert(0, pq.read_table(final))
    if tables:
        merged = pa.concat_tables(tables, promote_options="default")
    elif not final.exists() and schema is not None:
        merged = schema.empty_table()
    else:
        merged = None
    if merged is not None:
        for column, values in (derived or {}).items():
            merged = merged.set_column(merged.schema.get_field_index(column), column, values(merged))
        atomic_write_parquet(merged, final)
    shutil.rmtree(parts_dir, ignore_errors=True)
    try:
        (run_dir / PARTS_DIR).rmdir()
    except OSError:
        pass  # other tables still have parts, or it is already gone


def consolidate_run(run_dir: Path) -> list[str]:
    """Merge leftover part files of a crashed run into its tables; returns table names."""
    parts_root = Path(run_dir) / PARTS_DIR
    if not parts_root.is_dir():
        return []
    names = sorted(p.name for p in parts_root.iterdir() if p.is_dir())
    for name in names:
        _merge_parts(Path(run_dir), name)
    return names


def write_table(
    run_dir: Path, name: str, rows: list[dict[str, str | float | bool | None]], schema: pa.Schema, run_id: str
) -> Path:
    """Write a small table (a summary) in one atomic step."""
    if "run_id" not in schema.names:
        schema = pa.schema([pa.field("run_id", pa.string()), *schema])
    table = pa.Table.from_batches([_batch([{"run_id": run_id, **r} for r in rows], schema)], schema=schema)
    path = Path(run_dir) / f"{name}.parquet"
    atomic_write_parquet(table, path)
    return path

"""Yambda (Yandex Music, 2025: Hugging Face `yandex/yambda`, arXiv 2505.22238), the data MLPerf Training
v6.1's DLRMv4 trains on, converted into the lab's time-ordered requests (`data/request_files.py`).

The input files are read and checked in `data/yambda_events.py`; the rule that makes a user's events into
requests, and its options (`YambdaOptions`), is `data/yambda_requests.py`. Here: the conversion of a whole
file, in bounded memory and resumable.

Memory is bounded whatever the file's length or its number of users: the file is read by row groups in
batches of `batch_rows` events (`ParquetFile.iter_batches`, never a whole file); since it is sorted by
uid, one user's state is held at a time, at most 2 x max_history + max_candidates tokens (the history,
the open window's newest events and its candidates); written requests wait in spill buffers of at most
`buffer_tokens` tokens; the category lookup holds 8 bytes per catalogue item (75 MB for Yambda's 9.39M).
The merge holds one spill row group and one output row group (`row_group_requests` requests).

Resumable: pass 1 converts the file in chunks of whole row groups (`chunk_events` events; a chunk owns
the users whose first event it holds), each written to `.spill/` under a temporary name and renamed; pass
2 merges the spills window by window into `part-NNNNN.parquet` (each window's requests in uid order,
written under a temporary name and renamed). `_progress.json` records the inputs, options and what is
done after each step; a rerun into the same directory skips the done chunks and shards, and its files
are byte for byte those of an uninterrupted run. The sidecar `_dataset.json` comes last.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from dlrm_lab.config.values import JsonObject
from dlrm_lab.data.parquet import DATASET_FILE, FORMAT_VERSION
from dlrm_lab.data.request_files import KIND, SCHEMA
from dlrm_lab.data.yambda_events import (
    DISLIKE,
    EVENT_COLUMNS,
    Events,
    check_columns,
    check_order,
    decode_events,
    load_categories,
    open_events_file,
    row_group_batches,
)
from dlrm_lab.data.yambda_requests import YAMBDA_ACTION_BITS, YambdaOptions, YambdaRequest, YambdaUser
from dlrm_lab.errors import FieldError, UserError
from dlrm_lab.metrics.run import check_writable
from dlrm_lab.resources import read_bounded

PROGRESS_FILE = "_progress.json"
SPILL_DIR = ".spill"
MAX_OPEN_WINDOWS = 1024  # windows a chunk writes at once (one spill file each)
SOURCE = "yambda"


# ----------------------------------------------------------------------------- pass 1: chunks to spills


def _requests_table(requests: list[YambdaRequest], first: int = -1) -> pa.Table:
    def lists(parts: list[np.ndarray], kind: pa.DataType) -> pa.Array:
        offsets: np.ndarray = np.zeros(len(parts) + 1, dtype=np.int32)
        np.cumsum([len(p) for p in parts], out=offsets[1:])
        values = np.concatenate(parts) if parts else np.zeros(0)
        return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values).cast(kind))

    n = len(requests)
    request = np.arange(first, first + n) if first >= 0 else np.full(n, -1)
    columns = [
        pa.array(request, pa.int64()),
        pa.array([r.user for r in requests], pa.int64()),
        pa.array([r.step for r in requests], pa.int64()),
    ]
    for i, kind in enumerate((pa.int64(), pa.int64(), pa.uint8(), pa.float32())):
        columns.append(lists([r.history[i] for r in requests], kind))
    for i, kind in enumerate((pa.int64(), pa.int64(), pa.float32())):
        columns.append(lists([r.candidates[i] for r in requests], kind))
    columns.append(lists([np.full(len(r.candidates[0]), np.nan, np.float32) for r in requests], pa.float32()))
    return pa.Table.from_arrays(columns, schema=SCHEMA)


class _Spill:
    """A chunk's requests, one file per window, in the order they come (uid order within a window); at most
    `buffer_tokens` tokens wait in memory, the largest window's written first."""

    def __init__(self, directory: Path, opts: YambdaOptions):
        self.dir, self.opts = directory, opts
        self.buffers: dict[int, list[YambdaRequest]] = {}
        self.tokens: dict[int, int] = {}
        self.waiting = 0  # tokens in all buffers
        self.writers: dict[int, pq.ParquetWriter] = {}

    def add(self, r: YambdaRequest) -> None:
        self.buffers.setdefault(r.step, []).append(r)
        self.tokens[r.step] = self.tokens.get(r.step, 0) + r.tokens
        self.waiting += r.tokens
        while self.waiting > self.opts.buffer_tokens:
            self._flush(max(self.tokens, key=self.tokens.__getitem__))

    def _flush(self, step: int) -> None:
        if step not in self.writers:
            if len(self.writers) >= MAX_OPEN_WINDOWS:
                detail = f"{self.opts.window_s}: more than {MAX_OPEN_WINDOWS} windows; raise it, or convert fewer "
                raise FieldError(
                    "window_s", detail + "with {first_window} and {last_window}", "first_window", "last_window"
                )
            self.writers[step] = pq.ParquetWriter(self.dir / f"w{step:09d}.parquet", SCHEMA, compression="zstd")
        self.writers[step].write_table(_requests_table(self.buffers.pop(step)))
        self.waiting -= self.tokens.pop(step)

    def close(self) -> None:
        for step in list(self.buffers):
            self._flush(step)
        for w in self.writers.values():
            w.close()


def _chunks(pf: pq.ParquetFile, events: int) -> list[tuple[int, int]]:
    """Row groups [a, b) of each chunk: whole row groups, about `events` events each."""
    out, a, rows = [], 0, 0
    for rg in range(pf.num_row_groups):
        rows += pf.metadata.row_group(rg).num_rows
        if rows >= events:
            out.append((a, rg + 1))
            a, rows = rg + 1, 0
    if a < pf.num_row_groups:
        out.append((a, pf.num_row_groups))
    return out


def _last_uid(pf: pq.ParquetFile, rg: int) -> int:
    """The uid of row group `rg`'s last row: its maximum, the file being sorted by uid."""
    stats = pf.metadata.row_group(rg).column(pf.schema_arrow.names.index("uid")).statistics
    if stats is not None and stats.has_min_max:
        return int(stats.max)
    return int(pc.max(pf.read_row_group(rg, columns=["uid"]).column("uid")).as_py())


def _chunk_events(
    pf: pq.ParquetFile, path: Path, rows: tuple[int, int], lookup: np.ndarray, opts: YambdaOptions
) -> Iterator[tuple[Events, str, int, int]]:
    """(events, where they are, the first's row in its row group, rows read of the chunk's own) of the users
    whose first event lies in row groups [a, b): a user begun before `a` is skipped, the last user is read
    past `b` to their end. Every batch read is checked (nulls, types, order)."""
    a, b = rows
    lead = _last_uid(pf, a - 1) if a > 0 else None  # the user an earlier chunk owns
    tail = None  # past b: the chunk's last user
    last: tuple[int, int] | None = None
    for rg in range(a, pf.num_row_groups):
        if rg == b:
            if lead is not None:  # every row so far was an earlier chunk's user: this chunk owns none
                return
            tail = last[0] if last is not None else None
        row0 = 0
        for batch in row_group_batches(pf, rg, opts.batch_rows, list(EVENT_COLUMNS), path):
            where = f"{path}: row group {rg}"
            ev = decode_events(batch, where, row0, lookup)
            check_order(ev, last, where, row0)
            last = (int(ev.uid[-1]), int(ev.ts[-1]))
            n = len(ev.uid)
            lo = 0 if lead is None else int(np.searchsorted(ev.uid, lead, side="right"))
            if lo < n:
                lead = None
            hi = n if tail is None else int(np.searchsorted(ev.uid, tail, side="right"))
            yield ev.take(slice(lo, hi)), where, row0 + lo, n if rg < b else 0
            if hi < n:
                return
            row0 += n


COUNTS = (
    "events",
    "requests",
    "requests_short_history",
    "candidates_over_max",
    "unlike_undislike_events",
    "unmapped_events_dropped",
    "peak_state_tokens",
    "max_uid",
)
MAXED = ("peak_state_tokens", "max_uid")  # summed over chunks but these


class _ChunkConverter:
    """Pass 1 over one chunk: events to users to requests in `spill`."""

    def __init__(self, opts: YambdaOptions, spill: _Spill):
        self.opts, self.spill = opts, spill
        self.counts = dict.fromkeys(COUNTS, 0)
        self.counts["max_uid"] = -1
        self.user: YambdaUser | None = None

    def emit(self, r: YambdaRequest) -> None:
        self.counts["requests"] += 1
        self.spill.add(r)

    def feed(self, ev: Events, where: str, row0: int) -> None:
        self.counts["events"] += len(ev.uid)
        used = ev.code <= DISLIKE  # unlikes and undislikes need no category
        unmapped = used & (ev.cat < 0)
        if unmapped.any():
            if self.opts.unmapped == "error":
                row = int(np.argmax(unmapped))
                raise UserError(
                    f"{where}, column item_id: item {int(ev.item[row])} at row {row0 + row} has no "
                    "category in the item mapping (--unmapped drop drops such events)"
                )
            self.counts["unmapped_events_dropped"] += int(unmapped.sum())
            ev = ev.take(~unmapped)
        if not len(ev.uid):
            return
        self.counts["max_uid"] = max(self.counts["max_uid"], int(ev.uid[-1]))
        cuts = np.concatenate([[0], np.flatnonzero(np.diff(ev.uid)) + 1, [len(ev.uid)]])
        for a, b in zip(cuts[:-1], cuts[1:], strict=True):
            uid = int(ev.uid[a])
            if self.user is None or self.user.uid != uid:
                if self.user is not None:
                    self.user.close()
                self.user = YambdaUser(uid, self.opts, self.emit, self.counts)
            self.user.feed(ev.take(slice(a, b)))

    def finish(self) -> dict[str, int]:
        if self.user is not None:
            self.user.close()
        self.spill.close()
        return self.counts


# ----------------------------------------------------------------------------- pass 2: spills to windows


def _write_window(spills: list[Path], path: Path, first: int, rows: int) -> int:
    """One window's requests from its spill files (chunk order: uid order) as `path`, numbered from `first`, in
    row groups of `rows` requests whatever the spills' layout (so the bytes do not depend on it)."""
    tmp = path.with_name(f".{path.name}.tmp")
    pending: list[pa.Table] = []
    have, written = 0, 0
    with pq.ParquetWriter(tmp, SCHEMA, compression="zstd") as writer:

        def put(t: pa.Table) -> None:
            nonlocal written
            number = pa.array(np.arange(first + written, first + written + t.num_rows), pa.int64())
            writer.write_table(t.combine_chunks().set_column(0, SCHEMA.field("request"), number))
            written += t.num_rows

        for f in spills:
            spill = pq.ParquetFile(f)
            for rg in range(spill.num_row_groups):
                pending.append(spill.read_row_group(rg))
                have += pending[-1].num_rows
                while have >= rows:
                    whole = pa.concat_tables(pending)
                    put(whole.slice(0, rows))
                    pending, have = [whole.slice(rows)], have - rows
        if have:
            put(pa.concat_tables(pending))
    os.replace(tmp, path)
    return written


# ----------------------------------------------------------------------------- the conversion


def _describe(path: Path) -> dict[str, str | int]:
    meta = pq.ParquetFile(path).metadata
    return {
        "path": str(path.resolve()),
        "bytes": path.stat().st_size,
        "rows": meta.num_rows,
        "row_groups": meta.num_row_groups,
    }


def _save(path: Path, record: JsonObject) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, path)


def _differences(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[str]:
    keys = [f"options.{k}" for k in a["options"] if a["options"][k] != b.get("options", {}).get(k)]
    return keys + [f"inputs.{k}" for k in a["inputs"] if a["inputs"][k] != b.get("inputs", {}).get(k)]


def convert_yambda(
    events: str | Path,
    categories: str | Path,
    out: str | Path,
    options: YambdaOptions | None = None,
    *,
    on_events: Callable[[int], None] | None = None,
    on_commit: Callable[[str], None] | None = None,
) -> JsonObject:
    """Convert Yambda's flat `multi_event.parquet` (`events`) with an item mapping (`categories`) into
    requests in the new directory `out`, or resume the conversion begun there (module docstring). Returns
    the sidecar. `on_events(n)`: n more events read; `on_commit(what)`: a chunk or a window was committed."""
    opts = (options or YambdaOptions()).check()
    events, categories, out = Path(events), Path(categories), Path(out)
    pf = open_events_file(events, "Yambda's flat multi_event.parquet")
    check_columns(events, pf.schema_arrow, EVENT_COLUMNS, "Yambda's flat multi_event.parquet")
    if pf.metadata.num_rows == 0:
        raise UserError(f"{events}: no rows (an empty file)")
    mapping = load_categories(categories)
    lookup = mapping.of_item
    fingerprint = json.loads(
        json.dumps(
            {"inputs": {"events": _describe(events), "categories": _describe(categories)}, "options": asdict(opts)}
        )
    )
    if out.exists() and not out.is_dir():
        raise FieldError("out", f"{out}: not a directory; give a new directory to convert into")
    sidecar, progress_path = out / DATASET_FILE, out / PROGRESS_FILE
    if sidecar.is_file():
        done = _record(sidecar, out, "dataset record")
        if done.get("source") != SOURCE or _differences(fingerprint, done):
            raise FieldError("out", f"{out}: holds another dataset; choose a new directory")
        _clean(out)
        return done
    if progress_path.is_file():
        # the record read back from disk: its shape is checked below, field by field
        progress: dict[str, Any] = _record(progress_path, out, "conversion's progress record")
        if not all(
            isinstance(progress.get(k), t) for k, t in (("chunks", list), ("chunk_counts", list), ("windows_done", int))
        ):
            raise UserError(
                f"{progress_path}: a damaged conversion's progress record (chunks, chunk_counts or "
                f"windows_done missing); {_start_over(out)}"
            )
        changed = _differences(fingerprint, progress.get("fingerprint", {}))
        if changed:
            raise FieldError(
                "out",
                f"{out}: holds a conversion of other inputs or options ({', '.join(changed)}); "
                "rerun it as it was to resume, or choose a new directory",
            )
    else:
        if out.exists() and any(out.iterdir()):
            raise FieldError("out", f"{out}: directory exists and is not empty; choose a new one")
        check_writable(out, "out")
        out.mkdir(parents=True, exist_ok=True)
        progress = {
            "fingerprint": fingerprint,
            "chunks": [list(c) for c in _chunks(pf, opts.chunk_events)],
            "chunk_counts": [],
            "windows_done": 0,
        }
        _save(progress_path, progress)

    # pass 1: chunks of users into per-window spills
    for i, rows in enumerate(progress["chunks"]):
        if i < len(progress["chunk_counts"]):
            continue
        final, tmp = out / SPILL_DIR / f"c{i:05d}", out / SPILL_DIR / f"c{i:05d}.tmp"
        for d in (final, tmp):
            shutil.rmtree(d, ignore_errors=True)
        tmp.mkdir(parents=True)
        chunk = _ChunkConverter(opts, _Spill(tmp, opts))
        for ev, where, row0, read in _chunk_events(pf, events, tuple(rows), lookup, opts):
            chunk.feed(ev, where, row0)
            if on_events is not None and read:
                on_events(read)
        counts = chunk.finish()
        os.replace(tmp, final)
        progress["chunk_counts"].append(counts)
        _save(progress_path, progress)
        if on_commit is not None:
            on_commit(f"chunk {i}")
    totals = {k: (max if k in MAXED else sum)(c[k] for c in progress["chunk_counts"]) for k in COUNTS}
    if totals["requests"] == 0:
        raise UserError(
            f"{events}: no requests (no window with a listen and >= {opts.min_history} history events"
            + ("" if opts.first_window is None and opts.last_window is None else " in the windows asked")
            + ")"
        )

    # pass 2: each window's spills, in chunk order, as one file
    spills: dict[int, list[Path]] = {}
    for i in range(len(progress["chunks"])):
        for f in sorted((out / SPILL_DIR / f"c{i:05d}").glob("w*.parquet")):
            spills.setdefault(int(f.stem[1:]), []).append(f)
    files, first = [], 0
    for k, step in enumerate(sorted(spills)):
        rows = sum(_spill_rows(f, out) for f in spills[step])
        name = f"part-{k:05d}.parquet"
        if k >= progress["windows_done"]:
            _write_window(spills[step], out / name, first, opts.row_group_requests)
            progress["windows_done"] = k + 1
            _save(progress_path, progress)
            if on_commit is not None:
                on_commit(f"window {step}")
        files.append({"path": name, "rows": rows, "first_request": first, "step": step})
        first += rows
    manifest = {
        "format_version": FORMAT_VERSION,
        "kind": KIND,
        "family": "hstu",
        "source": SOURCE,
        "rule": (
            f"a request per (user, window of {opts.window_s} s) with a listen: candidates the window's first "
            f"{opts.max_candidates} listens, label played_ratio_pct >= {opts.listen_plus_pct}"
            + (" or a later like in the window" if opts.like_is_positive else "")
            + f"; history the user's earlier windows' listens, likes and dislikes, newest {opts.max_history}"
        ),
        "category": mapping.kind,
        "action_bits": list(YAMBDA_ACTION_BITS),
        **fingerprint,
        "tables": {"items": int(lookup.size), "categories": mapping.rows, "users": totals["max_uid"] + 1},
        "counts": totals,
        "teacher": None,
        "rows": first,
        "shards": len(files),
        "files": files,
    }
    _save(sidecar, manifest)
    _clean(out)
    return manifest


def _start_over(out: Path) -> str:
    return f"delete {out} and convert again (an interrupted conversion resumes; a damaged one cannot)"


def _record(path: Path, out: Path, what: str) -> JsonObject:
    """A conversion's JSON record, or one line naming the damaged file and how to start over."""
    try:
        record = json.loads(read_bounded(path, what))
    except ValueError as exc:  # truncated or not JSON
        raise UserError(f"{path}: a damaged {what} ({exc}); {_start_over(out)}") from None
    if not isinstance(record, dict):
        raise UserError(f"{path}: a damaged {what} (not a JSON object); {_start_over(out)}")
    return record


def _spill_rows(path: Path, out: Path) -> int:
    """The requests in one spill file, or one line naming it where it is damaged."""
    try:
        return pq.ParquetFile(path).metadata.num_rows
    except (pa.ArrowInvalid, OSError) as exc:
        raise UserError(f"{path}: a damaged spill file ({exc}); {_start_over(out)}") from None


def _clean(out: Path) -> None:
    """What a finished conversion leaves behind: its spills and progress record."""
    shutil.rmtree(out / SPILL_DIR, ignore_errors=True)
    (out / PROGRESS_FILE).unlink(missing_ok=True)

"""Parquet click-log datasets: the layout, the writer and the streaming loader.

Layout (one row per sample), chosen so that a batch converts to tensors without a
per-sample loop: `label` float32; `dense` fixed_size_list<float32>[num_dense]; one
`list<int64>` column per sparse feature, named as the model's features (list offsets
are the KeyedJaggedTensor lengths, list values its values). A dataset is a directory
of `part-NNNNN.parquet` shards plus the sidecar `_dataset.json`; the shards' schema
metadata (`dlrm_lab` key) carries the same JSON: source, resolved data spec, seed, first
sample index, rows and the teacher (AUC, bias).

The sidecar's leading `_` makes other tools skip it, so the directory opens as it is:
`pyarrow.dataset.dataset(dir)` and `pyarrow.parquet.read_table(dir)` (Arrow ignores names
starting with `_` or `.`), DuckDB's `read_parquet('dir/*.parquet')`, polars on
`dir/*.parquet` (or `scan_parquet(dir, hidden_file_prefix="_")`). Datasets written before
the rename hold `dataset.json` (LEGACY_DATASET_FILE); they are still read.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from torchrec.datasets.utils import Batch

from dlrm_lab.config import ModelSpec
from dlrm_lab.config.values import JsonObject
from dlrm_lab.data.source import block_to_batch
from dlrm_lab.data.synthetic import SampleBlock, SyntheticGenerator
from dlrm_lab.errors import FieldError, UserError
from dlrm_lab.metrics.run import check_writable

METADATA_KEY = b"dlrm_lab"
FORMAT_VERSION = 1  # of the sidecar and the files' layout; bumped when a reader could misread an older one
READABLE_FORMATS = (1,)
DATASET_FILE = "_dataset.json"  # the sidecar written; Arrow (and polars if told) skip `_` names
LEGACY_DATASET_FILE = "dataset.json"  # its name before; still read (Arrow takes it for Parquet)
ROW_GROUP_SAMPLES = 65_536


def dataset_schema(num_dense: int, feature_names: list[str], metadata: JsonObject | None = None) -> pa.Schema:
    fields = [
        pa.field("label", pa.float32(), nullable=False),
        pa.field("dense", pa.list_(pa.float32(), num_dense), nullable=False),
        *[pa.field(name, pa.list_(pa.int64()), nullable=False) for name in feature_names],
    ]
    meta = {METADATA_KEY: json.dumps(metadata).encode()} if metadata is not None else None
    return pa.schema(fields, metadata=meta)


def block_to_table(block: SampleBlock, schema: pa.Schema) -> pa.Table:
    n = block.size
    dense: np.ndarray = block.dense.astype(np.float32, copy=False).ravel()
    columns: list[pa.Array] = [
        pa.array(block.labels.astype(np.float32, copy=False)),
        pa.FixedSizeListArray.from_arrays(pa.array(dense), block.dense.shape[1]),
    ]
    for lengths, values in zip(block.lengths, block.values, strict=True):
        offsets: np.ndarray = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        columns.append(pa.LargeListArray.from_arrays(offsets, values).cast(pa.list_(pa.int64())))
    return pa.Table.from_arrays(columns, schema=schema)


def write_dataset(
    generator: SyntheticGenerator,
    rows: int,
    out: str | Path,
    shards: int = 1,
    first_sample: int = 0,
    row_group_samples: int = ROW_GROUP_SAMPLES,
    on_progress: Callable[[int], None] | None = None,
) -> JsonObject:
    """Write samples [first_sample, first_sample + rows) as `shards` Parquet files.

    Shard k holds a contiguous range, so the shards in order are the whole. Each file is
    written under a temporary name and renamed when complete; the sidecar (DATASET_FILE) comes last.
    """
    if rows < 1:
        raise FieldError("rows", f"{rows}: must be an integer >= 1")
    spec = generator.spec
    meta: JsonObject = {
        "format_version": FORMAT_VERSION,
        "source": "synthetic",
        "data_spec": spec.to_dict(),
        "seed": generator.seed,
        "first_sample": first_sample,
        "rows": rows,
        "teacher": generator.teacher,
    }
    return write_shards(
        out,
        meta,
        range(first_sample, first_sample + rows),
        shards,
        schema_of=lambda k, lo: dataset_schema(
            spec.num_dense, spec.feature_names, {**meta, "shard": k, "shard_first_sample": lo}
        ),
        table_of=lambda a, b, schema: block_to_table(generator.samples(a, b), schema),
        row_group=row_group_samples,
        first_key="first_sample",
        on_progress=on_progress,
    )


def write_shards(
    out: str | Path,
    meta: JsonObject,
    rows: range,
    shards: int,
    *,
    schema_of: Callable[[int, int], pa.Schema],
    table_of: Callable[[int, int, pa.Schema], pa.Table],
    row_group: int,
    first_key: str,
    on_progress: Callable[[int], None] | None = None,
) -> JsonObject:
    """Write rows `rows` (indices of the generator's stream) as `shards` Parquet files of contiguous ranges into
    the new directory `out`, all or nothing, then the sidecar (DATASET_FILE: `meta`, the shards and each file's
    rows and first row under `first_key`). `schema_of(shard, first row)` gives a file's schema, `table_of(a, b,
    schema)` rows [a, b) as a table. Each file is written under a temporary name and renamed when complete."""
    n = len(rows)
    if not 1 <= shards <= n:
        raise FieldError("shards", f"{shards}: must be in [1, rows={n}]")
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise FieldError("out", f"{out}: directory exists and is not empty; choose a new one")
    check_writable(out, "out")
    out.mkdir(parents=True, exist_ok=True)
    files = []
    with all_or_nothing(out) as part_path:
        for k in range(shards):
            lo, hi = rows.start + k * n // shards, rows.start + (k + 1) * n // shards
            schema = schema_of(k, lo)
            with part_path(k) as (path, tmp), pq.ParquetWriter(tmp, schema, compression="zstd") as writer:
                for a in range(lo, hi, row_group):
                    b = min(a + row_group, hi)
                    writer.write_table(table_of(a, b, schema), row_group_size=b - a)
                    if on_progress is not None:
                        on_progress(b - a)
            files.append({"path": path.name, "rows": hi - lo, first_key: lo})
        manifest = {**meta, "shards": shards, "files": files}
        (out / DATASET_FILE).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


@contextlib.contextmanager
def all_or_nothing(out: Path) -> Iterator[Callable[[int], Any]]:
    """Write a dataset's files so that a failure (or Ctrl-C) leaves no partial dataset.

    Each part is written under a hidden temporary name and renamed when complete; if
    anything fails, every part written so far and the temporary file are removed.
    """
    written: list[Path] = []

    @contextlib.contextmanager
    def part_path(k: int) -> Iterator[tuple[Path, Path]]:
        path = out / f"part-{k:05d}.parquet"
        tmp = out / f".{path.name}.tmp"
        written.append(tmp)
        yield path, tmp
        os.replace(tmp, path)
        written.append(path)

    try:
        yield part_path
    except BaseException:
        for p in [*written, out / DATASET_FILE]:
            p.unlink(missing_ok=True)
        raise


def read_dataset_info(path: str | Path) -> JsonObject:
    """The dataset's JSON description (from its sidecar, else the first file's metadata)."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"{path}: no such dataset directory or file")
    sidecar = dataset_sidecar(path)
    if sidecar is not None:
        try:
            info = json.loads(sidecar.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise UserError(f"{sidecar}: not valid JSON: {exc}") from None
        if not isinstance(info, dict):
            raise UserError(f"{sidecar}: not a dataset description (a JSON object)")
        version = info.get("format_version", FORMAT_VERSION)  # datasets from before the field: version 1
        if version not in READABLE_FORMATS:
            readable = ", ".join(map(str, READABLE_FORMATS))
            raise UserError(
                f"{sidecar}: format_version = {version!r}: this dlrm-lab reads {readable} (written by "
                "another version: regenerate it)"
            )
        return info
    files = dataset_files(path)
    meta = _read_schema(files[0]).metadata or {}
    info = json.loads(meta[METADATA_KEY]) if METADATA_KEY in meta else {"source": "unknown"}
    info["files"] = [{"path": str(f.relative_to(path) if path.is_dir() else f.name)} for f in files]
    return info


def dataset_sidecar(path: str | Path) -> Path | None:
    """The dataset directory's JSON sidecar: DATASET_FILE, else (an older dataset) LEGACY_DATASET_FILE."""
    for name in (DATASET_FILE, LEGACY_DATASET_FILE):
        if (Path(path) / name).is_file():
            return Path(path) / name
    return None


def dataset_files(path: str | Path) -> list[Path]:
    path = Path(path)
    if not path.exists():
        raise UserError(f"{path}: no such dataset directory or file")
    files = [path] if path.is_file() else sorted(path.glob("*.parquet"))
    if not files:
        raise UserError(f"{path}: no .parquet files (an empty dataset)")
    return files


def _read_schema(path: Path) -> pa.Schema:
    try:
        return pq.read_schema(path)
    except (pa.ArrowException, OSError) as exc:
        raise UserError(f"{path}: not a readable Parquet file ({str(exc).splitlines()[0]})") from None


class TableColumns(Protocol):
    """What `check_schema` and `validate_table` read of a table: a `TableSpec` or `stats.DatasetTable`."""

    @property
    def name(self) -> str: ...
    @property
    def num_embeddings(self) -> int: ...
    @property
    def feature_names(self) -> Sequence[str]: ...


class ModelColumns(Protocol):
    """What `check_schema` and `validate_table` read of a model: a `ModelSpec` or `stats.DatasetLayout`."""

    @property
    def name(self) -> str: ...
    @property
    def num_dense(self) -> int: ...
    @property
    def tables(self) -> Sequence[TableColumns]: ...
    @property
    def feature_names(self) -> list[str]: ...


def check_schema(path: Path, schema: pa.Schema, model: ModelColumns) -> None:
    """Refuse a file whose columns do not match `model`: one line naming file and column."""
    expected = ["label", "dense", *model.feature_names]
    names = schema.names
    missing = [c for c in expected if c not in names]
    if missing:
        raise UserError(
            f"{path}: missing column(s) {', '.join(missing[:5])} (model {model.name} needs {len(expected)})"
        )
    extra = [c for c in names if c not in expected]
    if extra:
        raise UserError(f"{path}: unexpected column(s) {', '.join(extra[:5])} for model {model.name}")
    label = schema.field("label").type
    if not (pa.types.is_floating(label) or pa.types.is_integer(label)):
        raise UserError(f"{path}: column label has type {label}; expected float32")
    dense = schema.field("dense").type
    if not (pa.types.is_fixed_size_list(dense) and pa.types.is_floating(dense.value_type)):
        raise UserError(f"{path}: column dense has type {dense}; expected fixed_size_list<float32>[{model.num_dense}]")
    if dense.list_size != model.num_dense:
        raise UserError(
            f"{path}: column dense holds {dense.list_size} values; model {model.name} has {model.num_dense}"
        )
    for name in model.feature_names:
        t = schema.field(name).type
        if not ((pa.types.is_list(t) or pa.types.is_large_list(t)) and pa.types.is_integer(t.value_type)):
            raise UserError(f"{path}: column {name} has type {t}; expected list<int64>")


def validate_table(table: pa.Table, model: ModelColumns, where: str) -> None:
    """Refuse nulls, labels other than 0 and 1, non-finite dense values and ids outside their table, naming file,
    row group, column and row: a NaN trains to a NaN loss and an AUC of 0.5 without a word."""
    for name in table.column_names:
        nulls = table.column(name).null_count
        if nulls:
            raise UserError(f"{where}: column {name} has {nulls} null value(s)")
    labels = table.column("label").to_numpy() if "label" in table.column_names else np.zeros(0)
    if (bad := np.flatnonzero((labels != 0) & (labels != 1))).size:
        raise UserError(
            f"{where}: column label: {float(labels[bad[0]])!r} at row {int(bad[0])} ({bad.size} such); "
            "labels are 0 or 1"
        )
    flat = pc.list_flatten(table.column("dense")) if "dense" in table.column_names else None
    if flat is not None and pa.types.is_floating(flat.type):
        dense = flat.to_numpy(zero_copy_only=False)
        if (bad := np.flatnonzero(~np.isfinite(dense))).size:
            row, k = divmod(int(bad[0]), max(1, model.num_dense))
            raise UserError(
                f"{where}: column dense: {float(dense[bad[0]])!r} at row {row}, value {k} "
                f"({bad.size} such); dense features must be finite numbers"
            )
    for t in model.tables:
        for name in t.feature_names:
            values = pc.list_flatten(table.column(name))
            if len(values) == 0:
                continue
            if values.null_count:
                raise UserError(f"{where}: column {name} has {values.null_count} null id(s)")
            lo, hi = pc.min_max(values).values()
            if lo.as_py() < 0 or hi.as_py() >= t.num_embeddings:
                bad = hi.as_py() if hi.as_py() >= t.num_embeddings else lo.as_py()
                raise UserError(f"{where}: column {name}: id {bad} outside table {t.name} rows [0, {t.num_embeddings})")


def table_to_block(table: pa.Table, model: ModelSpec, first: int = 0) -> SampleBlock:
    """Arrow rows (already validated) -> numpy samples, each feature's offsets read from its lists (a third of the
    time of Arrow's length kernel and a cumulative sum), so that the block is sliced into batches as it is."""
    labels = table.column("label").to_numpy().astype(np.float32, copy=False)
    dense = pc.list_flatten(table.column("dense")).to_numpy().astype(np.float32, copy=False)
    lengths, values, offsets = [], [], []
    for name in model.feature_names:
        lists = table.column(name).combine_chunks()  # one chunk as a row group is read: no copy
        at = lists.offsets.to_numpy().astype(np.int64)
        offsets.append(at - at[0])
        lengths.append(np.diff(at).astype(np.int32, copy=False))
        values.append(lists.flatten().to_numpy(zero_copy_only=False).astype(np.int64, copy=False))
    return SampleBlock(
        first, dense.reshape(len(labels), model.num_dense), labels, lengths, values, feature_offsets=offsets
    )


@dataclass
class ParquetSource:
    """Batches of one rank from a Parquet dataset, in file and row order.

    Global batch k holds rows [k*G, (k+1)*G) of the endless concatenation of the dataset's
    epochs (G = batch_size * world_size), rank r its r-th contiguous slice: the same split
    as the synthetic source, so training is identical whichever feeds it. With
    `epochs=1` the last batch holds what is left, split over the ranks. No row is dropped.
    """

    path: str | Path
    model: ModelSpec
    batch_size: int
    rank: int = 0
    world_size: int = 1
    num_batches: int | None = None
    epochs: int | None = None  # None: cycle for as long as batches are asked for
    start_batch: int = 0  # global batches to skip first (a resumed run's step)
    files: list[Path] = field(init=False)

    def __post_init__(self) -> None:
        self.files = dataset_files(self.path)
        for f in self.files:
            check_schema(f, _read_schema(f), self.model)
        self.info = read_dataset_info(self.path)

    def describe(self) -> JsonObject:
        return {
            "source": "parquet",
            "path": str(self.path),
            "files": len(self.files),
            "dataset": {k: v for k, v in self.info.items() if k != "files"},
            "batch_size_per_rank": self.batch_size,
            "world_size": self.world_size,
            "epochs": self.epochs,
        }

    def _row_groups(self) -> Iterator[tuple[pa.Table, str]]:
        epoch = 0
        while self.epochs is None or epoch < self.epochs:
            for f in self.files:
                try:
                    pf = pq.ParquetFile(f)
                except (pa.ArrowException, OSError) as exc:
                    raise UserError(f"{f}: not a readable Parquet file ({str(exc).splitlines()[0]})") from None
                for rg in range(pf.num_row_groups):
                    try:
                        table = pf.read_row_group(rg)
                    except (pa.ArrowException, OSError) as exc:
                        raise UserError(f"{f}: row group {rg} unreadable ({str(exc).splitlines()[0]})") from None
                    yield table, f"{f}: row group {rg}"
            epoch += 1

    def __iter__(self) -> Iterator[Batch]:
        g = self.batch_size * self.world_size
        pending: list[SampleBlock] = []  # row groups decoded, the first from `used` on
        have = produced = used = 0
        groups = self._row_groups()
        exhausted = False
        skip = self.start_batch * g  # rows already trained on: whole row groups, then a slice
        while self.num_batches is None or produced < self.num_batches:
            while have < g and not exhausted:
                try:
                    table, where = next(groups)
                except StopIteration:
                    exhausted = True
                    break
                if skip >= table.num_rows:
                    skip -= table.num_rows
                    continue
                if skip:
                    table, skip = table.slice(skip), 0
                if table.num_rows:
                    validate_table(table, self.model, where)
                    pending.append(table_to_block(table, self.model))
                    have += table.num_rows
            if have == 0:
                return
            take = min(g, have)
            lo, hi = self.rank * take // self.world_size, (self.rank + 1) * take // self.world_size
            yield block_to_batch(_rows_of(pending, used + lo, used + hi), self.model.feature_names)
            used += take
            while pending and used >= pending[0].size:  # row groups wholly consumed
                used -= pending[0].size
                pending.pop(0)
            have -= take
            produced += 1
            if exhausted and have == 0:
                return


def _rows_of(groups: list[SampleBlock], lo: int, hi: int) -> SampleBlock:
    """Rows [lo, hi) of the row groups laid end to end: slices of their arrays (Arrow's conversions per batch, three
    calls per feature, took 0.3-0.9 ms of kaggle's 2,048 samples, more than the data they moved)."""
    parts, base = [], 0
    for g in groups:
        a, b = max(lo - base, 0), min(hi - base, g.size)
        if a < b:
            parts.append(g.slice(a, b))
        base += g.size
        if base >= hi:
            break
    return SampleBlock.concat(parts)

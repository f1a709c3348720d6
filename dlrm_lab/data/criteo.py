"""Criteo click logs (Kaggle Display Advertising Challenge / Terabyte) in their TSV form.

Each line: label, 13 integer features, 26 categorical features as 8-digit hex strings,
tab-separated, any of the 39 features possibly empty. Conversion follows
facebookresearch/dlrm's preprocessing: missing or negative integers become 0 and
dense = log(1 + x); a categorical value is its hex number modulo the table's rows
(missing: 0). The writer produces the same format from synthetic data, so pipelines
built for Criteo can be fed without downloading it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from dlrm_lab.config import ModelSpec
from dlrm_lab.config.values import JsonObject
from dlrm_lab.data.parquet import DATASET_FILE, FORMAT_VERSION, all_or_nothing, block_to_table, dataset_schema
from dlrm_lab.data.spec import DataSpec
from dlrm_lab.data.synthetic import SampleBlock, SyntheticGenerator
from dlrm_lab.errors import FieldError, UserError

NUM_INT, NUM_CAT = 13, 26
INT_COLUMNS = [f"I{i}" for i in range(1, NUM_INT + 1)]
CAT_COLUMNS = [f"C{i}" for i in range(1, NUM_CAT + 1)]
COLUMNS = ["label", *INT_COLUMNS, *CAT_COLUMNS]

_HEX_VALUE: np.ndarray = np.full(256, 255, dtype=np.uint8)
for _i, _c in enumerate(b"0123456789abcdef"):
    _HEX_VALUE[_c] = _i
for _i, _c in enumerate(b"ABCDEF"):
    _HEX_VALUE[_c] = 10 + _i
_HEX_DIGITS = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)


def _check_model(model: ModelSpec) -> None:
    if model.num_dense != NUM_INT or model.num_features != NUM_CAT:
        raise UserError(
            f"model {model.name} has {model.num_dense} dense and {model.num_features} sparse features; "
            f"the Criteo format has {NUM_INT} and {NUM_CAT} (use kaggle or terabyte)"
        )


def _parse_hex(column: pa.ChunkedArray, path: Path, first_line: int, name: str) -> np.ndarray:
    """8-digit hex strings (null: missing) -> uint64 values, vectorised over bytes. Errors
    name the file's 1-based line (`first_line` is the line of the column's first value)."""
    arr = column.combine_chunks().fill_null("00000000")
    lengths = pc.utf8_length(arr).to_numpy(zero_copy_only=False)
    if lengths.size and (lengths != 8).any():
        row = int(np.argmax(lengths != 8))
        raise UserError(
            f"{path}: line {first_line + row}, column {name}: categorical value {arr[row].as_py()!r} "
            "is not 8 hex digits"
        )
    data = np.frombuffer(arr.buffers()[2], dtype=np.uint8)
    start = arr.offset * 8
    digits = _HEX_VALUE[data[start : start + 8 * len(arr)]].reshape(-1, 8)
    if (digits == 255).any():
        row = int(np.argmax((digits == 255).any(axis=1)))
        raise UserError(
            f"{path}: line {first_line + row}, column {name}: categorical value {arr[row].as_py()!r} is not hexadecimal"
        )
    shifts: np.ndarray = np.arange(28, -1, -4, dtype=np.uint64)
    return (digits.astype(np.uint64) << shifts).sum(axis=1)


def _where_broken(path: Path, from_line: int) -> str:
    """'line N: ' for the first line from `from_line` (1-based) whose field count is not the
    format's 40, else ''. Only on the error path: Arrow's parse errors carry no line number."""
    with open(path, "rb") as f:
        for number, line in enumerate(f, start=1):
            fields = line.rstrip(b"\r\n").count(b"\t") + 1
            if number >= from_line and fields != len(COLUMNS):
                return f"line {number}: {fields} fields, expected {len(COLUMNS)}: "
    return ""


def read_criteo_tsv(path: str | Path, model: ModelSpec, block_rows: int = 1 << 16) -> Iterator[SampleBlock]:
    """Stream a Criteo TSV file as sample blocks for `model` (kaggle/terabyte shapes)."""
    _check_model(model)
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: no such file")
    if path.stat().st_size == 0:
        raise UserError(f"{path}: no rows (an empty file)")
    convert = pacsv.ConvertOptions(
        column_types={
            "label": pa.int32(),
            **{c: pa.int64() for c in INT_COLUMNS},
            **{c: pa.string() for c in CAT_COLUMNS},
        },
        strings_can_be_null=True,
    )
    try:
        reader = pacsv.open_csv(
            path,
            read_options=pacsv.ReadOptions(column_names=COLUMNS, block_size=1 << 24),
            parse_options=pacsv.ParseOptions(delimiter="\t", quote_char=False),
            convert_options=convert,
        )
    except (pa.ArrowException, OSError) as exc:
        raise UserError(f"{path}: {_where_broken(path, 1)}not a Criteo TSV file ({str(exc).splitlines()[0]})") from None
    rows = model.rows_per_feature
    first = 0
    while True:
        try:
            batch = reader.read_next_batch()
        except StopIteration:
            return
        except (pa.ArrowException, OSError) as exc:
            raise UserError(f"{path}: {_where_broken(path, first + 1)}{str(exc).splitlines()[0]}") from None
        table = pa.Table.from_batches([batch])
        n = table.num_rows
        label = table.column("label")
        bad = pc.invert(pc.fill_null(pc.is_in(label, pa.array([0, 1], pa.int32())), False)).to_numpy(
            zero_copy_only=False
        )
        if bad.any():
            row = int(np.argmax(bad))
            raise UserError(f"{path}: line {first + row + 1}, column label: {label[row].as_py()!r}: must be 0 or 1")
        ints = np.stack([table.column(c).fill_null(0).to_numpy() for c in INT_COLUMNS], axis=1)
        dense = np.log1p(np.maximum(ints, 0)).astype(np.float32)
        values = [
            (_parse_hex(table.column(c), path, first + 1, c) % np.uint64(r)).astype(np.int64)
            for c, r in zip(CAT_COLUMNS, rows, strict=True)
        ]
        lengths = [np.ones(n, dtype=np.int32)] * NUM_CAT
        block = SampleBlock(first, dense, label.to_numpy().astype(np.float32), lengths, values)
        for lo in range(0, n, block_rows):
            yield block.slice(lo, min(lo + block_rows, n))
        first += n


def convert_criteo(
    inputs: Sequence[str | Path],
    model: ModelSpec,
    out: str | Path,
    on_progress: Callable[[int], None] | None = None,
) -> JsonObject:
    """Convert Criteo TSV files into a Parquet dataset (one shard per input file)."""
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise FieldError("out", f"{out}: directory exists and is not empty; choose a new one")
    out.mkdir(parents=True, exist_ok=True)
    meta: JsonObject = {
        "format_version": FORMAT_VERSION,
        "source": "criteo-tsv",
        "model": model.to_dict(),
        "data_spec": None,
    }
    files: list[JsonObject] = []
    total = 0
    with all_or_nothing(out) as part_path:
        for k, src in enumerate(inputs):
            schema = dataset_schema(model.num_dense, model.feature_names, {**meta, "input": str(src), "shard": k})
            rows = 0
            with part_path(k) as (path, tmp), pq.ParquetWriter(tmp, schema, compression="zstd") as writer:
                for block in read_criteo_tsv(src, model):
                    writer.write_table(block_to_table(block, schema))
                    rows += block.size
                    if on_progress is not None:
                        on_progress(block.size)
                if rows == 0:
                    raise UserError(f"{src}: no rows (an empty file)")
            files.append({"path": path.name, "rows": rows, "input": str(src)})
            total += rows
        manifest: JsonObject = {**meta, "rows": total, "shards": len(files), "files": files}
        (out / DATASET_FILE).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def _hex8(values: np.ndarray) -> pa.Array:
    """uint values < 2^32 -> 8-digit lowercase hex strings, without a per-value loop."""
    shifts: np.ndarray = np.arange(28, -1, -4, dtype=np.uint64)
    digits = _HEX_DIGITS[((values.astype(np.uint64)[:, None] >> shifts) & np.uint64(15)).astype(np.intp)]
    offsets: np.ndarray = np.arange(0, 8 * len(values) + 1, 8, dtype=np.int32)
    return pa.StringArray.from_buffers(len(values), pa.py_buffer(offsets), pa.py_buffer(digits.tobytes()))


def write_criteo_tsv(
    generator: SyntheticGenerator,
    rows: int,
    out: str | Path,
    first_sample: int = 0,
    on_progress: Callable[[int], None] | None = None,
) -> Path:
    """Write synthetic samples as a Criteo TSV file (one-hot features, lognormal counts)."""
    check_tsv_spec(generator.spec)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    options = pacsv.WriteOptions(include_header=False, delimiter="\t", quoting_style="none")
    with pacsv.CSVWriter(tmp, _tsv_schema(), write_options=options) as writer:
        for a in range(first_sample, first_sample + rows, generator.block_size):
            b = min(a + generator.block_size, first_sample + rows)
            block = generator.samples(a, b)
            cols = [pa.array(block.labels.astype(np.int32))]
            assert block.counts is not None  # a lognormal-dense spec (check_tsv_spec): its blocks keep their counts
            cols += [pa.array(block.counts[:, i]) for i in range(NUM_INT)]
            cols += [_hex8(v) for v in block.values]
            writer.write_table(pa.Table.from_arrays(cols, schema=_tsv_schema()))
            if on_progress is not None:
                on_progress(b - a)
    os.replace(tmp, out)
    return out


def check_tsv_spec(spec: DataSpec) -> None:
    """Refuse specs the Criteo TSV format cannot hold, before anything is written."""
    if spec.num_dense != NUM_INT or len(spec.features) != NUM_CAT:
        raise UserError(
            f"criteo-tsv needs {NUM_INT} dense and {NUM_CAT} sparse features; spec {spec.name} has "
            f"{spec.num_dense} and {len(spec.features)}"
        )
    multi = [f.name for f in spec.features if f.pooling != {"distribution": "fixed", "value": 1}]
    if multi:
        raise UserError(f"criteo-tsv holds exactly one id per feature; {multi[0]} of spec {spec.name} is multi-hot")
    if spec.dense["distribution"] != "lognormal":
        raise UserError(f"criteo-tsv holds integer counts; spec {spec.name} has {spec.dense['distribution']} dense")
    if any(f.rows > 1 << 32 for f in spec.features):
        raise UserError("criteo-tsv ids are 8 hex digits: tables must have at most 2^32 rows")


def _tsv_schema() -> pa.Schema:
    return pa.schema(
        [("label", pa.int32())] + [(c, pa.int64()) for c in INT_COLUMNS] + [(c, pa.string()) for c in CAT_COLUMNS]
    )

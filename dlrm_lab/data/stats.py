"""What a dataset really holds, compared with the spec it was generated from.

Per feature: samples, lookups, unique ids, share of lookups on the top 1% of the
table's rows, the fitted Zipf exponent, mean and p99 pooling factor; per dataset the
label rate. Each measured value that the spec predicts is checked against a tolerance
and flagged when outside it, so a generator bug (or a mislabelled dataset) shows.

Before measuring, the dataset's structure is checked by the very functions training
refuses a dataset with (`parquet.check_schema` per file, `parquet.validate_table` per row
group), against the tables the dataset declares (its stored data spec, else its stored
model): every problem found is one line naming file, column, row group, id and range.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from dlrm_lab.config import ModelSpec
from dlrm_lab.config.values import JsonObject
from dlrm_lab.data.check import Check, DatasetStats, FeatureStats
from dlrm_lab.data.distributions import expected_pooling, expected_top_share, fit_zipf_alpha
from dlrm_lab.data.parquet import check_schema, dataset_files, dataset_sidecar, read_dataset_info, validate_table
from dlrm_lab.data.request_files import request_stats
from dlrm_lab.data.spec import DataSpec
from dlrm_lab.errors import UserError
from dlrm_lab.metrics.stats import percentile

ALPHA_TOLERANCE = 0.05  # absolute, on the fitted Zipf exponent
TOP_SHARE_TOLERANCE = 0.05  # absolute, on the top-1% share
POOLING_RELATIVE_TOLERANCE = 0.02


@dataclass(frozen=True)
class DatasetTable:
    name: str
    num_embeddings: int
    feature_names: tuple[str, ...]


@dataclass(frozen=True)
class DatasetLayout:
    """The columns and table sizes a dataset declares: the part of a `ModelSpec` that
    `parquet.check_schema` and `parquet.validate_table` read (name, num_dense, tables,
    feature_names), so that `data stats` applies training's checks without a model preset."""

    name: str
    num_dense: int
    tables: tuple[DatasetTable, ...]
    sized: bool = True  # False: table sizes unknown (no spec or model stored): only ids < 0 are caught

    @property
    def feature_names(self) -> list[str]:
        return [f for t in self.tables for f in t.feature_names]

    def only(self, feature: str | None) -> DatasetLayout:
        """The layout of one feature column (None: of no feature), to check a column alone."""
        tables = tuple(
            DatasetTable(t.name, t.num_embeddings, (feature,)) for t in self.tables if feature in t.feature_names
        )
        return DatasetLayout(self.name, self.num_dense, tables, self.sized)

    @classmethod
    def of_model(cls, model: ModelSpec) -> DatasetLayout:
        return cls(
            model.name,
            model.num_dense,
            tuple(DatasetTable(t.name, t.num_embeddings, t.feature_names) for t in model.tables),
        )

    @classmethod
    def of_spec(cls, spec: DataSpec) -> DatasetLayout:
        tables: dict[str, list[Any]] = {}
        for f in spec.features:
            tables.setdefault(f.table, [f.rows, []])[1].append(f.name)
        return cls(spec.model, spec.num_dense, tuple(DatasetTable(n, r, tuple(fs)) for n, (r, fs) in tables.items()))

    @classmethod
    def of_schema(cls, schema: pa.Schema, where: str) -> DatasetLayout:
        """Nothing stored: the first file's columns, every table of unknown size."""
        dense = schema.field("dense").type if "dense" in schema.names else None
        num_dense = dense.list_size if dense is not None and pa.types.is_fixed_size_list(dense) else 0
        unbounded = int(np.iinfo(np.int64).max)
        tables = tuple(DatasetTable(c, unbounded, (c,)) for c in schema.names if c not in ("label", "dense"))
        return cls(f"like {where} (none stored)", num_dense, tables, sized=False)


def dataset_layout(info: dict[str, Any], files: list[Path], where: str) -> tuple[DatasetLayout, list[str]]:
    """The layout the dataset declares (its data spec, else its model, else its first file's
    columns) and the problem, if any, met reading the stored description (`where`): `info` as stored, any shape
    (a damaged data_spec or model is that problem)."""
    problem = None
    try:
        if info.get("data_spec"):
            return DatasetLayout.of_spec(DataSpec.from_dict(info["data_spec"])), []
        if info.get("model"):
            return DatasetLayout.of_model(ModelSpec.from_dict(info["model"])), []
    except (UserError, KeyError, TypeError, ValueError, AttributeError) as exc:
        problem = f"{where}: unreadable data_spec/model ({_first_line(exc)}); columns checked against {files[0].name}"
    try:
        layout = DatasetLayout.of_schema(pq.read_schema(files[0]), files[0].name)
    except (pa.ArrowException, OSError):
        layout = DatasetLayout("unknown", 0, (), sized=False)  # the file itself is reported unreadable
    return layout, [problem] if problem else []


def dataset_problems(path: str | Path) -> list[str]:
    """Every structural problem of the dataset at `path`, one line each; empty: it is sound.

    Training's own checks, applied to all of the dataset instead of stopping at the first
    failure: `check_schema` on each file (missing, unexpected or mistyped label, dense and
    feature columns), `validate_table` on each row group, one column at a time (nulls, ids
    outside [0, rows) of their table), plus files and rows against the sidecar. A
    nonexistent path or a directory without Parquet files stays a `UserError` (a user
    mistake, not a broken dataset)."""
    if _requests_info(path) is not None:
        return dataset_stats(path)["problems"]
    return _inspect(path)[3]


def _requests_info(path: str | Path) -> JsonObject | None:
    """The description of a dataset of HSTU requests, else None (an unreadable one `_inspect` reports)."""
    try:
        info = read_dataset_info(path)
    except UserError:
        return None
    return info if info.get("kind") == "requests" else None


def _inspect(path: str | Path) -> tuple[dict[str, Any], list[Path], DatasetLayout, list[str]]:
    files = dataset_files(path)
    problems: list[str] = []
    info: dict[str, Any]  # the description as stored: any shape (what it lacks or mistypes is reported)
    try:
        info = read_dataset_info(path)
    except UserError as exc:  # the path exists: a bad sidecar or first file is the dataset's fault
        info = {}
        problems.append(str(exc))
    sidecar = dataset_sidecar(path) if Path(path).is_dir() else None
    layout, bad = dataset_layout(info, files, str(sidecar or files[0]))
    problems += bad + _sidecar_problems(path, sidecar, info, files)
    total = 0
    for f in files:
        try:
            pf = pq.ParquetFile(f)
        except (pa.ArrowException, OSError) as exc:
            problems.append(f"{f}: not a readable Parquet file ({_first_line(exc)})")
            continue
        try:
            check_schema(f, pf.schema_arrow, layout)
        except UserError as exc:
            problems.append(str(exc))  # the columns that are there are still checked below
        names = pf.schema_arrow.names
        columns = [(c, layout.only(None)) for c in names if c not in layout.feature_names]
        columns += [(c, layout.only(c)) for c in layout.feature_names if c in names]
        for rg in range(pf.num_row_groups):
            where = f"{f}: row group {rg}"
            try:
                table = pf.read_row_group(rg)
            except (pa.ArrowException, OSError) as exc:
                problems.append(f"{where} unreadable ({_first_line(exc)})")
                continue
            total += table.num_rows
            for name, one in columns:  # column by column: each bad column is named, not only the first
                try:
                    validate_table(table.select([name]), one, where)
                except UserError as exc:
                    problems.append(str(exc))
                except (pa.ArrowException, TypeError, ValueError) as exc:  # a type check_schema refused
                    problems.append(f"{where}: column {name} cannot be checked ({_first_line(exc)})")
    if total == 0 and not problems:
        problems.append(f"{path}: the dataset has no rows")
    return info, files, layout, problems


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def _sidecar_problems(path: str | Path, sidecar: Path | None, info: JsonObject, files: list[Path]) -> list[str]:
    """Files and rows the sidecar lists against what the directory holds."""
    entries = info.get("files")
    if sidecar is None or not isinstance(entries, list):
        return []
    problems = []
    listed = {str(e.get("path")): e for e in entries if isinstance(e, dict)}
    on_disk = {f.name: f for f in files}
    for name in listed:
        if name not in on_disk:
            problems.append(f"{sidecar}: lists {name}, which is not in {path}")
    actual = 0
    for name, f in on_disk.items():
        if name not in listed:
            problems.append(f"{f}: not listed in {sidecar} (a stray file: training would read it)")
        try:
            rows = pq.ParquetFile(f).metadata.num_rows
        except (pa.ArrowException, OSError):
            continue  # reported as unreadable with the file's other checks
        actual += rows
        want = listed.get(name, {}).get("rows")
        if isinstance(want, int) and want != rows:
            problems.append(f"{f}: {rows:,} rows; {sidecar} says {want:,}")
    total = info.get("rows")
    if not problems and isinstance(total, int) and total != actual:
        problems.append(f"{sidecar}: rows {total:,}; its files hold {actual:,}")
    return problems


def dataset_stats(path: str | Path) -> DatasetStats:
    """Measure every feature of a dataset; compare with its stored spec where it has one.

    A dataset with structural problems (`dataset_problems`) is not measured: the result
    then holds them under "problems" (one line each) and no features or checks. A dataset of
    HSTU requests is measured by `request_files.request_stats` (quantities instead of features)."""
    requests = _requests_info(path)
    if requests is not None:
        return request_stats(path, requests, dataset_files(path))
    info, files, layout, problems = _inspect(path)
    source = info.get("source", "unknown")
    if problems:
        return {"path": str(path), "source": source, "problems": problems, "features": [], "checks": []}
    spec = DataSpec.from_dict(info["data_spec"]) if info.get("data_spec") else None
    rows_of = {f: t.num_embeddings for t in layout.tables for f in t.feature_names} if layout.sized else {}
    try:
        labels = pq.read_table(files, columns=["label"]).column("label").to_numpy()
    except Exception as exc:  # noqa: BLE001 - any read failure is a bad dataset
        raise UserError(f"{path}: cannot read column label ({str(exc).splitlines()[0]})") from None
    n = len(labels)
    if n == 0:
        raise UserError(f"{path}: the dataset has no rows")
    schema_names = pq.read_schema(files[0]).names
    feature_names = [c for c in schema_names if c not in ("label", "dense")]
    features, checks = [], []
    for name in feature_names:
        col = pq.read_table(files, columns=[name]).column(name)
        lengths = pc.list_value_length(col).to_numpy(zero_copy_only=False)
        ids = pc.list_flatten(col).to_numpy(zero_copy_only=False)
        rows = rows_of.get(name, int(ids.max()) + 1 if ids.size else 1)
        counts = np.bincount(ids, minlength=rows) if ids.size else np.zeros(rows, dtype=np.int64)
        top = max(1, math.ceil(rows / 100))
        top_share = float(np.partition(counts, rows - top)[rows - top :].sum() / max(ids.size, 1))
        alpha = fit_zipf_alpha(counts)
        row: FeatureStats = {
            "feature": name,
            "table_rows": rows,
            "samples": n,
            "lookups": int(ids.size),
            "unique_ids": int(np.count_nonzero(counts)),
            "top1pct_share": top_share,
            "zipf_alpha_fit": alpha,
            "pooling_mean": float(lengths.mean()),
            "pooling_p99": percentile(lengths, 99),
        }
        features.append(row)
        if spec is not None:
            checks.extend(_feature_checks(spec, name, row, lengths, rows, top))
    label_rate = float(labels.mean())
    if spec is not None:
        # the teacher was calibrated on a sample: allow its error beside binomial noise
        p = spec.click_rate
        checks.append(Check("(labels)", "label rate", label_rate, p, 4 * math.sqrt(p * (1 - p) / n) + 0.05 * p))
    return {
        "path": str(path),
        "source": source,
        "problems": [],
        "samples": n,
        "label_rate": label_rate,
        "teacher_auc": (info.get("teacher") or {}).get("teacher_auc"),
        "features": features,
        "checks": checks,
    }


def _feature_checks(
    spec: DataSpec, name: str, row: FeatureStats, lengths: np.ndarray, rows: int, top: int
) -> list[Check]:
    by_name = {f.name: f for f in spec.features}
    if name not in by_name:
        return [Check(name, "present in spec", 0.0, 1.0, 0.0)]
    f = by_name[name]
    out = []
    mean = expected_pooling(f.pooling)
    sem = float(lengths.std()) / math.sqrt(len(lengths))
    out.append(Check(name, "pooling mean", row["pooling_mean"], mean, 4 * sem + POOLING_RELATIVE_TOLERANCE * mean))
    if f.drift_every is None:  # drift moves the hot rows: the overall share is not the spec's
        share = expected_top_share(f.ids, rows, top)
        if share is not None:
            out.append(Check(name, "top-1% share", row["top1pct_share"], share, TOP_SHARE_TOLERANCE))
        if f.ids["distribution"] == "zipf" and row["zipf_alpha_fit"] is not None:
            out.append(Check(name, "zipf alpha", row["zipf_alpha_fit"], f.ids["alpha"], ALPHA_TOLERANCE))
    return out

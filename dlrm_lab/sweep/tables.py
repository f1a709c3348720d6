"""A sweep's tables, rebuilt from its run directories after every point (never appended to): `points.parquet`, one
row per point and repeat, and `summary.parquet`, per point each metric's median, 95% bootstrap CI, coefficient of
variation and unstable flag over the repeats (or the rows a sweep's own `summarise` makes, as scaling's)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

import pyarrow as pa
import pyarrow.parquet as pq

from dlrm_lab.metrics import columns
from dlrm_lab.metrics.run import Run, read_manifest
from dlrm_lab.metrics.tables import write_table
from dlrm_lab.sweep.grid import SweepSpec
from dlrm_lab.sweep.results import PointResult, SweepResult

# Columns that tell apart several summary rows of one child run (inference: per point, model, mode).
_ROW_KEYS = ("point", "model", "mode")

POINTS_SCHEMA = columns.schema_of("sweep points")

_Row = dict[str, str | float | bool | None]  # a row as `metrics.tables.write_table` takes it


def write_sweep_tables(run: Run, spec: SweepSpec, result: SweepResult) -> None:
    """points.parquet and summary.parquet, rebuilt from what is on disk (never appended to)."""
    rows: list[_Row] = []
    for pr in result.points:
        child = pr.child_dir
        rows.append(
            columns.PointRow(
                {
                    "point": pr.point,
                    "repeat": pr.repeat,
                    "params_json": json.dumps(pr.params, sort_keys=True),
                    "status": pr.status,
                    "child_run_id": child.name if child else None,
                    "child_dir": str(child.relative_to(run.dir)) if child else None,
                    "seconds": pr.seconds if pr.seconds is not None else _run_seconds(child),
                    "attempts": pr.attempts,
                }
            )
        )
    write_table(run.dir, "points", rows, POINTS_SCHEMA, run.run_id)
    summary: list[_Row]
    if spec.summarise is not None:
        made, schema = spec.summarise(spec, result)
        summary = cast("list[_Row]", made)  # its rows, as made (a list): `write_table` only reads them
    else:
        summary = aggregate(result, spec)
        schema = summary_schema(spec, summary)
    write_table(run.dir, "summary", summary, schema, run.run_id)


def _run_seconds(child: Path | None) -> float | None:
    return cast("float | None", read_manifest(child).get("duration_s")) if child else None  # seconds, or null


def aggregate(result: SweepResult, spec: SweepSpec) -> list[dict[str, str | float | bool | None]]:
    """Per point (and per inference point/model/mode inside it), each metric's median, 95%
    bootstrap CI, coefficient of variation and unstable flag over the finished repeats: a row's names are the
    grid's and the metrics' (`summary_schema`), not a registered table's."""
    from dlrm_lab.metrics.stats import estimate

    by_point: dict[int, list[PointResult]] = {}
    for pr in result.points:
        by_point.setdefault(pr.point, []).append(pr)
    out: list[_Row] = []
    for point, prs in sorted(by_point.items()):
        groups: dict[tuple[Any, ...], list[dict[str, str | float | bool | None]]] = {}  # child rows, read back
        for pr in prs:
            if pr.status != "ok" or pr.child_dir is None or not (pr.child_dir / "summary.parquet").is_file():
                continue
            for child_row in pq.read_table(pr.child_dir / "summary.parquet").to_pylist():
                groups.setdefault(tuple(child_row.get(k) for k in _ROW_KEYS), []).append(child_row)
        base: _Row = {
            "point": point,
            "params_json": json.dumps(prs[0].params, sort_keys=True),
            **{f"param_{k}": str(v) for k, v in prs[0].params.items()},
            "repeats_ok": sum(p.status == "ok" for p in prs),
            "repeats": len(prs),
        }
        if not groups:
            out.append(base)
            continue
        for key, rows in groups.items():
            row: _Row = {**base, **{f"child_{k}": v for k, v in zip(_ROW_KEYS, key, strict=True) if v is not None}}
            for metric in spec.all_metrics:
                values = [r[metric] for r in rows if isinstance(r.get(metric), (int, float))]
                row.update(estimate(values).to_columns(metric))
            out.append(row)
    return out


def summary_schema(spec: SweepSpec, rows: list[dict[str, str | float | bool | None]]) -> pa.Schema:
    """A point's registered columns (`metrics.columns`) with its grid's `param_*` and the child row's keys, then
    each metric's aggregates (`metrics.stats.Estimate.to_columns`): names the grid gives at run time."""
    typed = columns.COLUMNS
    fields = [pa.field(name, typed[name].type) for name in ("point", "params_json")]
    fields += [pa.field(f"param_{k}", pa.string()) for k in (spec.points[0] if spec.points else {})]
    fields += [pa.field(name, typed[name].type) for name in ("repeats_ok", "repeats")]
    fields += [pa.field(f"child_{key}", typed[key].type) for key in _ROW_KEYS]
    for metric in spec.all_metrics:
        fields += [pa.field(f"{metric}_{s}", pa.float64()) for s in ("median", "ci_low", "ci_high", "cv")]
        fields += [pa.field(f"{metric}_unstable", pa.bool_()), pa.field(f"{metric}_n", pa.int32())]
    return pa.schema(fields)

"""What a comparison reads from each side's runs: the runs found under a path (only those that ended `ok`; the
container runs of sweeps are skipped, the runs inside them count), and the samples they give a metric: each run's
summary value (a repeat), or within-run samples pooled over the side: training's measured steps (global throughput
and the slowest rank's step time per step), inference's `ok` queries per model and their completions per 1-s bin.
The rules that choose between them are `report.compare`'s."""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from dlrm_lab.config.values import JsonObject
from dlrm_lab.metrics import run as metrics_run

CONTAINER_KINDS = ("scale", "sweep")  # their points are runs of their own, found below them


# ----------------------------------------------------------------------------- runs


@dataclass
class RunSamples:
    dir: Path
    manifest: JsonObject

    @property
    def kind(self) -> str:
        return str(self.manifest.get("kind") or "?")

    @cached_property
    def summary(self) -> list[dict[str, str | float | bool | None]]:  # summary.parquet's rows, read back
        path = self.dir / "summary.parquet"
        return pq.read_table(path).to_pylist() if path.is_file() else []

    def columns(self, table: str, names: list[str]) -> dict[str, np.ndarray] | None:
        """Columns of `<table>.parquet` as numpy arrays (null numbers: NaN; null booleans:
        False), or None when the table or a column is missing or it has no rows."""
        path = self.dir / f"{table}.parquet"
        if not path.is_file() or not set(names) <= set(pq.read_schema(path).names):
            return None
        data = pq.read_table(path, columns=names)
        if data.num_rows == 0:
            return None
        out = {}
        for name in names:
            col = data[name]
            if pa.types.is_boolean(col.type):
                col = pc.fill_null(col, False)
            out[name] = col.to_numpy(zero_copy_only=False)
        return out


def discover_runs(path: str | Path) -> tuple[list[RunSamples], list[str]]:
    """Runs under `path` (a run, or a directory of runs at any depth), oldest first, and
    notes on what was skipped (sweep containers silently; unreadable or not-ok runs noted)."""
    runs: list[RunSamples] = []
    notes: list[str] = []
    not_ok: Counter[str] = Counter()
    for found in metrics_run.discover_runs(path, nested=True):
        if found.manifest is None:
            notes.append(f"{found.dir}: unreadable, skipped ({found.error})")
            continue
        if found.manifest.get("kind") in CONTAINER_KINDS:
            continue
        if found.manifest.get("status") != "ok":
            not_ok[str(found.manifest.get("status"))] += 1
            continue
        runs.append(RunSamples(found.dir, found.manifest))
    if not_ok:
        notes.append(f"{path}: skipped runs that did not end ok: " + ", ".join(f"{n} {s}" for s, n in not_ok.items()))
    return runs, notes


# ----------------------------------------------------------------------------- samples


def count_finite(values: list[Any]) -> int:
    return sum(1 for v in values if v is not None and np.isfinite(v))


def summary_values(runs: list[RunSamples], name: str) -> list[Any]:
    return [r.summary[0].get(name) for r in runs if r.summary]


def train_steps(runs: list[RunSamples]) -> tuple[np.ndarray, np.ndarray]:
    """Per measured step of every run: global throughput and the slowest rank's step time."""
    rates, times = [], []
    for run in runs:
        cols = run.columns("steps", ["step", "batch_size", "step_time_ms", "warmup"])
        if cols is None:
            continue
        measured: np.ndarray = ~cols["warmup"].astype(bool)  # null (warm-up never detected): measured
        step = cols["step"][measured].astype(np.int64)
        if len(step) == 0:
            continue
        ids, inverse = np.unique(step, return_inverse=True)
        samples = np.bincount(inverse, weights=cols["batch_size"][measured].astype(np.float64), minlength=len(ids))
        slowest = np.full(len(ids), -np.inf)
        np.maximum.at(slowest, inverse, cols["step_time_ms"][measured].astype(np.float64))
        with np.errstate(divide="ignore", invalid="ignore"):
            rates.append(samples / (slowest / 1000.0))
        times.append(slowest)
    empty = np.empty(0)
    return (np.concatenate(rates) if rates else empty, np.concatenate(times) if times else empty)


def infer_groups(
    runs: list[RunSamples],
) -> dict[tuple[str, str], list[tuple[RunSamples, list[dict[str, str | float | bool | None]]]]]:
    groups: dict[tuple[str, str], list[tuple[RunSamples, list[dict[str, str | float | bool | None]]]]]
    groups = defaultdict(list)
    for run in runs:
        by_key: dict[tuple[str, str], list[dict[str, str | float | bool | None]]] = defaultdict(list)
        for row in run.summary:
            by_key[(str(row.get("model")), str(row.get("mode") or "-"))].append(row)
        for key, rows in by_key.items():
            groups[key].append((run, rows))
    return groups


_QUERY_COLUMNS = ["latency_ms", "end_ms", "samples"]


def ok_queries(
    group: list[tuple[RunSamples, list[dict[str, str | float | bool | None]]]], model: str
) -> list[dict[str, np.ndarray]]:
    """Per run and point of the group: the model's ok queries (latency, end time, samples)."""
    out = []
    for run, rows in group:
        path = run.dir / "queries.parquet"
        if not path.is_file() or not {"point", "model", "status", *_QUERY_COLUMNS} <= set(pq.read_schema(path).names):
            continue
        table = pq.read_table(path, columns=["point", "model", "status", *_QUERY_COLUMNS])
        table = table.filter(pc.and_(pc.equal(table["model"], model), pc.equal(table["status"], "ok")))
        for point in sorted({r.get("point") for r in rows}, key=lambda p: -1 if p is None else p):
            sel = table if point is None else table.filter(pc.equal(table["point"], point))
            out.append({c: sel[c].to_numpy(zero_copy_only=False).astype(np.float64) for c in _QUERY_COLUMNS})
    return out


def latencies_of(queries: list[dict[str, np.ndarray]]) -> np.ndarray:
    return np.concatenate([q["latency_ms"] for q in queries]) if queries else np.empty(0)


def per_second(queries: list[dict[str, np.ndarray]], samples: bool) -> np.ndarray:
    """Completed queries (or samples) per 1-s bin of end_ms, first and last (partial) bins
    dropped; bins with no completion in between count as 0."""
    counts = []
    for q in queries:
        end = q["end_ms"]
        keep = np.isfinite(end)
        if not keep.any():
            continue
        bins = np.floor(end[keep] / 1000.0).astype(np.int64)
        bins -= bins.min()
        counts.append(np.bincount(bins, weights=q["samples"][keep] if samples else None)[1:-1])
    return np.concatenate(counts).astype(np.float64) if counts else np.empty(0)

"""Finding run directories and reading what the report draws from them.

Only `manifest.json` and Parquet files are read (plus a machine profile for the roofline
ceilings), and of the Parquet files only the columns a plot or table uses: a report over
hundreds of runs or a sweep of many thousand queries stays a matter of seconds. A file
that is missing or unreadable becomes a note on its run, never an exception.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict, cast

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from dlrm_lab.config.values import JsonObject, section
from dlrm_lab.errors import UserError
from dlrm_lab.metrics import columns
from dlrm_lab.metrics.run import MANIFEST, discover_runs, one_line

CONFIG_KEYS = ("instances", "threads_per_instance", "max_batch", "max_delay_ms")


@dataclass
class RunInfo:
    """One run directory: its manifest, kind, the run it is nested in, and reading notes."""

    dir: Path
    manifest: JsonObject
    kind: str
    run_id: str
    parent: str | None = None  # run_id of the enclosing scale or sweep run
    notes: list[str] = field(default_factory=list)

    @property
    def status(self) -> str | None:
        return cast("str | None", self.manifest.get("status"))  # as the manifest has it (`metrics.run.STATUSES`)

    @property
    def short(self) -> str:
        """`kind:hex` (the run id's random suffix): short enough for a plot legend."""
        return f"{self.kind}:{self.run_id.rsplit('-', 1)[-1]}"

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)


# A row the report read back from a run's table (summary, frontier, probes): its scalars by name, each of its
# column's type (read from Parquet: known only at run time), and the report's own keys beside them: `run_id`, `_run`
# (the RunInfo it came from: `run_of`) and, where a figure adds them, `label`, `ceiling`
ReportRow = dict[str, Any]


def run_of(row: ReportRow) -> RunInfo:
    """The run a row was read from (its `_run`, which every row the report reads carries)."""
    return cast(RunInfo, row["_run"])


def discover(paths: list[str | Path] | str | Path) -> list[RunInfo]:
    """Every run directory (one holding manifest.json) under `paths`, at any depth, oldest first
    (`dlrm_lab.metrics.run.discover_runs`). Runs nest (a scale or sweep run keeps its points'
    runs below it): each nested run knows its enclosing run as `parent`."""
    found = discover_runs(paths if isinstance(paths, list) else [paths], nested=True)
    if not found:
        shown = ", ".join(str(p) for p in (paths if isinstance(paths, list) else [paths]))
        raise UserError(f"no run directory (one holding {MANIFEST}) under {shown}")
    ids = {f.dir: f.run_id for f in found}
    infos = []
    for f in found:
        info = RunInfo(f.dir, f.manifest or {}, f.kind, f.run_id, ids.get(f.parent) if f.parent else None)
        if f.manifest is None:
            info.note(f"{MANIFEST} unreadable ({f.error.split(': ', 1)[-1] if f.error else ''})")
        infos.append(info)
    return infos


def read_table(
    run: RunInfo, name: str, columns: list[str] | None = None, filters: Any = None, required: bool = True
) -> pa.Table | None:
    """`<run>/<name>.parquet`, only the `columns` it has; None (and a note) when missing or corrupt."""
    path = run.dir / f"{name}.parquet"
    if not path.is_file():
        if required:
            run.note(f"{name}.parquet missing (run status {run.status})")
        return None
    try:
        names = pq.read_schema(path).names
        cols = [c for c in columns if c in names] if columns is not None else None
        return pq.read_table(path, columns=cols, filters=filters)
    except Exception as exc:  # noqa: BLE001 - truncated, garbage or not Parquet at all: report it, go on
        run.note(f"{name}.parquet unreadable ({one_line(exc)})")
        return None


def _rows(run: RunInfo, name: str, wanted: tuple[str, ...]) -> list[ReportRow] | None:
    table = read_table(run, name, list(wanted))
    if table is None:
        return None
    rows = table.to_pylist()
    if not rows:
        run.note(f"{name}.parquet has no rows")
    for r in rows:
        r["run_id"], r["_run"] = run.run_id, run
    return rows


@dataclass
class SearchRun:
    """A latency-bounded search: its frontier (one row per configuration) and probe rows."""

    run: RunInfo
    frontier: list[ReportRow]
    probes: list[ReportRow]

    def best_row(self) -> ReportRow | None:
        return next((r for r in self.frontier if r.get("best")), None)

    def best_probe_points(self) -> dict[tuple, list[ReportRow]]:
        """Per configuration, the summary rows (all repeats) of its highest passing probe."""
        out: dict[tuple, list[ReportRow]] = {}
        for key, rows in group_by_config(self.probes).items():
            passing = [r for r in rows if r.get("passed") and r.get("target_qps") is not None]
            if passing:
                top = max(r["target_qps"] for r in passing)
                out[key] = [r for r in passing if r["target_qps"] == top]
        return out


@dataclass
class ReportData:
    runs: list[RunInfo]
    train: list[ReportRow] = field(default_factory=list)  # one row per train run
    infer: list[ReportRow] = field(default_factory=list)  # one row per infer run, point and model
    search: list[SearchRun] = field(default_factory=list)
    scale: list[ReportRow] = field(default_factory=list)  # one row per point of each scale run
    sweeps: list[tuple[RunInfo, pa.Table]] = field(default_factory=list)
    sweep_children: dict[str, dict[int, list[str]]] = field(default_factory=dict)  # sweep -> point -> child run ids


def collect(runs: list[RunInfo]) -> ReportData:
    """Read every run's summary-sized tables (queries are read later, for the few curves drawn)."""
    data = ReportData(runs)
    for run in runs:
        if run.kind == "train":
            rows = _rows(run, "summary", columns.TRAIN_READ)
            data.train.extend(rows[:1] if rows else [{"run_id": run.run_id, "_run": run}])
        elif run.kind == "infer":
            rows = _rows(run, "summary", columns.INFER_READ)
            data.infer.extend(rows or [{"run_id": run.run_id, "_run": run}])
        elif run.kind == "infer-search":
            frontier = _rows(run, "frontier", columns.FRONTIER_READ) or []
            probes = _rows(run, "summary", columns.SEARCH_READ) or []
            data.search.append(SearchRun(run, frontier, probes))
        elif run.kind == "scale":
            data.scale.extend(_rows(run, "summary", columns.SCALE_READ) or [{"run_id": run.run_id, "_run": run}])
        elif run.kind == "sweep":
            table = read_table(run, "summary")
            if table is not None:
                data.sweeps.append((run, table))
            children = read_table(run, "points", ["point", "repeat", "child_run_id"], required=False)
            if children is not None:
                by_point = data.sweep_children.setdefault(run.run_id, {})
                for r in children.to_pylist():
                    if r.get("child_run_id") and r.get("point") is not None:
                        by_point.setdefault(r["point"], []).append(r["child_run_id"])
    return data


def config_of(row: ReportRow) -> tuple:
    return tuple(row.get(k) for k in CONFIG_KEYS)


def config_label(row: ReportRow) -> str:
    i, t, b, d = config_of(row)
    delay = "?" if d is None else f"{d:g}"
    return f"{i}x{t} threads, batch {b}, delay {delay} ms"


def group_by_config(rows: list[ReportRow]) -> dict[tuple, list[ReportRow]]:
    out: dict[tuple, list[ReportRow]] = {}
    for r in rows:
        out.setdefault(config_of(r), []).append(r)
    return out


@dataclass
class Curves:
    """Latency samples per curve label, what was left out, and the bounds to draw."""

    latencies: dict[str, np.ndarray]
    left_out: int
    sla_ms: list[float]
    notes: list[str]
    floors: dict[str, float] = field(default_factory=dict)  # label -> median latency_floor_ms of its rows


def median_floor(rows: list[ReportRow]) -> float | None:
    """The latency floor of a curve drawn from several summary rows (one configuration)."""
    found = [f for r in rows if isinstance(f := r.get("latency_floor_ms"), (int, float)) and np.isfinite(f)]
    return float(np.median(found)) if found else None


def latency_curves(data: ReportData, limit: int = 12) -> Curves:
    """Completed queries' latencies: one curve per (infer run, point, model) and, for searches,
    per configuration at its highest passing probe. Candidates come from the summaries, so
    queries.parquet is read only for the `limit` curves drawn (best configurations first)."""
    wanted: list[tuple[RunInfo, str, list[int], str | None, list[ReportRow]]] = []
    notes: list[str] = []
    for s in data.search:
        by_config = s.best_probe_points()
        score = {config_of(f): f.get("best_samples_per_s") or 0.0 for f in s.frontier}
        unpassed = len(group_by_config(s.probes)) - len(by_config)
        if unpassed:
            notes.append(f"{s.run.short}: {unpassed} configuration(s) passed no probe: no curve")
        for key in sorted(by_config, key=lambda k: -score.get(k, 0.0)):
            rows = by_config[key]
            label = f"{s.run.short} {config_label(rows[0])} @ {rows[0]['target_qps']:.0f} q/s"
            wanted.append((s.run, label, [r["point"] for r in rows], rows[0].get("model"), rows))
    for r in data.infer:
        if r.get("point") is None:
            continue
        label = f"{run_of(r).short} p{r['point']} {r.get('model')} ({r.get('mode')})"
        wanted.append((run_of(r), label, [r["point"]], r.get("model"), [r]))
    drawn, left_out = wanted[:limit], max(0, len(wanted) - limit)
    latencies: dict[str, np.ndarray] = {}
    by_run: dict[Path, list] = {}
    for w in drawn:
        by_run.setdefault(w[0].dir, []).append(w)
    for items in by_run.values():
        run = items[0][0]
        points = sorted({p for w in items for p in w[2]})
        table = read_table(
            run,
            "queries",
            ["point", "model", "status", "latency_ms"],
            filters=[("status", "=", "ok"), ("point", "in", points)],
        )
        if table is None:
            continue
        point = table["point"].to_numpy(zero_copy_only=False)
        model = np.asarray(table["model"].to_pylist(), dtype=object)
        latency = table["latency_ms"].to_numpy(zero_copy_only=False).astype(np.float64)
        for _, label, pts, name, _ in items:
            mask = np.isin(point, pts) & ~np.isnan(latency)
            if name is not None:
                mask &= model == name
            if mask.any():
                latencies[label] = latency[mask]
    bounds = sorted({row["sla_ms"] for w in drawn for row in w[4] if row.get("sla_ms")})
    floors = {w[1]: f for w in drawn if w[1] in latencies and (f := median_floor(w[4])) is not None}
    return Curves(latencies, left_out, bounds, notes, floors)


def device_of(run: RunInfo, row: ReportRow) -> str:
    """The device a row ran on: the training summary says; inference has it in its config."""
    infer = section(run.manifest, "config", "infer")
    return str(row.get("device") or infer.get("device") or "cpu")


class Ceilings(TypedDict):
    """A machine's roofline ceilings (`ceilings`): what `report.plots.roofline` draws a run under."""

    compute: dict[str, float]  # GEMM FLOP/s per precision
    gather_bytes_per_s: float  # the embedding gather bandwidth (on 2 MiB pages where the probe found them faster)
    gather_base_bytes_per_s: float | None  # the same gather on 4 KiB pages: tables the kernel left there
    gather_rows_per_s: float | None  # random 64-byte rows a second: the ceiling of narrow rows, whatever their bytes
    basis: str  # the profile and the device (or thread count) they are of


def ceilings(fingerprint_id: str | None, device: str, profile: JsonObject | None = None) -> Ceilings | str:
    """The roofline's ceilings from a machine profile (`profile`: the one a run carries; else this machine's cache
    of that fingerprint): the all-core (or GPU) GEMM peak per precision and the embedding gather bandwidth; a reason
    (str) when there are none."""
    from dlrm_lab.metrics.roofline import load_profile

    if not fingerprint_id:
        return "the manifest has no hardware fingerprint"
    if profile is None:
        try:
            profile = load_profile(fingerprint_id)
        except UserError as exc:
            return str(exc)
    if profile is None:
        return f"no machine profile for fingerprint {fingerprint_id} (run 'dlrm-lab machine probe' on that machine)"
    devices: Any = profile.get("devices") or {}  # as read from disk: a section of another shape is caught below
    try:
        if device.startswith("cuda"):
            key = device if ":" in device else next((k for k in sorted(devices) if k.startswith("cuda")), "cuda:0")
            peaks, basis = devices[key], key
        else:
            threads = devices["cpu"]["threads"]
            most = max(threads, key=int)
            peaks, basis = threads[most], f"cpu {most} threads"
        compute = {k: float(v) for k, v in peaks["gemm_flops_per_s"].items() if v}
        gather = float(peaks["gather_bytes_per_s"])
    except (KeyError, TypeError, ValueError):
        return f"the machine profile {fingerprint_id} has no {device} GEMM and gather peaks"
    if not compute or not gather > 0:
        return f"the machine profile {fingerprint_id} has no {device} GEMM and gather peaks"
    pages = peaks.get("gather_pages") or {}
    base, rows = _positive(pages.get("base_bytes_per_s")), _positive(peaks.get("gather_rows_per_s"))
    return {
        "compute": compute,
        "gather_bytes_per_s": gather,
        "gather_base_bytes_per_s": base,
        "gather_rows_per_s": rows,
        "basis": f"{fingerprint_id[:8]} {basis}",
    }


def _positive(value: Any) -> float | None:
    try:
        return float(value) if value is not None and float(value) > 0 else None
    except (TypeError, ValueError):
        return None

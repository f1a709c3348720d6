"""The report's figures: which runs each plot draws and the notes under it (`BUILDERS`), data in,
PNGs out through `report.plots`; `report.html` lays them out on the page."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np
import pyarrow.parquet as pq

from dlrm_lab.config.family import family_of, spec_from_dict
from dlrm_lab.config.values import JsonObject, section
from dlrm_lab.metrics import columns
from dlrm_lab.metrics.canary import ratios as canary_ratios
from dlrm_lab.metrics.roofline import run_profile
from dlrm_lab.report import plots
from dlrm_lab.report.load import (
    Ceilings,
    ReportData,
    ReportRow,
    RunInfo,
    ceilings,
    config_label,
    config_of,
    device_of,
    group_by_config,
    latency_curves,
    median_floor,
    run_of,
)

TITLES = {
    "latency_cdf": "Latency CDFs per configuration",
    "qps_vs_p99": "Throughput against tail latency",
    "latency_parts": "Where the tail's latency went",
    "heatmap": "Batching x co-location (latency-bounded samples/s)",
    "training_phases": "Training throughput and step-time phases",
    "scaling": "Scaling efficiency",
    "roofline": "Roofline",
    "energy": "Energy efficiency",
    "sweep": "Sweeps: medians with confidence intervals",
    "collectives": "Collectives compared: bus bandwidth per transport",
    "request_flops": "HSTU ranker: FLOPs per request against history length",
    "machines": "Machines side by side: cost per 1M inferences against the latency bound",
    "canary": "The host's speed beside the run's (speed canary)",
}


Drawings = dict[str, tuple[plots.Drawn, list[str]]]  # plots drawn with their notes, by name
Made = Drawings | str  # plots drawn with their notes, or why none was


def _latency(data: ReportData, out: Path) -> Made:
    curves = latency_curves(data, plots.MAX_CURVES)
    if not curves.latencies:
        return "no infer or infer-search run with completed queries (queries.parquet, status ok)" + (
            f"; {'; '.join(curves.notes)}" if curves.notes else ""
        )
    drawn = plots.latency_cdf(
        curves.latencies, out / "latency_cdf.png", curves.sla_ms, curves.left_out, floors=curves.floors
    )
    notes = list(curves.notes)
    if drawn.left_out:
        notes.append(
            f"{drawn.left_out} more curve(s) not drawn: at most {plots.MAX_CURVES}, searches' best configurations "
            "first, then infer points in run order"
        )
    return {"latency_cdf": (drawn, notes)}


def _qps(data: ReportData, out: Path) -> Made:
    # (queries/s, latency) as the rows hold them: `plots.qps_latency` draws the finite numbers
    series: dict[str, Sequence[tuple[Any, Any]]] = {}
    chosen: list[tuple[str, Any, Any]] = []
    floors: dict[str, float | None] = {}
    bounds: set[float] = set()
    percentiles: set[float] = set()
    infinite = 0
    for s in data.search:
        score = {config_of(f): f.get("best_samples_per_s") or 0.0 for f in s.frontier}
        groups = group_by_config(s.probes)
        for key in sorted(groups, key=lambda k: -score.get(k, 0.0)):
            rows = groups[key]
            infinite += sum(1 for r in rows if r.get("sla_latency_ms") is None)
            label = f"{s.run.short} {config_label(rows[0])}"
            series[label] = [(r.get("queries_per_s"), r.get("sla_latency_ms")) for r in rows]
            floors[label] = median_floor(rows)
        best = s.best_row()
        if best is not None:
            chosen.append(
                (f"{s.run.short} {config_label(best)}", best.get("best_qps"), best.get("best_sla_latency_ms"))
            )
        for r in [*s.frontier, *s.probes]:
            bounds.update([r["sla_ms"]] if r.get("sla_ms") else [])
            percentiles.update([r["sla_percentile"]] if r.get("sla_percentile") else [])
    by_config: dict[tuple, list[ReportRow]] = {}
    for r in data.infer:  # several rates of one configuration: the same curve from plain runs
        if r.get("point") is not None:
            by_config.setdefault((r.get("model"), r.get("mode"), *config_of(r)), []).append(r)
    for (model, mode, *_), rows in by_config.items():
        if len(rows) >= 2:
            label = f"{model} ({mode}) {config_label(rows[0])}"
            series[label] = [(r.get("queries_per_s"), r.get("sla_latency_ms")) for r in rows]
            floors[label] = median_floor(rows)
            bounds.update(r["sla_ms"] for r in rows if r.get("sla_ms"))
            percentiles.update(r["sla_percentile"] for r in rows if r.get("sla_percentile"))
    series = {k: kept for k, v in series.items() if (kept := [(x, y) for x, y in v if x is not None and y is not None])}
    if not series:
        return (
            "needs an infer-search run, or infer points at two or more rates of one configuration, with "
            "queries_per_s and sla_latency_ms"
        )
    pct = next(iter(percentiles)) if len(percentiles) == 1 else None
    drawn = plots.qps_latency(
        series,
        out / "qps_vs_p99.png",
        sorted(bounds),
        chosen,
        pct,
        floors={k: v for k, v in floors.items() if v is not None},
    )
    notes = []
    if infinite:
        notes.append(
            f"{infinite} probe(s) with dropped or unfinished queries (latency at the percentile infinite) are not drawn"
        )
    if drawn.left_out:
        notes.append(f"{drawn.left_out} more configuration(s) not drawn (best first, at most {plots.MAX_CURVES})")
    if not drawn.chosen and data.search:
        notes.append("no configuration met the bound: no chosen point")
    return {"qps_vs_p99": (drawn, notes)}


def _latency_parts(data: ReportData, out: Path) -> Made:
    rows = [{**r, "label": f"{run_of(r).short} p{r.get('point')} {r.get('model')}"} for r in data.infer]
    rows = [r for r in rows if r.get("tail_queue_ms") is not None]
    if not rows:
        return "no infer run with the latency parts (tail_*_ms) in its summary.parquet"
    drawn = plots.latency_parts(rows, columns.LATENCY_PARTS, out / "latency_parts.png")
    notes = (
        [f"{len(rows) - len(drawn.labels)} more point(s) not drawn (at most {plots.MAX_BARS} bars)"]
        if len(rows) > len(drawn.labels)
        else []
    )
    return {"latency_parts": (drawn, notes)}


def _heatmap(data: ReportData, out: Path) -> Made:
    made: Drawings = {}
    for s in data.search:
        rows = [r for r in s.frontier if None not in config_of(r)]
        if rows:
            name = f"heatmap-{s.run.run_id}"
            title = f"{s.run.short}: best samples/s under the bound (red box: chosen)"
            made[name] = (plots.batching_heatmap(rows, out / f"{name}.png", title), [])
    return made or "no infer-search run with a readable frontier.parquet"


def _phases(data: ReportData, out: Path) -> Made:
    rows = []
    for r in data.train:
        if r.get("step_time_ms_mean"):
            label = f"{run_of(r).short}\n{r.get('preset')} {r.get('world_size')}r b{r.get('global_batch_size')}"
            rows.append({**r, "label": label})
    if not rows:
        return "no train run with step_time_ms_mean in its summary.parquet"
    drawn = plots.training_phases(rows, out / "training_phases.png")
    notes = []
    if len(rows) > len(drawn.labels):
        notes.append(f"{len(rows) - len(drawn.labels)} more run(s) not drawn (at most {plots.MAX_BARS} bars)")
    if any(drawn.ms["unattributed"]):
        notes.append("pipelined runs have no phase shares (phases overlap): their bar is one 'unattributed' segment")
    return {"training_phases": (drawn, notes)}


def _request_flops(data: ReportData, out: Path) -> Made:
    models, runs = {}, {}
    for r in data.train:
        model = section(run_of(r).manifest, "config", "model")
        spec = spec_from_dict(model) if model else None
        if spec is not None and (curve := family_of(spec).request_flops_curve(spec)) is not None:
            label, shape, mean_history = curve
            models[label] = shape
            runs[f"{run_of(r).short} {spec.name}"] = (label, mean_history)
    if not models:
        return "no train run of a preset whose sample is a request of a history (the HSTU ranker)"
    return {"request_flops": (plots.request_flops(models, runs, out / "request_flops.png"), [])}


def _scaling(data: ReportData, out: Path) -> Made:
    rows = [r for r in data.scale if r.get("efficiency") is not None and r.get("ranks") is not None]
    if not rows:
        return "no scale run with efficiency values in its summary.parquet"
    runs_per_mode: dict[str | None, set[str]] = {}
    for r in rows:
        runs_per_mode.setdefault(r.get("mode"), set()).add(r["run_id"])
    for r in rows:  # one line per mode; per sweep when a mode was swept more than once
        r["label"] = r.get("mode") if len(runs_per_mode[r.get("mode")]) == 1 else f"{r.get('mode')} ({run_of(r).short})"
    return {"scaling": (plots.scaling_efficiency(rows, out / "scaling.png"), [])}


def _point_rows(data: ReportData) -> list[ReportRow]:
    """Runs and inference points placed on the roofline and the energy plot: each train run,
    each infer point and model, each search's chosen configuration at its best probe."""
    rows = [{**r, "label": f"{run_of(r).short} {r.get('preset')}"} for r in data.train]
    rows += [{**r, "label": f"{run_of(r).short} p{r.get('point')} {r.get('model')}"} for r in data.infer]
    for s in data.search:
        best = s.best_row()
        probe_rows = s.best_probe_points().get(config_of(best)) if best else None
        if probe_rows and best is not None:  # best is set wherever probe_rows is
            rows.append({**probe_rows[0], "label": f"{s.run.short} {best.get('model')} best"})
    return rows


def _roofline(data: ReportData, out: Path) -> Made:
    points, roofs, reasons = [], {}, []
    cache: dict[tuple, Ceilings | str] = {}
    for r in _point_rows(data):
        if not (r.get("flops_per_sample") and r.get("bytes_per_sample") and r.get("achieved_flops_per_s")):
            continue
        run = run_of(r)
        fingerprint = cast("str | None", section(run.manifest, "hardware").get("fingerprint_id"))  # as recorded
        key = (fingerprint, device_of(run, r))
        if key not in cache:  # the profile the run carries (made elsewhere, copied here), else this machine's
            cache[key] = ceilings(*key, profile=run_profile(run.manifest))
        c = cache[key]
        if isinstance(c, str):
            reasons.append(c)
            points.append({**r, "ceiling": None})
        else:
            roofs[c["basis"]] = c
            points.append({**r, "ceiling": c["basis"]})
    if not points:
        return "no run with flops_per_sample, bytes_per_sample and achieved_flops_per_s in its summary"
    drawn = plots.roofline(points, roofs, out / "roofline.png")
    notes = [f"points without ceilings: {reason}" for reason in dict.fromkeys(reasons)]
    if len(drawn.points) > plots.MAX_LABELS:
        notes.append(f"only the first {plots.MAX_LABELS} points are labelled")
    return {"roofline": (drawn, notes)}


def _collectives(data: ReportData, out: Path) -> Made:
    """The probed collectives of the machines the runs ran on, every transport side by side."""
    profiles: dict[str, JsonObject | None] = {}
    for run in data.runs:  # each machine's profile as its runs carry it (else this machine's cache of it)
        fid = cast("str | None", section(run.manifest, "hardware").get("fingerprint_id"))  # as recorded: a string
        if fid and profiles.get(fid) is None:
            profiles[fid] = run_profile(run.manifest)
    fingerprints = set(profiles)
    transports: dict[str, list[dict[str, Any]]] = {}  # the profiles' probed collectives
    for fid in sorted(fingerprints):
        profile = profiles[fid]
        comms: Any = (profile or {}).get("comms") or {}  # as the probe wrote it
        for key, rows in comms.items():
            transports[key if len(fingerprints) == 1 else f"{fid[:8]} {key}"] = rows
    if not transports:
        return "no machine profile of these runs holds collectives (dlrm-lab launch --nproc 2 -- machine probe)"
    return {"collectives": (plots.collectives(transports, out / "collectives.png"), [])}


def _energy(data: ReportData, out: Path) -> Made:
    rows, seen = [], set()
    for r in _point_rows(data):
        key = (r["run_id"], r.get("point"))  # energy is per point, shared by its models
        if key not in seen:
            seen.add(key)
            infer = run_of(r).kind == "infer"
            rows.append({**r, "label": f"{run_of(r).short} p{r.get('point')}" if infer else r["label"]})
    measured = [r for r in rows if r.get("energy_j") is not None]
    reasons = list(
        dict.fromkeys(
            r["energy_unavailable"] for r in rows if r.get("energy_j") is None and r.get("energy_unavailable")
        )
    )
    if not measured:
        why = "; ".join(reasons) if reasons else "energy_j is null in every summary"
        return f"no energy measured in any run: {why}"
    drawn = plots.energy(measured, out / "energy.png")
    notes = []
    if len(measured) < len(rows):
        notes.append(
            f"{len(rows) - len(measured)} run(s)/point(s) without energy"
            + (f": {'; '.join(reasons)}" if reasons else "")
        )
    return {"energy": (drawn, notes)}


def _sweeps(data: ReportData, out: Path) -> Made:
    made: Drawings = {}
    for run, table in data.sweeps:
        medians = [c for c in table.column_names if c.endswith("_median")]
        if any(table[c].null_count < table.num_rows for c in medians):
            name = f"sweep-{run.run_id}"
            drawn = plots.sweep_medians(table, out / f"{name}.png", f"{run.short}: median and CI per point")
            unstable = sorted({m for m, v in drawn.metrics.items() if any(v["unstable"])})
            notes = [f"unstable points (red circles) in: {', '.join(unstable)}"] if unstable else []
            if drawn.left_out:
                notes.append(f"metrics not drawn (table only): {', '.join(drawn.left_out)}")
            if drawn.empty:
                notes.append(f"metrics with no value at any point (not drawn): {', '.join(drawn.empty)}")
            made[name] = (drawn, notes)
    return made or "no sweep run with <metric>_median columns in its summary.parquet"


def _machines(data: ReportData, out: Path) -> Made:
    from dlrm_lab.report.machines import machine_rows

    rows = machine_rows(data)
    if not rows:
        return "runs from fewer than two machines (or none with a rate that met its bound)"
    if not any(r["cost_per_1m_queries"] is not None for r in rows):
        return "no machine has a price (dlrm-lab machine price, or --price-per-hour)"
    notes = [f"{r['machine']}: no price, not ranked" for r in rows if r["cost_per_1m_queries"] is None]
    return {"machines": (plots.cost_per_bound(rows, out / "machines.png"), list(dict.fromkeys(notes)))}


def _canary_readings(run: RunInfo) -> list[dict[str, Any]]:
    """A run's speed-canary readings (telemetry rows of channel `canary`), one dict each, in time order (the values
    as telemetry.parquet holds them)."""
    path = run.dir / "telemetry.parquet"
    if not path.is_file():
        return []
    table = pq.read_table(path, columns=["time_unix_s", "source", "channel", "quantity", "value"]).to_pylist()
    by_moment: dict[tuple[float, str], dict[str, Any]] = {}
    for r in table:
        if r["channel"] == "canary":
            reading = by_moment.setdefault((r["time_unix_s"], r["source"]), {"time_unix_s": r["time_unix_s"],
                                                                             "source": r["source"]})  # fmt: skip
            reading[f"canary_{r['quantity']}"] = r["value"]
    return [by_moment[k] for k in sorted(by_moment) if "canary_gemm_flops_per_s" in by_moment[k]]


def _run_rate(run: RunInfo) -> tuple[list[float], list[float]]:
    """The run's own rate over time (s, value): a training rank 0's steps (unix time), or a serving run's completed
    samples per second (its queries' ends in 1-s bins, on the server's own clock)."""
    if run.kind == "train" and (run.dir / "steps.parquet").is_file():
        steps = pq.read_table(run.dir / "steps.parquet", columns=["rank", "time_unix_s", "samples_per_s"]).to_pylist()
        rows = [r for r in steps if r["rank"] == 0 and r["time_unix_s"] and r["samples_per_s"]]
        return [float(r["time_unix_s"]) for r in rows], [float(r["samples_per_s"]) for r in rows]
    if run.kind == "infer" and (run.dir / "queries.parquet").is_file():
        queries = pq.read_table(run.dir / "queries.parquet", columns=["end_ms", "samples", "status"]).to_pylist()
        ends = [
            (float(q["end_ms"]), int(q["samples"])) for q in queries if q["status"] == "ok" and q["end_ms"] is not None
        ]
        if not ends:
            return [], []
        bins: dict[int, int] = {}
        for end, n in ends:
            bins[int(end // 1000)] = bins.get(int(end // 1000), 0) + n
        keys = sorted(bins)[1:-1]  # the first and last bins are partial
        return [float(k) for k in keys], [float(bins[k]) for k in keys]  # seconds of the server's own clock
    return [], []


def _canary(data: ReportData, out: Path) -> Made:
    series: dict[str, plots.CanarySeries] = {}
    for run in data.runs:
        if run.kind not in ("train", "infer") or not (readings := _canary_readings(run)):
            continue
        values, _ = canary_ratios(readings, None)  # each source against its own best in the run
        first = float(readings[0]["time_unix_s"])
        rate_t, rate = _run_rate(run)
        mid = float(np.median(rate)) if rate else 0.0
        times = [float(r["time_unix_s"]) - first for r in readings]
        same_clock = run.kind == "train"  # a serving run's query times are its own clock's: drawn from 0
        series[run.short] = plots.CanarySeries(
            times_s=times,
            ratios=values,
            foreign=[r.get("canary_foreign") for r in readings],
            rate_times_s=[t - (first if same_clock else (rate_t[0] if rate_t else 0.0)) for t in rate_t],
            rates=[v / mid for v in rate] if mid else [],
            phase=next(
                (
                    r.get("canary_phase")
                    for r in data.train + data.infer
                    if r.get("run_id") == run.run_id and r.get("canary_phase")
                ),
                None,
            ),  # fmt: skip
        )
    if not series:
        return "no run with speed-canary readings (telemetry.parquet, channel canary: runs since 2026-11-29)"
    drawn = plots.canary_timeline(series, out / "canary.png")
    notes = ["canary: each source (a rank, an instance) against its own fastest reading in the run; the summary's "
             "canary_ratio is against the machine profile's quiet canary"]  # fmt: skip
    if drawn.left_out:
        notes.append(f"{drawn.left_out} more run(s) with canary readings not drawn (at most {plots.MAX_RUNS_CANARY})")
    return {"canary": (drawn, notes)}


BUILDERS: list[tuple[str, Callable[[ReportData, Path], Made]]] = [
    ("latency_cdf", _latency),
    ("qps_vs_p99", _qps),
    ("latency_parts", _latency_parts),
    ("heatmap", _heatmap),
    ("training_phases", _phases),
    ("scaling", _scaling),
    ("roofline", _roofline),
    ("energy", _energy),
    ("sweep", _sweeps),
    ("collectives", _collectives),
    ("request_flops", _request_flops),
    ("machines", _machines),
    ("canary", _canary),
]

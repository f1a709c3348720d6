"""Inference experiments: load points, several models together, latency-bounded search.

Each experiment is one run directory: `queries.parquet` (one row per query), `summary.parquet`
(one row per model and load point), and for a search `frontier.parquet` (the best rate of
every configuration that meets the latency bound).
"""

from __future__ import annotations

import gc
import itertools
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from dlrm_lab.errors import UserError
from dlrm_lab.infer.calibrate import capacity_qps, choose_load
from dlrm_lab.infer.drivers import (
    LOADGEN_SCENARIOS,
    SCENARIOS,
    DriverStats,
    LoadGenDriver,
    OpenLoop,
    Stream,
)
from dlrm_lab.infer.instance import PRECISIONS
from dlrm_lab.infer.memory import check_fits
from dlrm_lab.infer.records import (
    QUERY_SCHEMA,
    SUMMARY_SCHEMA,
    energy_columns,
    roofline_columns,
    summarize,
    with_late_flags,
)
from dlrm_lab.infer.server import InferenceServer, ServedModel
from dlrm_lab.metrics.cpu import CpuMeter, usable_cores
from dlrm_lab.metrics.energy import EnergySampler, open_power_sources, telemetry_schema
from dlrm_lab.metrics.precision import AUTO, choose_precision, contenders
from dlrm_lab.metrics.roofline import gemm_precision, load_profile, peaks_for
from dlrm_lab.metrics.run import Run
from dlrm_lab.metrics.tables import TableWriter

Log = Callable[[str], None]


@dataclass
class PointProgress:
    """How far a load point is: reported about every 0.25 s while its load runs, and once
    (`finished`) when its queries are in. The caller shows it; this module prints nothing."""

    point: int  # index of the point in the run (a search: over all its probes)
    elapsed_s: float  # since the load started
    duration_s: float  # of load planned (LoadGen scenarios may run a little past it)
    queries: int  # finished so far in this point
    finished: bool = False


OnProgress = Callable[[PointProgress], None]


@dataclass
class InferConfig:
    scenario: str = "open-loop"
    duration_s: float = 5.0  # of the load at each point
    sla_ms: float = 10.0
    sla_percentile: float = 99.0
    seed: int = 0
    device: str = "cpu"
    pin_cores: bool = True
    compare_alone: bool = True  # several models: also serve each alone at the same load
    qps_auto: bool = False  # the lab chooses the rate it can honour (infer.calibrate.choose_load); one model
    sla_auto: bool = False  # ... and the bound too, from the latency of one query at a time
    calibrate_s: float = 2.0  # seconds of each calibration step of qps_auto (capacity, unloaded, probes)
    drain_timeout_s: float = 30.0  # after the load, wait this long for the last queries

    def __post_init__(self) -> None:
        if self.scenario not in SCENARIOS:
            raise UserError(f"--scenario {self.scenario!r}: allowed: {', '.join(SCENARIOS)}")
        if not self.duration_s > 0:
            raise UserError(f"--duration {self.duration_s!r}: must be > 0 seconds")
        if not self.sla_ms > 0:
            raise UserError(f"--sla-ms {self.sla_ms!r}: must be > 0")
        if not 0 < self.sla_percentile <= 100:
            raise UserError(f"--percentile {self.sla_percentile!r}: must be in (0, 100]")
        if not self.calibrate_s > 0:
            raise UserError(f"calibrate_s {self.calibrate_s!r}: must be > 0 seconds")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


CPU_COLUMNS = ("cpu_utilization", "instance_cpu_utilization", "server_cpu_s")


def _cpu_meter(server: InferenceServer, clock: Callable[[], float] = time.monotonic) -> CpuMeter:
    """CPU use over a point (CPU_COLUMNS): the cores this process may use, the instances at their
    threads (pinned or not), and this serving process."""
    instances = [(i["pid"], server.models[i["model"]].threads) for i in server.instance_info]
    groups = {"instance": instances, "server": [(os.getpid(), 1)]}
    return CpuMeter(usable_cores(), groups, clock=clock)


@dataclass
class Point:
    """One load point: these streams against the server, for `duration_s` (default: the config's)."""

    index: int
    streams: list[Stream]
    mode: str = "together"
    scenario: str = "open-loop"
    extra: dict[str, Any] = field(default_factory=dict)  # columns added to each summary row
    duration_s: float | None = None


def measure(
    server: InferenceServer,
    point: Point,
    cfg: InferConfig,
    queries: TableWriter,
    run_dir: Path,
    log: Log | None = None,
    telemetry: TableWriter | None = None,
    on_progress: OnProgress | None = None,
) -> list[dict[str, Any]]:
    """Drive one point and summarise it per model. Query rows are written as they finish;
    power and host samples of the point go to `telemetry`; `on_progress` hears how far the
    load is (see `PointProgress`)."""
    if point.duration_s is not None:
        cfg = replace(cfg, duration_s=point.duration_s)
    slas = {s.model: s.sla_ms or cfg.sla_ms for s in point.streams}
    meter = _cpu_meter(server)
    server.take_records()  # nothing from a previous point leaks in
    restore_queue = {}
    if point.scenario == "offline":  # LoadGen issues every query at once: the queue must hold them
        for s in point.streams:
            need = int(s.qps * cfg.duration_s * 1.5) + 64
            if server.models[s.model].max_queue < need:
                restore_queue[s.model] = server.models[s.model].max_queue
                server.configure(s.model, max_queue=need)
    if point.scenario in LOADGEN_SCENARIOS:
        driver: Any = LoadGenDriver(
            server, point.streams[0], point.scenario, duration_s=cfg.duration_s, sla_ms=slas[point.streams[0].model],
            sla_percentile=cfg.sla_percentile, log_dir=run_dir / "loadgen" / f"point-{point.index}",
            seed=cfg.seed + point.index,
        )  # fmt: skip
    else:
        driver = OpenLoop(server, point.streams, cfg.duration_s, seed=cfg.seed + point.index)
    records: list[dict[str, Any]] = []

    def pump() -> None:
        rows = with_late_flags(server.take_records(), slas, point.index)
        records.extend(rows)
        queries.extend(rows)

    # Records are plain dicts without cycles; a full collection over them pauses every
    # thread of this process for tens of ms, which is then measured as tail latency.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    sources, missing = open_power_sources(cfg.device)
    sampler = EnergySampler(
        sources, interval_s=0.1, unavailable=missing, pids=lambda: [i["pid"] for i in server.instance_info]
    ).start()
    meter.start()
    window = [sampler.mark()]
    driver.start()
    load_start = time.monotonic()

    def report(finished: bool = False) -> None:
        if on_progress is not None:
            elapsed = time.monotonic() - load_start
            on_progress(PointProgress(point.index, elapsed, cfg.duration_s, len(records), finished))

    try:
        while not driver.join(timeout=0.25):
            pump()
            server.check()
            report()
        if driver.error is not None:
            raise driver.error
        if not server.drain(cfg.drain_timeout_s):
            server.check()
            if log:
                log(f"point {point.index}: queries still unfinished {cfg.drain_timeout_s:.0f} s after the load")
    except BaseException:
        driver.stop()
        pump()
        raise
    finally:
        window.append(sampler.mark())
        sampler.stop()
        if telemetry is not None:
            telemetry.extend([{**r, "point": point.index} for r in sampler.rows()])
        if gc_was_enabled:
            gc.enable()
        for model, bound in restore_queue.items():
            server.configure(model, max_queue=bound)
    pump()
    use = meter.stop()
    cpu = {column: use[column] for column in CPU_COLUMNS}
    report(finished=True)
    energy = sampler.summary(window[0], window[1])
    profile = load_profile()
    stats: DriverStats = driver.stats
    rows = []
    for stream in point.streams:
        mine = [r for r in records if r["model"] == stream.model]
        span = cfg.duration_s if point.scenario == "open-loop" else stats.duration_s or cfg.duration_s
        if mine:  # a backlog drained after the load ends lowers throughput instead of hiding
            last_end = max(r["end_ms"] for r in mine) / 1e3
            first = min(r["scheduled_ms"] for r in mine) / 1e3
            span = max(span, last_end - first)
        served = server.models[stream.model]
        row = {
            "point": point.index,
            "mode": point.mode,
            "scenario": point.scenario,
            **served.describe(),
            "query_sizes": str(stream.sizes),
            "arrival": stream.arrivals.kind if point.scenario == "open-loop" else "loadgen",
            "target_qps": stream.qps,
            "duration_s": span,
            **summarize(mine, duration_s=span, sla_ms=slas[stream.model], sla_percentile=cfg.sla_percentile),
            **stats.accuracy(stream.model),
            **cpu,
            "snapshot_mb": server.snapshot_bytes.get(stream.model, 0) / 1e6,
            **stats.loadgen,
            **point.extra,
        }
        precision = gemm_precision(cfg.device, served.precision)
        peaks = peaks_for(profile, "cuda:0" if cfg.device == "cuda" else "cpu", precision, served.threads)
        row.update(roofline_columns(served.spec, served.table_precision, row, peaks))
        rows.append(row)
    for row in rows:
        row.update(energy_columns(energy, rows))
        if log:
            log(point_line(row))
    return rows


def point_line(row: dict[str, Any]) -> str:
    p99 = row.get("latency_p99_ms")
    lg = f", LoadGen {row['loadgen_result']}" if row.get("loadgen_result") else ""
    return (
        f"{row['model']} [{row['mode']}] target {row['target_qps']:.1f} queries/s: "
        f"{row['queries_per_s']:.1f} queries/s, {row['samples_per_s']:.0f} samples/s, "
        f"p99 {'-' if p99 is None else f'{p99:.2f}'} ms, "
        f"dropped {row['dropped_queries']}, late {row['late_queries']}, "
        f"SLA {'met' if row['sla_met'] else 'missed'}{lg}"
    )


def _summary_schema(extra: dict[str, pa.DataType] | None = None) -> pa.Schema:
    fields = list(SUMMARY_SCHEMA)
    for name, typ in (extra or {}).items():
        fields.append(pa.field(name, typ))
    return pa.schema(fields)


def run_inference(
    models: list[ServedModel],
    streams: list[Stream],
    cfg: InferConfig,
    *,
    metrics_dir: str | Path = "runs",
    argv: list[str] | None = None,
    log: Log | None = None,
    on_progress: OnProgress | None = None,
) -> Path:
    """Serve `models` under `streams` (one per model) at one load point and record it.

    With several models they are first served together, then (with `compare_alone`) each
    alone under the same load: the difference is their interference. `on_progress` hears
    how far each point's load is (points 0, 1, ... of `cfg.duration_s` each).
    """
    if len(streams) != len(models):
        raise UserError(f"{len(models)} models but {len(streams)} load streams")
    if cfg.scenario in LOADGEN_SCENARIOS and len(models) > 1:
        raise UserError(f"--scenario {cfg.scenario}: LoadGen drives one model; use open-loop for several")
    if cfg.qps_auto and (len(models) > 1 or cfg.scenario not in ("open-loop", "server")):
        raise UserError("--qps auto: one --model, with open-loop or server load (the rate is probed open loop)")
    if cfg.sla_auto and not cfg.qps_auto:
        raise UserError("--sla-ms auto: needs --qps auto (the bound is chosen with the load)")
    check_fits(models, device=cfg.device)  # a model too big is refused before its run directory exists
    config = {
        "infer": cfg.to_dict(),
        "models": [m.describe() for m in models],
        "streams": [{**_stream_dict(s), **({"qps": "auto"} if cfg.qps_auto else {})} for s in streams],
    }
    run = Run.create(metrics_dir, "infer", config, argv=argv)
    with run:
        queries = run.table("queries", QUERY_SCHEMA)
        summary = run.table("summary", _summary_schema())
        telemetry = run.table("telemetry", telemetry_schema("point"))
        with InferenceServer(models, device=cfg.device, pin_cores=cfg.pin_cores, seed=cfg.seed, log=log) as server:
            run.update_manifest(instances=server.instance_info, precision_choices=server.precision_choices)
            if cfg.qps_auto:
                (stream,) = streams
                if log:
                    log("choosing the load: closed-loop capacity, one query at a time, then a short bisection")
                choice = choose_load(
                    server, stream, sla_ms=None if cfg.sla_auto else (stream.sla_ms or cfg.sla_ms),
                    percentile=cfg.sla_percentile, probe_s=cfg.calibrate_s, seed=cfg.seed,
                    drain_s=cfg.drain_timeout_s,
                )  # fmt: skip
                streams = [replace(stream, qps=choice.qps, sla_ms=choice.sla_ms)]
                cfg = replace(cfg, sla_ms=choice.sla_ms)
                run.update_manifest(load_choice=choice.to_dict())
                if log:
                    log(choice.reason)
            points = [Point(0, streams, "together", cfg.scenario)]
            if len(streams) > 1 and cfg.compare_alone:
                points += [Point(k + 1, [s], "alone", cfg.scenario) for k, s in enumerate(streams)]
            for point in points:
                summary.extend(measure(server, point, cfg, queries, run.dir, log, telemetry, on_progress))
                summary.flush()
    return run.dir


def _stream_dict(s: Stream) -> dict[str, Any]:
    return {
        "model": s.model,
        "qps": s.qps,
        "query_sizes": str(s.sizes),
        "arrival": asdict(s.arrivals),
        "sla_ms": s.sla_ms,
    }


# ----------------------------------------------------------------------------- search


@dataclass
class SearchGrid:
    """Configurations to search: every (instances, threads) x max_batch x max_delay_ms."""

    layouts: list[tuple[int, int]]  # (instances, threads per instance)
    max_batch: list[int]
    max_delay_ms: list[float]

    @staticmethod
    def default_layouts(cores: int) -> list[tuple[int, int]]:
        """Every instances x threads that uses at most the cores (arXiv 1908.04705: more
        co-located instances beat more threads per instance for small-batch DLRM inference,
        and oversubscribing cores only adds interference)."""
        return [(i, t) for i in range(1, cores + 1) for t in range(1, cores + 1) if i * t <= cores]

    def configs(self) -> list[tuple[int, int, int, float]]:
        return [(i, t, b, d) for (i, t), b, d in itertools.product(self.layouts, self.max_batch, self.max_delay_ms)]


@dataclass
class SearchOptions:
    repeats: int = 2  # load points per probed rate; the median decides
    steps: int = 6  # bisection probes per configuration at most
    tolerance: float = 0.05  # stop when the bracket is this narrow relative to its top
    capacity_s: float = 2.0  # closed-loop saturation run that bounds the search
    min_queries: int = 500  # a probe lasts long enough for this many queries (p99 = the 5th worst of 500) ...
    max_duration_s: float = 20.0  # ... but at most this long

    def __post_init__(self) -> None:
        if self.repeats < 1 or self.steps < 1 or self.min_queries < 1:
            raise UserError(
                f"--repeats {self.repeats}, --steps {self.steps}, --min-queries {self.min_queries}: must be >= 1"
            )
        if not 0 < self.tolerance < 1:
            raise UserError(f"--tolerance {self.tolerance}: must be in (0, 1)")
        if not (self.capacity_s > 0 and self.max_duration_s > 0):
            raise UserError(
                f"--capacity-duration {self.capacity_s}, --max-probe-duration {self.max_duration_s}: must be > 0"
            )


FRONTIER_SCHEMA = pa.schema(
    [
        ("model", pa.string()),
        ("preset", pa.string()),
        ("instances", pa.int32()),
        ("threads_per_instance", pa.int32()),
        ("max_batch", pa.int32()),
        ("max_delay_ms", pa.float64()),
        ("precision", pa.string()),  # dense compute of this configuration
        ("capacity_queries_per_s", pa.float64()),  # closed-loop saturation, no latency bound
        ("best_qps", pa.float64()),  # highest probed rate that met the bound (0: none did)
        ("best_qps_uncertainty", pa.float64()),  # half the final bracket [best, lowest failing rate]
        ("best_samples_per_s", pa.float64()),
        ("best_sla_latency_ms", pa.float64()),
        ("best_sla_latency_spread_ms", pa.float64()),  # max - min over the repeats at best_qps
        # the repeats at best_qps (dlrm_lab.metrics.stats: CI needs >= 3 repeats)
        ("best_samples_per_s_ci_low", pa.float64()),
        ("best_samples_per_s_ci_high", pa.float64()),
        ("best_samples_per_s_cv", pa.float64()),
        ("best_samples_per_s_unstable", pa.bool_()),
        ("sla_ms", pa.float64()),
        ("sla_percentile", pa.float64()),
        ("probes", pa.int32()),
        ("best", pa.bool_()),  # the configuration with the highest best_samples_per_s
    ]
)


def search(
    base: ServedModel,
    stream: Stream,
    grid: SearchGrid,
    cfg: InferConfig,
    options: SearchOptions,
    *,
    metrics_dir: str | Path = "runs",
    argv: list[str] | None = None,
    log: Log | None = None,
    on_progress: OnProgress | None = None,
) -> Path:
    """For each configuration, the highest rate whose latency percentile meets the bound.

    Per configuration: a closed-loop saturation run measures capacity C; then bisection on
    the rate in (0, 1.05 C]: each probed rate is run `repeats` times (open loop) and passes
    when the median `sla_latency_ms` (dropped queries infinitely late) is within the bound.
    The answer is the highest passing rate, reported with half the final bracket as its
    uncertainty. Instances are started once per (instances, threads) layout. The load of
    each probe is our open-loop generator or MLPerf LoadGen's Server scenario
    (`cfg.scenario`); either way the verdict is computed from our own query records.
    `on_progress` hears how far each probe's load is (points numbered over the whole search).
    """
    if cfg.scenario not in ("open-loop", "server"):
        raise UserError(f"--scenario {cfg.scenario}: a search probes rates with open-loop or LoadGen server load")
    widest = max(grid.layouts, key=lambda layout: layout[0])[0]
    check_fits([replace(base, instances=widest, max_batch=max(grid.max_batch))], device=cfg.device)
    config = {
        "infer": cfg.to_dict(),
        "model": base.describe(),
        "stream": _stream_dict(stream),
        "grid": asdict(grid),
        "search": asdict(options),
    }
    run = Run.create(metrics_dir, "infer-search", config, argv=argv)
    frontier: list[dict[str, Any]] = []
    extra = {"repeat": pa.int32(), "probe": pa.int32(), "passed": pa.bool_()}
    with run:
        queries = run.table("queries", QUERY_SCHEMA)
        summary = run.table("summary", _summary_schema(extra))
        telemetry = run.table("telemetry", telemetry_schema("point"))
        point_index = 0
        choices: dict[str, Any] = {}
        layouts = [(layout, list(group)) for layout, group in itertools.groupby(grid.configs(), key=lambda c: c[:2])]
        runs = [
            (layout, precision, group)
            for layout, group in layouts
            for precision in _search_precisions(base, layout[1], max(grid.max_batch), cfg, log, choices)
        ]
        run.update_manifest(precision_choices=choices)
        for (instances, threads), precision, group in runs:
            first = replace(base, instances=instances, threads=threads, precision=precision)
            with InferenceServer([first], device=cfg.device, pin_cores=cfg.pin_cores, seed=cfg.seed) as server:
                for _, _, max_batch, delay in group:
                    server.configure(base.name, max_batch=max_batch, max_delay_ms=delay)
                    served = server.models[base.name]
                    capacity = capacity_qps(server, stream, options.capacity_s, cfg.seed, cfg.drain_timeout_s)
                    if log:
                        log(f"{_label(served)}: capacity {capacity:.1f} queries/s (closed loop)")
                    lo, hi = 0.0, capacity * 1.05
                    best_rows: list[dict[str, Any]] = []
                    probes = 0
                    while probes < options.steps and (hi - lo) / hi > options.tolerance:
                        qps = (lo + hi) / 2 if lo > 0 else hi * 0.8 if probes == 0 else hi / 2
                        rows = []
                        for rep in range(options.repeats):
                            seconds = min(max(cfg.duration_s, options.min_queries / qps), options.max_duration_s)
                            point = Point(point_index, [replace(stream, qps=qps)], "together", cfg.scenario,
                                          extra={"repeat": rep, "probe": probes}, duration_s=seconds)  # fmt: skip
                            point_index += 1
                            (row,) = measure(server, point, cfg, queries, run.dir, telemetry=telemetry,
                                             on_progress=on_progress)  # fmt: skip
                            rows.append(row)
                        lat = [r["sla_latency_ms"] if r["sla_latency_ms"] is not None else math.inf for r in rows]
                        passed = bool(np.median(lat) <= cfg.sla_ms)
                        for r in rows:
                            r["passed"] = passed
                        summary.extend(rows)
                        summary.flush()
                        if log:
                            log(f"{_label(served)}: {qps:.1f} queries/s -> p{cfg.sla_percentile:g} "
                                f"{np.median(lat):.2f} ms, {'pass' if passed else 'fail'}")  # fmt: skip
                        if passed:
                            lo, best_rows = qps, rows
                        else:
                            hi = qps
                        probes += 1
                    frontier.append(_frontier_row(served, capacity, lo, hi, best_rows, probes, cfg))
        if frontier:
            best = max(frontier, key=lambda r: r["best_samples_per_s"])
            for r in frontier:
                r["best"] = r is best and best["best_qps"] > 0
        run.write_summary(frontier, FRONTIER_SCHEMA, name="frontier")
        winner = next((r for r in frontier if r["best"]), None)
        run.update_manifest(best=winner)
    return run.dir


def _search_precisions(base: ServedModel, threads: int, rows: int, cfg: InferConfig, log: Log | None,
                       choices: dict[str, Any]) -> list[str]:  # fmt: skip
    """The precisions a layout is searched in: the one asked for, or with `auto` every
    precision whose measured GEMM rate is close enough to the fastest to win (a clear loser
    is left out of the grid, and so costs no search time)."""
    if base.precision != AUTO:
        return [base.precision]
    choice = choose_precision(
        AUTO, base.spec, allowed=PRECISIONS, device=cfg.device, threads=threads, rows=rows, log=log
    )
    kept = contenders(choice)
    choices[f"{threads} threads"] = {**choice.to_dict(), "searched": kept}
    if log:
        log(f"{threads} thread{'s' if threads != 1 else ''}: searching precision {', '.join(kept)} ({choice.reason})")
    return kept


def _label(m: ServedModel) -> str:
    return f"{m.instances}x{m.threads} threads, {m.precision}, batch {m.max_batch}, delay {m.max_delay_ms:g} ms"


def _frontier_row(served: ServedModel, capacity: float, lo: float, hi: float, rows: list[dict[str, Any]],
                  probes: int, cfg: InferConfig) -> dict[str, Any]:  # fmt: skip
    from dlrm_lab.metrics.stats import estimate

    lat = [r["sla_latency_ms"] for r in rows if r["sla_latency_ms"] is not None]
    rate = estimate([r["samples_per_s"] for r in rows])
    return {
        "best_samples_per_s_ci_low": rate.ci_low,
        "best_samples_per_s_ci_high": rate.ci_high,
        "best_samples_per_s_cv": rate.cv,
        "best_samples_per_s_unstable": rate.unstable,
        "model": served.name,
        "preset": served.spec.name,
        "instances": served.instances,
        "threads_per_instance": served.threads,
        "max_batch": served.max_batch,
        "max_delay_ms": served.max_delay_ms,
        "precision": served.precision,
        "capacity_queries_per_s": capacity,
        "best_qps": lo,
        "best_qps_uncertainty": (hi - lo) / 2,
        "best_samples_per_s": float(np.median([r["samples_per_s"] for r in rows])) if rows else 0.0,
        "best_sla_latency_ms": float(np.median(lat)) if lat else None,
        "best_sla_latency_spread_ms": float(max(lat) - min(lat)) if lat else None,
        "sla_ms": cfg.sla_ms,
        "sla_percentile": cfg.sla_percentile,
        "probes": probes,
        "best": False,
    }

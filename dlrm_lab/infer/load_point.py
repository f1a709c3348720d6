"""A load point: streams of queries driven against the system under test for a while, metered, and summarised per
model (one `summary.parquet` row each: its rates, latency percentiles and parts, roofline and latency floor, energy,
CPU use, cost and stalls).

A point is measured (`measure`) through the system-under-test interface alone
(`infer.sut.SystemUnderTest`): its driver comes from the scenario (`infer.drivers.make_driver`)
and what is recorded about the served models comes from `describe()`. An inference run (`infer.lab`) and a
search's probes (`infer.search`) are made of points.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, cast

from dlrm_lab.config.values import JsonObject, Log
from dlrm_lab.errors import ClientLost, RemoteFailure, ServerLost
from dlrm_lab.infer.builds import dense_weight_bytes
from dlrm_lab.infer.drivers import drive, make_driver, scenario
from dlrm_lab.infer.library import PackedLibrary
from dlrm_lab.infer.load import DriverStats, LoadSettings, Stream
from dlrm_lab.infer.options import InferConfig
from dlrm_lab.infer.records import (
    FLOOR_RESOLUTION_MS,
    batch_roof,
    build_peaks,
    energy_columns,
    latency_floor_columns,
    latency_parts,
    roofline_columns,
    summarize,
    with_late_flags,
)
from dlrm_lab.infer.sut import ModelDescription, Stall, SutDescription, SystemUnderTest
from dlrm_lab.metrics.canary import Canary, as_telemetry, canary_columns, quiet_of
from dlrm_lab.metrics.columns import InferSummaryRow, QueryRow
from dlrm_lab.metrics.cost import Price, price_of, serving_cost_columns
from dlrm_lab.metrics.cpu import CpuMeter, usable_cores
from dlrm_lab.metrics.energy import EnergySampler
from dlrm_lab.metrics.roofline import Peaks, load_profile
from dlrm_lab.metrics.sensors import open_power_sources
from dlrm_lab.metrics.tables import TableWriter, flush_interval_asked


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


CPU_COLUMNS = ("cpu_utilization", "instance_cpu_utilization", "server_cpu_s")


def _cpu_meter(sut: SutDescription, clock: Callable[[], float] = time.monotonic) -> CpuMeter:
    """CPU use over a point (CPU_COLUMNS): the cores this process may use, the instances at their
    threads (pinned or not), and this serving process."""
    instances = [(p["pid"], sut.models[p["model"]].threads or 1) for p in sut.processes]
    groups = {"instance": instances, "server": [(os.getpid(), 1)]}
    return CpuMeter(usable_cores(), groups, clock=clock)


@dataclass
class Point:
    """One load point: these streams against the server, for `duration_s` (default: the config's)."""

    index: int
    streams: list[Stream]
    mode: str = "together"
    scenario: str = "open-loop"
    duration_s: float | None = None


def warm_up(server: SystemUnderTest, streams: list[Stream], seconds: float, *, seed: int, drain_s: float) -> None:
    """Untimed open-loop load of these streams for `seconds`; its records are dropped by the caller."""
    if seconds <= 0:
        return
    settings = LoadSettings("open-loop", duration_s=seconds, seed=seed + 1_000_003, max_issue_lag_ms=None)
    drive(server, make_driver(server, streams, settings), drain_s=drain_s, take=lambda _rows: None)


def measure(
    server: SystemUnderTest,
    point: Point,
    cfg: InferConfig,
    queries: TableWriter,
    run_dir: Path,
    log: Log | None = None,
    telemetry: TableWriter | None = None,
    on_progress: OnProgress | None = None,
    decided: Callable[[list[QueryRow]], bool] | None = None,
    trace: bool = False,
) -> list[InferSummaryRow]:
    """Drive one point and summarise it per model. Query rows are written once its load ended (`write_rows`);
    power and host samples of the point go to `telemetry`; `on_progress` hears how far the
    load is (see `PointProgress`). What the rows say about each model (its serving
    configuration, spec, processes) is what `server.describe()` reports.

    `decided(records so far)` is asked every `drivers.POLL_S` while the load runs: True ends the
    load there (a search probe whose verdict can no longer change); the rows then say
    `load_stopped_early` and their rates count the time the load actually ran. `trace`: the point's
    load (not its warm-up) is profiled in every instance and written with the lab's spans to
    `trace.json` in `run_dir` (a server that cannot trace says so in `log`)."""
    if point.duration_s is not None:
        cfg = replace(cfg, duration_s=point.duration_s)
    sut = server.describe()
    warmup_s = min(cfg.warmup_s, cfg.duration_s / 4)
    try:
        warm_up(server, point.streams, warmup_s, seed=cfg.seed + point.index, drain_s=cfg.drain_timeout_s)
    except RemoteFailure as exc:  # before any row counts: nothing of the point to keep
        raise type(exc)(f"point {point.index}, warming up: the server at {sut.target}: {exc}") from None
    server.take_records()  # nothing from a previous point (or the warm-up) leaks in
    server.take_canary()
    profile = load_profile()
    peaks = {s.model: _peaks(profile, cfg.device, sut.models[s.model]) for s in point.streams}
    seen = _drive_point(server, point, cfg, sut, peaks, queries, run_dir, log, telemetry, on_progress, decided, trace)
    rows = [
        _summary_row(point, stream, seen, sut, cfg, peaks[stream.model], warmup_s, profile) for stream in point.streams
    ]
    price = point_price(profile, cfg, sut)
    for row in rows:
        row.update(energy_columns(seen.energy, rows))
    for row in rows:  # after every row's rate and energy: a co-located point shares the machine's price
        row.update(serving_cost_columns(row, price, rows))
        if log:
            log(point_line(row))
            if row.get("canary_phase"):
                log(f"{row['model']}: {row['canary_phase']}")
    return rows


def canary_quiet(
    readings: list[JsonObject], profile: JsonObject | None, threads: int, on_this_host: bool
) -> JsonObject | None:
    """The quiet reading a point's canary readings are read against: the load generator's own (source `client`, a
    server elsewhere) at the client's thread count; the instances' at theirs; none for a server elsewhere's (each
    against its run's fastest reading)."""
    if readings and all(r["source"] == "client" for r in readings):
        import torch

        return quiet_of(profile, torch.get_num_threads())
    return quiet_of(profile, threads) if on_this_host else None


@dataclass
class _Seen:
    """What one point's load left: its query records and what metered it."""

    records: list[QueryRow]
    stats: DriverStats
    energy: InferSummaryRow  # the point's energy columns, shared by its rows (`energy_columns`)
    cpu: InferSummaryRow  # CPU_COLUMNS
    stalls: list[Stall]
    slas: dict[str, float]
    stopped_after_s: float | None  # the load ended early (`decided`)
    failure: RemoteFailure | None  # a remote system under test failed: the point as far as it went
    canary: list[JsonObject]  # the instances' speed-canary readings over the point (`metrics.canary`), with their model
    # per model, the share of a batch's looked-up rows that are distinct (`PackedLibrary.distinct_share`; None: all)
    distinct: dict[str, Callable[[int], float] | None]


def _drive_point(
    server: SystemUnderTest,
    point: Point,
    cfg: InferConfig,
    sut: SutDescription,
    peaks: dict[str, Peaks | str],
    queries: TableWriter,
    run_dir: Path,
    log: Log | None,
    telemetry: TableWriter | None,
    on_progress: OnProgress | None,
    decided: Callable[[list[QueryRow]], bool] | None,
    trace: bool,
) -> _Seen:
    """The point's load, metered (energy, CPU, the trace): every finished query a row with its latency parts."""
    slas = {s.model: s.sla_ms or cfg.sla_ms for s in point.streams}
    settings = LoadSettings(
        point.scenario,
        duration_s=cfg.duration_s,
        seed=cfg.seed + point.index,
        sla_ms=slas[point.streams[0].model],
        sla_percentile=cfg.sla_percentile,
        log_dir=run_dir / "loadgen" / f"point-{point.index}",
        max_issue_lag_ms=cfg.max_issue_lag_ms,
        concurrency=cfg.concurrency,
    )
    driver = make_driver(server, point.streams, settings)
    records: list[QueryRow] = []
    distinct = {m: _distinct_share(server.library(m)) for m in peaks}  # read before the load, not during it
    roofs = {
        m: batch_roof(
            sut.models[m].spec, sut.models[m].table_precision or "fp32", p, _dense_bytes(sut.models[m]), distinct[m]
        )
        for m, p in peaks.items()
    }

    written = 0  # of `records`, the rows given their parts and written to `queries`

    live = flush_interval_asked()  # told to bound what a SIGKILL loses: written as the load runs, at that cost

    def pump(finished: list[QueryRow]) -> None:
        records.extend(finished)  # while the load runs, only kept: `write_rows` once it ended
        if live:
            write_rows()

    def write_rows() -> None:
        """The rows taken since the last call with their late flags and latency parts, into `queries`. Once the load
        ended, not while it runs: in the serving process they cost 15-20 us a query (a part of 10,000 rows converted
        and written: 150-330 ms), which its issue, batching and completion threads would wait for and a point would
        measure as tail latency (tiny, 1x1, 9,000 queries/s: BENCHMARKS.md, issue 56, twenty-fourth session).
        Memory is the same: the point's rows are held for its summary either way. A SIGKILL loses the point's rows
        (SIGTERM, SIGINT, SIGHUP and a failure write them), unless DLRM_LAB_FLUSH_SECONDS is set (`live`)."""
        nonlocal written
        rows = with_late_flags(records[written:], slas, point.index)
        written = len(records)
        parts: dict[tuple[str, int], float | None] = {}  # the roof of each model's batch size, once each
        for r in rows:
            n = r.get("batch_samples")
            key = (r["model"], n or 0)
            if key not in parts:
                parts[key] = roofs[key[0]](n) if n else None
            r.update(latency_parts(r, parts[key]))
        queries.extend(cast(list[dict[str, str | float | bool | None]], rows))  # a list of rows (list is invariant)

    meter = _cpu_meter(sut)
    # Records are plain dicts without cycles; a full collection over them pauses every
    # thread of this process for tens of ms, which is then measured as tail latency.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    sources, missing = open_power_sources(cfg.device)
    sampler = EnergySampler(
        sources, interval_s=0.1, unavailable=missing, pids=lambda: [p["pid"] for p in sut.processes]
    ).start()
    meter.start()
    window = [sampler.mark()]
    tracing = trace and sut.traces
    if trace and not tracing and log:
        log("--trace: this system under test cannot be profiled (no instances in this process); no trace")
    if tracing:
        server.start_trace()
    load_start = time.monotonic()
    stopped_after_s: float | None = None
    # a server elsewhere measures its own host; the load generator's host is this one, and its speed is the
    # client's part of every latency: read between polls (a reading costs under a ms every few seconds)
    client = Canary(None, "client") if not sut.processes else None

    def report(finished: bool = False) -> bool:
        nonlocal stopped_after_s
        if client is not None:
            client.maybe_read()
        elapsed = time.monotonic() - load_start
        if on_progress is not None:
            on_progress(PointProgress(point.index, elapsed, cfg.duration_s, len(records), finished))
        if not finished and decided is not None and decided(records):
            stopped_after_s = elapsed
            return True
        return False

    failure: RemoteFailure | None = None
    try:
        if not drive(server, driver, drain_s=cfg.drain_timeout_s, take=pump, poll=report) and log:
            log(f"point {point.index}: queries still unfinished {cfg.drain_timeout_s:.0f} s after the load")
    except RemoteFailure as exc:  # the point is summarised as far as it went; the run then fails
        failure = exc
        server.drain(cfg.drain_timeout_s)
    finally:
        window.append(sampler.mark())
        sampler.stop()
        if telemetry is not None:
            telemetry.extend([{**r, "point": point.index} for r in sampler.rows()])
        if gc_was_enabled:
            gc.enable()
        write_rows()  # what the load finished, written even where it failed
    pump(server.take_records())
    write_rows()
    stalls = server.take_stalls()
    canary = server.take_canary()
    if client is not None:  # the client's readings stand beside every model it drove
        canary += [{**r, "model": s.model} for r in client.readings for s in point.streams]
    if telemetry is not None:
        # a reading's telemetry rows hold scalars (`as_telemetry`: the long form's columns)
        readings = [cast(dict[str, str | float | bool | None], r) for c in canary for r in as_telemetry(c)]
        telemetry.extend([{**r, "point": point.index} for r in readings])
    use = meter.stop()
    if tracing:
        _write_trace(server, records, sut, run_dir, log)
    report(finished=True)
    return _Seen(
        records,
        driver.stats,
        InferSummaryRow(sampler.summary(window[0], window[1])),
        InferSummaryRow({column: use[column] for column in CPU_COLUMNS}),
        stalls,
        slas,
        stopped_after_s,
        failure,
        canary,
        distinct,
    )


def _distinct_share(library: object) -> Callable[[int], float] | None:
    """A DLRM library's distinct-row share by batch size, read now (the ranker's requests: every row counted)."""
    if not isinstance(library, PackedLibrary):
        return None
    library.distinct_rows  # noqa: B018 (read once, here: a cached property)
    return library.distinct_share


def _summary_row(
    point: Point,
    stream: Stream,
    seen: _Seen,
    sut: SutDescription,
    cfg: InferConfig,
    peaks: Peaks | str,
    warmup_s: float,
    profile: JsonObject | None,
) -> InferSummaryRow:
    """One model's summary row of a point (`infer summary`, less energy and cost: those are shared by the point);
    `profile`: the machine's, read once for the point (its peaks placed `peaks`; its quiet canary, the readings)."""
    stats, failure = seen.stats, seen.failure
    mine = [r for r in seen.records if r["model"] == stream.model]
    span = seen.stopped_after_s or stats.duration_s or cfg.duration_s  # LoadGen's: measured; ours: as planned
    if mine:  # a backlog drained after the load ends lowers throughput instead of hiding
        last_end = max(r["end_ms"] for r in mine) / 1e3
        first = min(r["scheduled_ms"] for r in mine) / 1e3
        span = last_end - first if stats.issue_stopped or failure else max(span, last_end - first)
    served = sut.models[stream.model]
    cost = sut.batch_costs.get(stream.model)
    error = None
    if failure is not None:
        if isinstance(failure, ServerLost):
            error = f"lost the server at {sut.target}: {failure}"
        elif isinstance(failure, ClientLost):
            error = f"{sut.target}: {failure}"
        else:
            error = f"the server at {sut.target} answered badly: {failure}"
    readings = [c for c in seen.canary if c["model"] == stream.model]
    quiet = canary_quiet(readings, profile, served.threads or 1, served.on_this_host)
    row = InferSummaryRow(
        {
            "point": point.index,
            "mode": point.mode,
            "scenario": point.scenario,
            "model": stream.model,
            "preset": served.spec.name,
            **served.columns,
            "query_sizes": str(stream.sizes),
            "arrival": stats.arrival[stream.model],
            "target_qps": stream.qps if scenario(point.scenario).rate else None,  # a closed loop has no rate
            "duration_s": span,
            "warmup_s": warmup_s,
            **summarize(mine, duration_s=span, sla_ms=seen.slas[stream.model], sla_percentile=cfg.sla_percentile),
            **stats.accuracy(stream.model),
            **seen.cpu,
            "snapshot_mb": sut.snapshot_bytes.get(stream.model, 0) / 1e6,
            **stats.loadgen,
            "load_stopped_early": seen.stopped_after_s is not None,
            "target": sut.target,
            "rpc": sut.rpc,
            "concurrency": sut.concurrency,
            "server_lost": None if sut.rpc is None else isinstance(failure, ServerLost),
            "error": error,
            "batch_fixed_ms": None if cost is None else cost.fixed_ms,
            "batch_per_sample_us": None if cost is None else cost.per_sample_ms * 1e3,
            **stall_columns([s for s in seen.stalls if s["model"] == stream.model]),
            **canary_columns(readings, quiet, span),
        }
    )
    dense_bytes, tables = _dense_bytes(served), served.table_precision or "fp32"
    row.update(roofline_columns(served.spec, tables, row, peaks, dense_bytes))
    row.update(
        latency_floor_columns(
            served.spec,
            tables,
            served.instances or 1,
            served.threads or 1,
            served.max_batch or 1,
            row,
            peaks,
            served.min_piece or 0,
            dense_bytes,
            seen.distinct.get(stream.model),
        )
    )
    return row


def point_price(profile: JsonObject | None, cfg: InferConfig, sut: SutDescription) -> Price | None:
    """The price a point's costs are at: `--price-per-hour`, else the price stored with this machine's profile, which
    is the server's only where the server runs on this machine (a remote host's is given, or there is none)."""
    here = all(d.on_this_host for d in sut.models.values())
    return price_of(profile if here else None, cfg.price_per_hour, cfg.currency)


def _write_trace(server: Any, records: list[QueryRow], sut: SutDescription, run_dir: Path, log: Log | None) -> None:
    """Collect the instances' profiles and write the point's trace.json beside its records."""
    import shutil

    from dlrm_lab.infer.instance import MAX_TRACED_BATCHES
    from dlrm_lab.metrics.trace import serving_trace

    parts = run_dir / "trace-instances"
    written, missing = server.stop_trace(parts)
    info = serving_trace(records, written, sut.processes, run_dir / "trace.json")
    shutil.rmtree(parts, ignore_errors=True)  # merged into trace.json
    if log:
        gaps = "".join(f"; instance {k}: {why}" for k, why in missing.items())
        gaps += "".join(f"; instance {k}: no served batch to align its profile by" for k in info["instances_unaligned"])
        log(
            f"trace: {run_dir / 'trace.json'} ({info['events']:,} events: every query and batch, and torch.profiler's "
            f"operators of at most the first {MAX_TRACED_BATCHES:,} batches of each instance; open in "
            f"ui.perfetto.dev){gaps}"
        )


def _peaks(profile: JsonObject | None, device: str, served: ModelDescription) -> Peaks | str:
    """The peaks one instance of `served` is placed against: its device, threads and GEMM precision (a
    reason instead where its instances are not on this machine, or their precision and threads are unknown)."""
    if not served.on_this_host or served.precision is None or served.threads is None:
        return served.unplaced or "the server did not say how it serves this model"
    return build_peaks(profile, "cuda" if device == "cuda" else "cpu", served.build, served.precision, served.threads)


def _dense_bytes(served: ModelDescription) -> float:
    """Bytes per dense parameter an instance reads per batch: as its build stores them (`infer.builds`)."""
    # None (a remote server's, unknown) is taken: 4 bytes, as for a build the registry does not know
    return dense_weight_bytes(cast(str, served.build), cast(str, served.precision))


def stall_columns(stalls: list[Stall]) -> InferSummaryRow:
    """How many batches an instance held far beyond their warm time, the longest, and which instances."""
    if not stalls:
        return InferSummaryRow(instance_stalls=0, longest_stall_s=None, stalled_instances=None)
    instances = ",".join(str(i) for i in sorted({s["instance"] for s in stalls}))
    return InferSummaryRow(
        instance_stalls=len(stalls),
        longest_stall_s=max(s["took_ms"] for s in stalls) / 1e3,
        stalled_instances=instances,
    )


def point_line(row: InferSummaryRow) -> str:
    p99, floor = row.get("latency_p99_ms"), row.get("latency_floor_ms")
    lg = f", LoadGen {row['loadgen_result']}" if row.get("loadgen_result") else ""
    ratio = row.get("latency_floor_ratio")
    if floor is not None and floor < FLOOR_RESOLUTION_MS:
        beside = f" (floor < {FLOOR_RESOLUTION_MS:g} ms: below what a query's timestamps resolve)"
    else:
        beside = (
            "" if floor is None else f" (floor {floor:.3g} ms" + ("" if ratio is None else f", {ratio:,.1f}x") + ")"
        )
    slow = row.get("compute_slowdown_p99")
    beside += "" if slow is None else f", batches at p99 {slow:.2f}x their warm time"
    load = "closed loop" if row["target_qps"] is None else f"target {row['target_qps']:.1f} queries/s"
    return (
        f"{row['model']} [{row['mode']}] {load}: "
        f"{row['queries_per_s']:.1f} queries/s, {row['samples_per_s']:.0f} samples/s, "
        f"p99 {'-' if p99 is None else f'{p99:.2f}'} ms{beside}, "
        f"dropped {row['dropped_queries']}, late {row['late_queries']}, "
        f"SLA {'met' if row['sla_met'] else 'missed'}{lg}"
        + (
            f", {row['cost_per_1m_samples']:,.4g} {row['currency']} per 1M samples"
            if row.get("cost_per_1m_samples") is not None
            else ""
        )
        + (
            f"; instance {row['stalled_instances']} stalled: {row['instance_stalls']} batch(es) held up to "
            f"{row['longest_stall_s']:.1f} s (a stopped or starved process)"
            if row.get("instance_stalls")
            else ""
        )
    )

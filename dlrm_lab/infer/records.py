"""Inference records: one row per query, one summary row per model and load point."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any, cast

import numpy as np

from dlrm_lab.config import ModelSpec
from dlrm_lab.infer.builds import computes_in
from dlrm_lab.infer.requests import SERVED_WINDOW
from dlrm_lab.infer.serving_parts import every_serving
from dlrm_lab.metrics.columns import BATCH_STAGES, LATENCY_PARTS, TRANSFER_STAGES, InferSummaryRow, QueryRow
from dlrm_lab.metrics.roofline import Peaks, Work, gemm_precision, peaks_for, place
from dlrm_lab.metrics.stats import percentile
from dlrm_lab.metrics.wake import cold_factor_for_gap, wake_ms_for_gap
from dlrm_lab.model.cost import lookup_bytes_per_sample, sample_cost, stored_table_bytes

PERCENTILES = (50, 90, 95, 99, 99.9)
# A load whose later half (by scheduled arrival) had its median latency this much above its earlier half's was still
# queueing up: a longer load at that rate reads higher (tiny at 8,867 queries/s, 2 x 1: p99 10.9 ms over 2 s, 21.5
# over 5 s), so a probe judges it by its later half (`sustained_latency`). The medians, not the tail: a half's p99
# rests on a handful of queries at make run's rates, and compared by it, 2 of 3 bisections stopped at half the rate.
GROWTH = 1.25


def _pct_name(p: float) -> str:
    return f"p{str(p).replace('.', '_').removesuffix('_0')}"


LATENCY_FIELDS = [f"latency_{_pct_name(p)}_ms" for p in PERCENTILES]


def compute_slowdown(records: list[QueryRow]) -> dict[str, float | None]:
    """Batch times over what the instances' warm model predicts (their back-to-back batch
    cost measured at start), median and p99 over the point's batches: the machine's own
    disturbances (cores that slept, a noisy host) apart from queueing. 1 is warm speed."""
    ratios = np.array(
        list(
            {
                r["batch_id"]: r["batch_compute_ms"] / r["batch_expected_ms"]
                for r in records
                if r.get("batch_id") is not None
                and r.get("batch_compute_ms") is not None
                and r.get("batch_expected_ms")
            }.values()
        ),
        dtype=np.float64,
    )
    return {"compute_slowdown_p50": percentile(ratios, 50), "compute_slowdown_p99": percentile(ratios, 99)}


def summarize(
    records: list[QueryRow],
    *,
    duration_s: float,
    sla_ms: float,
    sla_percentile: float,
) -> InferSummaryRow:
    """Throughput, latency percentiles, batching and queueing of one model at one point.

    Throughput counts completed queries over `duration_s`, the span of the load. Latency
    percentiles are over completed queries; `sla_latency_ms` counts dropped, failed and
    unfinished queries as infinitely late, so an overloaded server never meets its bound
    by shedding load. Rejected (malformed) queries are the client's fault and excluded.
    """
    status = np.array([r["status"] for r in records], dtype=object)
    ok = status == "ok"
    lat_all = np.array([r["latency_ms"] for r in records], dtype=np.float64)
    lat = lat_all[ok]
    samples = np.array([r["samples"] for r in records], dtype=np.int64)
    counted = status != "rejected"
    sla_lat = np.where(ok, lat_all, np.inf)[counted]
    batches: dict[int, tuple[int, int]] = {
        r["batch_id"]: (r["batch_samples"], r["batch_queries"]) for r in records if r.get("batch_id") is not None
    }
    batch_compute = np.array(
        list(
            {
                r["batch_id"]: r["compute_ms"] for r in records if r["status"] == "ok" and r.get("batch_id") is not None
            }.values()
        ),
        dtype=np.float64,
    )
    bsz = np.array([b[0] for b in batches.values()], dtype=np.float64)
    bq = np.array([b[1] for b in batches.values()], dtype=np.float64)
    # a server that reports no stage times (a third-party one) leaves queue and compute null
    queue = np.array(
        [r["queue_ms"] for r in records if r["status"] == "ok" and r.get("queue_ms") is not None], dtype=np.float64
    )
    compute = np.array(
        [r["compute_ms"] for r in records if r["status"] == "ok" and r.get("compute_ms") is not None], dtype=np.float64
    )
    out = InferSummaryRow(
        {
            "queries": len(records),
            "completed_queries": int(ok.sum()),
            "dropped_queries": int((status == "dropped").sum()),
            "rejected_queries": int((status == "rejected").sum()),
            "failed_queries": int((status == "failed").sum()),
            "unfinished_queries": int((status == "unfinished").sum()),
            "expired_queries": int((status == "expired").sum()),
            "late_queries": int((lat > sla_ms).sum()),
            "queries_per_s": float(ok.sum() / duration_s) if duration_s > 0 else None,
            "samples_per_s": float(samples[ok].sum() / duration_s) if duration_s > 0 else None,
            "latency_mean_ms": float(lat.mean()) if len(lat) else None,
            "latency_max_ms": float(lat.max()) if len(lat) else None,
            "sla_ms": sla_ms,
            "sla_percentile": sla_percentile,
            "batch_samples_mean": float(bsz.mean()) if len(bsz) else None,
            "batch_samples_p50": percentile(bsz, 50),
            "batch_samples_p99": percentile(bsz, 99),
            "batch_queries_mean": float(bq.mean()) if len(bq) else None,
            "batches": len(batches),
            "batch_compute_mean_ms": float(batch_compute.mean()) if len(batch_compute) else None,
            "queue_mean_ms": float(queue.mean()) if len(queue) else None,
            "compute_mean_ms": float(compute.mean()) if len(compute) else None,
            "queue_share": float(queue.sum() / lat.sum()) if len(queue) and lat.sum() > 0 else None,
            **compute_slowdown(records),
            **_family_summaries(records, ok, samples),
            **batch_stage_means(records),
            **tail_parts(records, sla_percentile),
            **transfer_columns(records),
        }
    )
    for name, p in zip(LATENCY_FIELDS, PERCENTILES, strict=True):
        out[name] = percentile(lat, p)
    sla_value = percentile(sla_lat, sla_percentile)
    out["sla_latency_ms"] = None if sla_value is None or not np.isfinite(sla_value) else sla_value
    out["sla_met"] = bool(sla_value is not None and sla_value <= sla_ms)
    # the load's later half by scheduled arrival, where each half has the queries for the percentile: its percentile,
    # and its median latency over the earlier half's (a queue still growing: above 1)
    scheduled = np.array([r.get("scheduled_ms", math.nan) for r in records], dtype=np.float64)[counted]
    if len(sla_lat) >= 2 * math.ceil(100 / max(100 - sla_percentile, 1e-9)) and not np.isnan(scheduled).any():
        later = scheduled > np.median(scheduled)
        value = percentile(sla_lat[later], sla_percentile)
        out["sla_latency_last_half_ms"] = None if value is None or not np.isfinite(value) else value
        first, last = np.median(sla_lat[~later]), np.median(sla_lat[later])
        out["latency_growth"] = float(last / first) if np.isfinite(last) and np.isfinite(first) and first > 0 else None
    floor_query = percentile(samples[counted].astype(np.float64), sla_percentile)
    out["latency_floor_samples"] = None if floor_query is None else int(floor_query)
    return out


def sustained_latency(row: Mapping[str, Any]) -> float | None:
    """The latency at the bound's percentile a load held: its whole span's, unless its later half's median latency
    was GROWTH above its earlier half's (a queue still growing), then the later half's percentile; None where it is
    infinite (dropped)."""
    whole, last, growth = row.get("sla_latency_ms"), row.get("sla_latency_last_half_ms"), row.get("latency_growth")
    if whole is not None and growth is not None and growth > GROWTH:
        return None if last is None else max(whole, last)
    return whole


def held_latency(row: Mapping[str, Any]) -> float | None:
    """The latency a probe's load held at the bound's percentile (`sustained_latency`); None where the load was cut
    short (decided early, or its issuer fell behind) or nothing completed: it did not hold its rate."""
    if row["load_stopped_early"] or row["issue_stopped"] or row["sla_latency_ms"] is None:
        return None
    return sustained_latency(row)


def transfer_columns(records: list[QueryRow]) -> InferSummaryRow:
    """What crossing a network cost the completed queries (`serve.remote`'s stages): round trips, each
    transfer stage's mean, their sum against the latency and the server's compute, and the bytes moved.
    Nulls in process; a stage a server did not report is null, and so are the sums that need it."""
    ok = [r for r in records if r["status"] == "ok" and r.get("round_trip_ms") is not None]
    out = InferSummaryRow({name: None for name in TRANSFER_SUMMARY})
    if not ok:
        return out

    def values(column: str) -> np.ndarray | None:
        v = [r.get(column) for r in ok]
        return None if any(x is None for x in v) else np.array(v, dtype=np.float64)

    rtt = values("round_trip_ms")
    out["round_trip_p50_ms"], out["round_trip_p99_ms"] = percentile(rtt, 50), percentile(rtt, 99)
    stages = {stage: values(f"{stage}_ms") for stage in TRANSFER_STAGES}
    for stage, v in stages.items():
        out[f"{stage}_mean_ms"] = None if v is None else float(v.mean())
    samples = float(sum(r["samples"] for r in ok))
    if all(v is not None for v in stages.values()):
        # every stage reported (checked above): the sum of their arrays, an array
        transfer = cast(np.ndarray, sum(v for v in stages.values() if v is not None))
        latency = np.array([r["latency_ms"] for r in ok], dtype=np.float64)
        compute = values("compute_ms")
        out["transfer_mean_ms"] = float(transfer.mean())
        out["transfer_share"] = float(transfer.sum() / latency.sum()) if latency.sum() > 0 else None
        out["transfer_per_sample_us"] = float(transfer.sum() / samples * 1e3)
        out["transfer_to_compute"] = (
            None if compute is None or compute.mean() <= 0 else float(transfer.mean() / compute.mean())
        )
    requests, responses = values("request_bytes"), values("response_bytes")
    out["request_bytes_mean"] = None if requests is None else float(requests.mean())
    out["request_bytes_per_sample"] = None if requests is None else float(requests.sum() / samples)
    out["response_bytes_mean"] = None if responses is None else float(responses.mean())
    return out


TRANSFER_SUMMARY = (
    "round_trip_p50_ms",
    "round_trip_p99_ms",
    *[f"{s}_mean_ms" for s in TRANSFER_STAGES],
    "transfer_mean_ms",
    "transfer_share",
    "transfer_per_sample_us",
    "transfer_to_compute",
    "request_bytes_mean",
    "response_bytes_mean",
    "request_bytes_per_sample",
)


def batch_stage_means(records: list[QueryRow]) -> dict[str, float | None]:
    """Mean ms per batch in each stage (over the point's batches that recorded it)."""
    batches = {r["batch_id"]: r for r in records if r.get("batch_id") is not None and r["status"] == "ok"}
    out: dict[str, float | None] = {}
    for stage in (*BATCH_STAGES, "completion"):
        values = [b[f"batch_{stage}_ms"] for b in batches.values() if b.get(f"batch_{stage}_ms") is not None]
        out[f"batch_{stage}_mean_ms"] = float(np.mean(values)) if values else None
    return out


def tail_parts(records: list[QueryRow], percentile_: float) -> dict[str, float | None]:
    """The latency parts of the tail: each part's mean over the completed queries whose latency is at
    or above the `percentile_` latency (so they add up to those queries' mean latency)."""
    ok = [r for r in records if r["status"] == "ok" and r.get("lat_queue_ms") is not None]
    out: dict[str, float | None] = {f"tail_{part}_ms": None for part in LATENCY_PARTS}
    if not ok:
        return out
    cut = percentile(np.array([r["latency_ms"] for r in ok], dtype=np.float64), percentile_)
    tail = [r for r in ok if r["latency_ms"] >= cut]
    for part in LATENCY_PARTS:
        values = [r[f"lat_{part}_ms"] for r in tail if r.get(f"lat_{part}_ms") is not None]
        out[f"tail_{part}_ms"] = float(np.mean(values)) if values else None
    return out


def latency_parts(record: QueryRow, roof_ms: float | None, transport_ms: float | None = None) -> QueryRow:
    """A completed query's latency in LATENCY_PARTS, which add up to `latency_ms` (nulls for a query that
    never ran). With the batch that finished it taking T on its instance, E as the instance's warm
    batch-cost model has it and R at the roofline (`roof_ms`; 0 without a machine profile):
        issue = issued - scheduled;  queue = that batch's start - issued (batching delay, a free
        instance, and a split query's earlier pieces);  roof = min(R, T);  beyond_roof = min(max(E, R), T)
        - roof;  slowdown = T - roof - beyond_roof (a batch slower than warm);  completion = end - that
        batch's end (its scores' trip back);  transport: the network, where the query crossed one
        (`transport_ms`, already outside the other parts' span: it is added to the latency's own)."""
    out = QueryRow({f"lat_{part}_ms": None for part in LATENCY_PARTS})
    start, took = record.get("batch_start_ms"), record.get("batch_compute_ms")
    if record.get("status") == "ok" and record.get("round_trip_ms") is not None:
        return _remote_latency_parts(record, roof_ms, out)
    if record.get("status") != "ok" or start is None or took is None:
        return out
    expected = record.get("batch_expected_ms") or took
    roof = min(roof_ms or 0.0, took)
    warm = min(max(expected, roof_ms or 0.0), took)
    out.update(
        lat_issue_ms=record["issued_ms"] - record["scheduled_ms"],
        lat_queue_ms=start - record["issued_ms"],
        lat_roof_ms=roof,
        lat_beyond_roof_ms=warm - roof,
        lat_slowdown_ms=took - warm,
        lat_completion_ms=record["end_ms"] - (start + took),
        lat_transport_ms=transport_ms,
    )
    return out


def _remote_latency_parts(record: QueryRow, roof_ms: float | None, out: QueryRow) -> QueryRow:
    """A query answered over a network, in LATENCY_PARTS from its client stages and the server's reported
    ones: issue, transport (the transfer stages), queue, and the server's compute as roof and beyond;
    the in-service slowdown and the completion are not told apart there (null). A server that reported
    no stages leaves all but the issue null."""
    transfer = [record.get(f"{stage}_ms") for stage in TRANSFER_STAGES]
    out["lat_issue_ms"] = record["issued_ms"] - record["scheduled_ms"]
    compute = record.get("compute_ms")
    if any(t is None for t in transfer) or compute is None or record.get("queue_ms") is None:
        return out
    roof = min(roof_ms or 0.0, compute)
    out.update(
        lat_transport_ms=sum(transfer),
        lat_queue_ms=record["queue_ms"],
        lat_roof_ms=roof,
        lat_beyond_roof_ms=compute - roof,
    )
    return out


def _family_summaries(records: list[QueryRow], ok: np.ndarray, samples: np.ndarray) -> InferSummaryRow:
    """Every family's own summary columns (null where its query columns are absent: another family's rows)."""
    out = InferSummaryRow()
    for serving in every_serving():
        out.update(serving.summarize_queries(records, ok, samples))
    return out


def with_late_flags(records: list[QueryRow], sla_ms: dict[str, float], point: int) -> list[QueryRow]:
    """Tag rows with their point and whether they missed their model's bound."""
    for r in records:
        r["point"] = point
        r["late"] = r["status"] == "ok" and r["latency_ms"] > sla_ms[r["model"]]
    return records


def roofline_columns(
    spec: ModelSpec,
    table_precision: str,
    row: InferSummaryRow,
    peaks: Peaks | str,
    dense_bytes_per_parameter: float = 4.0,
) -> InferSummaryRow:
    """The point's achieved FLOP/s and bytes/s (whole machine) and its mean batch on one
    instance against the roofline: forward FLOPs and embedding rows at the tables' storage
    precision per sample, the dense weights read once per batch, against the peaks at the
    instance's thread count. The measured time is the instance's compute time per batch."""
    cost = sample_cost(spec, window=SERVED_WINDOW)  # HSTU: the requests a server scores
    row_bytes = lookup_bytes_per_sample(spec, table_precision)
    out = InferSummaryRow(flops_per_sample=float(cost.forward_flops), bytes_per_sample=row_bytes)
    rate = row.get("samples_per_s")
    if rate is not None:
        out["achieved_flops_per_s"] = rate * cost.forward_flops
        out["achieved_bytes_per_s"] = rate * row_bytes
    batch, ms = row.get("batch_samples_mean"), row.get("batch_compute_mean_ms")
    if not batch:
        out["roofline_note"] = "no batch completed"
        return out
    work = Work(
        flops=batch * cost.forward_flops,
        gather_bytes=batch * row_bytes,
        stream_bytes=dense_bytes_per_parameter * spec.dense_parameters,
        gather_rows=batch * cost.embedding_rows_read,
        table_bytes=stored_table_bytes(spec, table_precision),
    )
    out.update(place(work, ms / 1e3 if ms else None, peaks))
    return out


# A query's timestamps (time.monotonic_ns, taken in Python) resolve about a microsecond: a floor below it (a tiny
# model's query at the roof) is printed as such, and no latency is divided by it.
FLOOR_RESOLUTION_MS = 1e-3


def latency_floor_columns(
    spec: ModelSpec,
    table_precision: str,
    instances: int,
    threads: int,
    max_batch: int,
    row: InferSummaryRow,
    peaks: Peaks | str,
    min_piece: int = 0,
    dense_bytes_per_parameter: float = 4.0,
    distinct: Callable[[int], float] | None = None,
) -> InferSummaryRow:
    """The latency floor of the point: the roofline time of its query at the bound's
    percentile (`latency_floor_samples`, from summarize) on the cores that would serve it.

    A query is split over min(instances, max(ceil(q / max_batch), q // min_piece))
    instances (the server's split: pieces of at most max_batch, and over idle instances in
    pieces of at least min_piece), each with `threads` threads (the peaks given); its floor is the roofline time
    of one piece (ceil(q / pieces) samples: forward FLOPs and embedding rows as in
    `roofline_columns`, the dense weights read once), plus the machine's wake of a thread idle as long as
    an instance sits between its queries at this rate (`latency_floor_wake_ms`, `metrics.wake`: the
    probe's p50 at the nearest idle time at or below instances / rate; 0 for an instance never idle 1 ms), its
    memory bandwidths divided by how much slower the machine reads memory gone cold over that gap
    (`latency_floor_cold_factor`, `metrics.wake.probe_cold_gather`; at `keep_warm_ms` where the instance keeps its
    memory warm that often; 1 for an instance never idle 1 ms).
    `latency_floor_ratio` is the measured latency at that percentile over the floor: 1 would be a query
    served at the machine's peaks with no queueing, batching delay or overhead. Nulls when the floor cannot
    be placed (no profile) or nothing completed.
    """
    out = InferSummaryRow(
        latency_floor_cores=None,
        latency_floor_ms=None,
        latency_floor_ratio=None,
        latency_floor_wake_ms=None,
        latency_floor_cold_factor=None,
    )
    q = row.get("latency_floor_samples")
    if not q or isinstance(peaks, str):
        return out
    pieces = max(1, min(instances, max(math.ceil(q / max_batch), q // min_piece if min_piece else 0)))
    rate = row.get("queries_per_s") or row.get("target_qps")
    gap_ms = 1e3 * instances / rate if rate else None  # how long an instance sits idle between its queries
    warmed = row.get("keep_warm_ms") or None  # an idle instance that runs a batch this often: its memory's gap
    cold = cold_factor_for_gap(peaks.cold, min(gap_ms, warmed) if gap_ms and warmed else gap_ms)
    memory_then = replace(
        peaks,
        gather_bytes_per_s=peaks.gather_bytes_per_s / cold,
        gather_rows_per_s=peaks.gather_rows_per_s / cold if peaks.gather_rows_per_s else None,
        gather_cached_bytes_per_s=peaks.gather_cached_bytes_per_s / cold if peaks.gather_cached_bytes_per_s else None,
        memory_bytes_per_s=peaks.memory_bytes_per_s / cold,
    )
    piece = math.ceil(q / pieces)  # its distinct rows only (`batch_roof`'s `distinct`)
    floor_ms = batch_roof(spec, table_precision, memory_then, dense_bytes_per_parameter, distinct)(piece)
    wake_ms = wake_ms_for_gap(peaks.wake, gap_ms)
    if floor_ms is not None:
        floor_ms += wake_ms
    out["latency_floor_cores"] = pieces * threads
    out["latency_floor_ms"] = floor_ms
    out["latency_floor_wake_ms"] = wake_ms
    out["latency_floor_cold_factor"] = cold
    measured = row.get("sla_latency_ms")
    if measured is not None and floor_ms and floor_ms >= FLOOR_RESOLUTION_MS:  # below it a ratio means nothing
        out["latency_floor_ratio"] = measured / floor_ms
    return out


def build_peaks(
    profile: Any, device: str, build: str | None, precision: str, threads: int, fallback: str | None = None
) -> Peaks | str:
    """The peaks a build's batches are placed against: those of the precision its GEMMs compute in (an int8 build:
    the int8 product's); where the profile has none (probed before int8 was), `fallback`'s (default: `precision`)."""
    where = "cuda:0" if device == "cuda" else device
    computed = computes_in(build, precision)
    peaks = peaks_for(profile, where, gemm_precision(device, computed), threads)
    if isinstance(peaks, str) and computed != precision:
        peaks = peaks_for(profile, where, gemm_precision(device, fallback or precision), threads)
    return peaks


def batch_roof(
    spec: ModelSpec,
    table_precision: str,
    peaks: Peaks | str,
    dense_bytes_per_parameter: float = 4.0,
    distinct: Callable[[int], float] | None = None,
) -> Callable[[int], float | None]:
    """The roofline time (ms) of a batch of n samples on one instance: forward FLOPs at the GEMM peak,
    embedding rows at the gather bandwidth and the dense weights read once (at the precision the
    build stores them in); None without peaks. `distinct(n)`: the share of a batch's looked-up rows that are
    distinct (`infer.library.PackedLibrary.distinct_share`: a repeated row is a cache hit); None: every row."""
    if isinstance(peaks, str):
        return lambda n: None
    cost = sample_cost(spec, window=SERVED_WINDOW)  # HSTU: the requests a server scores
    flops, rows = cost.forward_flops, cost.embedding_rows_read
    row_bytes = lookup_bytes_per_sample(spec, table_precision)
    stream = dense_bytes_per_parameter * spec.dense_parameters
    tables = stored_table_bytes(spec, table_precision)

    @functools.lru_cache(maxsize=4096)  # a batch's rows ask for one n, and batch sizes repeat: once each
    def roof(n: int) -> float | None:
        share = distinct(n) if distinct is not None else 1.0
        work = Work(n * flops, n * row_bytes * share, stream, gather_rows=n * rows * share, table_bytes=tables)
        return cast("float | None", place(work, None, peaks)["roofline_bound_ms"])  # a time (the note is the str)

    return roof


def energy_columns(energy: InferSummaryRow, point_rows: list[InferSummaryRow]) -> InferSummaryRow:
    """Energy of a point, shared by every model served in it: per query and per sample over
    all of the point's completed queries (mean power / throughput, so the drain after the
    load does not count as idle samples)."""
    out = InferSummaryRow(energy, energy_per_query_j=None, energy_per_sample_j=None, samples_per_s_per_w=None)
    power = energy.get("power_w_mean")
    qps = sum(r.get("queries_per_s") or 0.0 for r in point_rows)
    sps = sum(r.get("samples_per_s") or 0.0 for r in point_rows)
    if power and qps:
        out["energy_per_query_j"] = power / qps
        out["energy_per_sample_j"] = power / sps
        out["samples_per_s_per_w"] = sps / power
    return out

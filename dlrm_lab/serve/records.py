"""Client records: one row per query with its stages, one summary row per client run.

A query's latency (scheduled arrival -> scores decoded) is cut into stages that add up
exactly, each from the clock that saw it:

    lag             scheduled -> serialise start            client clock (the load generator's delay)
    serialise       serialise start -> send                 client clock (payload bytes + protobuf)
    network         round trip - server time                client round trip, server durations
    server_parse    receive -> submitted to the batcher     server clock (protobuf decode, checks)
    queue           submitted -> first compute start        server clock
    compute         first compute start -> scores back      server clock (instance + result pipe)
    server_respond  scores back -> response built           server clock
    deserialise     receive -> scores decoded               client clock

Only durations cross hosts, never timestamps: `network` is the client's round trip minus
the server's receive-to-send time, so it holds both directions of the wire, gRPC and
HTTP/2 framing, and the response's protobuf encoding (it follows the send stamp).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

STAGES = ("lag", "serialise", "network", "server_parse", "queue", "compute", "server_respond", "deserialise")
TRANSFER_STAGES = ("serialise", "network", "server_parse", "server_respond", "deserialise")  # not in-process
ERROR_CODES = ("RESOURCE_EXHAUSTED", "INVALID_ARGUMENT", "UNAVAILABLE", "DEADLINE_EXCEEDED", "INTERNAL")

CLIENT_QUERY_SCHEMA = pa.schema(
    [
        ("worker", pa.int32()),
        ("query_id", pa.int64()),
        ("model", pa.string()),
        ("samples", pa.int32()),
        ("status", pa.string()),  # ok, or the gRPC status code name
        ("error", pa.string()),  # the server's (or gRPC's) message when not ok
        # client clock, ms from the start of the load (every worker shares the origin)
        ("scheduled_ms", pa.float64()),
        ("serialise_start_ms", pa.float64()),
        ("serialise_end_ms", pa.float64()),
        ("send_ms", pa.float64()),
        ("receive_ms", pa.float64()),
        ("deserialise_end_ms", pa.float64()),
        ("latency_ms", pa.float64()),  # deserialise end - scheduled
        ("round_trip_ms", pa.float64()),  # receive - send
        *[(f"{s}_ms", pa.float64()) for s in STAGES],
        ("server_ms", pa.float64()),  # server receive -> send
        ("instance_compute_ms", pa.float64()),  # instance time summed over the query's pieces
        ("request_bytes", pa.int64()),
        ("response_bytes", pa.int64()),
        ("batch_samples", pa.int32()),
        ("instance", pa.int32()),
        ("pieces", pa.int32()),
        ("server_receive_ns", pa.int64()),  # server clock (only for matching the server's own log)
    ]
)

PERCENTILE_FIELDS = {"latency_p50_ms": 50, "latency_p90_ms": 90, "latency_p95_ms": 95, "latency_p99_ms": 99,
                     "latency_p99_9_ms": 99.9}  # fmt: skip

CLIENT_SUMMARY_SCHEMA = pa.schema(
    [
        ("model", pa.string()),
        ("preset", pa.string()),
        ("target", pa.string()),
        ("mode", pa.string()),  # open-loop or closed-loop
        ("rpc", pa.string()),  # stream (one InferStream per worker) or unary (one Infer call per query)
        ("concurrency", pa.int32()),  # worker processes
        ("target_qps", pa.float64()),  # open loop, all workers together
        ("query_sizes", pa.string()),
        ("arrival", pa.string()),
        ("duration_s", pa.float64()),
        ("queries", pa.int64()),
        ("completed_queries", pa.int64()),
        ("error_queries", pa.int64()),
        *[(f"{c.lower()}_queries", pa.int64()) for c in ERROR_CODES],
        ("errors_by_code", pa.map_(pa.string(), pa.int64())),
        ("queries_per_s", pa.float64()),
        ("samples_per_s", pa.float64()),
        *[(f, pa.float64()) for f in PERCENTILE_FIELDS],
        ("latency_mean_ms", pa.float64()),
        ("latency_max_ms", pa.float64()),
        ("round_trip_mean_ms", pa.float64()),
        ("round_trip_p50_ms", pa.float64()),
        ("round_trip_p99_ms", pa.float64()),
        *[(f"{s}_mean_ms", pa.float64()) for s in STAGES],
        *[(f"{s}_share", pa.float64()) for s in STAGES],
        ("instance_compute_mean_ms", pa.float64()),
        ("transfer_mean_ms", pa.float64()),  # serialise + network + server parse + respond + deserialise
        ("transfer_per_sample_us", pa.float64()),
        ("transfer_to_compute", pa.float64()),  # transfer_mean_ms / compute_mean_ms
        ("request_bytes_mean", pa.float64()),
        ("response_bytes_mean", pa.float64()),
        ("request_bytes_per_sample", pa.float64()),
        ("achieved_rate_ratio", pa.float64()),  # issued / target queries (open loop)
        ("issue_lag_p50_ms", pa.float64()),
        ("issue_lag_p99_ms", pa.float64()),
        ("issue_lag_max_ms", pa.float64()),
        ("issue_stopped", pa.string()),  # why a worker's open loop stopped issuing early (--max-issue-lag-ms)
        ("server_lost", pa.bool_()),
        ("error", pa.string()),
        ("loadgen_result", pa.string()),  # MLPerf LoadGen scenarios: its verdict, rate and p99
        ("loadgen_queries_per_s", pa.float64()),
        ("loadgen_p99_ms", pa.float64()),
    ]
)


def summarize_client(
    table: pa.Table, *, duration_s: float, target_qps: float | None, lost: bool, cut_short: bool = False
) -> dict[str, Any]:
    """Throughput, latency, errors by code and stage shares of a client run's query rows.

    Throughput counts ok queries over the load's span (longer than `duration_s` when the
    last answers came later; the observed span when the server was lost or the load was
    `cut_short`). Stage shares
    are each stage's mean over ok queries divided by their mean latency: they sum to 1.
    """
    from dlrm_lab.metrics.stats import percentile

    def col(name: str, rows: np.ndarray | None = None) -> np.ndarray:
        values = table.column(name).to_numpy(zero_copy_only=False)
        return values if rows is None else values[rows]

    n = table.num_rows
    status = col("status").astype(str) if n else np.array([], dtype=str)
    ok = status == "ok"
    codes, counts = np.unique(status[~ok], return_counts=True)
    by_code = dict(zip(codes.tolist(), counts.tolist(), strict=True))
    samples = col("samples").astype(np.int64) if n else np.zeros(0, dtype=np.int64)
    span = duration_s
    if n:
        observed = (np.nanmax(col("deserialise_end_ms")) - np.nanmin(col("scheduled_ms"))) / 1e3
        span = observed if lost or cut_short else max(duration_s, observed)
    lat = col("latency_ms", ok).astype(np.float64) if n else np.zeros(0)
    rtt = col("round_trip_ms", ok).astype(np.float64) if n else np.zeros(0)
    out: dict[str, Any] = {
        "duration_s": span,
        "queries": n,
        "completed_queries": int(ok.sum()),
        "error_queries": int((~ok).sum()),
        **{f"{c.lower()}_queries": by_code.get(c, 0) for c in ERROR_CODES},
        "errors_by_code": sorted(by_code.items()),
        "queries_per_s": float(ok.sum() / span) if span > 0 else None,
        "samples_per_s": float(samples[ok].sum() / span) if span > 0 else None,
        **{f: percentile(lat, p) for f, p in PERCENTILE_FIELDS.items()},
        "latency_mean_ms": float(lat.mean()) if len(lat) else None,
        "latency_max_ms": float(lat.max()) if len(lat) else None,
        "round_trip_mean_ms": float(rtt.mean()) if len(rtt) else None,
        "round_trip_p50_ms": percentile(rtt, 50),
        "round_trip_p99_ms": percentile(rtt, 99),
        "server_lost": lost,
    }
    means = {s: float(col(f"{s}_ms", ok).astype(np.float64).mean()) if len(lat) else None for s in STAGES}
    for s in STAGES:
        out[f"{s}_mean_ms"] = means[s]
        out[f"{s}_share"] = means[s] / out["latency_mean_ms"] if len(lat) and out["latency_mean_ms"] > 0 else None
    if len(lat):
        transfer = sum(col(f"{s}_ms", ok).astype(np.float64) for s in TRANSFER_STAGES)
        out["transfer_mean_ms"] = float(transfer.mean())
        out["transfer_per_sample_us"] = float(transfer.sum() / samples[ok].sum() * 1e3)
        out["transfer_to_compute"] = out["transfer_mean_ms"] / means["compute"] if means["compute"] else None
        out["instance_compute_mean_ms"] = float(col("instance_compute_ms", ok).astype(np.float64).mean())
        out["request_bytes_mean"] = float(col("request_bytes", ok).mean())
        out["response_bytes_mean"] = float(col("response_bytes", ok).mean())
        out["request_bytes_per_sample"] = float(col("request_bytes", ok).sum() / samples[ok].sum())
    if n:
        lag = col("lag_ms").astype(np.float64)
        out["issue_lag_p50_ms"] = percentile(lag, 50)
        out["issue_lag_p99_ms"] = percentile(lag, 99)
        out["issue_lag_max_ms"] = float(lag.max())
    if target_qps:
        out["achieved_rate_ratio"] = n / (target_qps * duration_s)
    return out

"""The inference lab's tables: a query per row (`queries`), a load point per row (`infer summary`), a search's
probes (`search summary`) and its serving configurations (`frontier`)."""

from __future__ import annotations

from dlrm_lab.metrics.columns.groups import CANARY, ENERGY, ROOFLINE, ROOFLINE_PLACED, SERVING_COST
from dlrm_lab.metrics.columns.registry import (
    BATCH_STAGES,
    BOOL,
    F64,
    HIGHER,
    I32,
    I64,
    LATENCY_PARTS,
    LOWER,
    STR,
    TRANSFER_STAGES,
    col,
    register_table,
)

# queries.parquet: one row per query (`infer.records.query_row`)
register_table(
    "queries",
    col("point", I32, "point", fmt="d"),
    col("query_id", I64),
    col("model", STR, "model", fmt="s"),
    col("samples", I32),
    col("status", STR),
    col("scheduled_ms", F64),
    col("issued_ms", F64),
    col("start_ms", F64),
    col("end_ms", F64),
    col("latency_ms", F64),
    col("queue_ms", F64),
    col("compute_ms", F64),
    col("batch_id", I64),
    col("batch_samples", I32),
    col("batch_queries", I32),
    col("instance", I32),
    col("batch_compute_ms", F64),  # that batch's time on its instance
    col("batch_expected_ms", F64),  # ... as the instance's warm batch-cost model has it
    col("pieces", I32),
    col("late", BOOL),
    col("error", STR),
    # (the HSTU family registers its history columns here: families/hstu.py COLUMNS)
    # the batch of the query's last piece: when it began on its instance, its stages there, and its
    # result's trip back to the serving process (docs/metrics.md)
    col("batch_start_ms", F64),
    *[col(f"batch_{stage}_ms", F64) for stage in BATCH_STAGES],
    col("batch_completion_ms", F64),
    # the query's latency in parts that sum to it (`latency_parts`)
    *[col(f"lat_{part}_ms", F64) for part in LATENCY_PARTS],
    # a query that crossed a network (`serve.remote`; null in process): the client connection that sent it,
    # the RPC's own status code, and its transfer stages (they and issue, queue, compute sum to the latency)
    col("worker", I32),
    col("rpc_status", STR),
    *[col(f"{stage}_ms", F64) for stage in TRANSFER_STAGES],
    col("round_trip_ms", F64),  # client send -> receive
    col("server_ms", F64),  # server receive -> send (its clock; a duration only)
    col("instance_compute_ms", F64),  # instance time summed over the query's pieces
    col("request_bytes", I64),
    col("response_bytes", I64),
)

# summary.parquet of `infer run`: one row per model and load point (`infer.records.summarize` and `infer.load_point`)
register_table(
    "infer summary",
    "point",
    "model",
    col("mode", STR, "mode", fmt="s"),  # "together" (all models served at once) or "alone"
    col("scenario", STR),
    col("preset", STR, "preset", fmt="s"),
    col("instances", I32, "instances", fmt="d"),
    col("threads_per_instance", I32, "threads per instance", fmt="d", short="threads"),
    col("max_batch", I32, "max batch", "samples", "d", short="max batch"),
    col("max_delay_ms", F64, "max batching delay", "ms", "g", short="delay ms"),
    col("max_queue", I32),
    col("min_piece", I32),  # smallest split piece (resolved: measured when 0 was asked)
    col("spin_ms", F64),  # an idle instance polls this long before it sleeps
    col("keep_warm_ms", F64),  # an idle instance runs a 1-sample batch this often (0: off)
    col("idle_hold", STR),  # what an idle instance holds while it waits (infer.instance.IDLE_HOLDS)
    col("batch_memory", STR),  # whether its instances' malloc keeps a batch's freed buffers (infer.batch_memory)
    col("allocator", STR),  # the C allocator its instances run: glibc, jemalloc or tcmalloc (infer.allocator)
    col("table_pages", STR),  # the snapshot's pages, where its instances map the tables: base or huge
    col("max_query_samples", I64),  # the largest query accepted
    col("precision", STR, "precision", fmt="s"),
    col("table_precision", STR, "table precision", fmt="s"),
    col("build", STR, "inference build", fmt="s"),  # the inference form served (infer.build)
    col("checkpoint", STR),  # the trained weights served (a train --checkpoint-dir step); null: untrained
    col("checkpoint_step", I64),  # the training steps behind them
    col("checkpoint_auc", F64, "trained model's held-out AUC", fmt=".4f"),  # at that step, as training measured it
    col("batch_fixed_ms", F64, "warm batch cost: fixed", "ms", ".3f"),  # the instances' warm batch cost: fixed ...
    col("batch_per_sample_us", F64),  # ... and per sample (measured back to back at start)
    # (the HSTU family registers its serving columns here: families/hstu.py COLUMNS)
    col("query_sizes", STR),
    col("arrival", STR),
    col("target_qps", F64, "offered load", "queries/s", ".1f", short="target q/s"),
    col("duration_s", F64, "duration", "s", ".1f", short="secs"),
    col("warmup_s", F64),  # untimed load before the point (infer.load_point.warm_up)
    col("queries", I64),
    col("completed_queries", I64),
    col("dropped_queries", I64, "dropped", "queries", "d", LOWER, "drop"),
    col("rejected_queries", I64),
    col("failed_queries", I64),
    col("unfinished_queries", I64),
    col("expired_queries", I64),  # their sender's deadline passed before they were computed
    col("late_queries", I64, "late", "queries", "d", LOWER, "late"),
    col("queries_per_s", F64, "throughput", "queries/s", ",.1f", HIGHER, "queries/s"),
    col("samples_per_s", F64, "throughput", "samples/s", ",.0f", HIGHER, "samples/s"),
    # nearest-rank percentiles over completed queries (`infer.records.LATENCY_FIELDS`)
    col("latency_p50_ms", F64, "latency p50", "ms", ".2f", LOWER, "p50 ms"),
    col("latency_p90_ms", F64),
    col("latency_p95_ms", F64),
    col("latency_p99_ms", F64, "latency p99", "ms", ".2f", LOWER, "p99 ms"),
    col("latency_p99_9_ms", F64, "latency p99.9", "ms", ".2f", LOWER, "p99.9 ms"),
    col("latency_mean_ms", F64),
    col("latency_max_ms", F64, "latency max", "ms", ".2f", LOWER, "max ms"),
    col("sla_ms", F64, "latency bound", "ms", "g"),
    col("sla_percentile", F64, "latency bound percentile", fmt="g"),
    # latency at sla_percentile, dropped/failed counted as infinite
    col("sla_latency_ms", F64, "latency at the bound's percentile", "ms", ".2f", LOWER),
    col("sla_met", BOOL, "SLA met", fmt="met|missed", short="SLA"),
    # the same over the later half of the load (by scheduled arrival), and that half's median latency over the earlier
    # half's: a queue still growing (`infer.records.sustained_latency`)
    col("sla_latency_last_half_ms", F64),
    col("latency_growth", F64),
    col("load_stopped_early", BOOL),  # ended once its verdict was decided (search probes)
    # the query at the bound's percentile, its roofline time on the cores serving it, and the measured latency over it
    col("latency_floor_samples", I64, "samples of the query at the bound's percentile", "samples", "d"),
    col("latency_floor_cores", I32, "cores serving that query", "cores", "d"),
    col("latency_floor_ms", F64, "latency floor (that query at the roofline)", "ms", ".2f", short="floor ms"),
    col("latency_floor_wake_ms", F64),  # of which the wake of an instance idle between queries (metrics.wake)
    col("latency_floor_cold_factor", F64),  # its memory read that many times slower after that idle (metrics.wake)
    col("latency_floor_ratio", F64, "latency at the bound's percentile over the floor", "x", ".1f", LOWER, "x floor"),
    col("batch_samples_mean", F64, "batch mean", "samples", ".1f", short="batch"),
    col("batch_samples_p50", F64),
    col("batch_samples_p99", F64),
    col("batch_queries_mean", F64),
    col("batches", I64),
    col("queue_share", F64, "queue share", "fraction", ".0%", short="queue"),
    col("compute_slowdown_p50", F64),  # batch time over the warm batch-cost model, median of batches
    col("compute_slowdown_p99", F64),  # ... 99th percentile (a noisy host, cold cores)
    col("queue_mean_ms", F64),
    col("compute_mean_ms", F64),
    # mean ms per batch in each stage on its instance, and its result's trip back
    *[col(f"batch_{stage}_mean_ms", F64) for stage in (*BATCH_STAGES, "completion")],
    # the latency parts of the tail: mean over the queries at or above the bound's percentile
    *[
        col(f"tail_{p}_ms", F64, f"tail latency: {p.replace('_', ' ')}", "ms", ".3f", short=p.replace("_", " "))
        for p in LATENCY_PARTS
    ],
    # (the HSTU family registers its history reuse columns here: families/hstu.py COLUMNS)
    col("achieved_rate_ratio", F64),  # issued / target queries (the load was what it claims)
    col("issue_lag_p50_ms", F64),
    col("issue_lag_p99_ms", F64),
    col("issue_lag_max_ms", F64),
    col("issue_stopped", STR),  # why the open loop stopped issuing early (--max-issue-lag-ms)
    col("instance_stalls", I32),  # batches an instance held >= 0.5 s and >= 20x their warm time
    col("longest_stall_s", F64),
    col("stalled_instances", STR),  # which instances, comma-separated
    col("cpu_utilization", F64),  # of all cores this process may use, 0..1
    col("instance_cpu_utilization", F64),  # instance processes' CPU time / (wall x their threads)
    col("server_cpu_s", F64),  # CPU seconds of the parent (load generator, batcher, completions)
    col("snapshot_mb", F64),
    col("loadgen_result", STR),  # VALID / INVALID (MLPerf LoadGen scenarios)
    col("loadgen_reason", STR),  # INVALID: what LoadGen found unmet (its summary's words)
    col("loadgen_queries_per_s", F64),  # LoadGen's "samples" are our queries
    col("loadgen_p99_ms", F64),
    # the system under test (`infer.targets`) and, over a network, what crossing it cost (null in process)
    col("target", STR, "system under test", fmt="s", short="target"),  # in-process, grpc://HOST:PORT or kserve://...
    col("rpc", STR, "RPC", fmt="s", short="rpc"),  # stream, unary or oip (the Open Inference Protocol's ModelInfer)
    col("concurrency", I32, "client connections", "", "d", short="conns"),  # each in its own process beyond one
    col("round_trip_p50_ms", F64, "round trip p50", "ms", ".3f", LOWER, "rtt p50"),
    col("round_trip_p99_ms", F64, "round trip p99", "ms", ".3f", LOWER, "rtt p99"),
    *[col(f"{stage}_mean_ms", F64) for stage in TRANSFER_STAGES],
    # the transfer stages together, over completed queries; over their mean latency; over the server's compute
    col("transfer_mean_ms", F64, "transfer per query", "ms", ".3f", LOWER, "transfer ms/query"),
    col("transfer_share", F64, "transfer share of latency", "fraction", ".1%", LOWER, "transfer share"),
    col("transfer_per_sample_us", F64),
    col("transfer_to_compute", F64, "transfer over the server's compute", "ratio", ".3f", LOWER, "transfer/compute"),
    col("request_bytes_mean", F64),
    col("response_bytes_mean", F64),
    col("request_bytes_per_sample", F64, "request bytes per sample", "B", ",.0f", LOWER, "B/sample"),
    col("server_lost", BOOL),  # the server answered only UNAVAILABLE until the load ended
    "error",  # why the point ended early (a lost server, a bad answer): the run then fails
    # roofline of one batch on one instance, energy of the whole point (docs/metrics.md)
    col("batch_compute_mean_ms", F64),
    *CANARY,
    *ROOFLINE,
    *ROOFLINE_PLACED,
    *ENERGY,
    col("energy_per_query_j", F64, "energy per query", "J", ".3g", LOWER),
    col("energy_per_sample_j", F64, "energy per sample", "J", ".3g", LOWER),
    col("samples_per_s_per_w", F64, "efficiency", "samples/s/W", ".3g", HIGHER),
    # what the point's rate costs on this machine where its price is known (`metrics.cost`, docs/metrics.md)
    *SERVING_COST,
)
# summary.parquet of `infer search`: its load points, each probe's repeat, which probe, and its verdict
register_table("search summary", col("repeat", I32), col("probe", I32), col("passed", BOOL), extends="infer summary")

# frontier.parquet of `infer search`: one row per serving configuration
register_table(
    "frontier",
    "model",
    "preset",
    "instances",
    "threads_per_instance",
    "max_batch",
    "max_delay_ms",
    "min_piece",  # smallest split piece (measured by the layout's instances when 0 was asked)
    "spin_ms",
    "max_query_samples",
    "precision",  # dense compute of this configuration
    "build",
    # (the HSTU family registers its history cache here: families/hstu.py COLUMNS)
    col("capacity_queries_per_s", F64, "capacity", "queries/s", ".1f", HIGHER, "capacity q/s"),  # closed loop, no bound
    # highest probed rate that met the bound (0: none did)
    col("best_qps", F64, "best rate", "queries/s", ".1f", HIGHER, "best q/s"),
    # half the final bracket [best, lowest failing rate]
    col("best_qps_uncertainty", F64, "best rate uncertainty", "queries/s", ".1f", short="+/-"),
    col("best_samples_per_s", F64, "best throughput", "samples/s", ",.0f", HIGHER, "samples/s"),
    col("best_sla_latency_ms", F64, "latency at the bound's percentile", "ms", ".2f", LOWER),
    col("best_sla_latency_spread_ms", F64),  # max - min over the repeats at best_qps
    # (the HSTU family registers its hit rate at the best rate here: families/hstu.py COLUMNS)
    # the repeats at best_qps (dlrm_lab.metrics.stats: CI needs >= 3 repeats)
    col("best_samples_per_s_ci_low", F64),
    col("best_samples_per_s_ci_high", F64),
    col("best_samples_per_s_cv", F64),
    col("best_samples_per_s_unstable", BOOL),
    "sla_ms",
    "sla_percentile",
    col("probes", I32),
    col("probe_points", I32),  # load points run (repeats), those stopped early included
    col("best", BOOL, "best", fmt="*|"),  # the configuration with the highest best_samples_per_s
    # the best configuration's rate as the lab's own open loop held it over a certification's length (`certify`'s
    # first runs: 0, none held; null: not certified) and its latency at the bound's percentile
    col("held_qps", F64, "held rate (open loop, certification's length)", "queries/s", ".1f", HIGHER, "held q/s"),
    col("held_sla_latency_ms", F64),
    # the best configuration's rate as a longer LoadGen Server run held it (`certify`): the rate that
    # held (0: none of the tries; null: not certified), that run's verdict, its p99 and its length
    col("certified_qps", F64, "certified rate (LoadGen Server)", "queries/s", ".1f", HIGHER, "certified q/s"),
    col("certified_samples_per_s", F64),
    col("certified_result", STR),
    col("certified_sla_latency_ms", F64),
    col("certify_s", F64),
    col("outcome", STR, "why not the best", fmt="s", short="outcome"),  # pruned, lower rate, no rate met the bound
    # its cost at the certified rate (else the best probed) where the machine's price is known (`metrics.cost`)
    *SERVING_COST,
)

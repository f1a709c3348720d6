"""Which columns each reader shows, in order: the command line's closing tables, the report's tables, what
`compare` and sweeps aggregate."""

from __future__ import annotations

from dlrm_lab.metrics.columns.registry import LATENCY_PARTS, PHASES

# Which columns each reader shows, in order.

ROOFLINE_READ = (
    "flops_per_sample",
    "bytes_per_sample",
    "achieved_flops_per_s",
    "roofline_fraction",
    "roofline_bound_by",
)
ENERGY_READ = ("energy_j", "energy_unavailable", "samples_per_s_per_w", "energy_per_sample_j")

# `dlrm-lab train`'s closing table (printed when present in the summary).
TRAIN_PRINTED = (
    "samples_per_s",
    "samples_per_s_per_rank",
    "step_time_ms_p50",
    "step_time_ms_p99",
    *[f"{p}_share" for p in PHASES],
    "loss_first",
    "loss_last",
    "eval_auc",
    "teacher_auc",
    "time_to_target_s",
    "valid_samples_per_s",
)
# `dlrm-lab infer run`'s points table (the floor and its ratio are in each point's log line).
INFER_PRINTED = (
    "model",
    "mode",
    "target_qps",
    "queries_per_s",
    "samples_per_s",
    "latency_p50_ms",
    "latency_p99_ms",
    "latency_max_ms",
    "batch_samples_mean",
    "queue_share",
    "dropped_queries",
    "late_queries",
    "sla_met",
)
# `dlrm-lab infer search`'s frontier table (the bound's percentile column is named at run time).
FRONTIER_PRINTED = (
    "instances",
    "threads_per_instance",
    "max_batch",
    "max_delay_ms",
    "capacity_queries_per_s",
    "best_qps",
    "best_samples_per_s",
    "best_sla_latency_ms",
    "certified_qps",
    "best",
    "outcome",
)
# `dlrm-lab infer run`'s transfer table, for a remote target (`--target`).
TRANSFER_PRINTED = (
    "target",
    "rpc",
    "concurrency",
    "round_trip_p50_ms",
    "round_trip_p99_ms",
    "transfer_mean_ms",
    "transfer_share",
    "transfer_to_compute",
    "request_bytes_per_sample",
)
# `dlrm-lab scale`'s table.
SCALE_PRINTED = (
    "ranks",
    "batch_size_per_rank",
    "global_batch_size",
    "repeats_ok",
    "samples_per_s",
    "samples_per_s_per_rank",
    "speedup",
    "efficiency",
    "ceiling_efficiency",
    "efficiency_vs_ceiling",
    "rank_step_ms",
    "predicted_step_ms",
    "prediction_error",
    "predicted_step_ms_mpi",
    "gap_ms",
    "point_status",
)
# `dlrm-lab runs list`, from each run's first summary row.
RUNS_LISTED = ("preset", "world_size", "global_batch_size", "steps", "samples_per_s", "eval_auc", "duration_s")

# Summary columns the report reads per kind of run.
TRAIN_READ = (
    "preset",
    "device",
    "precision",
    "world_size",
    "global_batch_size",
    "samples_per_s",
    "step_time_ms_mean",
    "step_time_ms_p50",
    "eval_auc",
    *[f"{p}_share" for p in PHASES],
    *ROOFLINE_READ,
    *ENERGY_READ,
)
INFER_READ = (
    "point",
    "model",
    "mode",
    "preset",
    "instances",
    "threads_per_instance",
    "max_batch",
    "max_delay_ms",
    "precision",
    "target_qps",
    "queries_per_s",
    "samples_per_s",
    "latency_p99_ms",
    "sla_ms",
    "sla_percentile",
    "sla_latency_ms",
    "sla_met",
    "latency_floor_ms",
    "latency_floor_ratio",
    "build",
    *[f"tail_{p}_ms" for p in LATENCY_PARTS],
    *ROOFLINE_READ,
    *ENERGY_READ,
    "energy_per_query_j",
    "cost_per_1m_queries",
    "cost_per_1m_samples",
    "currency",
)
SEARCH_READ = (*INFER_READ, "probe", "repeat", "passed")
FRONTIER_READ = (
    "model",
    "preset",
    "instances",
    "threads_per_instance",
    "max_batch",
    "max_delay_ms",
    "capacity_queries_per_s",
    "best_qps",
    "best_qps_uncertainty",
    "best_samples_per_s",
    "best_sla_latency_ms",
    "sla_ms",
    "sla_percentile",
    "probes",
    "best",
    "certified_qps",
    "certified_samples_per_s",
    "cost_per_1m_queries",
    "cost_per_1m_samples",
    "currency",
)

# The report's HTML tables of runs.
TRAIN_TABLE = (
    "preset",
    "world_size",
    "global_batch_size",
    "samples_per_s",
    "step_time_ms_p50",
    "eval_auc",
    "roofline_fraction",
    "energy_per_sample_j",
)
INFER_TABLE = (
    "model",
    "point",
    "mode",
    "queries_per_s",
    "samples_per_s",
    "latency_p99_ms",
    "latency_floor_ms",
    "latency_floor_ratio",
    "sla_met",
    "energy_per_query_j",
)
FRONTIER_TABLE = ("model", "capacity_queries_per_s", "best_qps", "best_samples_per_s", "best_sla_latency_ms", "outcome")
SCALE_TABLE = (
    "mode",
    "ranks",
    "samples_per_s",
    "speedup",
    "efficiency",
    "efficiency_vs_ceiling",
    "roof_efficiency",
    "efficiency_vs_roof",
    "predicted_step_ms",
    "prediction_error",
    "point_run_id",
    "point_status",
)
# what the report reads of a scale run: its table, and what the scaling plot draws besides
SCALE_READ = (*SCALE_TABLE, "ceiling_efficiency", "rank_step_ms")

# `dlrm-lab compare`: the metrics compared per kind of run.
COMPARED = {
    "train": ("samples_per_s", "step_time_ms_p50", "eval_auc", "energy_per_sample_j"),
    "infer": ("queries_per_s", "samples_per_s", "latency_p50_ms", "latency_p99_ms"),
}
# Sweeps: the metrics aggregated per point unless the grid names more.
SWEPT = {
    "train": (
        "samples_per_s",
        "step_time_ms_p50",
        "step_time_ms_p99",
        "eval_auc",
        "achieved_flops_per_s",
        "roofline_fraction",
        "energy_per_sample_j",
    ),
    "infer run": (
        "queries_per_s",
        "samples_per_s",
        "latency_p50_ms",
        "latency_p99_ms",
        "latency_p99_9_ms",
        "sla_latency_ms",
        "roofline_fraction",
        "energy_per_query_j",
    ),
}

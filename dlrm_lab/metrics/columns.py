"""The one column registry: what every metric column means to a reader.

Name, unit, label, number format and which way is better, for each column that a
summary table records and that a printer, report, comparison or sweep shows; and the
views (which columns each of those shows, in order). Records, reports, `compare`,
sweeps and the CLI printers all read it, so adding a metric is a change here (and its
meaning in docs/metrics.md, which a test keeps in step). Torch-free: reports import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

HIGHER, LOWER = "higher", "lower"

# The phases of a training step, in order: forward phases, then backward and the optimizer.
PHASES = (
    "data_wait",
    "input_dist",
    "embedding_lookup",
    "embedding_all_to_all",
    "dense_forward",
    "backward",
    "embedding_all_to_all_backward",
    "optimizer",
)
PHASE_LABELS = {
    "data_wait": "data wait",
    "input_dist": "input distribution",
    "embedding_lookup": "embedding lookup",
    "embedding_all_to_all": "pooled-embedding all-to-all",
    "dense_forward": "dense forward",
    "backward": "backward (table update, all-reduce)",
    "embedding_all_to_all_backward": "pooled-embedding all-to-all, backward",
    "optimizer": "dense optimizer",
}


@dataclass(frozen=True)
class Column:
    """One column: `label` in words, `unit` ("" for none), `fmt` a format spec, `better`
    HIGHER, LOWER or None (not a quantity to rank), `short` a narrow terminal heading.
    A flag's `fmt` is its two words, "true|false"."""

    name: str
    label: str
    unit: str = ""
    fmt: str = ",.4g"
    better: str | None = None
    short: str = ""

    @property
    def heading(self) -> str:
        return f"{self.label} ({self.unit})" if self.unit else self.label

    @property
    def narrow(self) -> str:
        return self.short or self.label

    def format(self, value: Any) -> str:
        """The value as the registry writes it; "-" for missing."""
        if value is None or (isinstance(value, float) and value != value):  # null or NaN
            return "-"
        if isinstance(value, bool):
            yes, _, no = (self.fmt if "|" in self.fmt else "yes|no").partition("|")
            return yes if value else no
        if not isinstance(value, (int, float)):
            return str(value)
        try:
            return format(value, self.fmt)
        except ValueError:  # an int format given a float, or the reverse
            return format(value, ",.4g")


def _c(name: str, label: str, unit: str = "", fmt: str = ",.4g", better: str | None = None, short: str = "") -> Column:
    return Column(name, label, unit, fmt, better, short)


# A served query's latency, cut into parts that add up to it (`infer.records.latency_parts`,
# docs/metrics.md): the load generator's issue lag; queueing and batching; the batch that finished it
# at the roofline, its warm time beyond the roof, and its in-service slowdown over that warm time; the
# result's trip back; and the network where a transport carries the query (null in process).
LATENCY_PARTS = ("issue", "queue", "roof", "beyond_roof", "slowdown", "completion", "transport")

_REGISTERED = [
    # -- what a run is (not ranked)
    _c("preset", "preset", fmt="s"),
    _c("model", "model", fmt="s"),
    _c("mode", "mode", fmt="s"),
    _c("point", "point", fmt="d"),
    _c("device", "device", fmt="s"),
    _c("precision", "precision", fmt="s"),
    _c("table_precision", "table precision", fmt="s"),
    _c("build", "inference build", fmt="s"),
    _c("world_size", "ranks", fmt="d"),
    _c("ranks", "ranks", fmt="d"),
    _c("global_batch_size", "global batch", "samples", ",d", short="batch"),
    _c("steps", "steps", fmt="d"),
    _c("instances", "instances", fmt="d"),
    _c("threads_per_instance", "threads per instance", fmt="d", short="threads"),
    _c("max_batch", "max batch", "samples", "d", short="max batch"),
    _c("max_delay_ms", "max batching delay", "ms", "g", short="delay ms"),
    _c("duration_s", "duration", "s", ".1f", short="secs"),
    _c("target_qps", "offered load", "queries/s", ".1f", short="target q/s"),
    _c("sla_ms", "latency bound", "ms", "g"),
    _c("sla_percentile", "latency bound percentile", fmt="g"),
    _c("sla_met", "SLA met", fmt="met|missed", short="SLA"),
    _c("best", "best", fmt="*|"),
    # -- training
    _c("samples_per_s", "throughput", "samples/s", ",.0f", HIGHER, "samples/s"),
    _c("samples_per_s_per_rank", "throughput per rank", "samples/s", ",.0f", HIGHER),
    _c("step_time_ms_mean", "step time mean", "ms", ".2f", LOWER),
    _c("step_time_ms_p50", "step time p50", "ms", ".2f", LOWER),
    _c("step_time_ms_p99", "step time p99", "ms", ".2f", LOWER),
    *[_c(f"{p}_share", f"{PHASE_LABELS[p]} share", "fraction", ".1%") for p in PHASES],
    _c("loss_first", "loss, first steps", fmt=".4f"),
    _c("loss_last", "loss, last steps", fmt=".4f", better=LOWER),
    _c("eval_auc", "held-out AUC", fmt=".4f", better=HIGHER, short="AUC"),
    _c("teacher_auc", "teacher AUC (best reachable)", fmt=".4f"),
    _c("time_to_target_s", "time to target AUC", "s", ".1f", LOWER),
    _c("valid_samples_per_s", "valid throughput (0 if target missed)", "samples/s", ",.0f", HIGHER),
    # -- roofline and energy
    _c("achieved_flops_per_s", "achieved", "FLOP/s", ".3g", HIGHER),
    _c("roofline_fraction", "roofline fraction", "fraction", ".3f", HIGHER),
    _c("energy_per_sample_j", "energy per sample", "J", ".3g", LOWER),
    _c("energy_per_query_j", "energy per query", "J", ".3g", LOWER),
    _c("samples_per_s_per_w", "efficiency", "samples/s/W", ".3g", HIGHER),
    # -- cost (metrics.cost; in the row's `currency`)
    _c("price_per_hour", "price per hour", fmt=",.4g", short="price/h"),
    _c("cost_per_1m_samples", "cost per 1M samples", fmt=",.4g", better=LOWER, short="cost/1M samples"),
    _c("cost_per_1m_queries", "cost per 1M queries", fmt=",.4g", better=LOWER, short="cost/1M queries"),
    _c("energy_cost_per_1m_samples", "energy cost per 1M samples", fmt=",.4g", better=LOWER),
    _c("cost_per_1m_training_samples", "cost per 1M training samples", fmt=",.4g", better=LOWER),
    _c("cost_to_target", "cost to the target AUC", fmt=",.4g", better=LOWER),
    _c("energy_cost_per_1m_training_samples", "energy cost per 1M training samples", fmt=",.4g", better=LOWER),
    # -- inference
    _c("queries_per_s", "throughput", "queries/s", ",.1f", HIGHER, "queries/s"),
    _c("latency_p50_ms", "latency p50", "ms", ".2f", LOWER, "p50 ms"),
    _c("latency_p99_ms", "latency p99", "ms", ".2f", LOWER, "p99 ms"),
    _c("latency_p99_9_ms", "latency p99.9", "ms", ".2f", LOWER, "p99.9 ms"),
    _c("latency_max_ms", "latency max", "ms", ".2f", LOWER, "max ms"),
    _c("sla_latency_ms", "latency at the bound's percentile", "ms", ".2f", LOWER),
    _c("latency_floor_samples", "samples of the query at the bound's percentile", "samples", "d"),
    _c("latency_floor_cores", "cores serving that query", "cores", "d"),
    _c("latency_floor_ms", "latency floor (that query at the roofline)", "ms", ".2f", short="floor ms"),
    _c("latency_floor_ratio", "latency at the bound's percentile over the floor", "x", ".1f", LOWER, "x floor"),
    _c("batch_samples_mean", "batch mean", "samples", ".1f", short="batch"),
    _c("queue_share", "queue share", "fraction", ".0%", short="queue"),
    _c("dropped_queries", "dropped", "queries", "d", LOWER, "drop"),
    _c("history_hit_rate", "requests that reused a cached history", "fraction", ".1%", HIGHER, "history hits"),
    _c("history_tokens_reused_mean", "history tokens reused per request", "tokens", ".1f"),
    _c("late_queries", "late", "queries", "d", LOWER, "late"),
    *[
        _c(f"tail_{p}_ms", f"tail latency: {p.replace('_', ' ')}", "ms", ".3f", short=p.replace("_", " "))
        for p in LATENCY_PARTS
    ],  # fmt: skip
    _c("batch_fixed_ms", "warm batch cost: fixed", "ms", ".3f"),
    # -- a remote system under test (`--target`)
    _c("target", "system under test", fmt="s", short="target"),
    _c("rpc", "RPC", fmt="s", short="rpc"),
    _c("concurrency", "client connections", "", "d", short="conns"),
    _c("round_trip_p50_ms", "round trip p50", "ms", ".3f", LOWER, "rtt p50"),
    _c("round_trip_p99_ms", "round trip p99", "ms", ".3f", LOWER, "rtt p99"),
    _c("transfer_mean_ms", "transfer per query", "ms", ".3f", LOWER, "transfer ms/query"),
    _c("transfer_share", "transfer share of latency", "fraction", ".1%", LOWER, "transfer share"),
    _c("transfer_to_compute", "transfer over the server's compute", "ratio", ".3f", LOWER, "transfer/compute"),
    _c("request_bytes_per_sample", "request bytes per sample", "B", ",.0f", LOWER, "B/sample"),
    # -- latency-bounded search (frontier)
    _c("capacity_queries_per_s", "capacity", "queries/s", ".1f", HIGHER, "capacity q/s"),
    _c("best_qps", "best rate", "queries/s", ".1f", HIGHER, "best q/s"),
    _c("best_qps_uncertainty", "best rate uncertainty", "queries/s", ".1f", short="+/-"),
    _c("best_samples_per_s", "best throughput", "samples/s", ",.0f", HIGHER, "samples/s"),
    _c("best_sla_latency_ms", "latency at the bound's percentile", "ms", ".2f", LOWER),
    _c("outcome", "why not the best", fmt="s", short="outcome"),
    _c("certified_qps", "certified rate (LoadGen Server)", "queries/s", ".1f", HIGHER, "certified q/s"),
    # -- scaling
    _c("batch_size_per_rank", "batch per rank", "samples", "d", short="batch/rank"),
    _c("repeats_ok", "repeats ok", fmt="d"),
    _c("speedup", "speedup", "x", ".2f", HIGHER),
    _c("efficiency", "efficiency", "fraction", ".3f", HIGHER),
    _c("ceiling_efficiency", "machine ceiling (N pinned processes' GEMM / N x one)", "fraction", ".3f", short="ceil"),
    _c("efficiency_vs_ceiling", "efficiency / ceiling", "fraction", ".3f", HIGHER, "eff/ceiling"),
    _c(
        "roof_efficiency",
        "efficiency the machine allows (compute at the ceiling, bytes at the raw collectives' probed speed)",
        "fraction",
        ".3f",
        short="roof",
    ),
    _c(
        "library_roof_efficiency",
        "efficiency allowed through TorchRec's probed distribution",
        "fraction",
        ".3f",
        short="TorchRec roof",
    ),
    _c("efficiency_vs_roof", "efficiency / the machine's roof", "fraction", ".3f", HIGHER, "eff/roof"),
    _c("rank_step_ms", "per-rank step (mean)", "ms", ".1f", LOWER, "rank step ms"),
    _c("predicted_step_ms", "predicted per-rank step", "ms", ".1f", short="predicted ms"),
    _c("prediction_error", "measured / predicted - 1", "fraction", "+.1%", short="pred. error"),
    _c("predicted_step_ms_mpi", "predicted per-rank step with MPI's collectives", "ms", ".1f", short="with MPI ms"),
    _c("gap_ms", "per-rank step beyond one rank's", "ms", ".1f", LOWER, "gap ms"),
    _c("point_run_id", "point run", fmt="s"),
    _c("point_status", "point status", fmt="s"),
]
COLUMNS: dict[str, Column] = {c.name: c for c in _REGISTERED}

# Units of columns the registry does not list (sweep aggregates, new columns), read off
# the name by the conventions of docs/metrics.md; first match wins.
_SUFFIX_UNITS = (
    ("samples_per_s_per_w", "samples/s/W"),
    ("flops_per_s_per_w", "FLOP/s/W"),
    ("samples_per_s", "samples/s"),
    ("queries_per_s", "queries/s"),
    ("flops_per_s", "FLOP/s"),
    ("bytes_per_s", "B/s"),
    ("_ms", "ms"),
    ("_j", "J"),
    ("_w", "W"),
    ("_mb", "MB"),
    ("_s", "s"),
    ("_share", "fraction"),
    ("fraction", "fraction"),
    ("efficiency", "fraction"),
)


def column(name: str) -> Column:
    """The registered column, or one derived from its name (unit by suffix, no direction)."""
    found = COLUMNS.get(name)
    if found is not None:
        return found
    unit = next((u for suffix, u in _SUFFIX_UNITS if name.endswith(suffix)), "")
    return Column(name, name, unit)


def unit_of(name: str) -> str:
    return column(name).unit


def fmt(name: str, value: Any) -> str:
    return column(name).format(value)


# ----------------------------------------------------------------------------- views
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
    "target", "rpc", "concurrency", "round_trip_p50_ms", "round_trip_p99_ms", "transfer_mean_ms", "transfer_share",
    "transfer_to_compute", "request_bytes_per_sample",
)  # fmt: skip
# `dlrm-lab scale`'s table.
SCALE_PRINTED = (
    "ranks", "batch_size_per_rank", "global_batch_size", "repeats_ok", "samples_per_s", "samples_per_s_per_rank",
    "speedup", "efficiency", "ceiling_efficiency", "efficiency_vs_ceiling", "rank_step_ms", "predicted_step_ms",
    "prediction_error", "predicted_step_ms_mpi", "gap_ms", "point_status",
)  # fmt: skip
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
FRONTIER_TABLE = (
    "model", "capacity_queries_per_s", "best_qps", "best_samples_per_s", "best_sla_latency_ms", "outcome"
)  # fmt: skip
SCALE_TABLE = (
    "mode", "ranks", "samples_per_s", "speedup", "efficiency", "efficiency_vs_ceiling", "roof_efficiency",
    "efficiency_vs_roof", "predicted_step_ms", "prediction_error", "point_run_id", "point_status",
)  # fmt: skip
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

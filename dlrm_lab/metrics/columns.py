"""The one column registry: what every column of a run's tables is, and how readers show it.

A column is defined once: its name, Arrow type and meaning, and, for a metric that a printer,
report, comparison or sweep shows, its label, unit, number format and which way is better. A
table (`queries`, `steps`, `train summary`, ...) is its columns in file order, so every Parquet
schema a run writes is `schema_of(table)`; a model family adds its own columns to a shared table
with `register_columns`. The views at the end say which columns each reader shows, in order.
Adding a metric is a change here (and its meaning in docs/metrics.md, which a test keeps in
step). Torch-free: reports import it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

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
# The stages of a batch on its instance (`infer.instance` times them).
BATCH_STAGES = ("assembly", "lookup", "dense", "interaction")
# The stages of a query's trip over a network that a server in this process does not have (`serve.remote`).
TRANSFER_STAGES = ("serialise", "network", "server_parse", "server_respond", "deserialise")
# A served query's latency, cut into parts that add up to it (`infer.records.latency_parts`,
# docs/metrics.md): the load generator's issue lag; queueing and batching; the batch that finished it
# at the roofline, its warm time beyond the roof, and its in-service slowdown over that warm time; the
# result's trip back; and the network where a transport carries the query (null in process).
LATENCY_PARTS = ("issue", "queue", "roof", "beyond_roof", "slowdown", "completion", "transport")


@dataclass(frozen=True)
class Column:
    """One column: `label` in words, `unit` ("" for none), `fmt` a format spec, `better`
    HIGHER, LOWER or None (not a quantity to rank), `short` a narrow terminal heading, `type`
    its Arrow type (None for a name no table registers, as `column` makes up).
    A flag's `fmt` is its two words, "true|false"."""

    name: str
    label: str
    unit: str = ""
    fmt: str = ",.4g"
    better: str | None = None
    short: str = ""
    type: pa.DataType | None = None

    @property
    def heading(self) -> str:
        return f"{self.label} ({self.unit})" if self.unit else self.label

    @property
    def narrow(self) -> str:
        return self.short or self.label

    @property
    def tables(self) -> tuple[str, ...]:
        """The tables that write this column."""
        return tuple(t for t in _LAYOUTS if self in table_columns(t))

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


# Units read off a column's name by the conventions of docs/metrics.md (first match wins): the unit of
# a registered column given none, and of a name the registry does not know (sweep aggregates).
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


def _unit_by_name(name: str) -> str:
    return next((u for suffix, u in _SUFFIX_UNITS if name.endswith(suffix)), "")


# ----------------------------------------------------------------------------- tables
# Every table a run writes, its columns in file order. A column is defined (`_c`: name, Arrow type,
# what a reader shows) where it first appears, and named by the tables after; `schema_of` derives
# each Parquet schema from this, `run_id` aside (every writer puts it first).

STR, BOOL, I32, I64, F64 = pa.string(), pa.bool_(), pa.int32(), pa.int64(), pa.float64()

COLUMNS: dict[str, Column] = {}  # every column a table writes, by name
_LAYOUTS: dict[str, list[Column]] = {}  # every table's columns, in file order
_EXTENDS: dict[str, str] = {}  # a table that is another's columns followed by its own


@dataclass(frozen=True)
class _Local:
    """A column of one table only, whose name a column of other tables also has (with another type)."""

    column: Column


def _c(
    name: str,
    type: pa.DataType,
    label: str = "",
    unit: str | None = None,
    fmt: str = ",.4g",
    better: str | None = None,
    short: str = "",
) -> Column:
    """A column's one definition; the label defaults to its name, the unit to its name's (`_SUFFIX_UNITS`)."""
    return Column(name, label or name, _unit_by_name(name) if unit is None else unit, fmt, better, short, type)


define = _c  # a column's one definition, for a model family's own columns (`register_columns`)


def _resolve(table: str, entries: Sequence[Column | str | _Local], again: bool = False) -> list[Column]:
    """A table's entries as columns: a Column defines one (once; `again` lets the same definition be
    given twice), a name places one defined before."""
    out = []
    for e in entries:
        if isinstance(e, _Local):
            out.append(e.column)
        elif isinstance(e, str):
            if e not in COLUMNS:
                raise ValueError(f"table {table!r}: column {e!r} is not defined")
            out.append(COLUMNS[e])
        elif e.name in COLUMNS and not (again and COLUMNS[e.name] == e):
            raise ValueError(f"table {table!r}: column {e.name!r} is defined twice; name it after its definition")
        else:
            out.append(COLUMNS.setdefault(e.name, e))
    return out


def _group(*columns: Column) -> tuple[str, ...]:
    """Columns several tables write side by side: defined here, named in each table."""
    return tuple(c.name for c in _resolve("a group", columns))


def _table(name: str, *entries: Column | str | _Local, extends: str | None = None) -> None:
    _LAYOUTS[name] = _resolve(name, entries)
    if extends is not None:
        _EXTENDS[name] = extends


def table_columns(table: str) -> list[Column]:
    """The table's columns in file order."""
    if table not in _LAYOUTS:
        raise KeyError(f"no table {table!r} in the column registry: {', '.join(_LAYOUTS)}")
    base = table_columns(_EXTENDS[table]) if table in _EXTENDS else []
    return [*base, *_LAYOUTS[table]]


def schema_of(table: str) -> pa.Schema:
    """The table's Parquet schema (`run_id` aside: the writers put it first). Read it when the table is
    opened, not at import: a family's columns (`register_columns`) are in it from their registration on."""
    return pa.schema([pa.field(c.name, c.type) for c in table_columns(table)])


def names_of(table: str) -> tuple[str, ...]:
    return tuple(c.name for c in table_columns(table))


def register_columns(table: str, columns: Sequence[Column | str], *, after: str | None = None) -> None:
    """A model family's own columns in a shared table, placed after column `after` (at the end without it).

    A Column defines one (registering the same definition again changes nothing), a name places one
    the registry defines. Every registered family's columns are in the table, null in the rows of
    other families' models, so a table has the same columns whichever models a run served.
    """
    layout = _LAYOUTS[table] if table in _LAYOUTS else table_columns(table)  # KeyError names the tables
    new = [c for c in _resolve(table, columns, again=True) if c not in layout]
    at = len(layout)
    if after is not None:
        names = [c.name for c in layout]
        if after not in names:
            raise ValueError(f"table {table!r} has no column {after!r} to place {[c.name for c in new]} after")
        at = names.index(after) + 1
    layout[at:at] = new


# Columns that training summaries, inference points and search frontiers share (docs/metrics.md,
# "Roofline and energy", "Cost").
ROOFLINE = _group(
    _c("flops_per_sample", F64),
    _c("bytes_per_sample", F64),
    _c("achieved_flops_per_s", F64, "achieved", "FLOP/s", ".3g", HIGHER),
    _c("achieved_bytes_per_s", F64),
)
# where the measured work sits against the machine's peaks (`metrics.roofline.place`)
ROOFLINE_PLACED = _group(
    _c("roofline_compute_ms", F64),
    _c("roofline_memory_ms", F64),
    _c("roofline_comm_ms", F64),
    _c("roofline_bound_ms", F64),
    _c("roofline_fraction", F64, "roofline fraction", "fraction", ".3f", HIGHER),
    _c("roofline_bound_by", STR),
    _c("roofline_basis", STR),
    _c("roofline_note", STR),
)
# an energy window (`metrics.energy.EnergySampler.summary`); the per-sample or per-query ones are the caller's
ENERGY = _group(
    _c("energy_j", F64),
    _c("power_w_mean", F64),
    _c("energy_scope", STR),
    _c("energy_unavailable", STR),
    _c("cpu_utilization_mean", F64),
    _c("process_rss_max_mb", F64),
)
# what a run or point costs where the machine's price is known (`metrics.cost`; in the row's `currency`)
PRICE = _group(
    _c("price_per_hour", F64, "price per hour", fmt=",.4g", short="price/h"),
    _c("currency", STR),
    _c("price_source", STR),
)
SERVING_COST = (
    *PRICE,
    *_group(
        _c("cost_rate", STR),  # which rate the costs are at: measured, certified or best
        _c("cost_per_1m_samples", F64, "cost per 1M samples", fmt=",.4g", better=LOWER, short="cost/1M samples"),
        _c("cost_per_1m_queries", F64, "cost per 1M queries", fmt=",.4g", better=LOWER, short="cost/1M queries"),
        _c("energy_cost_per_1m_samples", F64, "energy cost per 1M samples", fmt=",.4g", better=LOWER),
    ),
)
TRAINING_COST = (
    *PRICE,
    *_group(
        _c("cost_per_1m_training_samples", F64, "cost per 1M training samples", fmt=",.4g", better=LOWER),
        _c("cost_to_target", F64, "cost to the target AUC", fmt=",.4g", better=LOWER),
        _c("energy_cost_per_1m_training_samples", F64, "energy cost per 1M training samples", fmt=",.4g",
           better=LOWER),
    ),
)  # fmt: skip
# one telemetry reading (`metrics.energy`), in long form
TELEMETRY = _group(
    _c("time_unix_s", F64),
    _c("source", STR),
    _c("channel", STR),
    _c("quantity", STR),
    _c("value", F64),
)

# queries.parquet: one row per query (`infer.records.query_row`)
_table(
    "queries",
    _c("point", I32, "point", fmt="d"),
    _c("query_id", I64),
    _c("model", STR, "model", fmt="s"),
    _c("samples", I32),
    _c("status", STR),
    _c("scheduled_ms", F64),
    _c("issued_ms", F64),
    _c("start_ms", F64),
    _c("end_ms", F64),
    _c("latency_ms", F64),
    _c("queue_ms", F64),
    _c("compute_ms", F64),
    _c("batch_id", I64),
    _c("batch_samples", I32),
    _c("batch_queries", I32),
    _c("instance", I32),
    _c("batch_compute_ms", F64),  # that batch's time on its instance
    _c("batch_expected_ms", F64),  # ... as the instance's warm batch-cost model has it
    _c("pieces", I32),
    _c("late", BOOL),
    _c("error", STR),
    # (the HSTU family registers its history columns here: families/hstu.py COLUMNS)
    # the batch of the query's last piece: when it began on its instance, its stages there, and its
    # result's trip back to the serving process (docs/metrics.md)
    _c("batch_start_ms", F64),
    *[_c(f"batch_{stage}_ms", F64) for stage in BATCH_STAGES],
    _c("batch_completion_ms", F64),
    # the query's latency in parts that sum to it (`latency_parts`)
    *[_c(f"lat_{part}_ms", F64) for part in LATENCY_PARTS],
    # a query that crossed a network (`serve.remote`; null in process): the client connection that sent it,
    # the RPC's own status code, and its transfer stages (they and issue, queue, compute sum to the latency)
    _c("worker", I32),
    _c("rpc_status", STR),
    *[_c(f"{stage}_ms", F64) for stage in TRANSFER_STAGES],
    _c("round_trip_ms", F64),  # client send -> receive
    _c("server_ms", F64),  # server receive -> send (its clock; a duration only)
    _c("instance_compute_ms", F64),  # instance time summed over the query's pieces
    _c("request_bytes", I64),
    _c("response_bytes", I64),
)

# summary.parquet of `infer run`: one row per model and load point (`infer.records.summarize` and `infer.lab`)
_table(
    "infer summary",
    "point",
    "model",
    _c("mode", STR, "mode", fmt="s"),  # "together" (all models served at once) or "alone"
    _c("scenario", STR),
    _c("preset", STR, "preset", fmt="s"),
    _c("instances", I32, "instances", fmt="d"),
    _c("threads_per_instance", I32, "threads per instance", fmt="d", short="threads"),
    _c("max_batch", I32, "max batch", "samples", "d", short="max batch"),
    _c("max_delay_ms", F64, "max batching delay", "ms", "g", short="delay ms"),
    _c("max_queue", I32),
    _c("min_piece", I32),  # smallest split piece (resolved: measured when 0 was asked)
    _c("spin_ms", F64),  # an idle instance polls this long before it sleeps
    _c("keep_warm_ms", F64),  # an idle instance runs a 1-sample batch this often (0: off)
    _c("max_query_samples", I64),  # the largest query accepted
    _c("precision", STR, "precision", fmt="s"),
    _c("table_precision", STR, "table precision", fmt="s"),
    _c("build", STR, "inference build", fmt="s"),  # the inference form served (infer.build)
    _c("checkpoint", STR),  # the trained weights served (a train --checkpoint-dir step); null: untrained
    _c("checkpoint_step", I64),  # the training steps behind them
    _c("checkpoint_auc", F64, "trained model's held-out AUC", fmt=".4f"),  # at that step, as training measured it
    _c("batch_fixed_ms", F64, "warm batch cost: fixed", "ms", ".3f"),  # the instances' warm batch cost: fixed ...
    _c("batch_per_sample_us", F64),  # ... and per sample (measured back to back at start)
    # (the HSTU family registers its serving columns here: families/hstu.py COLUMNS)
    _c("query_sizes", STR),
    _c("arrival", STR),
    _c("target_qps", F64, "offered load", "queries/s", ".1f", short="target q/s"),
    _c("duration_s", F64, "duration", "s", ".1f", short="secs"),
    _c("warmup_s", F64),  # untimed load before the point (infer.lab.warm_up)
    _c("queries", I64),
    _c("completed_queries", I64),
    _c("dropped_queries", I64, "dropped", "queries", "d", LOWER, "drop"),
    _c("rejected_queries", I64),
    _c("failed_queries", I64),
    _c("unfinished_queries", I64),
    _c("expired_queries", I64),  # their sender's deadline passed before they were computed
    _c("late_queries", I64, "late", "queries", "d", LOWER, "late"),
    _c("queries_per_s", F64, "throughput", "queries/s", ",.1f", HIGHER, "queries/s"),
    _c("samples_per_s", F64, "throughput", "samples/s", ",.0f", HIGHER, "samples/s"),
    # nearest-rank percentiles over completed queries (`infer.records.LATENCY_FIELDS`)
    _c("latency_p50_ms", F64, "latency p50", "ms", ".2f", LOWER, "p50 ms"),
    _c("latency_p90_ms", F64),
    _c("latency_p95_ms", F64),
    _c("latency_p99_ms", F64, "latency p99", "ms", ".2f", LOWER, "p99 ms"),
    _c("latency_p99_9_ms", F64, "latency p99.9", "ms", ".2f", LOWER, "p99.9 ms"),
    _c("latency_mean_ms", F64),
    _c("latency_max_ms", F64, "latency max", "ms", ".2f", LOWER, "max ms"),
    _c("sla_ms", F64, "latency bound", "ms", "g"),
    _c("sla_percentile", F64, "latency bound percentile", fmt="g"),
    # latency at sla_percentile, dropped/failed counted as infinite
    _c("sla_latency_ms", F64, "latency at the bound's percentile", "ms", ".2f", LOWER),
    _c("sla_met", BOOL, "SLA met", fmt="met|missed", short="SLA"),
    _c("load_stopped_early", BOOL),  # ended once its verdict was decided (search probes)
    # the query at the bound's percentile, its roofline time on the cores serving it, and the measured latency over it
    _c("latency_floor_samples", I64, "samples of the query at the bound's percentile", "samples", "d"),
    _c("latency_floor_cores", I32, "cores serving that query", "cores", "d"),
    _c("latency_floor_ms", F64, "latency floor (that query at the roofline)", "ms", ".2f", short="floor ms"),
    _c("latency_floor_wake_ms", F64),  # of which the wake of an instance idle between queries (metrics.wake)
    _c("latency_floor_cold_factor", F64),  # its memory read that many times slower after that idle (metrics.wake)
    _c("latency_floor_ratio", F64, "latency at the bound's percentile over the floor", "x", ".1f", LOWER, "x floor"),
    _c("batch_samples_mean", F64, "batch mean", "samples", ".1f", short="batch"),
    _c("batch_samples_p50", F64),
    _c("batch_samples_p99", F64),
    _c("batch_queries_mean", F64),
    _c("batches", I64),
    _c("queue_share", F64, "queue share", "fraction", ".0%", short="queue"),
    _c("compute_slowdown_p50", F64),  # batch time over the warm batch-cost model, median of batches
    _c("compute_slowdown_p99", F64),  # ... 99th percentile (a noisy host, cold cores)
    _c("queue_mean_ms", F64),
    _c("compute_mean_ms", F64),
    # mean ms per batch in each stage on its instance, and its result's trip back
    *[_c(f"batch_{stage}_mean_ms", F64) for stage in (*BATCH_STAGES, "completion")],
    # the latency parts of the tail: mean over the queries at or above the bound's percentile
    *[
        _c(f"tail_{p}_ms", F64, f"tail latency: {p.replace('_', ' ')}", "ms", ".3f", short=p.replace("_", " "))
        for p in LATENCY_PARTS
    ],  # fmt: skip
    # (the HSTU family registers its history reuse columns here: families/hstu.py COLUMNS)
    _c("achieved_rate_ratio", F64),  # issued / target queries (the load was what it claims)
    _c("issue_lag_p50_ms", F64),
    _c("issue_lag_p99_ms", F64),
    _c("issue_lag_max_ms", F64),
    _c("issue_stopped", STR),  # why the open loop stopped issuing early (--max-issue-lag-ms)
    _c("instance_stalls", I32),  # batches an instance held >= 0.5 s and >= 20x their warm time
    _c("longest_stall_s", F64),
    _c("stalled_instances", STR),  # which instances, comma-separated
    _c("cpu_utilization", F64),  # of all cores this process may use, 0..1
    _c("instance_cpu_utilization", F64),  # instance processes' CPU time / (wall x their threads)
    _c("server_cpu_s", F64),  # CPU seconds of the parent (load generator, batcher, completions)
    _c("snapshot_mb", F64),
    _c("loadgen_result", STR),  # VALID / INVALID (MLPerf LoadGen scenarios)
    _c("loadgen_reason", STR),  # INVALID: what LoadGen found unmet (its summary's words)
    _c("loadgen_queries_per_s", F64),  # LoadGen's "samples" are our queries
    _c("loadgen_p99_ms", F64),
    # the system under test (`infer.targets`) and, over a network, what crossing it cost (null in process)
    _c("target", STR, "system under test", fmt="s", short="target"),  # in-process, grpc://HOST:PORT or kserve://...
    _c("rpc", STR, "RPC", fmt="s", short="rpc"),  # stream, unary or oip (the Open Inference Protocol's ModelInfer)
    _c("concurrency", I32, "client connections", "", "d", short="conns"),  # each in its own process beyond one
    _c("round_trip_p50_ms", F64, "round trip p50", "ms", ".3f", LOWER, "rtt p50"),
    _c("round_trip_p99_ms", F64, "round trip p99", "ms", ".3f", LOWER, "rtt p99"),
    *[_c(f"{stage}_mean_ms", F64) for stage in TRANSFER_STAGES],
    # the transfer stages together, over completed queries; over their mean latency; over the server's compute
    _c("transfer_mean_ms", F64, "transfer per query", "ms", ".3f", LOWER, "transfer ms/query"),
    _c("transfer_share", F64, "transfer share of latency", "fraction", ".1%", LOWER, "transfer share"),
    _c("transfer_per_sample_us", F64),
    _c("transfer_to_compute", F64, "transfer over the server's compute", "ratio", ".3f", LOWER, "transfer/compute"),
    _c("request_bytes_mean", F64),
    _c("response_bytes_mean", F64),
    _c("request_bytes_per_sample", F64, "request bytes per sample", "B", ",.0f", LOWER, "B/sample"),
    _c("server_lost", BOOL),  # the server answered only UNAVAILABLE until the load ended
    "error",  # why the point ended early (a lost server, a bad answer): the run then fails
    # roofline of one batch on one instance, energy of the whole point (docs/metrics.md)
    _c("batch_compute_mean_ms", F64),
    *ROOFLINE,
    *ROOFLINE_PLACED,
    *ENERGY,
    _c("energy_per_query_j", F64, "energy per query", "J", ".3g", LOWER),
    _c("energy_per_sample_j", F64, "energy per sample", "J", ".3g", LOWER),
    _c("samples_per_s_per_w", F64, "efficiency", "samples/s/W", ".3g", HIGHER),
    # what the point's rate costs on this machine where its price is known (`metrics.cost`, docs/metrics.md)
    *SERVING_COST,
)
# summary.parquet of `infer search`: its load points, each probe's repeat, which probe, and its verdict
_table("search summary", _c("repeat", I32), _c("probe", I32), _c("passed", BOOL), extends="infer summary")

# frontier.parquet of `infer search`: one row per serving configuration
_table(
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
    _c("capacity_queries_per_s", F64, "capacity", "queries/s", ".1f", HIGHER, "capacity q/s"),  # closed loop, no bound
    # highest probed rate that met the bound (0: none did)
    _c("best_qps", F64, "best rate", "queries/s", ".1f", HIGHER, "best q/s"),
    # half the final bracket [best, lowest failing rate]
    _c("best_qps_uncertainty", F64, "best rate uncertainty", "queries/s", ".1f", short="+/-"),
    _c("best_samples_per_s", F64, "best throughput", "samples/s", ",.0f", HIGHER, "samples/s"),
    _c("best_sla_latency_ms", F64, "latency at the bound's percentile", "ms", ".2f", LOWER),
    _c("best_sla_latency_spread_ms", F64),  # max - min over the repeats at best_qps
    # (the HSTU family registers its hit rate at the best rate here: families/hstu.py COLUMNS)
    # the repeats at best_qps (dlrm_lab.metrics.stats: CI needs >= 3 repeats)
    _c("best_samples_per_s_ci_low", F64),
    _c("best_samples_per_s_ci_high", F64),
    _c("best_samples_per_s_cv", F64),
    _c("best_samples_per_s_unstable", BOOL),
    "sla_ms",
    "sla_percentile",
    _c("probes", I32),
    _c("probe_points", I32),  # load points run (repeats), those stopped early included
    _c("best", BOOL, "best", fmt="*|"),  # the configuration with the highest best_samples_per_s
    # the best configuration's rate as a longer LoadGen Server run held it (`certify`): the rate that
    # held (0: none of the tries; null: not certified), that run's verdict, its p99 and its length
    _c("certified_qps", F64, "certified rate (LoadGen Server)", "queries/s", ".1f", HIGHER, "certified q/s"),
    _c("certified_samples_per_s", F64),
    _c("certified_result", STR),
    _c("certified_sla_latency_ms", F64),
    _c("certify_s", F64),
    _c("outcome", STR, "why not the best", fmt="s", short="outcome"),  # pruned, lower rate, no rate met the bound
    # its cost at the certified rate (else the best probed) where the machine's price is known (`metrics.cost`)
    *SERVING_COST,
)

# steps.parquet: one row per training step and rank (`train.records.step_row`)
_table(
    "steps",
    _c("step", I64),
    _c("rank", I32),
    _c("world_size", I32, "ranks", fmt="d"),
    _c("batch_size", I32),
    _c("global_samples", I64),
    _c("warmup", BOOL),
    _c("loss", F64),
    _c("step_time_ms", F64),
    *[_c(f"{p}_ms", F64) for p in PHASES],
    "samples_per_s",
    "time_unix_s",
)

# eval.parquet: one row per held-out evaluation
_table("eval", "step", _c("num_samples", I64), _c("auc", F64), "loss", _c("eval_time_ms", F64))

# summary.parquet of `train`: one row per run (`train.records.train_summary_row`)
_table(
    "train summary",
    _c("kind", STR),
    "status",
    "preset",
    _c("interaction", STR),
    _c("device", STR, "device", fmt="s"),
    "precision",
    "table_precision",
    _c("table_update", STR, "table update", fmt="s"),  # the tables' CPU backward and update (train.table_update)
    "world_size",
    "batch_size",
    _c("global_batch_size", I64, "global batch", "samples", ",d", short="batch"),
    _c("steps", I64, "steps", fmt="d"),
    _c("warmup_steps", I64),
    _c("measured_steps", I64),
    "samples_per_s",
    _c("samples_per_s_per_rank", F64, "throughput per rank", "samples/s", ",.0f", HIGHER),
    _c("step_time_ms_mean", F64, "step time mean", "ms", ".2f", LOWER),
    _c("step_time_ms_p50", F64, "step time p50", "ms", ".2f", LOWER),
    _c("step_time_ms_p90", F64),
    _c("step_time_ms_p99", F64, "step time p99", "ms", ".2f", LOWER),
    *[_c(f"{p}_share", F64, f"{PHASE_LABELS[p]} share", "fraction", ".1%") for p in PHASES],
    _c("loss_first", F64, "loss, first steps", fmt=".4f"),
    _c("loss_last", F64, "loss, last steps", fmt=".4f", better=LOWER),
    _c("eval_auc", F64, "held-out AUC", fmt=".4f", better=HIGHER, short="AUC"),
    _c("eval_loss", F64),
    _c("teacher_auc", F64, "teacher AUC (best reachable)", fmt=".4f"),
    _c("target_auc", F64),
    _c("target_reached", BOOL),
    _c("steps_to_target", I64),
    _c("time_to_target_s", F64, "time to target AUC", "s", ".1f", LOWER),
    _c("valid_samples_per_s", F64, "valid throughput (0 if target missed)", "samples/s", ",.0f", HIGHER),
    _c("num_parameters", I64),
    _c("embedding_parameters", I64),
    _c("dense_parameters", I64),
    _c("wall_time_s", F64),
    *ROOFLINE,  # docs/metrics.md, "Roofline and energy"
    *ROOFLINE_PLACED,
    _c("valid_flops_per_s", F64),
    *ENERGY,
    "energy_per_sample_j",
    "samples_per_s_per_w",
    _c("valid_flops_per_s_per_w", F64),
    # what the run cost on its machines where their price is known (`metrics.cost`, docs/metrics.md)
    *TRAINING_COST,
)

# summary.parquet of `scale`: one row per rank count (`train.scaling`)
_table(
    "scale summary",
    "kind",
    "mode",
    _c("ranks", I32, "ranks", fmt="d"),
    _c("threads_per_rank", I32),
    _c("batch_size_per_rank", I32, "batch per rank", "samples", "d", short="batch/rank"),
    "global_batch_size",
    _c("repeats", I32),
    _c("repeats_ok", I32, "repeats ok", fmt="d"),
    "samples_per_s",  # median over the repeats that ended ok
    _c("samples_per_s_ci_low", F64),
    _c("samples_per_s_ci_high", F64),
    "samples_per_s_per_rank",
    "step_time_ms_p50",
    _c("speedup", F64, "speedup", "x", ".2f", HIGHER),
    _c("efficiency", F64, "efficiency", "fraction", ".3f", HIGHER),
    *[f"{p}_share" for p in PHASES],
    # against this machine's N-process compute ceiling and the scaling model (scaling_model)
    # probed: N pinned processes' GEMM rate / N x one alone
    _c("ceiling_efficiency", F64, "machine ceiling (N pinned processes' GEMM / N x one)", "fraction", ".3f",
       short="ceil"),
    _c("efficiency_vs_ceiling", F64, "efficiency / ceiling", "fraction", ".3f", HIGHER, "eff/ceiling"),
    # the efficiency the machine allows (scaling_model.roof): compute at the ceiling, bytes at the raw
    # collectives' probed speed; and through TorchRec's probed distribution; the measured one over the first
    _c("roof_efficiency", F64,
       "efficiency the machine allows (compute at the ceiling, bytes at the raw collectives' probed speed)",
       "fraction", ".3f", short="roof"),
    _c("library_roof_efficiency", F64, "efficiency allowed through TorchRec's probed distribution", "fraction",
       ".3f", short="TorchRec roof"),
    _c("efficiency_vs_roof", F64, "efficiency / the machine's roof", "fraction", ".3f", HIGHER, "eff/roof"),
    # mean per-rank step over the measured steps (first ok repeat)
    _c("rank_step_ms", F64, "per-rank step (mean)", "ms", ".1f", LOWER, "rank step ms"),
    # per rank, from the one-rank phases (scaling_model.predict)
    _c("predicted_step_ms", F64, "predicted per-rank step", "ms", ".1f", short="predicted ms"),
    # measured / predicted - 1 (mean per-rank step times)
    _c("prediction_error", F64, "measured / predicted - 1", "fraction", "+.1%", short="pred. error"),
    # the same with MPI's probed collectives (PyPI torch has no MPI)
    _c("predicted_step_ms_mpi", F64, "predicted per-rank step with MPI's collectives", "ms", ".1f",
       short="with MPI ms"),
    _c("prediction_note", STR),
    # per-rank step beyond one rank's at the same per-rank work
    _c("gap_ms", F64, "per-rank step beyond one rank's", "ms", ".1f", LOWER, "gap ms"),
    _c("gap_named_ms", F64),  # the part named by the breakdown (gap.parquet): all of it
    _c("point_run_id", STR, "point run", fmt="s"),  # the first repeat that ended ok
    _c("point_status", STR, "point status", fmt="s"),  # ok when any repeat did
)  # fmt: skip

# gap.parquet of `scale`: the per-rank step beyond one rank's, item by item (`train.scaling.gap_breakdown`)
_table("scale gap", "ranks", _c("item", STR), _c("ms", F64), _c("note", STR))

# profile.parquet of `train --profile-steps`: the top operators per rank (`train.profile`)
_table(
    "profile",
    "rank",
    _c("op", STR),
    _c("calls_per_step", F64),
    _c("self_ms_per_step", F64),
    _c("total_ms_per_step", F64),
    _Local(_c("steps", I32)),  # steps profiled (the summary's `steps`, steps run, is int64)
)

# points.parquet of a sweep: one row per point and repeat (`sweep`)
_table(
    "sweep points",
    "point",
    "repeat",
    _c("params_json", STR),
    "status",
    _c("child_run_id", STR),
    _c("child_dir", STR),
    _c("seconds", F64),
    _c("attempts", I32),
)

# telemetry.parquet: the sampler's readings (`metrics.energy`), led by the run's key: its rank or its point
_table("telemetry", *TELEMETRY)
_table("train telemetry", "rank", *TELEMETRY)
_table("infer telemetry", "point", *TELEMETRY)


# ----------------------------------------------------------------------------- a family's own columns
def column(name: str) -> Column:
    """The registered column, or one made up from its name (unit by suffix, no direction, no type)."""
    found = COLUMNS.get(name)
    if found is not None:
        return found
    return Column(name, name, _unit_by_name(name))


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

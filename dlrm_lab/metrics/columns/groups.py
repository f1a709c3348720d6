"""Columns that several tables write side by side (roofline, energy, price and cost, telemetry): defined once
here, named by each table that writes them."""

from __future__ import annotations

from dlrm_lab.metrics.columns.registry import F64, HIGHER, I64, LOWER, STR, col, column_group

# Columns that training summaries, inference points and search frontiers share (docs/metrics.md,
# "Roofline and energy", "Cost").
ROOFLINE = column_group(
    col("flops_per_sample", F64),
    col("bytes_per_sample", F64),
    col("achieved_flops_per_s", F64, "achieved", "FLOP/s", ".3g", HIGHER),
    col("achieved_bytes_per_s", F64),
)
# where the measured work sits against the machine's peaks (`metrics.roofline.place`)
ROOFLINE_PLACED = column_group(
    col("roofline_compute_ms", F64),
    col("roofline_memory_ms", F64),
    col("roofline_comm_ms", F64),
    col("roofline_bound_ms", F64),
    col("roofline_fraction", F64, "roofline fraction", "fraction", ".3f", HIGHER),
    col("roofline_bound_by", STR),
    col("roofline_basis", STR),
    col("roofline_note", STR),
)
# an energy window (`metrics.energy.EnergySampler.summary`); the per-sample or per-query ones are the caller's
ENERGY = column_group(
    col("energy_j", F64),
    col("power_w_mean", F64),
    col("energy_scope", STR),
    col("energy_unavailable", STR),
    col("cpu_utilization_mean", F64),
    col("process_rss_max_mb", F64),
)
# what a run or point costs where the machine's price is known (`metrics.cost`; in the row's `currency`)
PRICE = column_group(
    col("price_per_hour", F64, "price per hour", fmt=",.4g", short="price/h"),
    col("currency", STR),
    col("price_source", STR),
)
SERVING_COST = (
    *PRICE,
    *column_group(
        col("cost_rate", STR),  # which rate the costs are at: measured, certified or best
        col("cost_per_1m_samples", F64, "cost per 1M samples", fmt=",.4g", better=LOWER, short="cost/1M samples"),
        col("cost_per_1m_queries", F64, "cost per 1M queries", fmt=",.4g", better=LOWER, short="cost/1M queries"),
        col("energy_cost_per_1m_samples", F64, "energy cost per 1M samples", fmt=",.4g", better=LOWER),
    ),
)
TRAINING_COST = (
    *PRICE,
    *column_group(
        col("cost_per_1m_training_samples", F64, "cost per 1M training samples", fmt=",.4g", better=LOWER),
        col("cost_to_target", F64, "cost to the target AUC", fmt=",.4g", better=LOWER),
        col(
            "energy_cost_per_1m_training_samples", F64, "energy cost per 1M training samples", fmt=",.4g", better=LOWER
        ),
    ),
)
# one telemetry reading (`metrics.energy`), in long form
TELEMETRY = column_group(
    col("time_unix_s", F64),
    col("source", STR),
    col("channel", STR),
    col("quantity", STR),
    col("value", F64),
)
# the speed canary of a run or a point (`metrics.canary`): its readings against the same work measured quiet
CANARY = column_group(
    col("canary_readings", I64),
    col("canary_ratio", F64, "machine speed (canary / quiet)", "fraction", ".2f", HIGHER, short="canary"),
    col("canary_ratio_p10", F64),
    col("canary_ratio_p90", F64),
    col("canary_foreign", F64, "foreign CPU load (canary)", "fraction", ".2f", LOWER),  # other sessions' and the host's
    col("canary_ms", F64),
    col("canary_share", F64),  # the canary's time over the run's or point's
    col("canary_basis", STR),
    col("canary_phase", STR),
)

"""Columns that several tables write side by side (roofline, energy, price and cost, telemetry): defined once
here, named by each table that writes them."""

from __future__ import annotations

from dlrm_lab.metrics.columns.registry import F64, HIGHER, LOWER, STR, _c, _group

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

"""The search's frontier (`frontier.parquet`): one row per serving configuration searched (its capacity, the highest
rate it sustains under the latency bound with the final bracket's half-width as its uncertainty, or why it was not
bisected), the judgement that marks the best and says of every other why not, and a configuration's name in the
search's lines (`label_of`).
"""

from __future__ import annotations

import numpy as np

from dlrm_lab.config.values import Log
from dlrm_lab.infer.options import InferConfig
from dlrm_lab.infer.sut import ModelDescription
from dlrm_lab.metrics.columns import FrontierRow, SearchSummaryRow
from dlrm_lab.metrics.stats import estimate


def pruned_row(
    served: ModelDescription, capacity: float, capacity_sps: float, best_sps: float, cfg: InferConfig, log: Log | None
) -> FrontierRow:
    """The frontier row of a configuration not bisected: its capacity cannot beat the best rate under the bound."""
    why = f"pruned: capacity {capacity_sps:,.0f} samples/s cannot beat {best_sps:,.0f} under the bound"
    if log:
        log(f"{label_of(served)}: {why}")
    return FrontierRow(
        {
            **frontier_row(served, capacity, 0.0, 0.0, [], 0, cfg),
            "best_qps": None,
            "best_qps_uncertainty": None,
            "best_samples_per_s": None,
            "probe_points": 0,
            "outcome": why,
        }
    )


def judge(frontier: list[FrontierRow]) -> FrontierRow | None:
    """Mark the configuration with the highest rate under the bound `best`, say of every other why not; the best."""
    searched = [r for r in frontier if r["best_samples_per_s"] is not None]
    best = max(searched, key=lambda r: r["best_samples_per_s"], default=None)
    for r in frontier:
        r["best"] = r is best and bool(best["best_qps"])
        if r["best"]:
            r["outcome"] = "best"
        elif r.get("outcome") is None:
            r["outcome"] = (
                "no probed rate met the bound"
                if not r["best_qps"]
                else f"lower: {r['best_samples_per_s']:,.0f} samples/s under the bound, the best "
                f"{best['best_samples_per_s']:,.0f}"  # type: ignore[index]
            )
    return next((r for r in frontier if r["best"]), None)


def label_of(m: ModelDescription) -> str:
    if m.instances is None or m.max_delay_ms is None:
        return f"{m.name} as its server serves it"
    return f"{m.instances}x{m.threads} threads, {m.precision}, batch {m.max_batch}, delay {m.max_delay_ms:g} ms"


def frontier_row(
    served: ModelDescription,
    capacity: float,
    lo: float,
    hi: float,
    rows: list[SearchSummaryRow],
    probes: int,
    cfg: InferConfig,
) -> FrontierRow:
    lat = [r["sla_latency_ms"] for r in rows if r["sla_latency_ms"] is not None]
    hits = [r["history_hit_rate"] for r in rows if r.get("history_hit_rate") is not None]
    rate = estimate([r["samples_per_s"] for r in rows])
    return FrontierRow(
        {
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
            "min_piece": served.min_piece,
            "spin_ms": served.spin_ms,
            "precision": served.precision,
            "build": served.build,
            "history_cache_mb": served.columns.get("history_cache_mb"),
            "capacity_queries_per_s": capacity,
            "best_qps": lo,
            "best_qps_uncertainty": (hi - lo) / 2,
            "best_samples_per_s": float(np.median([r["samples_per_s"] for r in rows])) if rows else 0.0,
            "best_sla_latency_ms": float(np.median(lat)) if lat else None,
            "best_sla_latency_spread_ms": float(max(lat) - min(lat)) if lat else None,
            "best_history_hit_rate": float(np.median(hits)) if hits else None,
            "sla_ms": cfg.sla_ms,
            "sla_percentile": cfg.sla_percentile,
            "probes": probes,
            "best": False,
            "outcome": None,
        }
    )

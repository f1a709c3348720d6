"""Schemas of the training tables and the summary computed from step rows.

Column meanings and units are documented in docs/metrics.md; keep the two in step.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

PHASES = ("data_wait", "forward", "backward", "optimizer")

STEP_SCHEMA = pa.schema(
    [
        ("step", pa.int64()),
        ("rank", pa.int32()),
        ("world_size", pa.int32()),
        ("batch_size", pa.int32()),
        ("global_samples", pa.int64()),
        ("warmup", pa.bool_()),
        ("loss", pa.float64()),
        ("step_time_ms", pa.float64()),
        *[(f"{p}_ms", pa.float64()) for p in PHASES],
        ("samples_per_s", pa.float64()),
        ("time_unix_s", pa.float64()),
    ]
)

EVAL_SCHEMA = pa.schema(
    [
        ("step", pa.int64()),
        ("num_samples", pa.int64()),
        ("auc", pa.float64()),
        ("loss", pa.float64()),
        ("eval_time_ms", pa.float64()),
    ]
)

SUMMARY_SCHEMA = pa.schema(
    [
        ("kind", pa.string()),
        ("status", pa.string()),
        ("preset", pa.string()),
        ("interaction", pa.string()),
        ("device", pa.string()),
        ("precision", pa.string()),
        ("table_precision", pa.string()),
        ("world_size", pa.int32()),
        ("batch_size", pa.int32()),
        ("global_batch_size", pa.int64()),
        ("steps", pa.int64()),
        ("warmup_steps", pa.int64()),
        ("measured_steps", pa.int64()),
        ("samples_per_s", pa.float64()),
        ("samples_per_s_per_rank", pa.float64()),
        ("step_time_ms_mean", pa.float64()),
        ("step_time_ms_p50", pa.float64()),
        ("step_time_ms_p90", pa.float64()),
        ("step_time_ms_p99", pa.float64()),
        *[(f"{p}_share", pa.float64()) for p in PHASES],
        ("loss_first", pa.float64()),
        ("loss_last", pa.float64()),
        ("eval_auc", pa.float64()),
        ("eval_loss", pa.float64()),
        ("teacher_auc", pa.float64()),
        ("num_parameters", pa.int64()),
        ("embedding_parameters", pa.int64()),
        ("dense_parameters", pa.int64()),
        ("wall_time_s", pa.float64()),
    ]
)

_LOSS_WINDOW = 10  # steps averaged for loss_first / loss_last


def summarize_steps(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Throughput, step-time percentiles, phase shares and loss trend of a run.

    Throughput is total samples over total step time of the measured (non-warm-up)
    steps: a ratio of sums, so long steps weigh as much as they cost.
    """
    measured = [r for r in rows if not r["warmup"]]
    out: dict[str, Any] = {"measured_steps": len(measured)}
    losses = [r["loss"] for r in rows]
    if losses:
        out["loss_first"] = float(np.mean(losses[:_LOSS_WINDOW]))
        out["loss_last"] = float(np.mean(losses[-_LOSS_WINDOW:]))
    if not measured:
        return out
    times = np.array([r["step_time_ms"] for r in measured])
    samples = sum(r["global_samples"] for r in measured)
    total_s = times.sum() / 1000.0
    world = measured[0]["world_size"]
    out.update(
        samples_per_s=float(samples / total_s),
        samples_per_s_per_rank=float(samples / total_s / world),
        step_time_ms_mean=float(times.mean()),
        step_time_ms_p50=float(np.percentile(times, 50)),
        step_time_ms_p90=float(np.percentile(times, 90)),
        step_time_ms_p99=float(np.percentile(times, 99)),
    )
    for phase in PHASES:
        out[f"{phase}_share"] = float(sum(r[f"{phase}_ms"] for r in measured) / times.sum())
    return out

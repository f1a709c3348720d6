"""Schemas of the training tables and the summary computed from step rows.

Column meanings and units are documented in docs/metrics.md; keep the two in step.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from dlrm_lab.config import TrainConfig
from dlrm_lab.config.family import Spec
from dlrm_lab.config.values import JsonObject
from dlrm_lab.metrics.columns import PHASES, StepRow, TrainSummaryRow, schema_of
from dlrm_lab.metrics.roofline import Peaks, Work, phase_floors, place
from dlrm_lab.metrics.run import register_recovery
from dlrm_lab.metrics.stats import percentile
from dlrm_lab.metrics.tables import write_table
from dlrm_lab.model.cost import (
    dense_step_bytes,
    sample_cost,
    step_communication_bytes,
    step_phase_work,
    stored_table_bytes,
    table_update_work,
)

# The training tables, from the column registry (`metrics.columns`, which docs/metrics.md explains)
STEP_SCHEMA = schema_of("steps")
EVAL_SCHEMA = schema_of("eval")
SUMMARY_SCHEMA = schema_of("train summary")

_LOSS_WINDOW = 10  # steps averaged for loss_first / loss_last
WARMUP_TOLERANCE = 0.10


def detect_warmup(step_times_ms: list[float]) -> int:
    """How many steps at the start of a run are warm-up, read off its step times.

    Rule (documented in docs/metrics.md): with n >= 5 steps, the steady-state step time is
    the median of the second half of the run; warm-up ends at the first step k >= 1 whose
    own time and the median of the w = clamp(n // 10, 3, 10) steps from it are both within
    10% above it (one fast step in a slow stretch does not end it). The first step always
    counts as warm-up (lazy allocation, kernel selection, caches filled), and at most half
    of the run does. Runs of fewer than 5 steps have none.
    """
    n = len(step_times_ms)
    if n < 5:
        return 0
    times = np.asarray(step_times_ms, dtype=np.float64)
    steady = float(np.median(times[n // 2 :]))
    window = min(10, max(3, n // 10))
    bound = (1 + WARMUP_TOLERANCE) * steady
    for k in range(1, n // 2 + 1):
        if times[k] <= bound and float(np.median(times[k : k + window])) <= bound:
            return k
    return n // 2


def flag_warmup(rows: list[StepRow], first_step: int, warmup: int | None = None) -> int:
    """Set every row's `warmup` flag (rows of all ranks): the first `warmup` steps, or as many
    as `detect_warmup` finds, but never all of them (a run stopped early still measures its
    last step). Returns the number of warm-up steps."""
    if warmup is None:
        warmup = detect_warmup(global_step_times(rows))
    warmup = min(warmup, max(0, len({r["step"] for r in rows}) - 1))
    for r in rows:
        r["warmup"] = r["step"] - first_step < warmup
    return warmup


def global_step_times(rows: list[StepRow]) -> list[float]:
    """Per step (in order) the slowest rank's step time: when the step ended for the job."""
    by_step: dict[int, float] = {}
    for r in rows:
        by_step[r["step"]] = max(by_step.get(r["step"], 0.0), r["step_time_ms"])
    return [by_step[k] for k in sorted(by_step)]


def warmup_column(first_measured_step: int) -> Callable[[pa.Table], pa.ChunkedArray]:
    """steps.parquet's `warmup` column, every rank's rows, from the run's first measured step: derived as the table
    is merged at the run's close (`TableWriter.derive_on_close`); the same flags `flag_warmup` gave the rows."""
    return lambda steps: pc.less(steps["step"], pa.scalar(first_measured_step, pa.int64()))


def summarize_steps(rows: list[StepRow]) -> TrainSummaryRow:
    """Throughput, step-time percentiles, phase shares and loss trend of a run.

    `rows` may hold every rank's rows. A step takes as long as its slowest rank, so the
    global step time is the maximum over ranks and global throughput is total samples
    over the sum of those times (a ratio of sums over the measured, non-warm-up steps).
    Per-rank throughput is each rank's samples over its own time, averaged over ranks;
    the loss of a step is the mean over ranks (equal local batches: the global loss).
    """
    by_step: dict[int, list[StepRow]] = {}
    for r in rows:
        by_step.setdefault(r["step"], []).append(r)
    steps = [by_step[k] for k in sorted(by_step)]
    out = TrainSummaryRow(measured_steps=sum(1 for s in steps if not s[0]["warmup"]))
    losses = [float(np.mean([r["loss"] for r in s])) for s in steps]
    if losses:
        out["loss_first"] = float(np.mean(losses[:_LOSS_WINDOW]))
        out["loss_last"] = float(np.mean(losses[-_LOSS_WINDOW:]))
    measured = [s for s in steps if not s[0]["warmup"]]
    if not measured:
        return out
    times = np.array([max(r["step_time_ms"] for r in s) for s in measured])
    samples = sum(s[0]["global_samples"] for s in measured)
    total_s = times.sum() / 1000.0
    ranks = sorted({r["rank"] for s in measured for r in s})
    per_rank = [
        sum(r["batch_size"] for s in measured for r in s if r["rank"] == k)
        / (sum(r["step_time_ms"] for s in measured for r in s if r["rank"] == k) / 1000.0)
        for k in ranks
    ]
    out.update(
        samples_per_s=float(samples / total_s),
        samples_per_s_per_rank=float(np.mean(per_rank)),
        step_time_ms_mean=float(times.mean()),
        step_time_ms_p50=percentile(times, 50),
        step_time_ms_p90=percentile(times, 90),
        step_time_ms_p99=percentile(times, 99),
    )
    flat = [r for s in measured for r in s]
    rank_time = sum(r["step_time_ms"] for r in flat)
    for phase in PHASES:  # null when the phases overlap (pipelined training)
        if all(r.get(f"{phase}_ms") is not None for r in flat):
            out[f"{phase}_share"] = float(sum(r[f"{phase}_ms"] for r in flat) / rank_time)
    updates = [r.get("table_update_ms") for r in flat]
    if updates and all(v is not None for v in updates):
        out["table_update_ms_mean"] = float(np.mean(updates))
    return out


def summary_row(
    *,
    status: str,
    preset: str | None,
    interaction: str | None,
    device: str | None,
    precision: str | None,
    table_precision: str | None,
    world_size: int,
    batch_size: int | None,
    steps: int,
    warmup: int,
    step_rows: list[StepRow],
    **columns: Any,
) -> TrainSummaryRow:
    """A training run's row of `train summary` (`metrics.columns`; columns not given are null), as a finished run
    and a recovered one record it: what ran, its `steps` and `warmup` steps, what its every rank's `step_rows`
    measured (`summarize_steps`), then the table's other `columns` by name."""
    return TrainSummaryRow(
        {
            "kind": "train",
            "status": status,
            "preset": preset,
            "interaction": interaction,
            "device": device,
            "precision": precision,
            "table_precision": table_precision,
            "world_size": world_size,
            "batch_size": batch_size,
            "global_batch_size": batch_size * world_size if batch_size else None,
            "steps": steps,
            "warmup_steps": warmup,
            **summarize_steps(step_rows),
            **columns,
        }
    )


def roofline_columns(
    spec: Spec,
    cfg: TrainConfig,
    summary: TrainSummaryRow,
    world_size: int,
    peaks: Peaks | str,
    distinct_share: float | None = None,
) -> TrainSummaryRow:
    """Analytic work of the run, what it achieved, and one rank's step on the roofline.

    Per sample: training FLOPs (forward + backward) and embedding-row bytes (rows read,
    rewritten by the fused update, row-wise optimizer state). A step on one rank does
    `batch_size` samples' worth of both (model-parallel tables split the lookups of the
    global batch evenly on average), touches the dense parameters once and sends its share
    of the input distribution, pooled-embedding all-to-all and gradient all-reduce.

    The roofs gather a batch's distinct rows only (`distinct_share` of its ids, measured on the run's first
    batch; None: every id): a repeated id is summed once by the update and found in cache by the lookup.

    Valid FLOPS (HPC AI500 V2.0, as MLPerf counts time to quality): the achieved FLOP/s
    when the run reached --target-auc, 0 when it did not, null without a target.
    """
    cost = sample_cost(spec, table_precision=cfg.table_precision, optimizer=cfg.embedding_optimizer)
    row_bytes = cost.embedding_bytes_read + cost.embedding_bytes_written + cost.optimizer_state_bytes
    out = TrainSummaryRow(
        flops_per_sample=float(cost.training_flops), bytes_per_sample=row_bytes, valid_flops_per_s=None
    )
    rate = summary.get("samples_per_s")
    if rate:
        out["achieved_flops_per_s"] = rate * cost.training_flops
        out["achieved_bytes_per_s"] = rate * row_bytes
    share = 1.0 if distinct_share is None else distinct_share
    work = Work(
        flops=cfg.batch_size * cost.training_flops,
        gather_bytes=cfg.batch_size * share * row_bytes,
        stream_bytes=dense_step_bytes(spec, cfg.dense_optimizer),
        comm_bytes=sum(step_communication_bytes(spec, cfg.batch_size * world_size, world_size).values()),
        # the lookup's rows, then the update's: each row again, and its row-wise state in an array of its own
        gather_rows=cfg.batch_size * share * cost.embedding_rows_read * (2 + (1 if cost.optimizer_state_bytes else 0)),
        table_bytes=stored_table_bytes(spec, cfg.table_precision),
    )
    step_ms = summary.get("step_time_ms_mean")
    out.update(place(work, step_ms / 1e3 if step_ms else None, peaks))
    if not isinstance(peaks, str):
        phases = step_phase_work(
            spec,
            cfg.batch_size,
            world_size,
            cfg.table_precision,
            cfg.embedding_optimizer,
            cfg.dense_optimizer,
            distinct_share=share,
        )
        floors = phase_floors(phases, peaks)
        out.update({f"{p}_floor_ms": floors[p] for p in PHASES})
        if all(v is not None for v in floors.values()):  # a collective unbounded leaves the sum unknown
            out["phase_floor_ms"] = sum(v for v in floors.values() if v is not None)
            if step_ms:
                out["phase_floor_fraction"] = out["phase_floor_ms"] / step_ms
        tables = table_update_work(spec, cfg.batch_size, cfg.table_precision, cfg.embedding_optimizer, share)
        update = phase_floors({"table_update": tables}, peaks)["table_update"]
        out["table_update_floor_ms"] = update
        if update and summary.get("table_update_ms_mean"):
            out["table_update_floor_fraction"] = update / summary["table_update_ms_mean"]
    if cfg.target_auc is not None:
        out["valid_flops_per_s"] = out.get("achieved_flops_per_s") if summary.get("target_reached") else 0.0
    return out


def energy_columns(energy: dict[str, float | str | None], summary: TrainSummaryRow) -> TrainSummaryRow:
    """Energy over the measured steps, per sample and per watt.

    Joules per sample is the mean power over the measured window divided by the measured
    throughput, so evaluation pauses inside the window do not count as training samples'
    energy. Null (with `energy_unavailable` saying why) where no sensor is readable.
    """
    out = TrainSummaryRow(energy, energy_per_sample_j=None, samples_per_s_per_w=None, valid_flops_per_s_per_w=None)
    power, rate = energy.get("power_w_mean"), summary.get("samples_per_s")
    if power and rate:
        out["energy_per_sample_j"] = power / rate
        out["samples_per_s_per_w"] = rate / power
        valid = summary.get("valid_flops_per_s")
        if valid is not None:
            out["valid_flops_per_s_per_w"] = valid / power
    return out


def recovered_summary(run_dir: Path, manifest: JsonObject) -> TrainSummaryRow | None:
    """Write the summary a training run died before writing (SIGKILL, out of memory), from
    the steps recovery merged: throughput, step times, phase shares and loss trend, status
    failed; evaluation, roofline and energy stay null (they were never measured). None when
    there is nothing to do (a summary exists, no steps, or not a training run)."""
    run_dir = Path(run_dir)
    steps_path = run_dir / "steps.parquet"
    if manifest.get("kind") != "train" or (run_dir / "summary.parquet").exists() or not steps_path.exists():
        return None
    steps = pq.read_table(steps_path)
    if steps.num_rows == 0 or not set(STEP_SCHEMA.names) <= set(steps.column_names):
        return None  # not the training loop's steps table: nothing to summarise
    rows = [StepRow(r) for r in steps.select(STEP_SCHEMA.names).to_pylist()]  # the table's columns, as written
    warmup = flag_warmup(rows, min(r["step"] for r in rows))
    config = cast("dict[str, Any]", manifest.get("config", {}))  # the run's config as recorded: an object
    model, cfg = config.get("model", {}), config.get("train", {})
    world = config.get("world_size") or 1
    summary = summary_row(
        status="failed",
        preset=model.get("name"),
        interaction=model.get("interaction"),
        device=cfg.get("device"),
        precision=cfg.get("precision"),
        table_precision=cfg.get("table_precision"),
        table_update=cfg.get("table_update"),
        world_size=world,
        batch_size=cfg.get("batch_size"),
        steps=len({r["step"] for r in rows}),
        warmup=warmup,
        step_rows=rows,
    )
    run_id = cast(str, manifest.get("run_id") or run_dir.name)  # the manifest's run_id: a string
    write_table(run_dir, "summary", [summary], SUMMARY_SCHEMA, run_id)
    return summary


register_recovery("train", recovered_summary)  # `runs recover`, sweeps and the launcher rebuild a dead run's summary

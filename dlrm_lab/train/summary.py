"""A training run's summary, after its last step.

Every rank's step rows gathered and their warm-up found, the energy of the measured steps, and the summary row:
throughput, quality against the target AUC (MLPerf's rule: throughput only counts when quality was reached),
roofline, energy and cost, written by rank 0. `MeasuredSteps` is what the step loop hands over to it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, TypedDict, cast

import torch
import torch.distributed as dist

from dlrm_lab.config import TrainConfig
from dlrm_lab.config.family import Spec
from dlrm_lab.distributed.context import DistContext
from dlrm_lab.metrics.canary import Canary, canary_columns
from dlrm_lab.metrics.columns import EvalRow, StepRow, TrainSummaryRow
from dlrm_lab.metrics.cost import price_of, training_cost_columns
from dlrm_lab.metrics.energy import EnergySampler, combine_summaries
from dlrm_lab.metrics.roofline import gemm_precision, load_profile, peaks_for
from dlrm_lab.metrics.run import Run
from dlrm_lab.train.profile import StepProfiler, write_profile
from dlrm_lab.train.records import (
    SUMMARY_SCHEMA,
    energy_columns,
    flag_warmup,
    roofline_columns,
    summary_row,
    warmup_column,
)
from dlrm_lab.train.setup import TrainSetup


class Reached(TypedDict, total=False):
    """The steps and seconds to the target AUC: empty until it is reached."""

    steps: int
    seconds: float


def _quality(cfg: TrainConfig, reached: Reached) -> TrainSummaryRow:
    if cfg.target_auc is None:
        return TrainSummaryRow()
    return TrainSummaryRow(
        target_auc=cfg.target_auc,
        target_reached=bool(reached),
        steps_to_target=reached.get("steps"),
        time_to_target_s=reached.get("seconds"),
    )


def _gather_rows(rows: list[StepRow], ctx: DistContext) -> list[StepRow]:
    """Every rank's step rows, on every rank (the summary needs the slowest rank per step)."""
    if ctx.world_size == 1:
        return rows
    gathered: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(gathered, rows)
    return [r for part in gathered for r in part]


def _gather_energy(energy: dict[str, float | str | None], ctx: DistContext) -> dict[str, float | str | None]:
    if ctx.world_size == 1:
        return energy
    gathered: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(gathered, energy)
    return combine_summaries(gathered)


def _peaks(ctx: DistContext, cfg: TrainConfig):
    device = str(ctx.device) if ctx.device.type == "cuda" else "cpu"
    precision = gemm_precision(ctx.device.type, cfg.precision)
    return peaks_for(load_profile(), device, precision, torch.get_num_threads(), ctx.world_size, ctx.backend)


def _summary(
    spec: Spec,
    cfg: TrainConfig,
    ctx: Any,
    status: str,
    steps: list[StepRow],
    all_steps: list[StepRow],
    evals: list[EvalRow],
    warmup: int,
    reached: Reached,
    energy: dict[str, float | str | None],
    teacher_auc: float | None,
    wall_time_s: float,
    distinct_share: float | None = None,
) -> TrainSummaryRow:
    """The run's summary row (`train.records.summary_row`): its throughput, quality, roofline, energy and cost."""
    summary = summary_row(
        status=status,
        preset=spec.name,
        interaction=spec.interaction,
        device=ctx.device.type,
        precision=cfg.precision,
        table_precision=cfg.table_precision,
        table_update=cfg.table_update,
        world_size=ctx.world_size,
        batch_size=cfg.batch_size,
        steps=len(steps),
        warmup=warmup,
        step_rows=all_steps,
        eval_auc=evals[-1]["auc"] if evals else None,
        eval_loss=evals[-1]["loss"] if evals else None,
        teacher_auc=teacher_auc,
        **_quality(cfg, reached),
        num_parameters=spec.num_parameters,
        embedding_parameters=spec.embedding_parameters,
        dense_parameters=spec.dense_parameters,
        wall_time_s=wall_time_s,
    )
    if cfg.target_auc is not None:  # MLPerf's rule: throughput only counts when quality was reached
        summary["valid_samples_per_s"] = summary.get("samples_per_s") if reached else 0.0
    summary.update(roofline_columns(spec, cfg, summary, ctx.world_size, _peaks(ctx, cfg), distinct_share))
    summary.update(energy_columns(energy, summary))
    # every host of the run is paid for: ranks / ranks per host machines at this machine's price
    machines = max(1, ctx.world_size // max(1, ctx.local_world_size))
    price = price_of(load_profile(), cfg.price_per_hour, cfg.currency)
    summary.update(training_cost_columns(summary, price, machines))
    return summary


@dataclass
class MeasuredSteps:
    """What the step loop measured (`_loop`), for `summarise`."""

    steps: list[StepRow]  # this rank's rows
    evals: list[EvalRow]
    reached: Reached  # the steps and seconds to the target AUC, once reached
    status: str  # ok, or interrupted (Ctrl-C)
    t_start: float  # perf_counter at the first step
    step_starts: list[float]  # sampler clock at each step's start: the energy window starts after the warm-up
    sampler: EnergySampler
    profiler: StepProfiler
    steps_table: Any  # this rank's steps.parquet writer (None: no run directory)
    canary: Canary  # this rank's speed canary, read between steps (`metrics.canary`)


def summarise(setup: TrainSetup, record: Run | None, measured: MeasuredSteps) -> tuple[TrainSummaryRow, list[StepRow]]:
    """Every rank's rows gathered and their warm-up found (flagged in memory now; in steps.parquet as it is merged
    at the run's close), the energy of the measured steps, the summary row (written by rank 0). (summary, rows)"""
    spec, cfg, ctx, start_step = setup.spec, setup.cfg, setup.ctx, setup.start_step
    steps, sampler, profiler = measured.steps, measured.sampler, measured.profiler
    t_end = sampler.mark()
    profiler.stop()  # a run that ended inside the window
    all_steps = _gather_rows(steps, ctx)
    if cfg.profile_steps:
        write_profile(record, profiler.rows, ctx, profiler.trace, all_steps)
    warmup = flag_warmup(all_steps, start_step, cfg.warmup_steps)
    if steps and measured.steps_table is not None:
        measured.steps_table.derive_on_close("warmup", warmup_column(start_step + warmup))
    t_measured = measured.step_starts[warmup] if len(measured.step_starts) > warmup else t_end
    energy = _gather_energy(sampler.summary(t_measured, t_end), ctx)
    # the manifest's config as `build_setup` wrote it: the held-out data's record, the loop's distinct rows (or None)
    eval_data = cast("dict[str, Any]", setup.config["eval_data"])
    distinct_rows = cast("dict[str, Any]", setup.config.get("distinct_rows") or {})
    summary = _summary(
        spec,
        cfg,
        ctx,
        measured.status,
        steps,
        all_steps,
        measured.evals,
        warmup,
        measured.reached,
        energy,
        eval_data.get("teacher_auc"),
        time.perf_counter() - measured.t_start,
        distinct_rows.get("share"),
    )
    elapsed_s = time.perf_counter() - measured.t_start
    summary.update(canary_columns(measured.canary.readings, measured.canary.quiet, elapsed_s))
    if record is not None and ctx.is_main:
        record.write_summary([summary], SUMMARY_SCHEMA)
    return summary, all_steps

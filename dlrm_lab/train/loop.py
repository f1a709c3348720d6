"""The training loop: sharded tables with fused optimizers, DDP dense layers, timed phases.

One code path for one rank and many: a plain process becomes a group of one and still
trains through `DistributedModelParallel`, so what is measured on one rank is what
scales. The loop returns data; progress display is the caller's `on_step` callback (rank 0's steps).
Its checks before any work (`train.preflight`), the setup before its first step (`train.setup`) and
the summary after its last (`train.summary`) stand apart.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torchrec.datasets.utils import Batch

from dlrm_lab.config.values import JsonObject, Log
from dlrm_lab.data import BatchSource
from dlrm_lab.data.prefetch import Prefetcher
from dlrm_lab.distributed.context import DistContext, RankFailure
from dlrm_lab.metrics.canary import Canary, as_telemetry, quiet_of
from dlrm_lab.metrics.columns import PHASES, EvalRow, StepRow, TrainSummaryRow, schema_of
from dlrm_lab.metrics.energy import EnergySampler, telemetry_schema
from dlrm_lab.metrics.roofline import load_profile
from dlrm_lab.metrics.run import Run
from dlrm_lab.metrics.sensors import open_power_sources
from dlrm_lab.train.checkpoint import save_checkpoint
from dlrm_lab.train.dense_weights import as_trained
from dlrm_lab.train.evaluate import HeldOut, evaluate
from dlrm_lab.train.pipeline import make_pipeline
from dlrm_lab.train.preflight import ResolvedRun
from dlrm_lab.train.profile import StepProfiler, profile_window
from dlrm_lab.train.records import STEP_SCHEMA
from dlrm_lab.train.setup import TrainSetup, build_setup, prepare_run
from dlrm_lab.train.step import autocast, train_step
from dlrm_lab.train.step_trial import StepTrial
from dlrm_lab.train.summary import MeasuredSteps, Reached, summarise
from dlrm_lab.train.table_update import UpdatePathWatch, fused_table_groups
from dlrm_lab.train.timing import StepTimer, instrument_embedding_phases, instrument_table_update
from dlrm_lab.train.watchdog import Watchdog


@dataclass
class TrainResult:
    summary: TrainSummaryRow
    steps: list[StepRow]
    evals: list[EvalRow]
    plan: JsonObject  # the sharding plan's description (`distributed.plan.describe_plan`)
    run_dir: Path | None = None
    model: torch.nn.Module | None = field(default=None, repr=False)
    reports: bool = True  # this process reports the run (rank 0; every rank returns a result)


def _open_run(metrics_dir: str | Path | None, config: JsonObject, argv: list[str] | None, ctx: DistContext):
    """Rank 0 creates the run directory; the other ranks attach to it and write their own
    step rows; a barrier before rank 0 merges makes sure every rank's rows are on disk."""
    if not metrics_dir:
        return None
    run = Run.create(metrics_dir, kind="train", config=config, argv=argv) if ctx.is_main else None
    if ctx.world_size == 1:
        return run
    shared = [str(run.dir) if run else None]
    dist.broadcast_object_list(shared, src=0)
    run = run or Run.attach(cast(str, shared[0]), ctx.rank)  # rank 0 created it: a directory
    run.before_finish(dist.barrier)
    return run


def _mark_failed(run: Run | None) -> Callable[[str], None]:
    def mark(message: str) -> None:
        if run is not None and run.rank == 0:
            run.update_manifest(status="failed", error=f"RankFailure: {message}")

    return mark


_COLLECTIVE_WORDS = ("gloo", "nccl", "connection", "timed out", "timeout", "peer", "socket", "c10d", "broken pipe")


def _is_collective_error(exc: BaseException) -> bool:
    """An error of the collectives (a peer gone or silent), as opposed to one of this rank's own ops."""
    return isinstance(exc, getattr(dist, "DistError", ())) or any(w in str(exc).lower() for w in _COLLECTIVE_WORDS)


def _energy_sampler(ctx: DistContext) -> EnergySampler:
    """Each rank samples its own GPU; the CPU packages are read once per node (local rank 0),
    so that summing over ranks counts every sensor once."""
    gpus = [ctx.device.index or 0] if ctx.device.type == "cuda" else None
    sources, missing = open_power_sources(ctx.device.type, nvml_devices=gpus, packages=ctx.local_rank == 0)
    return EnergySampler(sources, unavailable=missing)


def _evaluator(
    setup: TrainSetup,
    pipeline: Any,
    watchdog: Watchdog | None,
    table: Any,
    t_start: float,
    evals: list[EvalRow],
    reached: Reached,
) -> Callable[[int], bool]:
    """`run_eval(step)` of `_loop`: evaluate on the held-out batches and record it in `evals` (and `table`); True
    when the target AUC is reached (training stops there; `reached` gets its steps and seconds)."""
    dmp, eval_source, ctx, cfg = setup.dmp, setup.eval_source, setup.ctx, setup.cfg
    follow = getattr(eval_source, "after_step", None)  # a stream's held-out batches follow its training
    held_out = HeldOut(eval_source)  # else the same batches every time: made once

    def run_eval(step: int) -> bool:
        t0 = time.perf_counter()
        batches = follow(step) if follow is not None else held_out
        if pipeline is None:
            auc, loss, n = evaluate(dmp, batches, ctx.device)
        else:  # the pipeline's rewritten forward only runs inside it: undo it meanwhile
            pipeline.detach()
            auc, loss, n = evaluate(dmp.module.model, batches, ctx.device)
            pipeline.attach(dmp)
        row = EvalRow(
            {
                "step": step,
                "num_samples": n,
                "auc": auc,
                "loss": loss,
                "eval_time_ms": (time.perf_counter() - t0) * 1000,
                **getattr(batches, "columns", {}),  # a stream's: the windows trained on and scored
            }
        )
        evals.append(row)
        if watchdog is not None:
            watchdog.beat()
        if table is not None:
            table.append(row)
        if cfg.target_auc is not None and auc >= cfg.target_auc and not reached:
            reached["steps"], reached["seconds"] = step + 1, time.perf_counter() - t_start
            return True
        return False

    return run_eval


def _loop(
    setup: TrainSetup,
    record: Run | None,
    stack: contextlib.ExitStack,
    on_step: Callable[[StepRow], None] | None,
    log: Log | None = None,
) -> MeasuredSteps:
    """The steps, timed by phase, each row written as it is taken; evaluations every `eval_every` steps and at the
    end (training stops once the target AUC is reached); checkpoints. Ctrl-C ends it `interrupted`; a collective
    that failed is a RankFailure. `stack` stops the sampler, the watchdog, the phase hooks and the profiler."""
    cfg, ctx, dmp, optimizer, start_step = setup.cfg, setup.ctx, setup.dmp, setup.optimizer, setup.start_step
    steps_table = record.table("steps", STEP_SCHEMA) if record else None
    # its schema read now: the families' columns (a stream's windows) are registered by the time a run starts
    eval_table = record.table("eval", schema_of("eval")) if record and ctx.is_main else None
    steps: list[StepRow] = []
    evals: list[EvalRow] = []

    reached: Reached = {}
    sampler = _energy_sampler(ctx).start()
    telemetry = record.table("telemetry", telemetry_schema("rank")) if record else None

    def stop_sampler() -> None:  # also on a crash: the power readings so far are kept
        sampler.stop()
        if telemetry is not None:
            telemetry.extend([{**r, "rank": ctx.rank} for r in sampler.rows()])

    stack.callback(stop_sampler)
    # the host's speed beside the steps: read between them, outside the timed step (`metrics.canary`)
    canary = Canary(quiet_of(load_profile(), torch.get_num_threads()), f"rank {ctx.rank}")
    status = "ok"
    t_start = time.perf_counter()
    step_starts: list[float] = []  # sampler clock: the energy window starts after the warm-up
    batches: Iterator[Batch] = iter(setup.source)
    pipeline = make_pipeline(dmp, optimizer, ctx.device) if cfg.pipeline else None
    watchdog = None
    if ctx.world_size > 1:  # a peer can stall us only when there are peers
        watchdog = Watchdog(cfg.timeout_s, ctx.rank, _mark_failed(record))
        stack.callback(watchdog.stop)
    run_eval = _evaluator(setup, pipeline, watchdog, eval_table, t_start, evals, reached)
    timer = StepTimer(ctx.device)
    tables = fused_table_groups(dmp)
    if setup.weights is not None:  # whatever the loop ends in, the model holds the fp32 weights the optimizer has
        stack.callback(setup.weights.use, "fp32")
    if pipeline is None:
        for handle in instrument_embedding_phases(dmp, timer) + instrument_table_update(tables, timer):
            stack.callback(handle.remove)
    dmp.train()
    trials_end = max((trial.last_step for trial in setup.trials), default=None)
    profiler = StepProfiler(*profile_window(start_step, cfg.steps, cfg.profile_steps, trials_end), cuda=timer.cuda)
    stack.callback(profiler.stop)
    try:
        for step in range(start_step, cfg.steps):
            profiler.step(step)
            for trial in setup.trials:
                trial.before(step)
            step_starts.append(time.monotonic())
            t0 = time.perf_counter()
            if pipeline is not None:
                # phases overlap by design here: only the step time is measured
                with autocast(ctx, cfg):
                    loss = pipeline.progress(batches)[0]
                if timer.cuda:
                    torch.cuda.synchronize(ctx.device)
                phases: Mapping[str, float | None] = {p: None for p in PHASES}
                parts: dict[str, float] = {}
                step_ms = (time.perf_counter() - t0) * 1000
            else:
                timer.start()
                batch = next(batches).to(ctx.device, non_blocking=True)
                timer.mark("data_wait")
                if setup.config.get("distinct_rows") is None:  # the run's first batch, before its step
                    _distinct_rows(setup, record, batch)
                    timer.mark("data_wait")
                # the first step on each table-update path says which path fbgemm's backward took (observed)
                watch = UpdatePathWatch(tables) if "update_path" not in setup.config["table_update_choice"] else None
                loss = train_step(dmp, optimizer, batch, ctx, cfg, timer.mark, setup.weights)
                if watch is not None:
                    _update_path(setup, record, watch)
                timer.mark("optimizer")  # the step's tail (its frame and last tensors freed, 10-20 us) is named too
                step_ms = (time.perf_counter() - t0) * 1000  # before the lab's own bookkeeping below
                phases = {p: 0.0 for p in PHASES} | timer.phases_ms()
                parts = timer.parts_ms()
                timer.stop()
                if timer.cuda:
                    step_ms = sum(phases.values())
            for trial in setup.trials:
                if (decided := trial.after(step, step_ms)) is not None:
                    _decided(setup, record, trial, decided, log)
            global_samples = cfg.batch_size * ctx.world_size
            row = StepRow(
                {
                    "step": step,
                    "rank": ctx.rank,
                    "world_size": ctx.world_size,
                    "batch_size": cfg.batch_size,
                    "global_samples": global_samples,
                    "warmup": None,  # known at the end (detected): steps.parquet derives it as it is merged
                    "loss": loss.item(),
                    "step_time_ms": step_ms,
                    **{f"{k}_ms": v for k, v in phases.items()},
                    "table_update_ms": parts.get("table_update"),
                    "samples_per_s": global_samples / (step_ms / 1000),
                    "time_unix_s": time.time(),
                }
            )
            steps.append(row)
            if watchdog is not None:
                watchdog.beat()
            if steps_table is not None:
                steps_table.append(row)
            if on_step is not None and ctx.is_main:  # one display under a launcher: rank 0's
                on_step(row)
            if (reading := canary.maybe_read()) is not None and telemetry is not None:
                canary_rows = cast("list[dict[str, Any]]", as_telemetry(reading))  # flat rows of scalars
                telemetry.extend([{**r, "rank": ctx.rank} for r in canary_rows])
            if cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0 and step + 1 < cfg.steps:
                with as_trained(setup.weights):
                    save_checkpoint(  # --checkpoint-every comes with --checkpoint-dir (`TrainConfig`)
                        cast(str, cfg.checkpoint_dir),
                        dmp,
                        optimizer,
                        step + 1,
                        ctx.is_main,
                        _trained(setup, record, evals),
                    )
            every = cfg.resolved_eval_every
            if every and (step + 1) % every == 0 and step + 1 < cfg.steps and run_eval(step):
                break
        else:
            run_eval(cfg.steps - 1)
        if cfg.checkpoint_dir:
            with as_trained(setup.weights):
                save_checkpoint(
                    cfg.checkpoint_dir,
                    dmp,
                    optimizer,
                    steps[-1]["step"] + 1,
                    ctx.is_main,
                    _trained(setup, record, evals),
                )
    except KeyboardInterrupt:
        status = "interrupted"
    except RuntimeError as exc:  # gloo/NCCL errors surface as RuntimeError subclasses
        if ctx.world_size == 1 or isinstance(exc, RankFailure) or not _is_collective_error(exc):
            raise  # a fault of this rank's own work keeps its traceback: it is not another rank's death
        raise RankFailure(
            f"rank {ctx.rank}: a collective failed at step {len(steps)}: another rank died or did not answer "
            f"within --timeout {cfg.timeout_s:g}s ({str(exc).strip().splitlines()[0][:200]})"
        ) from exc
    return MeasuredSteps(steps, evals, reached, status, t_start, step_starts, sampler, profiler, steps_table, canary)


def distinct_rows(batch: Any) -> JsonObject | None:
    """A batch's distinct rows over its ids, feature by feature (a repeated id is summed once by the update and
    found in cache by the lookup: the roofs gather only distinct rows, `train.records.roofline_columns`); None
    where the batch has no pooled sparse features (the HSTU ranker's requests)."""
    kjt = getattr(batch, "sparse_features", None)
    if kjt is None or not hasattr(kjt, "to_dict"):
        return None
    ids = rows = 0
    for jagged in kjt.to_dict().values():
        values = jagged.values()
        ids += values.numel()
        rows += int(torch.unique(values).numel())
    return {"ids": ids, "rows": rows, "share": rows / ids if ids else 1.0, "batch": "the run's first, this rank's"}


def _distinct_rows(setup: TrainSetup, record: Run | None, batch: Any) -> None:
    """The run's first batch's distinct rows over its ids (`distinct_rows`: the roofs gather those), in
    the manifest's config. Timed as data wait (once: 1-2 ms at kaggle's 53k ids)."""
    setup.config["distinct_rows"] = distinct_rows(batch) or {"share": None, "reason": "no pooled sparse features"}
    if record is not None and setup.ctx.is_main:
        record.update_manifest(config=setup.config)


def _update_path(setup: TrainSetup, record: Run | None, watch: UpdatePathWatch) -> None:
    """The path each table group's backward took on a real step (`UpdatePathWatch`), in the manifest's config."""
    setup.config["table_update_choice"]["update_path"] = watch.record()
    if record is not None and setup.ctx.is_main:
        record.update_manifest(config=setup.config)


def _decided(setup: TrainSetup, record: Run | None, trial: StepTrial, decided: JsonObject, log: Log | None) -> None:
    """A choice decided on the run's steps: its record in the manifest's config (beside the timing apart that it
    replaced), and the run's config where the summary reads it."""
    before = setup.config[trial.manifest_key] or {}
    setup.config[trial.manifest_key] = {
        **before,
        trial.name: decided[trial.name],
        "reason": decided["reason"],
        "apart": {k: v for k, v in before.items() if k not in ("apart", "trial")},
        "trial": decided,
    }
    if trial.name == "table_update":
        setup.cfg = replace(setup.cfg, table_update=cast(str, decided["table_update"]))  # the path's name
        setup.config[trial.manifest_key].pop("update_path", None)  # observed again on the next step ("apart" keeps it)
        setup.config["train"] = setup.cfg.to_dict()
    if record is not None and setup.ctx.is_main:
        record.update_manifest(config=setup.config)
    if log is not None and setup.ctx.is_main:
        log(f"{trial.name} {decided[trial.name]}: {decided['reason']}")


def _trained(setup: TrainSetup, record: Run | None, evals: list[EvalRow]) -> JsonObject:
    """What a checkpoint's weights were trained on (`model.checkpoint.TRAINED`): serving reads it to check the
    spec it serves and to draw the run's held-out samples again for a build's accuracy rule."""
    cfg, last = setup.cfg, (evals[-1] if evals else None)
    data = cfg.data if cfg.data in ("synthetic",) else str(Path(cfg.data).resolve())
    return {
        "model": setup.spec.to_dict(),
        "run_id": record.run_id if record else None,
        "data": data,
        "data_spec": cfg.data_spec,
        "data_overrides": list(cfg.data_overrides),
        "seed": cfg.seed,
        "protocol": cfg.protocol,
        "eval_data": setup.config["eval_data"],
        "eval": None
        if last is None
        else {"step": last["step"] + 1, "auc": last["auc"], "loss": last["loss"], "samples": last["num_samples"]},
        "precision": cfg.precision,
        "world_size": setup.ctx.world_size,
    }


def train(
    run: ResolvedRun,
    *,
    metrics_dir: str | Path | None = None,
    argv: list[str] | None = None,
    source: BatchSource | None = None,
    eval_source: BatchSource | None = None,
    on_step: Callable[[StepRow], None] | None = None,
    keep_model: bool = False,
    log: Log | None = None,
) -> TrainResult:
    """Train for `cfg.steps` steps; record steps, evaluations and a summary.

    `run` is what `preflight(spec, cfg)` returned (its checks made, its inputs read: they are not made or read
    again; `data=False` where the caller brings its own `source`). With `metrics_dir`, rank 0 creates a run directory
    (manifest, steps.parquet, eval.parquet, summary.parquet) and the other ranks add their step rows to
    it. Ctrl-C stops at the current step, writes the summary of what was measured, marks the run
    `interrupted` and re-raises KeyboardInterrupt. `cfg.precision` "auto" is resolved by
    measurement (`dlrm_lab.metrics.precision`); the choice and its reason go into the
    manifest, and `log` (rank 0) receives the quick-probe notice and any slow-precision warning.
    """
    setup = build_setup(prepare_run(run, metrics_dir, log), source, eval_source, log)
    record = _open_run(metrics_dir, setup.config, argv, setup.ctx)
    with contextlib.ExitStack() as stack:
        if record is not None:
            stack.enter_context(record)
        if isinstance(setup.source, Prefetcher):
            stack.callback(setup.source.close)
        measured = _loop(setup, record, stack, on_step, log)
        summary, all_steps = summarise(setup, record, measured)
        if log and setup.ctx.is_main and summary.get("canary_phase"):
            log(str(summary["canary_phase"]))
        if measured.status == "interrupted":
            raise KeyboardInterrupt
    return TrainResult(
        summary=summary,
        steps=all_steps,
        evals=measured.evals,
        plan=setup.config["sharding_plan"],
        run_dir=record.dir if record else None,
        model=setup.dmp if keep_model else None,
        reports=setup.ctx.is_main,
    )

"""The training loop: sharded tables with fused optimizers, DDP dense layers, timed phases.

One code path for one rank and many: a plain process becomes a group of one and still
trains through `DistributedModelParallel`, so what is measured on one rank is what
scales. The loop returns data; progress display is the caller's `on_step` callback (rank 0's steps).
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torchrec.datasets.utils import Batch

from dlrm_lab.config import TrainConfig
from dlrm_lab.config.family import Spec, family_of
from dlrm_lab.config.train import dense_lr_for, dense_recipe_for, embedding_lr_for, target_auc_for
from dlrm_lab.data import BatchSource, DataSpec, check_data_options, open_sources
from dlrm_lab.data.prefetch import Prefetcher
from dlrm_lab.distributed.context import (
    DistContext,
    RankFailure,
    detect_launch,
    init_distributed,
    pin_to_cores,
    resolve_device,
)
from dlrm_lab.distributed.lean import use_lean_distribution
from dlrm_lab.distributed.plan import check_table_types, describe_plan, parse_table_sharding
from dlrm_lab.distributed.tables import init_tables
from dlrm_lab.distributed.wrap import EmbeddingOptimizer, shard_model, table_sharder
from dlrm_lab.errors import FieldError
from dlrm_lab.metrics.columns import PHASES, schema_of
from dlrm_lab.metrics.cost import price_of, training_cost_columns
from dlrm_lab.metrics.energy import EnergySampler, combine_summaries, telemetry_schema
from dlrm_lab.metrics.roofline import gemm_precision, load_profile, peaks_for
from dlrm_lab.metrics.run import Run, check_writable
from dlrm_lab.metrics.sensors import open_power_sources
from dlrm_lab.metrics.trust import check_stored_profile
from dlrm_lab.model import build_model
from dlrm_lab.model.cost import TABLE_BYTES_PER_VALUE
from dlrm_lab.train.checkpoint import load_checkpoint, save_checkpoint
from dlrm_lab.train.choices import (
    choose_prefetch,
    choose_run_attention,
    choose_run_collectives,
    choose_run_interaction,
    choose_run_precision,
    choose_run_table_update,
)
from dlrm_lab.train.evaluate import evaluate
from dlrm_lab.train.pipeline import BatchLoss, make_pipeline
from dlrm_lab.train.profile import StepProfiler, profile_window, write_profile
from dlrm_lab.train.records import (
    STEP_SCHEMA,
    SUMMARY_SCHEMA,
    energy_columns,
    flag_warmup,
    roofline_columns,
    summary_row,
    warmup_column,
)
from dlrm_lab.train.sharding_trial import resolve_sharding
from dlrm_lab.train.step import RecipeOptimizer, autocast, dense_optimizer, model_inputs, train_step
from dlrm_lab.train.timing import StepTimer, instrument_embedding_phases
from dlrm_lab.train.watchdog import Watchdog


@dataclass
class TrainResult:
    summary: dict[str, Any]
    steps: list[dict[str, Any]]
    evals: list[dict[str, Any]]
    plan: dict[str, Any]
    run_dir: Path | None = None
    model: torch.nn.Module | None = field(default=None, repr=False)
    reports: bool = True  # this process reports the run (rank 0; every rank returns a result)


def _init_output_bias(model: torch.nn.Module, click_rate: float | None) -> float | None:
    """Start the click logit at the data's base rate (the logit of its click rate), so the
    first steps do not spend themselves, and Adagrad's first sign-sized step on every
    weight, moving every logit from 0 to the prior together. None when the rate is unknown."""
    if click_rate is None or not 0 < click_rate < 1:
        return None
    linears = [
        m
        for name, m in model.named_modules()
        if ("over_arch" in name or ".head." in f".{name}.") and isinstance(m, torch.nn.Linear)
    ]  # a DLRM's top MLP, the HSTU ranker's head
    if not linears or linears[-1].out_features != 1 or linears[-1].bias is None:
        return None
    bias = math.log(click_rate / (1 - click_rate))
    with torch.no_grad():
        linears[-1].bias.fill_(bias)  # every rank sets the same value: DDP replicas stay equal
    return bias


def _open_run(metrics_dir: str | Path | None, config: dict[str, Any], argv: list[str] | None, ctx: DistContext):
    """Rank 0 creates the run directory; the other ranks attach to it and write their own
    step rows; a barrier before rank 0 merges makes sure every rank's rows are on disk."""
    if not metrics_dir:
        return None
    run = Run.create(metrics_dir, kind="train", config=config, argv=argv) if ctx.is_main else None
    if ctx.world_size == 1:
        return run
    shared = [str(run.dir) if run else None]
    dist.broadcast_object_list(shared, src=0)
    run = run or Run.attach(shared[0], ctx.rank)
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


def _quality(cfg: TrainConfig, reached: dict[str, Any]) -> dict[str, Any]:
    if cfg.target_auc is None:
        return {}
    return {
        "target_auc": cfg.target_auc,
        "target_reached": bool(reached),
        "steps_to_target": reached.get("steps"),
        "time_to_target_s": reached.get("seconds"),
    }


def _gather_rows(rows: list[dict[str, Any]], ctx: DistContext) -> list[dict[str, Any]]:
    """Every rank's step rows, on every rank (the summary needs the slowest rank per step)."""
    if ctx.world_size == 1:
        return rows
    gathered: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(gathered, rows)
    return [r for part in gathered for r in part]


def _gather_energy(energy: dict[str, Any], ctx: DistContext) -> dict[str, Any]:
    if ctx.world_size == 1:
        return energy
    gathered: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(gathered, energy)
    return combine_summaries(gathered)


def _energy_sampler(ctx: DistContext) -> EnergySampler:
    """Each rank samples its own GPU; the CPU packages are read once per node (local rank 0),
    so that summing over ranks counts every sensor once."""
    gpus = [ctx.device.index or 0] if ctx.device.type == "cuda" else None
    sources, missing = open_power_sources(ctx.device.type, nvml_devices=gpus, packages=ctx.local_rank == 0)
    return EnergySampler(sources, unavailable=missing)


def _peaks(ctx: DistContext, cfg: TrainConfig):
    device = str(ctx.device) if ctx.device.type == "cuda" else "cpu"
    precision = gemm_precision(ctx.device.type, cfg.precision)
    return peaks_for(load_profile(), device, precision, torch.get_num_threads(), ctx.world_size, ctx.backend)


@dataclass(frozen=True)
class ResolvedRun:
    """A training run as `preflight` checked it: what `train` starts from, so that nothing is checked or read twice."""

    spec: Spec
    cfg: TrainConfig
    per_table: dict[str, str]  # --shard, parsed against the model's tables
    # the synthetic data's spec, read once with its --set overrides (None: a dataset on disk, samples its preset
    # describes as the HSTU ranker's requests, or data left unchecked because the caller brings its own sources)
    data_spec: DataSpec | None = None

    def open_data(self, ctx: DistContext, eval_batches: int, start_batch: int = 0) -> tuple[BatchSource, BatchSource]:
        """This rank's training and held-out sources, from the data spec read by `preflight` (not read again);
        `--protocol streaming`: the windows in time order and, at each evaluation, the window after."""
        cfg = self.cfg
        if cfg.protocol == "streaming":
            return family_of(self.spec).open_stream(self.spec, cfg.batch_size, rank=ctx.rank, world_size=ctx.world_size,
                                                    eval_batches=eval_batches, seed=cfg.seed,
                                                    start_batch=start_batch)  # fmt: skip
        data_spec, overrides = (cfg.data_spec, cfg.data_overrides) if self.data_spec is None else (self.data_spec, ())
        return open_sources(self.spec, cfg.data, cfg.batch_size, ctx.rank, ctx.world_size, eval_batches, data_spec,
                            overrides, cfg.seed, start_batch=start_batch)  # fmt: skip


def preflight(spec: Spec, cfg: TrainConfig, *, data: bool = True) -> ResolvedRun:
    """The checks `train` makes before any work, callable alone (the CLI runs them before its
    size line): the device exists, `--shard` names real tables and types, and (with `data`)
    the data options fit the model. Each failure is one UserError. The run as checked, with
    what the checks read, is what `train(run)` starts from."""
    device = resolve_device(cfg.device)
    family = family_of(spec)
    family.check_training(spec, cfg)  # its own rules (the ranker's pipeline, a DLRM's memory)
    if cfg.protocol not in getattr(family, "protocols", ("holdout",)):
        raise FieldError("protocol", f"{cfg.protocol}: {spec.name} ({family.called}) has no time windows to stream "
                         "(allowed: holdout)")  # fmt: skip
    per_table = parse_table_sharding(cfg.shard, [t.name for t in spec.tables])
    check_table_types(spec.name, table_sharder(spec).sharding_types(device.type), cfg.sharding, per_table)
    data_spec = check_data_options(spec, cfg.data, cfg.data_spec, cfg.data_overrides) if data else None
    if cfg.protocol == "streaming" and data:  # the stream holds a global batch a window: checked before any work
        streamed = family.with_data_overrides(spec, cfg.data_overrides, serving=False)
        family.stream(streamed, cfg.batch_size * detect_launch().world_size)
    return ResolvedRun(spec, cfg, per_table, data_spec)


@dataclass
class _Setup:
    """Everything a training run's steps need, resolved and built (`_prepare`, `_build`)."""

    spec: Spec
    cfg: TrainConfig  # with its precision and target AUC resolved
    ctx: Any  # the process group's DistContext
    dmp: Any  # the sharded model
    optimizer: Any
    source: BatchSource
    eval_source: BatchSource
    start_step: int
    config: dict[str, Any]  # the manifest's config: every choice and why


def _output_bias_rule(output_bias: float | None, click_rate: float | None, start_step: int) -> str:
    if output_bias is not None:
        return f"logit of the training data's click rate {click_rate:g}"
    return "resumed from a checkpoint" if start_step else "0: the data states no click rate"


@dataclass
class _Prepared:
    """A run joined to its ranks, every measured choice but the sharding's made (`_prepare`)."""

    run: ResolvedRun  # as it trains: its precision resolved, --set applied where it changes the samples
    ctx: DistContext
    choices: dict[str, Any]  # collectives, precision and attention, each with its reason (the manifest's)


def _prepare(run: ResolvedRun, metrics_dir: str | Path | None, log: Callable[[str], None] | None) -> _Prepared:
    """Join the ranks and choose the collectives, precision and attention by measurement (`train`'s first part;
    `preflight` checked the options)."""
    spec, cfg = run.spec, run.cfg
    if metrics_dir:
        check_writable(metrics_dir, "metrics_dir")
    price_of(load_profile(), cfg.price_per_hour, cfg.currency)  # a damaged stored price: refused now, not at the end
    if (family := family_of(spec)).samples_in_spec:  # --set changes the samples, so the cost and the manifest too
        spec, cfg = family.with_data_overrides(spec, cfg.data_overrides, serving=False), replace(cfg, data_overrides=())
    launch = detect_launch()
    if launch.world_size == 1:  # ranks starting beside it would disturb the check itself
        check_stored_profile(log)
    collectives = choose_run_collectives(spec, cfg, launch)
    ctx = init_distributed(cfg.device, cfg.timeout_s, collectives["collectives"], launch)
    if cfg.pin_cores:
        pin_to_cores(ctx)
    precision_choice = choose_run_precision(spec, cfg, ctx, log)
    cfg = replace(cfg, precision=precision_choice.precision)
    attention = choose_run_attention(spec, cfg, ctx, log)
    choices = {"precision_choice": precision_choice.to_dict(), "attention_choice": attention,
               "collectives_choice": collectives}  # fmt: skip
    if cfg.protocol == "streaming":
        cfg, choices["stream"] = _stream_steps(spec, cfg, ctx.world_size)
    return _Prepared(replace(run, spec=spec, cfg=cfg), ctx, choices)


def _stream_steps(spec: Spec, cfg: TrainConfig, world_size: int) -> tuple[TrainConfig, dict[str, Any]]:
    """`--protocol streaming`: the run's steps (at most the stream's) and its evaluation cadence (--eval-every, else
    one every --eval-every-share of the stream's steps), and the stream's record for the manifest."""
    stream = family_of(spec).stream(spec, cfg.batch_size * world_size)
    every = cfg.eval_every or stream.eval_every(cfg.eval_every_share)
    steps = min(cfg.steps, stream.steps)
    rule = f"--eval-every {cfg.eval_every}" if cfg.eval_every else f"every {cfg.eval_every_share:g} of its steps"
    record = {**stream.describe(), "run_steps": steps, "eval_every": every, "eval_every_rule": rule}
    return replace(cfg, steps=steps, eval_every=every), record


def _build(
    prepared: _Prepared, source: BatchSource | None, eval_source: BatchSource | None, log: Callable[[str], None] | None
) -> _Setup:
    """Choose the sharding (timed where it must be), build and shard the model with its optimizers, resume, open
    the data from what `preflight` read and write down every choice and why (the manifest's config)."""
    run, ctx = prepared.run, prepared.ctx
    spec, cfg, attention = run.spec, run.cfg, prepared.choices["attention_choice"]
    torch.manual_seed(cfg.seed)
    embedding_lr, embedding_lr_reason = embedding_lr_for(spec, cfg)
    # identical initial rows whatever the sharding and rank count, spread as in the published model
    init_bounds = {t.name: t.init_bound for t in spec.tables}
    distribution: dict[str, Any] = {}  # the last built model's (the run's)

    def build(sharding: str, pipelined: bool = False) -> tuple[Any, Any]:
        torch.manual_seed(cfg.seed)  # the same dense weights for every plan the sharding trial builds, and the run's
        model = build_model(
            spec, device=ctx.device, table_device="meta", table_precision=cfg.table_precision,
            attention=attention["attention"] if attention else "padded",
        )  # fmt: skip
        dmp, plan = shard_model(
            model,
            ctx,
            EmbeddingOptimizer(cfg.embedding_optimizer, embedding_lr),
            sharding=sharding,
            per_table=run.per_table,
            batch_size=cfg.batch_size,
            wrapper=BatchLoss(model) if pipelined else None,
        )
        init_tables(dmp, cfg.seed, init_bounds)
        distribution["record"] = _distribution(dmp, cfg, ctx)
        return dmp, plan

    sharding_choice = resolve_sharding(spec, cfg, ctx, lambda: source or run.open_data(ctx, 1)[0], build, log)
    gc.collect()  # the trial's models freed before the run's is planned against the memory left
    dmp, plan = build(sharding_choice.sharding, cfg.pipeline)
    dense_lr, dense_lr_reason = dense_lr_for(spec, cfg, ctx.world_size)
    recipe = dense_recipe_for(spec, cfg)
    optimizer = dense_optimizer(dmp, cfg, dense_lr, recipe)
    start_step = load_checkpoint(cfg.checkpoint_dir, dmp, optimizer) if cfg.resume else 0
    if isinstance(optimizer, RecipeOptimizer):
        optimizer.resume_at(start_step)
    if start_step >= cfg.steps:
        raise FieldError("resume", f": the checkpoint is at step {start_step}; {{steps}} {cfg.steps} leaves nothing "
                         "to do", "steps")  # fmt: skip
    table_update = choose_run_table_update(
        cfg, ctx, dmp, lambda: next(iter(source or run.open_data(ctx, 1)[0])),
        (lambda batch: dmp(batch)) if cfg.pipeline else (lambda batch: dmp(*model_inputs(batch))), log,
    )  # fmt: skip
    cfg = replace(cfg, table_update=table_update["table_update"])
    interaction = choose_run_interaction(spec, cfg, ctx, dmp, log)
    plan_info = describe_plan(
        plan, spec, ctx.world_size, bytes_per_value=int(TABLE_BYTES_PER_VALUE[cfg.table_precision])
    )

    if source is None or eval_source is None:
        default_train, default_eval = run.open_data(ctx, cfg.eval_batches, start_step)
        source, eval_source = source or default_train, eval_source or default_eval
    described = source.describe()  # synthetic: its spec's rate; a generated dataset: its sidecar's
    target_auc, target_auc_rule = target_auc_for(spec, cfg, described)
    cfg = replace(cfg, target_auc=target_auc)
    sidecar = (described.get("dataset") or {}).get("teacher") or {}
    click_rate = described.get("click_rate") or sidecar.get("click_rate")
    output_bias = _init_output_bias(dmp, click_rate) if start_step == 0 else None
    prefetch = choose_prefetch(cfg, ctx)
    if prefetch["prefetch"]:
        source = Prefetcher(source, depth=prefetch["prefetch"], pin_memory=ctx.device.type == "cuda")
    config = {
        "model": spec.to_dict(),
        "train": cfg.to_dict(),
        "data": source.describe(),
        "eval_data": eval_source.describe(),
        "sharding_plan": plan_info,
        "sharding_choice": sharding_choice.to_dict(),
        "world_size": ctx.world_size,
        "backend": ctx.backend,
        "launcher": ctx.launcher,
        "resumed_from_step": start_step if cfg.resume else None,
        "pipelined": cfg.pipeline,
        "torch_threads": torch.get_num_threads(),
        **prepared.choices,  # precision, attention, collectives
        "prefetch_choice": prefetch,
        "table_update_choice": table_update,
        "distribution_choice": distribution["record"],
        "interaction_choice": interaction,
        # what the scaled model shares with the full one (docs/metrics.md, "numerics")
        "numerics": {
            "table_init": "uniform +-sqrt(1 / rows of the published table)",
            "table_init_bounds": init_bounds,
            "dense_lr": dense_lr,
            "dense_lr_rule": dense_lr_reason,
            "dense_recipe": recipe.to_dict(),
            "embedding_lr": embedding_lr,
            "embedding_lr_rule": embedding_lr_reason,
            "output_bias": output_bias,
            "target_auc": target_auc,
            "target_auc_rule": target_auc_rule,
            "output_bias_rule": _output_bias_rule(output_bias, click_rate, start_step),
        },
        "cpu_affinity": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
    }
    return _Setup(spec, cfg, ctx, dmp, optimizer, source, eval_source, start_step, config)


def _distribution(dmp: Any, cfg: TrainConfig, ctx: DistContext) -> dict[str, Any]:
    """The pooled embeddings' distribution between ranks (`--distribution`), put in place on `dmp`."""
    if cfg.distribution == "torchrec":
        return {"distribution": "torchrec", "reason": "TorchRec's own (the default: the lab measures it as deployed)"}
    if ctx.world_size == 1:
        return {"distribution": "torchrec", "reason": "--distribution lean: one rank, nothing to distribute"}
    return {**use_lean_distribution(dmp), "reason": "--distribution lean"}


def _summary(spec: Spec, cfg: TrainConfig, ctx: Any, status: str, steps: list[dict[str, Any]],
             all_steps: list[dict[str, Any]], evals: list[dict[str, Any]], warmup: int, reached: dict[str, Any],
             energy: dict[str, Any], teacher_auc: float | None, wall_time_s: float) -> dict[str, Any]:  # fmt: skip
    """The run's summary row (`train.records.summary_row`): its throughput, quality, roofline, energy and cost."""
    summary = summary_row(
        status=status, preset=spec.name, interaction=spec.interaction, device=ctx.device.type,
        precision=cfg.precision, table_precision=cfg.table_precision, table_update=cfg.table_update,
        world_size=ctx.world_size,
        batch_size=cfg.batch_size, steps=len(steps), warmup=warmup, step_rows=all_steps,
        eval_auc=evals[-1]["auc"] if evals else None,
        eval_loss=evals[-1]["loss"] if evals else None,
        teacher_auc=teacher_auc,
        **_quality(cfg, reached),
        num_parameters=spec.num_parameters,
        embedding_parameters=spec.embedding_parameters,
        dense_parameters=spec.dense_parameters,
        wall_time_s=wall_time_s,
    )  # fmt: skip
    if cfg.target_auc is not None:  # MLPerf's rule: throughput only counts when quality was reached
        summary["valid_samples_per_s"] = summary.get("samples_per_s") if reached else 0.0
    summary.update(roofline_columns(spec, cfg, summary, ctx.world_size, _peaks(ctx, cfg)))
    summary.update(energy_columns(energy, summary))
    # every host of the run is paid for: ranks / ranks per host machines at this machine's price
    machines = max(1, ctx.world_size // max(1, ctx.local_world_size))
    price = price_of(load_profile(), cfg.price_per_hour, cfg.currency)
    summary.update(training_cost_columns(summary, price, machines))
    return summary


@dataclass
class _Steps:
    """What the step loop measured (`_loop`), for `_summarise`."""

    steps: list[dict[str, Any]]  # this rank's rows
    evals: list[dict[str, Any]]
    reached: dict[str, Any]  # the steps and seconds to the target AUC, once reached
    status: str  # ok, or interrupted (Ctrl-C)
    t_start: float  # perf_counter at the first step
    step_starts: list[float]  # sampler clock at each step's start: the energy window starts after the warm-up
    sampler: EnergySampler
    profiler: StepProfiler
    steps_table: Any  # this rank's steps.parquet writer (None: no run directory)


def _evaluator(setup: _Setup, pipeline: Any, watchdog: Watchdog | None, table: Any, t_start: float,
               evals: list[dict[str, Any]], reached: dict[str, Any]) -> Callable[[int], bool]:  # fmt: skip
    """`run_eval(step)` of `_loop`: evaluate on the held-out batches and record it in `evals` (and `table`); True
    when the target AUC is reached (training stops there; `reached` gets its steps and seconds)."""
    dmp, eval_source, ctx, cfg = setup.dmp, setup.eval_source, setup.ctx, setup.cfg
    follow = getattr(eval_source, "after_step", None)  # a stream's held-out batches follow its training

    def run_eval(step: int) -> bool:
        t0 = time.perf_counter()
        batches = follow(step) if follow is not None else eval_source
        if pipeline is None:
            auc, loss, n = evaluate(dmp, batches, ctx.device)
        else:  # the pipeline's rewritten forward only runs inside it: undo it meanwhile
            pipeline.detach()
            auc, loss, n = evaluate(dmp.module.model, batches, ctx.device)
            pipeline.attach(dmp)
        row = {
            "step": step,
            "num_samples": n,
            "auc": auc,
            "loss": loss,
            "eval_time_ms": (time.perf_counter() - t0) * 1000,
            **getattr(batches, "columns", {}),  # a stream's: the windows trained on and scored
        }
        evals.append(row)
        if watchdog is not None:
            watchdog.beat()
        if table is not None:
            table.append(row)
        if cfg.target_auc is not None and auc >= cfg.target_auc and not reached:
            reached.update(steps=step + 1, seconds=time.perf_counter() - t_start)
            return True
        return False

    return run_eval


def _loop(setup: _Setup, record: Run | None, stack: contextlib.ExitStack,
          on_step: Callable[[dict[str, Any]], None] | None) -> _Steps:  # fmt: skip
    """The steps, timed by phase, each row written as it is taken; evaluations every `eval_every` steps and at the
    end (training stops once the target AUC is reached); checkpoints. Ctrl-C ends it `interrupted`; a collective
    that failed is a RankFailure. `stack` stops the sampler, the watchdog, the phase hooks and the profiler."""
    cfg, ctx, dmp, optimizer, start_step = setup.cfg, setup.ctx, setup.dmp, setup.optimizer, setup.start_step
    steps_table = record.table("steps", STEP_SCHEMA) if record else None
    # its schema read now: the families' columns (a stream's windows) are registered by the time a run starts
    eval_table = record.table("eval", schema_of("eval")) if record and ctx.is_main else None
    steps: list[dict[str, Any]] = []
    evals: list[dict[str, Any]] = []

    reached: dict[str, Any] = {}
    sampler = _energy_sampler(ctx).start()
    telemetry = record.table("telemetry", telemetry_schema("rank")) if record else None

    def stop_sampler() -> None:  # also on a crash: the power readings so far are kept
        sampler.stop()
        if telemetry is not None:
            telemetry.extend([{**r, "rank": ctx.rank} for r in sampler.rows()])

    stack.callback(stop_sampler)
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
    if pipeline is None:
        for handle in instrument_embedding_phases(dmp, timer):
            stack.callback(handle.remove)
    dmp.train()
    profiler = StepProfiler(*profile_window(start_step, cfg.steps, cfg.profile_steps), cuda=timer.cuda)
    stack.callback(profiler.stop)
    try:
        for step in range(start_step, cfg.steps):
            profiler.step(step)
            step_starts.append(time.monotonic())
            t0 = time.perf_counter()
            if pipeline is not None:
                # phases overlap by design here: only the step time is measured
                with autocast(ctx, cfg):
                    loss = pipeline.progress(batches)[0]
                if timer.cuda:
                    torch.cuda.synchronize(ctx.device)
                phases: dict[str, float | None] = {p: None for p in PHASES}
                step_ms = (time.perf_counter() - t0) * 1000
            else:
                timer.start()
                batch = next(batches).to(ctx.device, non_blocking=True)
                timer.mark("data_wait")
                loss = train_step(dmp, optimizer, batch, ctx, cfg, timer.mark)
                timer.mark("optimizer")  # the step's tail (its frame and last tensors freed, 10-20 us) is named too
                step_ms = (time.perf_counter() - t0) * 1000  # before the lab's own bookkeeping below
                phases = {p: 0.0 for p in PHASES} | timer.phases_ms()
                timer.stop()
                if timer.cuda:
                    step_ms = sum(phases.values())
            global_samples = cfg.batch_size * ctx.world_size
            row = {
                "step": step,
                "rank": ctx.rank,
                "world_size": ctx.world_size,
                "batch_size": cfg.batch_size,
                "global_samples": global_samples,
                "warmup": None,  # known at the end (detected): steps.parquet derives it as it is merged
                "loss": loss.item(),
                "step_time_ms": step_ms,
                **{f"{k}_ms": v for k, v in phases.items()},
                "samples_per_s": global_samples / (step_ms / 1000),
                "time_unix_s": time.time(),
            }
            steps.append(row)
            if watchdog is not None:
                watchdog.beat()
            if steps_table is not None:
                steps_table.append(row)
            if on_step is not None and ctx.is_main:  # one display under a launcher: rank 0's
                on_step(row)
            if cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0 and step + 1 < cfg.steps:
                save_checkpoint(cfg.checkpoint_dir, dmp, optimizer, step + 1, ctx.is_main,
                                _trained(setup, record, evals))  # fmt: skip
            every = cfg.resolved_eval_every
            if every and (step + 1) % every == 0 and step + 1 < cfg.steps and run_eval(step):
                break
        else:
            run_eval(cfg.steps - 1)
        if cfg.checkpoint_dir:
            save_checkpoint(cfg.checkpoint_dir, dmp, optimizer, steps[-1]["step"] + 1, ctx.is_main,
                            _trained(setup, record, evals))  # fmt: skip
    except KeyboardInterrupt:
        status = "interrupted"
    except RuntimeError as exc:  # gloo/NCCL errors surface as RuntimeError subclasses
        if ctx.world_size == 1 or isinstance(exc, RankFailure) or not _is_collective_error(exc):
            raise  # a fault of this rank's own work keeps its traceback: it is not another rank's death
        raise RankFailure(
            f"rank {ctx.rank}: a collective failed at step {len(steps)}: another rank died or did not answer "
            f"within --timeout {cfg.timeout_s:g}s ({str(exc).strip().splitlines()[0][:200]})"
        ) from exc
    return _Steps(steps, evals, reached, status, t_start, step_starts, sampler, profiler, steps_table)


def _trained(setup: _Setup, record: Run | None, evals: list[dict[str, Any]]) -> dict[str, Any]:
    """What a checkpoint's weights were trained on (`model.checkpoint.TRAINED`): serving reads it to check the
    spec it serves and to draw the run's held-out samples again for a build's accuracy rule."""
    cfg, last = setup.cfg, (evals[-1] if evals else None)
    data = cfg.data if cfg.data in ("synthetic",) else str(Path(cfg.data).resolve())
    return {
        "model": setup.spec.to_dict(), "run_id": record.run_id if record else None,
        "data": data, "data_spec": cfg.data_spec, "data_overrides": list(cfg.data_overrides), "seed": cfg.seed,
        "protocol": cfg.protocol, "eval_data": setup.config["eval_data"],
        "eval": None if last is None else {"step": last["step"] + 1, "auc": last["auc"], "loss": last["loss"],
                                           "samples": last["num_samples"]},
        "precision": cfg.precision, "world_size": setup.ctx.world_size,
    }  # fmt: skip


def _summarise(setup: _Setup, record: Run | None, measured: _Steps) -> tuple[dict[str, Any], list[dict[str, Any]]]:
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
    summary = _summary(spec, cfg, ctx, measured.status, steps, all_steps, measured.evals, warmup, measured.reached,
                       energy, setup.config["eval_data"].get("teacher_auc"),
                       time.perf_counter() - measured.t_start)  # fmt: skip
    if record is not None and ctx.is_main:
        record.write_summary([summary], SUMMARY_SCHEMA)
    return summary, all_steps


def train(
    run: ResolvedRun | Spec,
    cfg: TrainConfig | None = None,
    *,
    metrics_dir: str | Path | None = None,
    argv: list[str] | None = None,
    source: BatchSource | None = None,
    eval_source: BatchSource | None = None,
    on_step: Callable[[dict[str, Any]], None] | None = None,
    keep_model: bool = False,
    log: Callable[[str], None] | None = None,
) -> TrainResult:
    """Train for `cfg.steps` steps; record steps, evaluations and a summary.

    `run` is what `preflight` returned (its checks made, its inputs read: they are not made or read
    again), or a spec with its `cfg` (checked here). With `metrics_dir`, rank 0 creates a run directory
    (manifest, steps.parquet, eval.parquet, summary.parquet) and the other ranks add their step rows to
    it. Ctrl-C stops at the current step, writes the summary of what was measured, marks the run
    `interrupted` and re-raises KeyboardInterrupt. `cfg.precision` "auto" is resolved by
    measurement (`dlrm_lab.metrics.precision`); the choice and its reason go into the
    manifest, and `log` (rank 0) receives the quick-probe notice and any slow-precision warning.
    """
    if not isinstance(run, ResolvedRun):
        if cfg is None:
            raise TypeError("train(spec, cfg): the config is missing")
        run = preflight(run, cfg, data=source is None)  # a bad option: one line, before anything starts
    elif cfg is not None:
        raise TypeError("train(run): a resolved run carries its config")
    setup = _build(_prepare(run, metrics_dir, log), source, eval_source, log)
    record = _open_run(metrics_dir, setup.config, argv, setup.ctx)
    with contextlib.ExitStack() as stack:
        if record is not None:
            stack.enter_context(record)
        if isinstance(setup.source, Prefetcher):
            stack.callback(setup.source.close)
        measured = _loop(setup, record, stack, on_step)
        summary, all_steps = _summarise(setup, record, measured)
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

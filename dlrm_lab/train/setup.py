"""A training run's setup, everything before its first step.

The ranks joined and the collectives, precision and attention chosen by measurement (`prepare_run`); then the sharding
chosen (timed where it must be), the model built and sharded with its optimizers, resumed from a checkpoint, its
click logit started at the data's base rate, the data opened, and every choice written down with its reason for the
manifest (`build_setup`). What the steps need comes back as one `TrainSetup`.
"""

from __future__ import annotations

import gc
import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, cast

import torch

from dlrm_lab.config import TrainConfig
from dlrm_lab.config.family import Spec, family_of
from dlrm_lab.config.train import DEFAULT_EMBEDDING_LR, dense_lr_for, dense_recipe_for, target_auc_for
from dlrm_lab.config.values import JsonObject, Log
from dlrm_lab.data import BatchSource
from dlrm_lab.data.prefetch import Prefetcher, WorkerPrefetcher
from dlrm_lab.data.source import SyntheticSource
from dlrm_lab.data.streaming import streaming_of
from dlrm_lab.distributed.context import DistContext, detect_launch, init_distributed, pin_to_cores
from dlrm_lab.distributed.lean import use_lean_distribution
from dlrm_lab.distributed.plan import describe_plan
from dlrm_lab.distributed.tables import init_tables
from dlrm_lab.distributed.wrap import EmbeddingOptimizer, shard_model
from dlrm_lab.errors import FieldError
from dlrm_lab.metrics.cost import price_of
from dlrm_lab.metrics.roofline import load_profile
from dlrm_lab.metrics.run import check_writable
from dlrm_lab.metrics.trust import check_stored_profile
from dlrm_lab.model import build_model
from dlrm_lab.model.cost import TABLE_BYTES_PER_VALUE
from dlrm_lab.train.checkpoint import load_checkpoint
from dlrm_lab.train.choices import (
    choose_dense_update,
    choose_dense_weights,
    choose_run_attention,
    choose_run_collectives,
    choose_run_interaction,
    choose_run_precision,
    choose_run_table_update,
    choose_table_pages,
    run_step_trials,
)
from dlrm_lab.train.dense_weights import DenseWeights, as_trained
from dlrm_lab.train.pipeline import BatchLoss
from dlrm_lab.train.prefetch_choice import choose_prefetch
from dlrm_lab.train.preflight import ResolvedRun
from dlrm_lab.train.sharding_trial import resolve_sharding
from dlrm_lab.train.step import RecipeOptimizer, dense_optimizer, model_inputs
from dlrm_lab.train.step_trial import StepTrial


def embedding_lr_for(spec: Any, cfg: TrainConfig) -> tuple[float, str]:
    """The tables' learning rate and why: `--embedding-lr` when given, else 0.05 divided by
    the mean pooling factor over features. Row-wise Adagrad moves every row a sample looks
    up by about the rate; a feature sum-pooling P ids then moves its pooled vector P times
    as far as a one-hot feature's, so the rate is divided by P to keep that step. Measured
    2026-11-23 (batch 256, 100 steps): rm2 (120 ids per feature) first-steps loss 1.42 ->
    0.14 and AUC 0.49 -> 0.75; rm1 (80) AUC 0.60 -> 0.74; dcnv2 (8.3 on average) 0.853 -> 0.866;
    rm3 (20) unchanged; one-hot presets keep 0.05."""
    if cfg.embedding_lr is not None:
        return cfg.embedding_lr, "given (--embedding-lr)"

    return family_of(spec).embedding_lr(spec, DEFAULT_EMBEDDING_LR)


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


@dataclass
class TrainSetup:
    """Everything a training run's steps need, resolved and built (`prepare_run`, `build_setup`)."""

    spec: Spec
    cfg: TrainConfig  # with its precision and target AUC resolved
    ctx: Any  # the process group's DistContext
    dmp: Any  # the sharded model
    optimizer: Any
    source: BatchSource
    eval_source: BatchSource
    start_step: int
    # the manifest's config: every choice and why (sections of many shapes, read and updated in place by the loop)
    config: dict[str, Any]
    trials: list[StepTrial] = field(default_factory=list)  # choices decided again on the run's own steps
    weights: DenseWeights | None = None  # the dense part's bf16 copies of its masters, where the run has them


def _output_bias_rule(output_bias: float | None, click_rate: float | None, start_step: int) -> str:
    if output_bias is not None:
        return f"logit of the training data's click rate {click_rate:g}"
    return "resumed from a checkpoint" if start_step else "0: the data states no click rate"


@dataclass
class _Prepared:
    """A run joined to its ranks, every measured choice but the sharding's made (`prepare_run`)."""

    run: ResolvedRun  # as it trains: its precision resolved, --set applied where it changes the samples
    ctx: DistContext
    choices: JsonObject  # collectives, precision and attention, each with its reason (the manifest's)


def prepare_run(run: ResolvedRun, metrics_dir: str | Path | None, log: Log | None) -> _Prepared:
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
    choices = {
        "precision_choice": precision_choice.to_dict(),
        "attention_choice": attention,
        "collectives_choice": collectives,
    }
    if cfg.protocol == "streaming":
        cfg, choices["stream"] = _stream_steps(spec, cfg, ctx.world_size)
    return _Prepared(replace(run, spec=spec, cfg=cfg), ctx, choices)


def _stream_steps(spec: Spec, cfg: TrainConfig, world_size: int) -> tuple[TrainConfig, JsonObject]:
    """`--protocol streaming`: the run's steps (at most the stream's) and its evaluation cadence (--eval-every, else
    one every --eval-every-share of the stream's steps), and the stream's record for the manifest."""
    stream = streaming_of(family_of(spec)).stream(spec, cfg.batch_size * world_size)
    every = cfg.eval_every or stream.eval_every(cfg.eval_every_share)
    steps = min(cfg.steps, stream.steps)
    rule = f"--eval-every {cfg.eval_every}" if cfg.eval_every else f"every {cfg.eval_every_share:g} of its steps"
    record = {**stream.describe(), "run_steps": steps, "eval_every": every, "eval_every_rule": rule}
    return replace(cfg, steps=steps, eval_every=every), record


def build_setup(
    prepared: _Prepared, source: BatchSource | None, eval_source: BatchSource | None, log: Log | None
) -> TrainSetup:
    """Choose the sharding (timed where it must be), build and shard the model with its optimizers, resume, open
    the data from what `preflight` read and write down every choice and why (the manifest's config)."""
    run, ctx = prepared.run, prepared.ctx
    spec, cfg = run.spec, run.cfg
    attention = cast("JsonObject | None", prepared.choices["attention_choice"])  # `choose_run_attention`'s
    torch.manual_seed(cfg.seed)
    embedding_lr, embedding_lr_reason = embedding_lr_for(spec, cfg)
    # identical initial rows whatever the sharding and rank count, spread as in the published model
    init_bounds = {t.name: t.init_bound for t in spec.tables}
    distribution: dict[str, JsonObject] = {}  # "record": the last built model's (the run's)

    built = [0]  # models built so far (the sharding trial's, before the run's)

    def build(sharding: str, pipelined: bool = False) -> tuple[Any, Any]:
        built[0] += 1
        torch.manual_seed(cfg.seed)  # the same dense weights for every plan the sharding trial builds, and the run's
        model = build_model(
            spec,
            device=ctx.device,
            table_device="meta",
            table_precision=cfg.table_precision,
            attention=cast(str, attention["attention"]) if attention else "padded",  # the path's name
        )
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
    if built[0]:  # the trial's models freed before the run's is planned against the memory left (a full collection
        gc.collect()  # costs 0.14 s in a process with many objects: only where a trial built models)
    dmp, plan = build(sharding_choice.sharding, cfg.pipeline)
    dense_lr, dense_lr_reason = dense_lr_for(spec, cfg, ctx.world_size)
    recipe = dense_recipe_for(spec, cfg)
    dense_update = choose_dense_update(cfg, ctx, dmp, dense_lr, recipe, log)
    optimizer = dense_optimizer(dmp, cfg, dense_lr, recipe, cast(str, dense_update["dense_update"]))  # a way's name
    # --resume comes with --checkpoint-dir (`TrainConfig` refuses one without the other)
    start_step = load_checkpoint(cast(str, cfg.checkpoint_dir), dmp, optimizer) if cfg.resume else 0
    if isinstance(optimizer, RecipeOptimizer):
        optimizer.resume_at(start_step)
    if start_step >= cfg.steps:
        raise FieldError(
            "resume", f": the checkpoint is at step {start_step}; {{steps}} {cfg.steps} leaves nothing to do", "steps"
        )
    table_pages = choose_table_pages(cfg, ctx, dmp, log)  # before the update's timing, which reads the rows
    table_update = choose_run_table_update(
        cfg,
        ctx,
        dmp,
        lambda: next(iter(source or run.open_data(ctx, 1)[0])),
        (lambda batch: dmp(batch)) if cfg.pipeline else (lambda batch: dmp(*model_inputs(batch))),
        log,
    )
    cfg = replace(cfg, table_update=cast(str, table_update["table_update"]))  # the path chosen, by name
    interaction = choose_run_interaction(spec, cfg, ctx, dmp, log)
    dense_weights = choose_dense_weights(cfg, ctx, dmp, log)
    trials = run_step_trials(cfg, ctx, dmp, start_step, table_update, interaction, dense_weights)
    plan_info = describe_plan(
        plan, spec, ctx.world_size, bytes_per_value=int(TABLE_BYTES_PER_VALUE[cfg.table_precision])
    )

    if source is None or eval_source is None:
        default_train, default_eval = run.open_data(ctx, cfg.eval_batches, start_step)
        source, eval_source = source or default_train, eval_source or default_eval
    described = source.describe()  # synthetic: its spec's rate; a generated dataset: its sidecar's
    target_auc, target_auc_rule = target_auc_for(spec, cfg, described)
    cfg = replace(cfg, target_auc=target_auc)
    dataset = cast("dict[str, Any]", described.get("dataset") or {})  # a dataset's sidecar, where it has one
    sidecar = dataset.get("teacher") or {}
    click_rate = cast("float | None", described.get("click_rate") or sidecar.get("click_rate"))  # a rate, or none
    with as_trained(dense_weights[1]):
        output_bias = _init_output_bias(dmp, click_rate) if start_step == 0 else None  # on the fp32 masters
    prefetch = choose_prefetch(cfg, ctx)
    if prefetch["workers"] and not isinstance(source, SyntheticSource):  # a dataset on disk: read on the thread
        prefetch = {**prefetch, "workers": 0, "reason": f"{prefetch['reason']}; workers make synthetic batches only"}
    if prefetch["prefetch"] and prefetch["workers"]:
        source = WorkerPrefetcher(
            source, prefetch["workers"], depth=prefetch["prefetch"], pin_memory=ctx.device.type == "cuda"
        )
    elif prefetch["prefetch"]:
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
        "dense_update_choice": dense_update,
        "dense_weights_choice": dense_weights[0],
        "table_pages_choice": table_pages,
        "distribution_choice": distribution["record"],
        "interaction_choice": interaction,
        "distinct_rows": None,  # measured on the loop's first batch (`train.loop`): drawing one here would take it
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
    return TrainSetup(spec, cfg, ctx, dmp, optimizer, source, eval_source, start_step, config, trials, dense_weights[1])


def _distribution(dmp: Any, cfg: TrainConfig, ctx: DistContext) -> JsonObject:
    """The pooled embeddings' distribution between ranks (`--distribution`), put in place on `dmp`."""
    if cfg.distribution == "torchrec":
        return {"distribution": "torchrec", "reason": "TorchRec's own (the default: the lab measures it as deployed)"}
    if ctx.world_size == 1:
        return {"distribution": "torchrec", "reason": "--distribution lean: one rank, nothing to distribute"}
    return {**use_lean_distribution(dmp), "reason": "--distribution lean"}

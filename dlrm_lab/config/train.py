"""Run options: how a training run is driven, checked when constructed."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dlrm_lab.errors import UserError

PRECISIONS = ("fp32", "bf16")
# TorchRec's sharding types, by their ShardingType values.
SHARDING_TYPES = ("table_wise", "row_wise", "column_wise", "table_row_wise", "table_column_wise", "data_parallel")
# `--sharding`: `planner` is TorchRec's planner choosing per table; `auto` is resolved before planning
# (`train.sharding_trial`): the fastest plan measured on several CPU ranks, the planner on GPUs.
SHARDING_CHOICES = ("auto", "planner", *SHARDING_TYPES)
TABLE_PRECISIONS = ("fp32", "fp16")
DENSE_OPTIMIZERS = ("adagrad", "adam", "sgd")
EMBEDDING_OPTIMIZERS = ("rowwise_adagrad", "sgd")


@dataclass(frozen=True)
class TrainConfig:
    """How a training run is driven (the model comes from a `ModelSpec`).

    `batch_size` is per rank; the global batch is `batch_size * world_size`. The first
    `warmup_steps` steps are recorded but left out of throughput and step-time statistics
    (default None: detected from the step times, `train.records.detect_warmup`).
    """

    steps: int = 100
    batch_size: int = 512
    device: str = "cpu"
    precision: str = "fp32"  # or "auto": measured on this machine (dlrm_lab.metrics.precision)
    table_precision: str = "fp32"
    embedding_optimizer: str = "rowwise_adagrad"
    embedding_lr: float | None = None  # None: 0.05 / the tables' mean pooling factor (`embedding_lr_for`)
    dense_optimizer: str = "adagrad"
    dense_lr: float | None = None  # None: the preset's published rate for this batch (`dense_lr_for`)
    eval_every: int = 0  # steps between held-out AUC evaluations; 0: only at the end
    eval_batches: int = 8
    seed: int = 0
    warmup_steps: int | None = None
    data: str = "synthetic"  # or a Parquet dataset directory
    data_spec: str | None = None  # synthetic only; default: the model preset's
    data_overrides: tuple[str, ...] = ()  # synthetic only: `--set key=value` on the data spec
    # batches prepared ahead on a background thread (0: inline), or auto: a thread only where the rank
    # has a core its compute threads do not use (`train.choices.choose_prefetch`)
    prefetch: str | int = "auto"
    sharding: str = "auto"  # measured (several CPU ranks) or TorchRec's planner, or one type for every table
    shard: tuple[str, ...] = ()  # per-table overrides: "t_cat_3=row_wise"
    timeout_s: float = 300.0  # bound on every collective: a dead rank fails the others
    pin_cores: bool = False  # pin each rank (and its data thread) to its own intra-op cores
    target_auc: float | None = None  # stop when held-out AUC reaches it (MLPerf-style time to quality)
    checkpoint_dir: str | None = None  # sharded checkpoints (torch.distributed.checkpoint)
    checkpoint_every: int = 0  # steps between checkpoints; 0: only at the end
    resume: bool = False  # continue from the newest checkpoint in checkpoint_dir
    attention: str = "auto"  # HSTU ranker: padded | jagged attention, or auto (timed, model.hstu.choose_attention)
    pipeline: bool = False  # TorchRec's TrainPipelineSparseDist: next batch's input dist overlaps this step
    # CPU ranks' collectives: gloo, MPI (ranks started by mpiexec; distributed.mpi), or auto (the
    # faster at this machine's probed speeds for the step's bytes)
    collectives: str = "auto"
    profile_steps: int = 0  # torch.profiler over this many steps after warm-up: profile.parquet (train.profile)
    # The machine's price per hour for the cost columns (None: the price stored with its profile, if any)
    price_per_hour: float | None = None
    currency: str | None = None

    def __post_init__(self) -> None:
        from dlrm_lab.metrics.cost import check_currency, check_price

        if self.price_per_hour is not None:
            check_price(self.price_per_hour, "--price-per-hour")
        if self.currency is not None:
            check_currency(self.currency)
        _positive("--steps", self.steps)
        _positive("--batch-size", self.batch_size)
        _choice("--device", self.device, ("cpu", "cuda"))
        _choice("--precision", self.precision, ("auto", *PRECISIONS))
        _choice("--table-precision", self.table_precision, TABLE_PRECISIONS)
        _choice("--embedding-optimizer", self.embedding_optimizer, EMBEDDING_OPTIMIZERS)
        _choice("--dense-optimizer", self.dense_optimizer, DENSE_OPTIMIZERS)
        for name, lr in (("--embedding-lr", self.embedding_lr), ("--dense-lr", self.dense_lr)):
            if lr is None:  # the rule's rate (`dense_lr_for`, `embedding_lr_for`)
                continue
            if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0):
                raise UserError(f"{name} {lr!r}: must be a number > 0")
        if self.eval_every < 0:
            raise UserError(f"--eval-every {self.eval_every}: must be >= 0 (0: evaluate at the end only)")
        _positive("--eval-batches", self.eval_batches)
        if self.data != "synthetic" and not Path(self.data).exists():
            raise UserError(f"--data {self.data}: no such dataset directory or file (or use 'synthetic')")
        if isinstance(self.prefetch, str) and self.prefetch.strip().isdigit():  # the command line's "2"
            object.__setattr__(self, "prefetch", int(self.prefetch))
        if self.prefetch != "auto" and (
            isinstance(self.prefetch, bool) or not isinstance(self.prefetch, int) or self.prefetch < 0
        ):
            raise UserError(f"--prefetch {self.prefetch!r}: must be auto or an integer >= 0")
        if not (isinstance(self.timeout_s, (int, float)) and math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise UserError(f"--timeout {self.timeout_s!r}: must be a number of seconds > 0")
        if self.target_auc is not None and not (
            isinstance(self.target_auc, (int, float)) and 0.5 < self.target_auc < 1
        ):
            raise UserError(f"--target-auc {self.target_auc!r}: must be in (0.5, 1)")
        _choice("--sharding", self.sharding, SHARDING_CHOICES)
        _choice("--attention", self.attention, ("auto", "padded", "jagged"))
        _choice("--collectives", self.collectives, ("auto", "gloo", "mpi"))
        if self.checkpoint_every < 0:
            raise UserError(f"--checkpoint-every {self.checkpoint_every}: must be >= 0 (0: at the end only)")
        if (self.resume or self.checkpoint_every) and not self.checkpoint_dir:
            raise UserError("--resume and --checkpoint-every need --checkpoint-dir")
        if (
            isinstance(self.profile_steps, bool)
            or not isinstance(self.profile_steps, int)
            or not (0 <= self.profile_steps <= self.steps)
        ):
            raise UserError(f"--profile-steps {self.profile_steps!r}: must be an integer in [0, steps={self.steps}]")
        if self.warmup_steps is not None and not 0 <= self.warmup_steps < self.steps:
            raise UserError(f"--warmup-steps {self.warmup_steps}: must be in [0, steps={self.steps})")

    @property
    def resolved_eval_every(self) -> int:
        """Steps between evaluations; with a target AUC and none given, every 5% of the steps."""
        if self.eval_every or self.target_auc is None:
            return self.eval_every
        return max(1, self.steps // 20)

    def to_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "eval_every": self.resolved_eval_every,
            "data_overrides": list(self.data_overrides),
            "shard": list(self.shard),
        }


DEFAULT_DENSE_LR = 0.005  # Adagrad, for presets without a published recipe
DEFAULT_EMBEDDING_LR = 0.05  # row-wise Adagrad, for one id per feature


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
    if getattr(spec, "family", "dlrm") == "hstu":
        return DEFAULT_EMBEDDING_LR, f"{DEFAULT_EMBEDDING_LR:g}: sequence features, every id keeps its own vector"
    pooling = [t.pooling_factor for t in spec.tables for _ in t.feature_names]
    mean = sum(pooling) / len(pooling)
    if mean <= 1:
        return DEFAULT_EMBEDDING_LR, f"{DEFAULT_EMBEDDING_LR:g}: one id per feature"
    return DEFAULT_EMBEDDING_LR / mean, f"{DEFAULT_EMBEDDING_LR:g} / mean pooling factor {mean:g}"


def dense_lr_for(spec: Any, cfg: TrainConfig, world_size: int) -> tuple[float, str]:
    """The dense learning rate of a run and why. `--dense-lr` when given; else a preset's
    published rate (its `[reference]`) scaled by sqrt(global batch / the batch it was
    published for), the square-root rule for adaptive optimizers (Malladi et al., 2022):
    dcnv2's Adagrad 0.005 (torchrec_dlrm's recipe, global batch 16,384) sends every weight of
    its 1024-wide layers a step of 0.005 at once, which at batch 256 diverged (loss 0.69 ->
    98,425 by step 3, measured 2026-11-23); else `DEFAULT_DENSE_LR`."""
    if cfg.dense_lr is not None:
        return cfg.dense_lr, "given (--dense-lr)"
    batch = cfg.batch_size * world_size
    if spec.reference_batch_size and spec.reference_dense_lr:
        lr = spec.reference_dense_lr * math.sqrt(batch / spec.reference_batch_size)
        return lr, (
            f"published {spec.reference_dense_lr:g} at global batch {spec.reference_batch_size} "
            f"({spec.reference_source or 'the preset'}) x sqrt({batch} / {spec.reference_batch_size})"
        )
    return DEFAULT_DENSE_LR, "the lab's default (the preset publishes no recipe)"


def target_auc_for(spec: Any, cfg: TrainConfig, data: dict[str, Any]) -> tuple[float | None, str]:
    """The run's target AUC and why: `--target-auc` when given; else, on real data converted
    from Criteo (`data` is the training source's description), the preset's published target
    (its `[reference] target_auc`, MLPerf's 0.80275 for dcnv2). Synthetic data has its own
    best AUC (the teacher's), so a published target means nothing there."""
    if cfg.target_auc is not None:
        return cfg.target_auc, "given (--target-auc)"
    converted = (data.get("dataset") or {}).get("source") == "criteo-tsv"
    if converted and spec.reference_target_auc is not None:
        auc = spec.reference_target_auc
        return auc, f"published {auc:g} (the preset's [reference] target_auc), on data converted from Criteo"
    return None, "none"


def _positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UserError(f"{name} {value!r}: must be an integer >= 1")


def _choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise UserError(f"{name} {value!r}: allowed: {', '.join(allowed)}")

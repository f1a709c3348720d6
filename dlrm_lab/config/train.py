"""Run options: how a training run is driven, checked when constructed."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

from dlrm_lab.config.options import by_field, option
from dlrm_lab.config.prices import check_currency, check_price
from dlrm_lab.config.values import JsonObject
from dlrm_lab.errors import FieldError

PRECISIONS = ("fp32", "bf16")
# TorchRec's sharding types, by their ShardingType values.
SHARDING_TYPES = ("table_wise", "row_wise", "column_wise", "table_row_wise", "table_column_wise", "data_parallel")
# `--sharding`: `planner` is TorchRec's planner choosing per table; `auto` is resolved before planning
# (`train.sharding_trial`): the fastest plan measured on several CPU ranks, the planner on GPUs.
SHARDING_CHOICES = ("auto", "planner", *SHARDING_TYPES)
TABLE_PRECISIONS = ("fp32", "fp16")
DENSE_OPTIMIZERS = ("adagrad", "adam", "sgd")
EMBEDDING_OPTIMIZERS = ("rowwise_adagrad", "sgd")
# The tables' CPU backward and update: fbgemm's kernel, the same update batched on all cores, or the faster
# measured on the run's first batch (`train.table_update`)
TABLE_UPDATES = ("auto", "fbgemm", "batched")
# How the dense optimizer steps: torch's per-tensor loop, its foreach ops, its fused kernel, or the fastest of them
# timed before the run (`train.choices.choose_dense_update`)
DENSE_UPDATES = ("auto", "per_tensor", "foreach", "fused")
# The weights a bf16 step computes with: fp32 cast by autocast at every use, bf16 copies of fp32 masters refreshed
# once a step, or the faster on the run's own steps (`train.dense_weights`)
DENSE_WEIGHTS = ("auto", "fp32", "bf16")
# How a dot interaction computes its Gram matrix: torch's ops as autocast casts them, in fp32, the lab's kernel
# (`model.native`), or the fastest timed before the run and proved on its steps (`train.choices`)
DOT_INTERACTIONS = ("auto", "autocast", "fp32", "native")
# The CPU tables' memory pages: 4 KiB (as allocated), 2 MiB (`metrics.huge_pages`), or huge where this machine's
# probe measured a gather on them faster (`train.choices.choose_table_pages`)
TABLE_PAGES = ("auto", "base", "huge")
# The pooled embeddings' output distribution between ranks: TorchRec's, or the lab's leaner all-to-all for
# table-wise tables (`distributed.lean`), only when asked
DISTRIBUTIONS = ("torchrec", "lean")
# holdout: train on the training samples, evaluate on held-out ones; streaming (time-ordered families, MLPerf
# Training DLRMv4's): train on window T, evaluate on window T + 1 before training on it (data.streaming.Stream)
PROTOCOLS = ("holdout", "streaming")


@dataclass(frozen=True)
class TrainConfig:
    """How a training run is driven (the model comes from a `ModelSpec`).

    `batch_size` is per rank; the global batch is `batch_size * world_size`. The first
    `warmup_steps` steps are recorded but left out of throughput and step-time statistics
    (default None: detected from the step times, `train.records.detect_warmup`).
    """

    # Each field is also `dlrm-lab train`'s option and a sweep key (config.options): declared here once.
    steps: int = option(100, "Training steps.")
    batch_size: int = option(512, "Samples per step and rank.")
    device: str = option("cpu", "cpu or cuda.")
    # "auto": measured on this machine (dlrm_lab.metrics.precision); the library's default stays fp32
    precision: str = option(
        "fp32",
        "Dense compute: auto (measured: bf16 only where its GEMMs are faster), fp32 or bf16.",
        cli_default="auto",
    )
    table_precision: str = option("fp32", "Stored table rows: fp32 or fp16.")
    embedding_optimizer: str = option("rowwise_adagrad", "Fused table optimizer: rowwise_adagrad or sgd.")
    table_update: str = option(
        "fbgemm",
        "The tables' CPU backward and update: auto (both timed on the first batch, then on the run's own steps "
        "with every rank running them where the run is long enough; the faster kept), fbgemm "
        "(TorchRec's fused kernel) or batched (the same exact update as batched torch ops on all cores).",
        cli_default="auto",
    )
    dense_update: str = option(
        "per_tensor",
        "How the dense optimizer steps: auto (each way timed on the run's dense parameters before it starts; the "
        "fastest kept), per_tensor (torch's loop of small ops per tensor), foreach (the same ops over every tensor "
        "at once) or fused (torch's one fused kernel).",
        cli_default="auto",
    )
    dense_weights: str = option(
        "fp32",
        "The weights a bf16 step computes with: auto (both ways tried on the run's own steps, the faster kept), fp32 "
        "(autocast casts each weight at every use, every step) or bf16 (bf16 copies of the fp32 master weights the "
        "optimizer keeps, refreshed once a step; only the dense input, the embeddings and the logits cast).",
        cli_default="auto",
    )
    dot_interaction: str = option(
        "auto",
        "How a dot interaction computes its Gram matrix: auto (each way timed before the run at its batch, the "
        "fastest proved on its own steps), autocast (torch's ops, in bf16 where the run is), fp32 (torch's ops in "
        "fp32) or native (the lab's C++ kernel, CPU only; built on first use).",
    )
    table_pages: str = option(
        "base",
        "The CPU tables' memory pages: auto (2 MiB pages where this machine's embedding gather measured faster on "
        "them), base (4 KiB, as allocated) or huge (2 MiB, transparent huge pages collapsed in place).",
        cli_default="auto",
    )
    distribution: str = option(
        "torchrec",
        "The pooled embeddings' distribution between ranks: torchrec (TorchRec's, as deployed) or lean (the same "
        "all-to-all straight from the lookup's output, one copy each way; table-wise tables; never the default).",
    )
    # None: 0.05 / the tables' mean pooling factor (`train.setup.embedding_lr_for`)
    embedding_lr: float | None = option(
        None, "Table learning rate (default: 0.05 / the mean pooling factor; the manifest says which)."
    )
    dense_optimizer: str = option("adagrad", "MLP optimizer: adagrad, adam or sgd.")
    dense_lr: float | None = option(  # None: the preset's published rate for this batch (`dense_lr_for`)
        None,
        "MLP learning rate (default: the preset's published rate scaled by sqrt(batch / its batch), else 0.005; "
        "the manifest says which).",
    )
    # None: the preset's published recipe (its [reference]: DLRMv4's Adam betas, warm-up and clipping), else none
    adam_beta1: float | None = option(None, "Adam's beta1 (default: the preset's published recipe, else torch's 0.9).")
    adam_beta2: float | None = option(
        None, "Adam's beta2 (default: the preset's published recipe, else torch's 0.999)."
    )
    lr_warmup_steps: int | None = option(
        None,
        "Steps over which the MLP learning rate rises linearly from 0 (default: the preset's published "
        "recipe, else none; 0: none).",
    )
    grad_clip_norm: float | None = option(
        None, "Clip the MLP gradients' total norm to this (default: the preset's published recipe, else none)."
    )
    eval_every: int = option(0, "Steps between held-out AUC evaluations (0: at the end only).")
    eval_batches: int = option(8, "Held-out batches per evaluation.")
    protocol: str = option(
        "holdout",
        "holdout (train on the training window, evaluate on the later one) or streaming (HSTU presets, MLPerf "
        "DLRMv4's: walk the windows in time order, training on window T and evaluating on T+1 before training on "
        "it; the run ends with the stream or at --steps).",
    )
    # MLPerf DLRMv4 evaluates every 0.1% of its training stream (EVAL_EVERY_DATA_PCT=0.001)
    eval_every_share: float = option(
        0.001,
        "--protocol streaming: evaluate every this share of the stream's steps (at least 1 step); "
        "--eval-every N sets steps instead.",
    )
    warmup_steps: int | None = option(None, "Steps left out of throughput (default: 10%, at most 20).")
    seed: int = option(0, "Seed of the data and the initial weights.")
    data: str = option("synthetic", "'synthetic' or a Parquet dataset directory.")
    data_spec: str | None = option(  # synthetic only
        None, "Synthetic data spec (data_gen/ name or .toml); default: the preset's."
    )
    data_overrides: tuple[str, ...] = option(  # synthetic only: key=value on the data spec
        (),
        "Override a data spec field (repeatable), e.g. click_rate=0.1.",
        flags=("--set",),
        type=Optional[list[str]],
        cli_default=None,
    )
    # a thread only where the rank has a core its compute threads do not use (`train.prefetch_choice.choose_prefetch`)
    prefetch: str | int = option(
        "auto",
        "Batches prepared ahead on a background thread (0: inline), or auto: a thread of depth 2 where the rank has "
        "a core its compute threads leave free (or computes on a GPU), else inline.",
        type=str,
    )
    # processes only where the step runs on a GPU: on a CPU the host's cores run the step (`choose_prefetch`)
    data_workers: str | int = option(
        "auto",
        "Processes that make synthetic batches ahead (0: none, the prefetch thread alone), or auto: on a GPU every "
        "host core but two (at most 8), on a CPU none.",
        type=str,
    )
    sharding: str = option(
        "auto",
        "auto (several CPU ranks: the fastest of the planner's plan and each type, timed for a few steps and cached; "
        "GPUs: the planner), planner (TorchRec's planner), or one type for all tables: table_wise, row_wise, "
        "column_wise, table_row_wise, table_column_wise, data_parallel.",
    )
    shard: tuple[str, ...] = option(
        (), "Per-table sharding type, e.g. t_cat_3=row_wise (repeatable).", type=Optional[list[str]], cli_default=None
    )
    # a bound on every collective: a dead rank fails the others
    timeout_s: float = option(300.0, "Seconds a collective may wait for the other ranks.", flags=("--timeout",))
    pin_cores: bool = option(False, "Pin each rank and its data thread to its own cores.")
    # TorchRec's TrainPipelineSparseDist: the next batch's input dist overlaps this step
    pipeline: bool = option(False, "TorchRec's sparse-dist pipeline: overlap the next batch's input distribution.")
    # the HSTU ranker's attention (model.hstu.choose_attention)
    attention: str = option("auto", "HSTU presets: padded, jagged, or auto (both timed on the run's requests).")
    # CPU ranks: gloo, MPI (distributed.mpi), or the faster at this machine's probed speeds for the step's bytes
    collectives: str = option(
        "auto", "CPU ranks: gloo, mpi (ranks started by mpiexec), or auto (faster at the probed speeds)."
    )
    checkpoint_dir: str | None = option(None, "Directory of sharded checkpoints.")  # torch.distributed.checkpoint
    checkpoint_every: int = option(0, "Steps between checkpoints (0: at the end only).")
    resume: bool = option(False, "Continue from the newest checkpoint in --checkpoint-dir.")
    # MLPerf-style time to quality
    target_auc: float | None = option(None, "Stop when held-out AUC reaches this; records time to target.")
    profile_steps: int = option(  # train.profile
        0, "torch.profiler over this many steps after warm-up: per-operator profile.parquet."
    )
    # None: the price stored with the machine's profile, if any
    price_per_hour: float | None = option(
        None,
        "The machine's price per hour for the cost columns (default: the price stored with `dlrm-lab machine "
        "price`, if any).",
    )
    currency: str | None = option(None, "Currency of --price-per-hour (default: USD).")

    def __post_init__(self) -> None:
        if self.price_per_hour is not None:
            by_field("price_per_hour", check_price, self.price_per_hour)
        if self.currency is not None:
            by_field("currency", check_currency, self.currency)
        _positive("steps", self.steps)
        _positive("batch_size", self.batch_size)
        _choice("device", self.device, ("cpu", "cuda"))
        _choice("precision", self.precision, ("auto", *PRECISIONS))
        _choice("table_precision", self.table_precision, TABLE_PRECISIONS)
        _choice("embedding_optimizer", self.embedding_optimizer, EMBEDDING_OPTIMIZERS)
        _choice("table_update", self.table_update, TABLE_UPDATES)
        _choice("dense_update", self.dense_update, DENSE_UPDATES)
        _choice("dense_weights", self.dense_weights, DENSE_WEIGHTS)
        _choice("dot_interaction", self.dot_interaction, DOT_INTERACTIONS)
        _choice("table_pages", self.table_pages, TABLE_PAGES)
        _choice("distribution", self.distribution, DISTRIBUTIONS)
        _choice("dense_optimizer", self.dense_optimizer, DENSE_OPTIMIZERS)
        for name, lr in (("embedding_lr", self.embedding_lr), ("dense_lr", self.dense_lr)):
            if lr is None:  # the rule's rate (`dense_lr_for`, `train.setup.embedding_lr_for`)
                continue
            if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0):
                raise FieldError(name, f"{lr!r}: must be a number > 0")
        for name in ("adam_beta1", "adam_beta2"):
            beta = getattr(self, name)
            if beta is not None and not (isinstance(beta, (int, float)) and 0 <= beta < 1):
                raise FieldError(name, f"{beta!r}: must be in [0, 1)")
        if self.lr_warmup_steps is not None and (isinstance(self.lr_warmup_steps, bool) or self.lr_warmup_steps < 0):
            raise FieldError("lr_warmup_steps", f"{self.lr_warmup_steps!r}: must be an integer >= 0")
        if self.grad_clip_norm is not None and not (
            isinstance(self.grad_clip_norm, (int, float))
            and math.isfinite(self.grad_clip_norm)
            and self.grad_clip_norm > 0
        ):
            raise FieldError("grad_clip_norm", f"{self.grad_clip_norm!r}: must be a number > 0")
        if self.eval_every < 0:
            raise FieldError("eval_every", f"{self.eval_every}: must be >= 0 (0: evaluate at the end only)")
        _positive("eval_batches", self.eval_batches)
        _choice("protocol", self.protocol, PROTOCOLS)
        share = self.eval_every_share
        if not (isinstance(share, (int, float)) and not isinstance(share, bool) and 0 < share <= 1):
            raise FieldError("eval_every_share", f"{share!r}: must be a share in (0, 1]")
        if self.data != "synthetic" and not Path(self.data).exists():
            raise FieldError("data", f"{self.data}: no such dataset directory or file (or use 'synthetic')")
        for field in ("prefetch", "data_workers"):  # auto, or a count
            value = getattr(self, field)
            if isinstance(value, str) and value.strip().isdigit():  # the command line's "2"
                object.__setattr__(self, field, value := int(value))
            if value != "auto" and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise FieldError(field, f"{value!r}: must be auto or an integer >= 0")
        if self.data_workers not in ("auto", 0) and self.prefetch == 0:
            raise FieldError(
                "data_workers", f"{self.data_workers}: workers make batches ahead; {{prefetch}} 0 makes them inline",
                "prefetch",
            )  # fmt: skip
        if not (isinstance(self.timeout_s, (int, float)) and math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise FieldError("timeout_s", f"{self.timeout_s!r}: must be a number of seconds > 0")
        if self.target_auc is not None and not (
            isinstance(self.target_auc, (int, float)) and 0.5 < self.target_auc < 1
        ):
            raise FieldError("target_auc", f"{self.target_auc!r}: must be in (0.5, 1)")
        _choice("sharding", self.sharding, SHARDING_CHOICES)
        _choice("attention", self.attention, ("auto", "padded", "jagged"))
        _choice("collectives", self.collectives, ("auto", "gloo", "mpi"))
        if self.checkpoint_every < 0:
            raise FieldError("checkpoint_every", f"{self.checkpoint_every}: must be >= 0 (0: at the end only)")
        if (self.resume or self.checkpoint_every) and not self.checkpoint_dir:
            raise FieldError(
                "resume", "and {checkpoint_every} need {checkpoint_dir}", "checkpoint_every", "checkpoint_dir"
            )
        if (
            isinstance(self.profile_steps, bool)
            or not isinstance(self.profile_steps, int)
            or not (0 <= self.profile_steps <= self.steps)
        ):
            raise FieldError("profile_steps", f"{self.profile_steps!r}: must be an integer in [0, steps={self.steps}]")
        if self.warmup_steps is not None and not 0 <= self.warmup_steps < self.steps:
            raise FieldError("warmup_steps", f"{self.warmup_steps}: must be in [0, steps={self.steps})")

    @property
    def resolved_eval_every(self) -> int:
        """Steps between evaluations; with a target AUC and none given, every 5% of the steps."""
        if self.eval_every or self.target_auc is None:
            return self.eval_every
        return max(1, self.steps // 20)

    def to_dict(self) -> JsonObject:
        return {
            **asdict(self),
            "eval_every": self.resolved_eval_every,
            "data_overrides": list(self.data_overrides),
            "shard": list(self.shard),
        }


DEFAULT_DENSE_LR = 0.005  # Adagrad, for presets without a published recipe
DEFAULT_EMBEDDING_LR = 0.05  # row-wise Adagrad, for one id per feature


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


@dataclass(frozen=True)
class DenseRecipe:
    """How the MLPs are stepped beyond their optimizer and rate: Adam's betas, a linear warm-up of the rate and
    a clip of the gradients' norm; each given, else the preset's published recipe, else none (`dense_recipe_for`)."""

    betas: tuple[float, float] | None = None  # Adam only
    lr_warmup_steps: int = 0
    grad_clip_norm: float | None = None
    rule: str = "none"

    def to_dict(self) -> JsonObject:
        return {
            "adam_betas": list(self.betas) if self.betas else None,
            "lr_warmup_steps": self.lr_warmup_steps,
            "grad_clip_norm": self.grad_clip_norm,
            "rule": self.rule,
        }

    def lr_scale(self, step: int) -> float:
        """The rate's share at `step` (0-based): linear from 1/warm-up to 1 over the warm-up, then 1."""
        return min(1.0, (step + 1) / self.lr_warmup_steps) if self.lr_warmup_steps else 1.0


def dense_recipe_for(spec: Any, cfg: TrainConfig) -> DenseRecipe:
    """The run's `DenseRecipe` and why: each setting given (`--adam-beta1/2`, `--lr-warmup-steps`,
    `--grad-clip-norm`), else the preset's published one (a ranker's [reference]: MLPerf DLRMv4's Adam betas
    0.95/0.999, 24,000 warm-up steps, clip 1.0), else none. The published betas apply only to the published
    optimizer (Adam)."""
    published = getattr(spec, "reference", None)
    given: list[str] = []
    taken: list[str] = []

    def pick(value: Any, key: str) -> Any:
        if value is not None:
            given.append(key)
            return value
        value = getattr(published, key, None)
        if value is not None:
            taken.append(key)
        return value

    betas = None
    if cfg.dense_optimizer == "adam":
        recipe_betas = pick(None, "adam_betas") if cfg.adam_beta1 is None and cfg.adam_beta2 is None else None
        if cfg.adam_beta1 is not None or cfg.adam_beta2 is not None:
            given.append("adam_betas")
        default = recipe_betas or (0.9, 0.999)  # torch's
        b1 = cfg.adam_beta1 if cfg.adam_beta1 is not None else default[0]
        b2 = cfg.adam_beta2 if cfg.adam_beta2 is not None else default[1]
        betas = (float(b1), float(b2))
    warmup = pick(cfg.lr_warmup_steps, "lr_warmup_steps") or 0
    clip = pick(cfg.grad_clip_norm, "grad_clip_norm")
    source = getattr(published, "source", "") or "the preset"
    rule = "; ".join(
        part
        for part in (
            f"given: {', '.join(given)}" if given else "",
            f"published ({source}): {', '.join(taken)}" if taken else "",
        )
        if part
    )
    return DenseRecipe(betas, int(warmup), clip, rule or "none (the optimizer's defaults)")


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


def _positive(field: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise FieldError(field, f"{value!r}: must be an integer >= 1")


def _choice(field: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise FieldError(field, f"{value!r}: allowed: {', '.join(allowed)}")

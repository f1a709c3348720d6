"""The training lab's tables: a step per row and rank (`steps`), evaluations, a run's summary, scaling runs and
their gaps, operator profiles, a sweep's points, and the telemetry tables. Declared after the serving tables, whose
columns (`point`, `model`, ...) some of them name."""

from __future__ import annotations

from dlrm_lab.metrics.columns import serving  # noqa: F401  # its columns are defined first; these tables name them
from dlrm_lab.metrics.columns.groups import (
    CANARY,
    ENERGY,
    ROOFLINE,
    ROOFLINE_PLACED,
    TELEMETRY,
    TRAINING_COST,
)
from dlrm_lab.metrics.columns.registry import (
    BOOL,
    F64,
    HIGHER,
    I32,
    I64,
    LOWER,
    PHASE_LABELS,
    PHASES,
    STR,
    LocalColumn,
    col,
    register_table,
)

# steps.parquet: one row per training step and rank (`train.records.step_row`)
register_table(
    "steps",
    col("step", I64),
    col("rank", I32),
    col("world_size", I32, "ranks", fmt="d"),
    col("batch_size", I32),
    col("global_samples", I64),
    col("warmup", BOOL),
    col("loss", F64),
    col("step_time_ms", F64),
    *[col(f"{p}_ms", F64) for p in PHASES],
    # the tables' backward and update, a part of `backward_ms` timed apart (`train.timing.instrument_table_update`)
    col("table_update_ms", F64),
    "samples_per_s",
    "time_unix_s",
)

# eval.parquet: one row per held-out evaluation
register_table("eval", "step", col("num_samples", I64), col("auc", F64), "loss", col("eval_time_ms", F64))

# summary.parquet of `train`: one row per run (`train.records.train_summary_row`)
register_table(
    "train summary",
    col("kind", STR),
    "status",
    "preset",
    col("interaction", STR),
    col("device", STR, "device", fmt="s"),
    "precision",
    "table_precision",
    col("table_update", STR, "table update", fmt="s"),  # the tables' CPU backward and update (train.table_update)
    "world_size",
    "batch_size",
    col("global_batch_size", I64, "global batch", "samples", ",d", short="batch"),
    col("steps", I64, "steps", fmt="d"),
    col("warmup_steps", I64),
    col("measured_steps", I64),
    "samples_per_s",
    col("samples_per_s_per_rank", F64, "throughput per rank", "samples/s", ",.0f", HIGHER),
    col("step_time_ms_mean", F64, "step time mean", "ms", ".2f", LOWER),
    col("step_time_ms_p50", F64, "step time p50", "ms", ".2f", LOWER),
    col("step_time_ms_p90", F64),
    col("step_time_ms_p99", F64, "step time p99", "ms", ".2f", LOWER),
    *[col(f"{p}_share", F64, f"{PHASE_LABELS[p]} share", "fraction", ".1%") for p in PHASES],
    col("loss_first", F64, "loss, first steps", fmt=".4f"),
    col("loss_last", F64, "loss, last steps", fmt=".4f", better=LOWER),
    col("eval_auc", F64, "held-out AUC", fmt=".4f", better=HIGHER, short="AUC"),
    col("eval_loss", F64),
    col("teacher_auc", F64, "teacher AUC (best reachable)", fmt=".4f"),
    col("target_auc", F64),
    col("target_reached", BOOL),
    col("steps_to_target", I64),
    col("time_to_target_s", F64, "time to target AUC", "s", ".1f", LOWER),
    col("valid_samples_per_s", F64, "valid throughput (0 if target missed)", "samples/s", ",.0f", HIGHER),
    col("num_parameters", I64),
    col("embedding_parameters", I64),
    col("dense_parameters", I64),
    col("wall_time_s", F64),
    *ROOFLINE,  # docs/metrics.md, "Roofline and energy"
    *ROOFLINE_PLACED,
    # each phase at its own bound, and their sum: the floor of a step whose phases run in sequence
    # (`metrics.roofline.phase_floors`, docs/metrics.md "Roofline and energy")
    *[col(f"{p}_floor_ms", F64) for p in PHASES],
    col("phase_floor_ms", F64, "phase-sum floor", "ms", ".2f"),
    col("phase_floor_fraction", F64, "fraction of the phase-sum floor", "fraction", ".3f", HIGHER),
    # the tables' backward and update (inside backward): its mean, its bound (rows and state read and written at
    # the gather bandwidth) and the fraction of it reached
    col("table_update_ms_mean", F64, "table update mean", "ms", ".2f", LOWER),
    col("table_update_floor_ms", F64),
    col("table_update_floor_fraction", F64, "table update, fraction of its bound", "fraction", ".3f", HIGHER),
    col("valid_flops_per_s", F64),
    *CANARY,
    *ENERGY,
    "energy_per_sample_j",
    "samples_per_s_per_w",
    col("valid_flops_per_s_per_w", F64),
    # what the run cost on its machines where their price is known (`metrics.cost`, docs/metrics.md)
    *TRAINING_COST,
)

# summary.parquet of `scale`: one row per rank count (`scaling`)
register_table(
    "scale summary",
    "kind",
    "mode",
    col("ranks", I32, "ranks", fmt="d"),
    col("threads_per_rank", I32),
    col("batch_size_per_rank", I32, "batch per rank", "samples", "d", short="batch/rank"),
    "global_batch_size",
    col("repeats", I32),
    col("repeats_ok", I32, "repeats ok", fmt="d"),
    "samples_per_s",  # median over the repeats that ended ok
    col("samples_per_s_ci_low", F64),
    col("samples_per_s_ci_high", F64),
    "samples_per_s_per_rank",
    "step_time_ms_p50",
    col("speedup", F64, "speedup", "x", ".2f", HIGHER),
    col("efficiency", F64, "efficiency", "fraction", ".3f", HIGHER),
    # the efficiency of each repeat from its adjacent pair (this count's run and one rank's of the same repeat, run
    # one after the other): how many, how many left out (their speed canaries over 20% apart), their spread
    col("efficiency_pairs", I64),
    col("efficiency_pairs_left_out", I64),
    col("efficiency_spread", F64, "efficiency spread over pairs", "fraction", ".2f", LOWER),
    *[f"{p}_share" for p in PHASES],
    # against this machine's N-process compute ceiling and the scaling model (scaling_model)
    # probed: N pinned processes' GEMM rate / N x one alone
    col(
        "ceiling_efficiency",
        F64,
        "machine ceiling (N pinned processes' GEMM / N x one)",
        "fraction",
        ".3f",
        short="ceil",
    ),
    col("efficiency_vs_ceiling", F64, "efficiency / ceiling", "fraction", ".3f", HIGHER, "eff/ceiling"),
    # the efficiency the machine allows (scaling_model.roof): compute at the ceiling, bytes at the raw
    # collectives' probed speed; and through TorchRec's probed distribution; the measured one over the first
    col(
        "roof_efficiency",
        F64,
        "efficiency the machine allows (compute at the ceiling, bytes at the raw collectives' probed speed)",
        "fraction",
        ".3f",
        short="roof",
    ),
    col(
        "library_roof_efficiency",
        F64,
        "efficiency allowed through TorchRec's probed distribution",
        "fraction",
        ".3f",
        short="TorchRec roof",
    ),
    col("efficiency_vs_roof", F64, "efficiency / the machine's roof", "fraction", ".3f", HIGHER, "eff/roof"),
    # mean per-rank step over the measured steps (first ok repeat)
    col("rank_step_ms", F64, "per-rank step (mean)", "ms", ".1f", LOWER, "rank step ms"),
    # per rank, from the one-rank phases (scaling_model.predict)
    col("predicted_step_ms", F64, "predicted per-rank step", "ms", ".1f", short="predicted ms"),
    # measured / predicted - 1 (mean per-rank step times)
    col("prediction_error", F64, "measured / predicted - 1", "fraction", "+.1%", short="pred. error"),
    # the same with MPI's probed collectives (PyPI torch has no MPI)
    col(
        "predicted_step_ms_mpi", F64, "predicted per-rank step with MPI's collectives", "ms", ".1f", short="with MPI ms"
    ),
    col("prediction_note", STR),
    # per-rank step beyond one rank's at the same per-rank work
    col("gap_ms", F64, "per-rank step beyond one rank's", "ms", ".1f", LOWER, "gap ms"),
    col("gap_named_ms", F64),  # the part named by the breakdown (gap.parquet): all of it
    col("point_run_id", STR, "point run", fmt="s"),  # the first repeat that ended ok
    col("point_status", STR, "point status", fmt="s"),  # ok when any repeat did
)

# gap.parquet of `scale`: the per-rank step beyond one rank's, item by item (`scaling.gap_breakdown`)
register_table("scale gap", "ranks", col("item", STR), col("ms", F64), col("note", STR))

# profile.parquet of `train --profile-steps`: the top operators per rank (`train.profile`)
register_table(
    "profile",
    "rank",
    col("op", STR),
    col("calls_per_step", F64),
    col("self_ms_per_step", F64),
    col("total_ms_per_step", F64),
    LocalColumn(col("steps", I32)),  # steps profiled (the summary's `steps`, steps run, is int64)
)

# points.parquet of a sweep: one row per point and repeat (`sweep`)
register_table(
    "sweep points",
    "point",
    "repeat",
    col("params_json", STR),
    "status",
    col("child_run_id", STR),
    col("child_dir", STR),
    col("seconds", F64),
    col("attempts", I32),
)

# telemetry.parquet: the sampler's readings (`metrics.energy`), led by the run's key: its rank or its point
register_table("telemetry", *TELEMETRY)
register_table("train telemetry", "rank", *TELEMETRY)
register_table("infer telemetry", "point", *TELEMETRY)

"""`dlrm-lab train`: one training run, recorded in a run directory."""

from __future__ import annotations

import sys
from typing import Annotated, Any, Optional

import typer
from rich.table import Table

from dlrm_lab.cli.format import console, say_interrupted
from dlrm_lab.cli.format import progress as progress_display
from dlrm_lab.cli.options import MaxRows, MetricsDir, Preset, TableScale
from dlrm_lab.cli.presets import size_line
from dlrm_lab.errors import raise_on_sigterm
from dlrm_lab.metrics import columns


def train_command(
    preset: Preset = "tiny",
    steps: Annotated[int, typer.Option(help="Training steps.")] = 100,
    batch_size: Annotated[int, typer.Option(help="Samples per step and rank.")] = 512,
    device: Annotated[str, typer.Option(help="cpu or cuda.")] = "cpu",
    precision: Annotated[
        str, typer.Option(help="Dense compute: auto (measured: bf16 only where its GEMMs are faster), fp32 or bf16.")
    ] = "auto",
    table_precision: Annotated[str, typer.Option(help="Stored table rows: fp32 or fp16.")] = "fp32",
    table_scale: TableScale = None,
    max_rows: MaxRows = None,
    embedding_optimizer: Annotated[
        str, typer.Option(help="Fused table optimizer: rowwise_adagrad or sgd.")
    ] = "rowwise_adagrad",
    embedding_lr: Annotated[
        Optional[float],
        typer.Option(help="Table learning rate (default: 0.05 / the mean pooling factor; the manifest says which)."),
    ] = None,
    dense_optimizer: Annotated[str, typer.Option(help="MLP optimizer: adagrad, adam or sgd.")] = "adagrad",
    dense_lr: Annotated[
        Optional[float],
        typer.Option(
            help="MLP learning rate (default: the preset's published rate scaled by sqrt(batch / its batch), "
            "else 0.005; the manifest says which)."
        ),
    ] = None,
    eval_every: Annotated[int, typer.Option(help="Steps between held-out AUC evaluations (0: at the end only).")] = 0,
    eval_batches: Annotated[int, typer.Option(help="Held-out batches per evaluation.")] = 8,
    warmup_steps: Annotated[
        Optional[int], typer.Option(help="Steps left out of throughput (default: 10%, at most 20).")
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed of the data and the initial weights.")] = 0,
    data: Annotated[str, typer.Option(help="'synthetic' or a Parquet dataset directory.")] = "synthetic",
    data_spec: Annotated[
        Optional[str], typer.Option(help="Synthetic data spec (data_gen/ name or .toml); default: the preset's.")
    ] = None,
    set_: Annotated[
        Optional[list[str]], typer.Option("--set", help="Override a data spec field (repeatable), e.g. click_rate=0.1.")
    ] = None,
    prefetch: Annotated[
        str,
        typer.Option(
            help="Batches prepared ahead on a background thread (0: inline), or auto: a thread of depth 2 where "
            "the rank has a core its compute threads leave free (or computes on a GPU), else inline."
        ),
    ] = "auto",
    sharding: Annotated[
        str,
        typer.Option(
            help="auto (several CPU ranks: the fastest of the planner's plan and each type, timed for a few steps "
            "and cached; GPUs: the planner), planner (TorchRec's planner), or one type for all tables: table_wise, "
            "row_wise, column_wise, table_row_wise, table_column_wise, data_parallel."
        ),
    ] = "auto",
    shard: Annotated[
        Optional[list[str]],
        typer.Option("--shard", help="Per-table sharding type, e.g. t_cat_3=row_wise (repeatable)."),
    ] = None,
    timeout: Annotated[float, typer.Option(help="Seconds a collective may wait for the other ranks.")] = 300.0,
    pin_cores: Annotated[bool, typer.Option(help="Pin each rank and its data thread to its own cores.")] = False,
    pipeline: Annotated[
        bool, typer.Option(help="TorchRec's sparse-dist pipeline: overlap the next batch's input distribution.")
    ] = False,
    attention: Annotated[
        str, typer.Option(help="HSTU presets: padded, jagged, or auto (both timed on the run's requests).")
    ] = "auto",
    collectives: Annotated[
        str,
        typer.Option(help="CPU ranks: gloo, mpi (ranks started by mpiexec), or auto (faster at the probed speeds)."),
    ] = "auto",
    checkpoint_dir: Annotated[Optional[str], typer.Option(help="Directory of sharded checkpoints.")] = None,
    checkpoint_every: Annotated[int, typer.Option(help="Steps between checkpoints (0: at the end only).")] = 0,
    resume: Annotated[bool, typer.Option(help="Continue from the newest checkpoint in --checkpoint-dir.")] = False,
    target_auc: Annotated[
        Optional[float], typer.Option(help="Stop when held-out AUC reaches this; records time to target.")
    ] = None,
    profile_steps: Annotated[
        int, typer.Option(help="torch.profiler over this many steps after warm-up: per-operator profile.parquet.")
    ] = 0,
    price_per_hour: Annotated[
        Optional[float],
        typer.Option(
            help="The machine's price per hour for the cost columns (default: the price stored with "
            "`dlrm-lab machine price`, if any)."
        ),
    ] = None,  # fmt: skip
    currency: Annotated[Optional[str], typer.Option(help="Currency of --price-per-hour (default: USD).")] = None,
    metrics_dir: MetricsDir = "runs",
    progress: Annotated[bool, typer.Option(help="Show a progress bar.")] = True,
) -> None:
    """Train a DLRM preset on synthetic clicks or a Parquet dataset, and record the run."""
    options = dict(locals())  # the parameters alone, before any other name is bound
    from dlrm_lab.commands import train_setup

    spec, cfg = train_setup(options)  # the one construction (sweeps check their points with it too)
    from dlrm_lab.train import preflight, train  # torch loads once the options are valid

    run = preflight(spec, cfg)  # a missing GPU, a bad --shard or data option: one line, before the size line
    raise_on_sigterm()
    err = console(stderr=True)
    err.print(size_line(spec))

    # a live bar on a terminal, else a plain line every few seconds (`| tee log`)
    bar = progress_display("{task.fields[rate]}", "loss {task.fields[loss]}", unit="steps", to=err, enabled=progress)
    task = bar.add_task("train", total=steps, rate="", loss="")
    shown = False

    def on_step(row: dict[str, Any]) -> None:
        nonlocal shown
        if not shown:  # only once the model is built and the first step ran (also after --resume)
            shown = True
            bar.start()
        bar.update(
            task, completed=row["step"] + 1, rate=f"{row['samples_per_s']:,.0f} samples/s", loss=f"{row['loss']:.4f}"
        )

    try:
        with say_interrupted(err):
            result = train(
                run, metrics_dir=metrics_dir, argv=["dlrm-lab", *sys.argv[1:]], on_step=on_step,
                log=lambda msg: err.print(msg, highlight=False, soft_wrap=True),
            )  # fmt: skip
    finally:
        bar.stop()  # nothing when never started
    if result.reports:  # under a launcher every rank runs this command: one report
        print_plan(result.plan)
        print_summary(result.summary, str(result.run_dir))


def print_plan(plan: dict[str, Any]) -> None:
    from dlrm_lab.cli.format import human_bytes

    table = Table(title="sharding plan")
    for col in ("table", "sharding", "kernel", "ranks", "bytes"):
        table.add_column(col, justify="right" if col == "bytes" else "left")
    for t in plan["tables"]:
        ranks = ",".join(map(str, sorted(set(t["ranks"]))))
        table.add_row(t["table"], t["sharding_type"], t["compute_kernel"], ranks, human_bytes(t["bytes"]))
    console().print(table)
    per_rank = ", ".join(f"rank {r}: {human_bytes(b)}" for r, b in enumerate(plan["bytes_per_rank"]))
    console().print(f"table bytes per rank: {per_rank}")


def print_summary(summary: dict[str, Any], run_dir: str) -> None:
    table = Table(title=f"train {summary['preset']}: {summary['status']}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key in columns.TRAIN_PRINTED:
        if key in summary:
            table.add_row(columns.column(key).heading, columns.fmt(key, summary[key]))
    console().print(table)
    console().print(f"run directory: {run_dir}")

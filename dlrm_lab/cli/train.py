"""`dlrm-lab train`: one training run, recorded in a run directory."""

from __future__ import annotations

import sys
from typing import Annotated, Any, cast

import typer
from rich.table import Table

from dlrm_lab.cli.format import console, say_interrupted
from dlrm_lab.cli.format import progress as progress_display
from dlrm_lab.cli.options import METRICS_DIR, CliOnly, command
from dlrm_lab.cli.presets import size_line
from dlrm_lab.commands import TRAIN
from dlrm_lab.config.values import JsonObject, OptionValues
from dlrm_lab.errors import raise_on_sigterm
from dlrm_lab.metrics import columns
from dlrm_lab.metrics.columns import StepRow, TrainSummaryRow


@command(*TRAIN, METRICS_DIR, CliOnly("progress", Annotated[bool, typer.Option(help="Show a progress bar.")], True))
def train_command(options: OptionValues) -> None:
    """Train a DLRM preset on synthetic clicks or a Parquet dataset, and record the run."""
    from dlrm_lab.commands import train_setup

    spec, cfg = train_setup(options)  # the one construction (sweeps check their points with it too)
    from dlrm_lab.train import preflight, train  # torch loads once the options are valid

    run = preflight(spec, cfg)  # a missing GPU, a bad --shard or data option: one line, before the size line
    raise_on_sigterm()
    err = console(stderr=True)
    err.print(size_line(spec))

    # a live bar on a terminal, else a plain line every few seconds (`| tee log`)
    bar = progress_display(
        "{task.fields[rate]}",
        "loss {task.fields[loss]}",
        unit="steps",
        to=err,
        enabled=cast(bool, options["progress"]),  # --progress: a flag
    )
    task = bar.add_task("train", total=cfg.steps, rate="", loss="")
    shown = False

    def on_step(row: StepRow) -> None:
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
                run,
                metrics_dir=cast("str | None", options["metrics_dir"]),  # --metrics-dir: a directory
                argv=["dlrm-lab", *sys.argv[1:]],
                on_step=on_step,
                log=lambda msg: err.print(msg, highlight=False, soft_wrap=True),
            )
    finally:
        bar.stop()  # nothing when never started
    if result.reports:  # under a launcher every rank runs this command: one report
        print_plan(result.plan)
        print_summary(result.summary, str(result.run_dir))


def print_plan(plan: JsonObject) -> None:
    from dlrm_lab.config.words import human_bytes

    table = Table(title="sharding plan")
    for col in ("table", "sharding", "kernel", "ranks", "bytes"):
        table.add_column(col, justify="right" if col == "bytes" else "left")
    # `distributed.plan.describe_plan`'s record: a row per table, the bytes on each rank
    for t in cast("list[dict[str, Any]]", plan["tables"]):
        ranks = ",".join(map(str, sorted(set(t["ranks"]))))
        table.add_row(t["table"], t["sharding_type"], t["compute_kernel"], ranks, human_bytes(t["bytes"]))
    console().print(table)
    bytes_per_rank = cast("list[int]", plan["bytes_per_rank"])
    per_rank = ", ".join(f"rank {r}: {human_bytes(b)}" for r, b in enumerate(bytes_per_rank))
    console().print(f"table bytes per rank: {per_rank}")


def print_summary(summary: TrainSummaryRow, run_dir: str) -> None:
    table = Table(title=f"train {summary['preset']}: {summary['status']}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key in columns.TRAIN_PRINTED:
        if key in summary:
            table.add_row(columns.column(key).heading, columns.fmt(key, summary[key]))
    console().print(table)
    console().print(f"run directory: {run_dir}")

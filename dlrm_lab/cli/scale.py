"""`dlrm-lab scale`: weak or strong scaling of training over rank counts."""

from __future__ import annotations

import sys
from typing import Annotated, Optional

import typer
from rich.table import Table

from dlrm_lab.cli.format import console, say_interrupted
from dlrm_lab.cli.options import MetricsDir
from dlrm_lab.metrics import columns


def scale_command(
    ctx: typer.Context,
    ranks: Annotated[str, typer.Option(help="Rank counts, e.g. 1,2,4.")] = "1,2",
    mode: Annotated[str, typer.Option(help="weak (per-rank batch fixed) or strong (global batch fixed).")] = "weak",
    batch_size: Annotated[int, typer.Option(help="Per-rank batch (weak) or global batch (strong).")] = 1024,
    launcher: Annotated[str, typer.Option(help="torchrun or mpi.")] = "torchrun",
    threads_per_rank: Annotated[
        Optional[int], typer.Option(help="Intra-op threads per rank (default: cores / largest rank count).")
    ] = None,
    repeats: Annotated[int, typer.Option(help="Runs per rank count (medians are reported).")] = 1,
    metrics_dir: MetricsDir = "runs",
) -> None:
    """Train at each rank count and report speedup and efficiency.

    Options after `--` go to `dlrm-lab train`, e.g.
    dlrm-lab scale --ranks 1,2 --mode weak -- --preset kaggle --max-rows 100000 --steps 50

    A scaling run is a sweep over rank counts: the same command again resumes it.
    """
    from dlrm_lab.train.scaling import parse_ranks, scaling_spec, scaling_sweep

    spec = scaling_spec(parse_ranks(ranks), mode, batch_size, list(ctx.args), metrics_dir, launcher, threads_per_rank,
                        repeats)  # fmt: skip
    err = console(stderr=True)
    with say_interrupted(err):
        sweep_dir, points = scaling_sweep(spec, argv=["dlrm-lab", *sys.argv[1:]])
    table = Table(title=f"{mode} scaling ({points[0]['threads_per_rank']} thread(s) per rank)")
    for name in columns.SCALE_PRINTED:
        table.add_column(columns.column(name).narrow, justify="right")
    for p in points:
        table.add_row(*(columns.fmt(name, p.get(name)) for name in columns.SCALE_PRINTED))
    console().print(table)
    console().print(f"sweep directory: {sweep_dir}")
    if any(p["point_status"] != "ok" for p in points):
        raise typer.Exit(1)

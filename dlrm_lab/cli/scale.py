"""`dlrm-lab scale`: weak or strong scaling of training over rank counts."""

from __future__ import annotations

import sys
from typing import Annotated, Optional

import typer
from rich.table import Table

from dlrm_lab.cli.format import console
from dlrm_lab.cli.options import MetricsDir


def scale_command(
    ctx: typer.Context,
    ranks: Annotated[str, typer.Option(help="Rank counts, e.g. 1,2,4.")] = "1,2",
    mode: Annotated[str, typer.Option(help="weak (per-rank batch fixed) or strong (global batch fixed).")] = "weak",
    batch_size: Annotated[int, typer.Option(help="Per-rank batch (weak) or global batch (strong).")] = 1024,
    launcher: Annotated[str, typer.Option(help="torchrun or mpi.")] = "torchrun",
    threads_per_rank: Annotated[
        Optional[int], typer.Option(help="Intra-op threads per rank (default: cores / largest rank count).")
    ] = None,
    metrics_dir: MetricsDir = "runs",
) -> None:
    """Train at each rank count and report speedup and efficiency.

    Options after `--` go to `dlrm-lab train`, e.g.
    dlrm-lab scale --ranks 1,2 --mode weak -- --preset kaggle --max-rows 100000 --steps 50
    """
    from dlrm_lab.train.scaling import parse_ranks, scaling_sweep

    sweep_dir, points = scaling_sweep(
        parse_ranks(ranks),
        mode,
        batch_size,
        list(ctx.args),
        metrics_dir,
        launcher,
        threads_per_rank,
        argv=["dlrm-lab", *sys.argv[1:]],
    )
    table = Table(title=f"{mode} scaling ({points[0]['threads_per_rank']} thread(s) per rank)")
    for col in ("ranks", "batch/rank", "global batch", "samples/s", "per rank", "speedup", "efficiency", "status"):
        table.add_column(col, justify="right")

    def fmt(v: object, spec: str) -> str:
        return "-" if v is None else format(v, spec)

    for p in points:
        table.add_row(
            str(p["ranks"]),
            str(p["batch_size_per_rank"]),
            str(p["global_batch_size"]),
            fmt(p["samples_per_s"], ",.0f"),
            fmt(p["samples_per_s_per_rank"], ",.0f"),
            fmt(p["speedup"], ".2f"),
            fmt(p["efficiency"], ".1%"),
            p["point_status"],
        )
    console().print(table)
    console().print(f"sweep directory: {sweep_dir}")
    if any(p["point_status"] != "ok" for p in points):
        raise typer.Exit(1)

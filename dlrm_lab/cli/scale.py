"""`dlrm-lab scale`: weak or strong scaling of training over rank counts."""

from __future__ import annotations

import sys
from typing import Annotated, Optional, cast

import typer
from rich.table import Table

from dlrm_lab.cli.format import console, say_interrupted
from dlrm_lab.cli.options import MetricsDir
from dlrm_lab.commands import train_words
from dlrm_lab.errors import UserError
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
    project: Annotated[
        Optional[str], typer.Option(help="Rank counts to project the one-rank run to on --fabric, e.g. 8,64,512,4096.")
    ] = None,
    fabric: Annotated[
        str, typer.Option(help="Named cluster for --project (docs/metrics.md, Scaling sweeps).")
    ] = "h100-nvlink-ndr",
    plan_up_to: Annotated[
        int, typer.Option(help="Ask TorchRec's planner for its sharding up to this many ranks (59 s at 512).")
    ] = 64,
    metrics_dir: MetricsDir = "runs",
) -> None:
    """Train at each rank count and report speedup and efficiency.

    Options after `--` go to `dlrm-lab train`, e.g.
    dlrm-lab scale --ranks 1,2 --mode weak -- --preset kaggle --max-rows 100000 --steps 50

    A scaling run is a sweep over rank counts: the same command again resumes it.
    """
    from dlrm_lab.scaling import parse_ranks, projection, scaling_spec, scaling_sweep
    from dlrm_lab.train.fabrics import FABRICS

    if fabric not in FABRICS:
        raise UserError(f"--fabric {fabric!r}: allowed: {', '.join(FABRICS)}")
    projected = parse_ranks(project, "project") if project else []
    if projected and 1 not in parse_ranks(ranks):
        raise UserError(f"--project {project}: projects the one-rank run; include 1 in --ranks (got {ranks})")
    if plan_up_to < 1:
        raise UserError(f"--plan-up-to {plan_up_to}: must be an integer >= 1")
    spec = scaling_spec(
        parse_ranks(ranks), mode, batch_size, train_words(ctx.args), metrics_dir, launcher, threads_per_rank, repeats
    )
    err = console(stderr=True)
    with say_interrupted(err):
        sweep_dir, points = scaling_sweep(spec, argv=["dlrm-lab", *sys.argv[1:]])
    table = Table(title=f"{mode} scaling ({points[0]['threads_per_rank']} thread(s) per rank)")
    for name in columns.SCALE_PRINTED:
        table.add_column(columns.column(name).narrow, justify="right")
    for p in points:
        table.add_row(*(columns.fmt(name, p.get(name)) for name in columns.SCALE_PRINTED))
    console().print(table)
    notes = sorted({cast(str, p["prediction_note"]) for p in points if p.get("prediction_note")})  # words
    for note in notes:
        console().print(f"prediction: {note}")
    _print_gaps(sweep_dir, points)
    if projected:
        rows, assumptions, plans = projection(sweep_dir, points, projected, FABRICS[fabric], mode, plan_up_to)
        _print_projection(FABRICS[fabric], rows, assumptions, plans)
    console().print(f"sweep directory: {sweep_dir}")
    if any(p["point_status"] != "ok" for p in points):
        raise typer.Exit(1)


def _print_gaps(sweep_dir, points) -> None:
    """Where each multi-rank point's per-rank step went, against one rank (gap.parquet), and the
    efficiency the machine and the library allow there."""
    import pyarrow.parquet as pq

    path = sweep_dir / "gap.parquet"
    if not path.is_file():
        return
    rows = pq.read_table(path).to_pylist()
    for n in sorted({r["ranks"] for r in rows}):
        mine = [r for r in rows if r["ranks"] == n]
        table = Table(title=f"{n} ranks: the per-rank step beyond one rank's, named (ms per step)")
        table.add_column("item")
        table.add_column("ms", justify="right")
        for r in mine:
            table.add_row(r["item"], f"{r['ms']:+.1f}")
        table.add_row("total", f"{sum(r['ms'] for r in mine):+.1f}")
        console().print(table)
        if mine[0]["note"]:
            console().print(f"  assumed: {mine[0]['note']}")
        for p in points:
            if p["ranks"] == n and p.get("roof_efficiency") and p.get("efficiency") is not None:
                console().print(
                    f"  efficiency {p['efficiency']:.3f}: {p['efficiency_vs_roof']:.2f} of the "
                    f"{p['roof_efficiency']:.3f} this machine allows (compute at its ceiling, the collectives at "
                    "their probed speed); "
                    f"{p['library_roof_efficiency']:.3f} through TorchRec's distribution at its probed speed"
                )


SHARDING_SHORT = {
    "table_row_wise": "TRW",
    "table_column_wise": "TCW",
    "column_wise": "CW",
    "row_wise": "RW",
    "table_wise": "TW",
    "data_parallel": "DP",
}


def _print_projection(fabric, rows, assumptions, plans) -> None:
    table = Table(title=f"projected on {fabric.name}: {fabric.description}")
    for name in (
        "ranks",
        "batch/rank",
        "compute ms",
        "input dist ms",
        "pooled a2a ms",
        "all-reduce ms",
        "step ms",
        "samples/s",
        "efficiency",
        "planner's sharding",
    ):
        table.add_column(name, justify="right")
    for r in rows:
        plan = plans.get(r["ranks"], "")
        for long, short in SHARDING_SHORT.items():
            plan = plan.replace(long, short)
        table.add_row(
            str(r["ranks"]),
            str(r["batch_size_per_rank"]),
            f"{r['compute_ms']:.2f}",
            f"{r['input_dist_ms']:.2f}",
            f"{r['pooled_all_to_all_ms']:.2f}" + (" *" if r["all_to_all_dominates"] else ""),
            f"{r['all_reduce_ms']:.2f}",
            f"{r['step_ms']:.2f}",
            f"{r['samples_per_s'] / 1e6:,.2f}M",
            f"{r['efficiency']:.3f}",
            plan,
        )
    console().print(table)
    console().print(
        "  * all-to-all (input distribution and pooled embeddings) takes longer than compute; planner's "
        "sharding: tables per type, " + ", ".join(f"{v} {k}" for k, v in SHARDING_SHORT.items())
    )
    for a in assumptions:
        console().print(f"  assumed: {a}")
    console().print(f"  figures: {fabric.source}")

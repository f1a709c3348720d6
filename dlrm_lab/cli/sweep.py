"""`dlrm-lab sweep GRID.toml`: a resumable grid of train or infer experiments with repeats."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer

from dlrm_lab.cli.format import console, say_interrupted
from dlrm_lab.cli.format import progress as progress_display
from dlrm_lab.cli.options import MetricsDir
from dlrm_lab.errors import raise_on_sigterm

if TYPE_CHECKING:
    from dlrm_lab.sweep.results import PointResult


def sweep_command(
    grid: Annotated[Path, typer.Argument(help="Grid file (TOML): command, [options], [grid], [zip], repeats.")],
    repeats: Annotated[Optional[int], typer.Option(help="Repeats per point (overrides the file's).")] = None,
    out: Annotated[
        Optional[Path],
        typer.Option(help="Sweep directory (default: the file's `out`, else METRICS_DIR/sweep-<file stem>)."),
    ] = None,
    metrics_dir: MetricsDir = "runs",
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print every point's command line and stop.")] = False,
    progress: Annotated[bool, typer.Option(help="Show a progress bar.")] = True,
) -> None:
    """Run every point x repeat of a grid, each as its own run; resume where a previous
    invocation stopped (finished point-repeats are skipped, unfinished ones repeated)."""
    from dlrm_lab.metrics.run import register_recovery
    from dlrm_lab.sweep.grid import load_spec, point_args
    from dlrm_lab.sweep.run import run_sweep

    register_recovery("train", _recovered_training_summary, fallback=True)  # a dead training point's summary

    raise_on_sigterm()
    spec = load_spec(grid, repeats=repeats, out=out)
    out_console = console()
    if dry_run:
        for k, params in enumerate(spec.points):
            out_console.print(
                f"p{k:04d} x{spec.repeats}: dlrm-lab {' '.join(point_args(spec, params))}", soft_wrap=True
            )
        return
    total = len(spec.points) * spec.repeats
    # a live bar on a terminal, else a plain line every few seconds (`| tee log`)
    bar = progress_display("{task.fields[per_point]}", unit="point-repeats", rate=False, enabled=progress)
    task = bar.add_task("sweep", total=total, per_point="")
    times: list[float] = []

    def started(pr: PointResult, i: int, todo: int) -> None:
        if i == 0:
            bar.update(task, completed=total - todo)  # finished by an earlier invocation
        label = ", ".join(f"{k}={v}" for k, v in pr.params.items())
        bar.update(task, description=f"p{pr.point:04d}-r{pr.repeat} {label}"[:60])
        started.t0 = time.monotonic()  # type: ignore[attr-defined]

    def done(pr: PointResult) -> None:
        times.append(time.monotonic() - started.t0)  # type: ignore[attr-defined]
        mean = sum(times) / len(times)
        bar.update(task, advance=1, per_point=f"{mean:.1f} s/point")
        if pr.status != "ok":
            bar.console.print(f"p{pr.point:04d}-r{pr.repeat}: {pr.status} (see its point.log)")

    with say_interrupted(), bar:
        result = run_sweep(
            spec, metrics_dir=metrics_dir, argv=["dlrm-lab", *sys.argv[1:]], on_start=started, on_done=done
        )
    skipped = sum(p.skipped for p in result.points)
    out_console.print(
        f"sweep {result.dir}: {total - len(result.failed)}/{total} point-repeats ok"
        + (f" ({skipped} from an earlier invocation)" if skipped else "")
        + "; points.parquet, summary.parquet (median, 95% CI, CV per metric)",
        soft_wrap=True,
    )
    if result.failed:
        raise typer.Exit(1)


def _recovered_training_summary(run_dir: Any, manifest: Any) -> Any:
    """Training's recovery, its module (torch) imported only when a dead training point is met."""
    from dlrm_lab.train.records import recovered_summary

    return recovered_summary(run_dir, manifest)

"""`dlrm-lab report`: plots and one HTML page over run directories."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from dlrm_lab.errors import UserError


def report_command(
    dirs: Annotated[
        list[Path],
        typer.Argument(help="Run directories, or directories holding runs at any depth.", show_default=False),
    ],
    out: Annotated[Path, typer.Option("--out", help="Directory that receives index.html and the PNG plots.")],
    last: Annotated[
        Optional[int], typer.Option(help="Only the N most recent runs directly under each DIR (with what they hold).")
    ] = None,
) -> None:
    """Plot every run found under DIRS and write OUT/index.html (tables, plots, manifests)."""
    from dlrm_lab.metrics.run import find_runs, undecodable
    from dlrm_lab.report.html import write_report

    for given in (*dirs, out):
        if (name := undecodable(given.absolute())) is not None:
            raise UserError(f"{name}: not UTF-8; a report names its runs' paths in UTF-8: rename it")
    paths: list[str | Path] = list(dirs)
    if last is not None:
        if last < 1:
            raise UserError(f"--last {last}: must be >= 1")
        paths = [run for d in dirs for run in find_runs(d)[-last:]]  # find_runs sorts oldest first
        if not paths:
            raise UserError(f"{', '.join(map(str, dirs))}: no run directory found")
    result = write_report(paths, out)
    typer.echo(str(result.index))

"""`dlrm-lab runs`: look at run directories."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import pyarrow.parquet as pq
import typer
from rich.table import Table

from dlrm_lab.cli.format import console
from dlrm_lab.metrics.run import find_runs, recover_run

app = typer.Typer(help="Run directories written by train, scale and infer.", no_args_is_help=True)


def _fmt(value: object, spec: str) -> str:
    return "-" if value is None else format(value, spec)


@app.command("list")
def list_runs(
    directory: Annotated[Path, typer.Argument(help="A metrics directory (or one run).")] = Path("runs"),
) -> None:
    """One line per run: id, kind, status, preset, throughput, quality, duration."""
    table = Table(title=str(directory))
    for col in ("run_id", "kind", "status", "preset", "ranks", "batch", "steps", "samples/s", "AUC", "secs"):
        left = col in ("run_id", "kind", "status", "preset")
        table.add_column(col, justify="left" if left else "right", no_wrap=col == "run_id")
    for run_dir in find_runs(directory):
        manifest = recover_run(run_dir)
        summary = {}
        if (run_dir / "summary.parquet").is_file():
            rows = pq.read_table(run_dir / "summary.parquet").to_pylist()
            summary = rows[0] if rows else {}
        table.add_row(
            manifest["run_id"],
            manifest.get("kind", "?"),
            manifest.get("status", "?"),
            summary.get("preset") or manifest.get("config", {}).get("model", {}).get("name", "?"),
            _fmt(summary.get("world_size"), "d"),
            _fmt(summary.get("global_batch_size"), "d"),
            _fmt(summary.get("steps"), "d"),
            _fmt(summary.get("samples_per_s"), ",.0f"),
            _fmt(summary.get("eval_auc"), ".4f"),
            _fmt(manifest.get("duration_s"), ".1f"),
        )
    console().print(table)

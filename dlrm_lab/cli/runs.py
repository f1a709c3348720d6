"""`dlrm-lab runs`: look at run directories (`list`, which only reads) and make crashed
ones readable (`recover`, which writes)."""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, cast

import pyarrow.parquet as pq
import typer
from rich.table import Table

from dlrm_lab.cli.format import console
from dlrm_lab.config.values import JsonObject, section
from dlrm_lab.metrics import columns
from dlrm_lab.metrics.run import FoundRun, discover_runs, one_line, pid_alive, recover_run_and_summary
from dlrm_lab.metrics.tables import PARTS_DIR

app = typer.Typer(help="Run directories written by train, scale and infer.", no_args_is_help=True)


def _liveness(manifest: JsonObject) -> str:
    """For a manifest saying `running`: `alive`, `dead` (its process is gone: it crashed or
    was killed) or `elsewhere` (started on another host, whose pids cannot be checked here)."""
    host = section(manifest, "hardware").get("hostname")
    if host and host != socket.gethostname():
        return "elsewhere"
    return "alive" if pid_alive(cast("int | None", manifest.get("pid"))) else "dead"  # its process id, as recorded


def _part_files(run_dir: Path) -> dict[str, list[Path]]:
    """Flushed part files a run has not merged yet, per table (what recovery would merge)."""
    parts_root = run_dir / PARTS_DIR
    if not parts_root.is_dir():
        return {}
    tables = {p.name: sorted(p.glob("part-*.parquet")) for p in sorted(parts_root.iterdir()) if p.is_dir()}
    return {name: parts for name, parts in tables.items() if parts}


@dataclass
class _Row:
    run_id: str
    status: str
    manifest: JsonObject
    summary: dict[str, str | float | bool | None] = field(default_factory=dict)  # summary.parquet's row
    steps: int | None = None
    notes: list[str] = field(default_factory=list)


def _steps_read_only(run_dir: Path, row: _Row) -> int | None:
    """Distinct `step` values in `steps.parquet` and in unmerged parts, without merging them."""
    files = [run_dir / "steps.parquet"] if (run_dir / "steps.parquet").is_file() else []
    files += _part_files(run_dir).get("steps", [])
    steps: set[Any] = set()
    for path in files:
        try:
            if "step" in pq.read_schema(path).names:
                steps.update(pq.read_table(path, columns=["step"]).column("step").to_pylist())
        except Exception as exc:  # noqa: BLE001 - a corrupt file is a note on its run, not a crash
            row.notes.append(f"{path.relative_to(run_dir)} unreadable ({one_line(exc)})")
    steps.discard(None)
    return len(steps) if files and steps else None


def _read_row(found: FoundRun) -> _Row:
    """What `runs list` shows of one run; reads files, never writes them."""
    if found.manifest is None:
        return _Row(found.run_id, "unreadable", {}, notes=[f"unreadable: {found.error}"])
    manifest = found.manifest
    row = _Row(found.run_id, str(manifest.get("status") or "?"), manifest)
    if row.status == "running":
        liveness = _liveness(manifest)
        if liveness == "dead":
            parts = _part_files(found.dir)
            merge = f"merge {sum(len(p) for p in parts.values())} part files ({', '.join(parts)}) and " if parts else ""
            row.status = "running (dead)"
            row.notes.append(
                f"manifest says running but pid {manifest.get('pid')} is gone (crashed or killed); "
                f"'dlrm-lab runs recover {found.dir}' would {merge}mark it failed"
            )
        elif liveness == "elsewhere":
            row.notes.append(
                f"running on host {section(manifest, 'hardware')['hostname']} (pid {manifest.get('pid')}), "
                "whose process cannot be checked from here"
            )
    summary_path = found.dir / "summary.parquet"
    if summary_path.is_file():
        try:
            rows = pq.read_table(summary_path).to_pylist()
            row.summary = rows[0] if rows else {}
        except Exception as exc:  # noqa: BLE001 - a corrupt file is a note on its run, not a crash
            row.notes.append(f"unreadable: summary.parquet: {one_line(exc)} (manifest status {row.status})")
            row.status = "unreadable"
    row.steps = cast("int | None", row.summary.get("steps"))  # the summary's steps: a count, or null
    if row.steps is None:  # no summary (crashed, or still running): count the steps flushed so far
        row.steps = _steps_read_only(found.dir, row)
    return row


@app.command("list")
def list_runs(
    directory: Annotated[Path, typer.Argument(help="A metrics directory (or one run).")] = Path("runs"),
) -> None:
    """One line per run: id, kind, status, preset, throughput, quality, duration.

    Only reads: a run left `running` by a process that is gone shows as `running (dead)`,
    with what `dlrm-lab runs recover` would do to it; a run whose manifest or summary
    cannot be read shows as `unreadable`, with the file and the error.
    """
    out = console()
    table = Table(title=str(directory))
    for col in ("run_id", "kind", "status"):
        table.add_column(col, no_wrap=col != "kind")
    for name in columns.RUNS_LISTED:
        table.add_column(columns.column(name).narrow, justify="left" if name == "preset" else "right")
    rows = [_read_row(found) for found in discover_runs(directory)]
    for row in rows:
        summary, manifest = row.summary, row.manifest
        values = {
            **summary,
            "steps": row.steps,
            "duration_s": manifest.get("duration_s"),
            "preset": summary.get("preset") or section(manifest, "config", "model").get("name", "?"),
        }
        table.add_row(
            row.run_id,
            str(manifest.get("kind", "?")),
            row.status,
            *(columns.fmt(name, values.get(name)) for name in columns.RUNS_LISTED),
        )
    out.print(table)
    for row in rows:
        for note in row.notes:
            out.print(f"{row.run_id}: {note}", markup=False, highlight=False, soft_wrap=True)


@app.command("recover")
def recover_runs(
    directories: Annotated[list[Path], typer.Argument(help="Run directories, or directories of runs.")],
) -> None:
    """Make crashed runs readable: a run still `running` whose process is gone gets its
    flushed part files merged into its tables and is marked `failed`.

    Runs that ended, or whose process is alive, are left alone. One line per recovered run.
    """
    import dlrm_lab.train.records  # noqa: F401 - a training run's recovery (its summary) registers itself

    out = console()
    found = [f for d in directories for f in discover_runs(d)]
    recovered = failed = 0
    for run in found:
        if run.manifest is None:
            out.print(f"skipped {run.dir}: unreadable: {run.error}", markup=False, highlight=False, soft_wrap=True)
            continue
        if run.manifest.get("status") != "running":
            continue
        liveness = _liveness(run.manifest)
        pid = run.manifest.get("pid")
        if liveness != "dead":
            where = (
                "is alive" if liveness == "alive" else f"runs on host {section(run.manifest, 'hardware')['hostname']}"
            )
            out.print(f"left alone {run.run_id}: pid {pid} {where}", markup=False, highlight=False, soft_wrap=True)
            continue
        parts = _part_files(run.dir)
        try:
            manifest, rebuilt = recover_run_and_summary(run.dir)
        except Exception as exc:  # noqa: BLE001 - one run that cannot be merged must not stop the others
            failed += 1
            out.print(f"could not recover {run.run_id}: {one_line(exc)}", markup=False, highlight=False, soft_wrap=True)
            continue
        merged = (
            f"; merged {sum(len(p) for p in parts.values())} part files into "
            + ", ".join(f"{name}.parquet" for name in parts)
            if parts
            else ""
        )
        if rebuilt:
            merged += "; summary.parquet rebuilt from its steps"
        recovered += 1
        out.print(
            f"recovered {run.run_id}: marked {manifest.get('status')} (pid {pid} gone){merged}",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
    if not recovered and not failed:
        out.print("nothing to recover: no run is left `running` by a process that is gone", markup=False)
    if failed:
        raise typer.Exit(1)

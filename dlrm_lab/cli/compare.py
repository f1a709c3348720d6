"""`dlrm-lab compare BASE NEW`: which metrics changed beyond noise (rules: dlrm_lab.report.compare)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich import box
from rich.table import Table

from dlrm_lab.cli.format import console
from dlrm_lab.errors import UserError
from dlrm_lab.metrics.stats import Estimate
from dlrm_lab.report.compare import DEFAULT_THRESHOLD, IMPROVEMENT, REGRESSION, compare, compare_machines

_STYLE = {REGRESSION: "bold red", IMPROVEMENT: "green"}


def _num(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"


def _value(est: Estimate) -> str:
    return _num(est.median) + (" †" if est.unstable else "")


def _ci(est: Estimate) -> str:
    return "-" if est.ci_low is None or est.ci_high is None else f"[{est.ci_low:.3f}, {est.ci_high:.3f}]"


def compare_command(
    base: Annotated[Path, typer.Argument(help="Baseline: a run directory, or a directory of runs (any depth).")],
    new: Annotated[
        Optional[Path], typer.Argument(help="Candidate: a run directory, or a directory of runs (any depth).")
    ] = None,
    by_machine: Annotated[
        bool,
        typer.Option(
            "--by-machine",
            help="Compare the runs under BASE machine by machine (their hardware "
            "fingerprints): each machine against the base machine.",
        ),
    ] = False,
    base_machine: Annotated[
        Optional[str],
        typer.Option(help="--by-machine: the base machine (a fingerprint prefix; default: the oldest run's)."),
    ] = None,
    threshold: Annotated[
        float,
        typer.Option(
            "--threshold", min=0.0, help="Smallest change that counts, as a fraction of the base (0.02 = 2%)."
        ),
    ] = DEFAULT_THRESHOLD,
    as_json: Annotated[bool, typer.Option("--json", help="Print the rows as a JSON list instead of a table.")] = False,
) -> None:
    """Compare NEW against BASE metric by metric, with 95% bootstrap confidence intervals.

    Runs of one kind on a side are repeats (>= 3 a side: run-to-run noise; fewer: noise
    within the runs, per step, per query or per 1-s bin). Exits 1 when a metric regressed
    beyond --threshold with its whole interval, so CI jobs can gate on it.
    """
    if by_machine:
        if new is not None:
            raise UserError("--by-machine compares the machines of the runs under one path: give BASE only")
        results = compare_machines(base, base_machine, threshold=threshold)
    else:
        if new is None:
            raise UserError("give BASE and NEW, or one path with --by-machine")
        results = [compare(base, new, threshold=threshold)]
    if as_json:  # by machine, each row says which comparison it is of
        rows = [
            {**({"base": str(r.base), "new": str(r.new)} if by_machine else {}), **row.to_dict()}
            for r in results
            for row in r.rows
        ]
        typer.echo(json.dumps(rows, indent=2))
        for note in dict.fromkeys(n for r in results for n in r.notes):
            typer.echo(f"note: {note}", err=True)
    else:
        for result in results:
            _print(result, threshold)
    if any(r.regressions for r in results):
        raise typer.Exit(1)


def _print(result: Any, threshold: float) -> None:
    table = Table(
        title=f"{result.base} ({_kinds(result.base_kinds)}) -> {result.new} ({_kinds(result.new_kinds)})",
        box=box.SIMPLE_HEAD,
        caption=(
            "ratio: new/base, base/new where lower is better (< 1 is worse); a verdict needs the whole 95% CI "
            f"beyond ±{threshold:.0%}; basis: run-to-run repeats, or within-run steps, queries or 1-s bins "
            "(n base/new); † unstable: cv or CI half-width > 5% of the median"
        ),
        caption_justify="left",
    )
    for col in ("metric", "base", "new", "ratio", "95% CI", "verdict", "basis"):
        left = col in ("metric", "verdict", "basis")
        table.add_column(col, justify="left" if left else "right", no_wrap=col in ("metric", "95% CI"))
    for row in result.rows:
        style = _STYLE.get(row.verdict, "")
        table.add_row(
            row.label,
            _value(row.base),
            _value(row.new),
            "-" if row.ratio.median is None else f"{row.ratio.median:.3f}",
            _ci(row.ratio),
            f"[{style}]{row.verdict}[/]" if style else row.verdict,
            f"{row.basis.removeprefix('within-run: ')} {row.base.n}/{row.new.n}",
        )
    out = console()
    out.print(table)
    for note in result.notes:
        out.print(f"note: {note}", markup=False, highlight=False)


def _kinds(kinds: dict[str, int]) -> str:
    return ", ".join(f"{k} x{n}" for k, n in sorted(kinds.items())) or "no runs"

"""`dlrm-lab presets`: list the model presets, or show one resolved."""

from __future__ import annotations

import json

import typer
from rich.table import Table

from dlrm_lab.cli.format import console
from dlrm_lab.cli.options import MaxRows, TableScale
from dlrm_lab.config import available_presets, load_any_preset
from dlrm_lab.config.family import Spec, families, family_of

app = typer.Typer(help="Model presets (models/*.toml).", invoke_without_command=True, no_args_is_help=False)


def size_line(spec: Spec) -> str:
    """One line with what a preset costs, printed before anything is built."""
    return family_of(spec).size_line(spec)


@app.callback()
def list_presets(
    ctx: typer.Context,
    table_scale: TableScale = None,
    max_rows: MaxRows = None,
) -> None:
    """List presets with tables, rows, parameters and bytes."""
    if ctx.invoked_subcommand is not None:
        return
    for family in families().values():
        names = available_presets(family.name)
        specs = [load_any_preset(name, table_scale=table_scale, max_rows=max_rows) for name in names]
        if specs:
            _print_table(*family.preset_table(specs))


def _print_table(title: str | None, columns: list[str], rows: list[list[str]]) -> None:
    table = Table(title=title)
    for i, col in enumerate(columns):
        table.add_column(col, justify="left" if i == 0 or col in ("inter", "feature") else "right", no_wrap=True)
    for row in rows:
        table.add_row(*row)
    console().print(table)


@app.command("show")
def show(
    name: str = typer.Argument(..., help="Preset name or .toml path."),
    table_scale: TableScale = None,
    max_rows: MaxRows = None,
    as_json: bool = typer.Option(False, "--json", help="Print the resolved spec as JSON."),
) -> None:
    """Print one preset resolved: every table, the MLPs and the sizes."""
    spec = load_any_preset(name, table_scale=table_scale, max_rows=max_rows)
    if as_json:
        typer.echo(json.dumps(spec.to_dict(), indent=2, default=str))
        return
    lines, table = family_of(spec).describe(spec)
    for line in lines:
        console().print(line)
    if table is not None:
        _print_table(None, *table)

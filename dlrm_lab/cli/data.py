"""`dlrm-lab data`: generate, inspect and convert click-log datasets."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional, cast

import typer
from rich.progress import Progress
from rich.table import Table

from dlrm_lab.cli.format import LineProgress, console, progress
from dlrm_lab.cli.options import MaxRows, TableScale
from dlrm_lab.config import load_any_preset, load_preset
from dlrm_lab.data import data_parts
from dlrm_lab.errors import UserError

if TYPE_CHECKING:  # the data room loads torch: the command line imports it only when a command runs
    from dlrm_lab.data.check import DatasetStats

app = typer.Typer(help="Synthetic and Criteo click-log datasets (Parquet).", no_args_is_help=True)

FORMATS = ("parquet", "criteo-tsv")
DataSpecOption = Annotated[
    Optional[str], typer.Option("--spec", help="Data spec name (data_gen/) or .toml path; default: the preset's.")
]
SetOption = Annotated[
    Optional[list[str]],
    typer.Option("--set", help="Override a spec field, e.g. features.cat_3.ids.alpha=1.2 (repeatable)."),
]


def _progress() -> Progress | LineProgress:
    """A live bar on a terminal, else a plain line every few seconds (see `format.progress`)."""
    return progress(unit="samples")


@app.command("specs")
def specs() -> None:
    """List the shipped data specs."""
    from dlrm_lab.data.spec import available_data_specs, data_spec_path

    table = Table(title="data specs (data_gen/)")
    table.add_column("spec")
    table.add_column("description")
    from dlrm_lab.config.toml import read_toml

    for name in available_data_specs():
        raw = read_toml(data_spec_path(name), "data spec")
        table.add_row(name, raw.get("description", ""))
    console().print(table)


@app.command("gen")
def gen(
    out: Annotated[Path, typer.Option("--out", help="Output directory (parquet) or file (criteo-tsv).")],
    preset: Annotated[str, typer.Option("--preset", "-p", help="Model preset: features and table sizes.")] = "tiny",
    spec: DataSpecOption = None,
    rows: Annotated[int, typer.Option(help="Samples to write.")] = 100_000,
    shards: Annotated[int, typer.Option(help="Parquet files (contiguous sample ranges).")] = 1,
    seed: Annotated[int, typer.Option(help="Seed: (spec, seed) fixes every byte.")] = 0,
    fmt: Annotated[str, typer.Option("--format", help="parquet or criteo-tsv.")] = "parquet",
    table_scale: TableScale = None,
    max_rows: MaxRows = None,
    set_: SetOption = None,
    window: Annotated[str, typer.Option(help="HSTU presets: the train or eval window's requests.")] = "train",
) -> None:
    """Generate a synthetic dataset for a model preset (an HSTU preset: its time-ordered requests)."""
    if fmt not in FORMATS:
        raise UserError(f"--format {fmt!r}: allowed: {', '.join(FORMATS)}")
    if rows < 1:
        raise UserError(f"--rows {rows}: must be an integer >= 1")
    model = load_any_preset(preset, table_scale=table_scale, max_rows=max_rows)
    writer = data_parts(model).dataset_writer(
        model, rows=rows, shards=shards, seed=seed, fmt=fmt, data_spec=spec, overrides=tuple(set_ or ()), window=window
    )
    console(stderr=True).print(writer.headline)
    with _progress() as bar:
        task = bar.add_task("gen", total=writer.rows)
        writer.write(out, on_progress=lambda n: bar.update(task, advance=n))
    console().print(f"wrote {writer.rows:,} {writer.unit} to {out}")


def _print_request_stats(result: DatasetStats, strict: bool) -> None:
    out = console()
    teacher = result["teacher_auc"]
    out.print(
        f"{result['path']}: {result['samples']:,} HSTU requests from {result['source']}, label rate "
        f"{result['label_rate']:.4f}" + (f", teacher AUC {teacher:.4f}" if teacher is not None else "")
    )
    table = Table()
    table.add_column("quantity")
    table.add_column("value", justify="right")
    quantities = result["quantities"]
    assert isinstance(quantities, dict)  # measured: a dataset with problems is reported before this
    for name, value in quantities.items():
        table.add_row(
            name,
            f"{value:,.3f}" if isinstance(value, float) else f"{value:,}" if isinstance(value, int) else str(value),
        )
    out.print(table)
    _print_checks(result["checks"], strict)


def _print_checks(checks: list[Any], strict: bool) -> None:
    out = console()
    bad = [c for c in checks if not c.ok]
    for c in bad:
        out.print(
            f"[red]outside tolerance[/]: {c.feature} {c.quantity}: measured {c.measured:.4f}, "
            f"spec {c.expected:.4f} +- {c.tolerance:.4f}"
        )
    if checks:
        out.print(f"{len(checks) - len(bad)} of {len(checks)} checks against the spec within tolerance")
    else:
        out.print("no spec stored in this dataset: nothing to check against")
    if strict and bad:
        raise typer.Exit(1)


@app.command("convert-criteo")
def convert(
    inputs: Annotated[list[Path], typer.Argument(help="Criteo TSV files (day_0, train.txt, ...).")],
    out: Annotated[Path, typer.Option("--out", help="Output dataset directory.")],
    preset: Annotated[
        str, typer.Option("--preset", "-p", help="kaggle or terabyte: table sizes to hash into.")
    ] = "kaggle",
    table_scale: TableScale = None,
    max_rows: MaxRows = None,
) -> None:
    """Convert Criteo TSV files into a Parquet dataset (categoricals hashed into the preset's tables)."""
    from dlrm_lab.data.criteo import convert_criteo

    model = load_preset(preset, table_scale=table_scale, max_rows=max_rows)
    with _progress() as bar:
        task = bar.add_task("convert", total=None)
        manifest = convert_criteo(inputs, model, out, on_progress=lambda n: bar.update(task, advance=n))
    console().print(f"converted {manifest['rows']:,} samples from {len(inputs)} file(s) to {out}")


@app.command("convert-yambda")
def convert_yambda_command(
    events: Annotated[Path, typer.Argument(help="Yambda's flat multi_event.parquet (50m, 500m or 5b).")],
    categories: Annotated[
        Path, typer.Option("--categories", help="artist_item_mapping.parquet or album_item_mapping.parquet.")
    ],
    out: Annotated[Path, typer.Option("--out", help="Output dataset directory (new, or a conversion to resume).")],
    preset: Annotated[
        Optional[str],
        typer.Option("--preset", "-p", help="HSTU preset whose max_history bounds the histories."),
    ] = None,
    max_history: Annotated[Optional[int], typer.Option(help="History events kept per request (default 4096).")] = None,
    max_candidates: Annotated[int, typer.Option(help="Listens of a window scored: its first ones.")] = 32,
    window_s: Annotated[int, typer.Option(help="Window length in seconds: a request per (user, window).")] = 86_400,
    timestamp_unit_s: Annotated[int, typer.Option(help="Seconds per timestamp unit (Yambda: 1).")] = 1,
    min_history: Annotated[int, typer.Option(help="Requests with fewer history events are dropped.")] = 1,
    listen_plus_pct: Annotated[int, typer.Option(help="Label 1 from this played_ratio_pct (listen+).")] = 50,
    like_is_positive: Annotated[bool, typer.Option(help="A later like in the window labels a listen 1.")] = True,
    first_window: Annotated[Optional[int], typer.Option(help="First window written (histories use all).")] = None,
    last_window: Annotated[Optional[int], typer.Option(help="Last window written.")] = None,
    unmapped: Annotated[str, typer.Option(help="An item without a category: error or drop (its events).")] = "error",
    batch_rows: Annotated[int, typer.Option(help="Events decoded at once (memory).")] = 65_536,
    chunk_events: Annotated[int, typer.Option(help="Events per resumable chunk.")] = 50_000_000,
) -> None:
    """Convert Yambda (Yandex Music, MLPerf DLRMv4's data) into time-ordered HSTU requests; rerun to resume."""
    from dlrm_lab.data.yambda import convert_yambda
    from dlrm_lab.data.yambda_requests import YambdaOptions
    from dlrm_lab.errors import FieldError

    if max_history is None:
        max_history = YambdaOptions.max_history
        if preset is not None:
            model = load_any_preset(preset)
            if not hasattr(getattr(model, "data", None), "max_history"):
                raise UserError(f"--preset {preset}: not an HSTU preset (its [data] max_history bounds the histories)")
            max_history = model.data.max_history
    options = YambdaOptions(
        window_s=window_s,
        timestamp_unit_s=timestamp_unit_s,
        max_history=max_history,
        max_candidates=max_candidates,
        min_history=min_history,
        listen_plus_pct=listen_plus_pct,
        like_is_positive=like_is_positive,
        first_window=first_window,
        last_window=last_window,
        unmapped=unmapped,
        batch_rows=batch_rows,
        chunk_events=chunk_events,
    )
    try:
        with progress(unit="events") as bar:
            task = bar.add_task("convert", total=None)
            manifest = convert_yambda(events, categories, out, options, on_events=lambda n: bar.update(task, advance=n))
    except FieldError as exc:  # named by this command's flags, which `commands.flag` does not know
        raise UserError(exc.named(lambda f: "--" + f.replace("_", "-"))) from None
    counts = cast("dict[str, int]", manifest["counts"])  # `convert_yambda`'s counts, by name
    console().print(
        f"converted {counts['events']:,} events to {manifest['rows']:,} requests in {manifest['shards']} "
        f"window(s) to {out}"
    )


MAX_PROBLEMS_SHOWN = 50  # `data stats`: problem lines printed before the count of the rest


@app.command("stats")
def stats(
    directory: Annotated[Path, typer.Argument(help="Dataset directory (or one Parquet file).")],
    strict: Annotated[bool, typer.Option(help="Exit 1 when a measured value is outside its tolerance.")] = False,
) -> None:
    """Per feature: ids, skew, pooling; checked against the spec stored in the dataset.

    First the dataset's structure, by training's own checks (columns, types, nulls, ids within
    their table) and against its sidecar (files, rows): a broken dataset prints one line per
    problem and exits 1, with or without --strict."""
    from dlrm_lab.data.stats import dataset_stats

    result = dataset_stats(directory)
    problems = result["problems"]
    if problems:
        for line in problems[:MAX_PROBLEMS_SHOWN]:
            typer.echo(f"error: {line}", err=True)
        if len(problems) > MAX_PROBLEMS_SHOWN:
            typer.echo(f"error: ... and {len(problems) - MAX_PROBLEMS_SHOWN} more problem(s)", err=True)
        typer.echo(f"{result['path']}: {len(problems)} structural problem(s); no statistics measured", err=True)
        raise typer.Exit(1)
    out = console()
    teacher = result["teacher_auc"]
    if result.get("kind") == "requests":
        _print_request_stats(result, strict)
        return
    out.print(
        f"{result['path']}: {result['samples']:,} samples from {result['source']}, label rate "
        f"{result['label_rate']:.4f}" + (f", teacher AUC {teacher:.4f}" if teacher is not None else "")
    )
    table = Table()
    for col in ("feature", "rows", "lookups", "unique ids", "top-1% share", "zipf alpha", "pooling mean", "p99"):
        table.add_column(col, justify="left" if col == "feature" else "right")
    for f in result["features"]:
        alpha = f["zipf_alpha_fit"]
        table.add_row(
            f["feature"],
            f"{f['table_rows']:,}",
            f"{f['lookups']:,}",
            f"{f['unique_ids']:,}",
            f"{f['top1pct_share']:.3f}",
            "-" if alpha is None else f"{alpha:.3f}",
            f"{f['pooling_mean']:.2f}",
            f"{f['pooling_p99']:.0f}",
        )
    out.print(table)
    _print_checks(result["checks"], strict)

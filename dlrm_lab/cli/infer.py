"""`dlrm-lab infer run|search`: latency-bounded inference throughput."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Annotated, Any, cast

import pyarrow.parquet as pq
import typer
from rich.table import Table

from dlrm_lab.cli.format import console, say_interrupted
from dlrm_lab.cli.format import progress as progress_display
from dlrm_lab.cli.options import METRICS_DIR, CliOnly, command
from dlrm_lab.commands import INFER_BUILDS, INFER_RUN, INFER_SEARCH
from dlrm_lab.config.values import OptionValues
from dlrm_lab.errors import UserError, raise_on_sigterm
from dlrm_lab.metrics import columns

app = typer.Typer(help="Inference lab: dynamic batching, co-location, MLPerf LoadGen, latency-bounded search, builds.")

ShowProgress = Annotated[bool, typer.Option(help="Show progress (a bar on a terminal, else a line every few s).")]
PROGRESS = CliOnly("progress", ShowProgress, True)
# a terminal bar redraws in the serving process: seldom, to stay out of the measured latency
_REFRESH_PER_S = 1.0


@app.command("run")
@command(*INFER_RUN, METRICS_DIR, PROGRESS)
def run_command(options: OptionValues) -> None:
    """Serve one load point (or several models together) and record every query."""
    from dlrm_lab.commands import infer_setup
    from dlrm_lab.infer.lab import run_inference
    from dlrm_lab.infer.load_point import PointProgress

    served, load, cfg = infer_setup(options)  # the one construction (sweeps check their points with it too)
    streams, n = load.streams, len(served)
    raise_on_sigterm()
    out = console(stderr=True)
    points = 1 + (n if n > 1 and cfg.compare_alone else 0)
    bar = progress_display(
        "point {task.fields[point]}",
        "{task.fields[queries]:,} queries",
        unit="s of load",
        rate=False,
        to=out,
        enabled=cast(bool, options["progress"]),  # --progress: a flag
        refresh_per_second=_REFRESH_PER_S,
    )
    task = bar.add_task("infer", total=points * cfg.duration_s, point=f"1/{points}", queries=0)

    def on_progress(p: PointProgress) -> None:
        done = p.duration_s if p.finished else min(p.elapsed_s, p.duration_s)
        bar.update(task, completed=p.point * p.duration_s + done, point=f"{p.point + 1}/{points}", queries=p.queries)

    with say_interrupted(out), bar:
        run_dir = run_inference(
            served,
            streams,
            cfg,
            metrics_dir=cast(str, options["metrics_dir"]),  # --metrics-dir: a directory
            argv=["dlrm-lab", *sys.argv[1:]],
            log=lambda msg: out.print(msg, highlight=False),
            on_progress=on_progress,
        )
    invalid, stopped = _print_points(run_dir)
    console().print(f"run directory: {run_dir}")
    if stopped:  # the load was not what was asked: the numbers must not pass for it
        out.print(f"error: {stopped}; rows kept in {run_dir}", highlight=False, soft_wrap=True)
        raise typer.Exit(1)
    if invalid:  # a failed verdict fails the command, as a regression fails `compare`: scripts gate on it
        reasons = "; ".join(f"{model}: {why}" if why else model for model, why in invalid)
        out.print(
            f"error: MLPerf LoadGen's verdict is INVALID for {reasons} (LoadGen's summary: "
            f"{run_dir}/loadgen/point-*/mlperf_log_summary.txt)",
            highlight=False,
            soft_wrap=True,
        )
        raise typer.Exit(1)


def _print_points(run_dir: Any) -> tuple[list[tuple[str, str | None]], str | None]:
    """Print the points' table; return the models whose LoadGen verdict was INVALID (with LoadGen's reason), and why
    the first load stopped issuing early (None: none did)."""
    rows = pq.read_table(run_dir / "summary.parquet").to_pylist()
    table = Table(title=f"inference ({rows[0]['scenario']})")
    for name in columns.INFER_PRINTED:
        table.add_column(columns.column(name).narrow, justify="right")
    for r in rows:
        table.add_row(*(columns.fmt(name, r.get(name)) for name in columns.INFER_PRINTED))
    console().print(table)
    remote = [r for r in rows if r.get("rpc") is not None]
    if remote:  # what crossing the network cost, beside the latency it is part of
        table = Table(title=f"over the network ({remote[0]['target']})")
        for name in columns.TRANSFER_PRINTED:
            table.add_column(columns.column(name).narrow, justify="right")
        for r in remote:
            table.add_row(*(columns.fmt(name, r.get(name)) for name in columns.TRANSFER_PRINTED))
        console().print(table)
    for r in rows:
        if r.get("server_lost"):
            console().print(f"{r['model']}: {r['error']}")
        if r["loadgen_result"]:
            console().print(
                f"MLPerf LoadGen ({r['model']}): {r['loadgen_result']}, {r['loadgen_queries_per_s']:.1f} queries/s, "
                f"p99 {r['loadgen_p99_ms']:.2f} ms (LoadGen's own accounting; logs in {run_dir}/loadgen)"
            )
    stopped = next((f"point {r['point']}: {r['issue_stopped']}" for r in rows if r.get("issue_stopped")), None)
    invalid = [(r["model"], r.get("loadgen_reason")) for r in rows if r["loadgen_result"] == "INVALID"]
    return invalid, stopped


@app.command("search")
@command(*INFER_SEARCH, METRICS_DIR, PROGRESS)
def search_command(options: OptionValues) -> None:
    """Find, per configuration, the highest queries/s whose latency percentile meets the bound."""
    from dlrm_lab.commands import search_setup
    from dlrm_lab.infer.load_point import PointProgress
    from dlrm_lab.infer.search import search

    if len(cast("Sequence[str]", options["model"] or [])) > 1:  # --model: a list option of names
        raise UserError("infer search: one --model at a time")
    base, stream, grid, cfg, probing = search_setup(options)
    raise_on_sigterm()
    out = console(stderr=True)
    bar = progress_display(
        "{task.fields[probe]}",
        unit="probe points",
        rate=False,
        to=out,
        enabled=cast(bool, options["progress"]),  # --progress: a flag
        refresh_per_second=_REFRESH_PER_S,
    )
    task = bar.add_task("search", total=None, probe="")

    def on_progress(p: PointProgress) -> None:
        shown = p.duration_s if p.finished else min(p.elapsed_s, p.duration_s)
        probe = f"point {p.point}: {shown:.1f}/{p.duration_s:.1f} s of load, {p.queries:,} queries"
        bar.update(task, completed=p.point + p.finished, probe=probe)

    with say_interrupted(out), bar:
        run_dir = search(
            base,
            stream,
            grid,
            cfg,
            probing,
            metrics_dir=cast(str, options["metrics_dir"]),  # --metrics-dir: a directory
            argv=["dlrm-lab", *sys.argv[1:]],
            log=lambda msg: out.print(msg, highlight=False),
            on_progress=on_progress,
        )
    rows = pq.read_table(run_dir / "frontier.parquet").to_pylist()
    percentile, sla_ms = cfg.sla_percentile, cfg.sla_ms
    table = Table(
        title=f"highest queries/s with p{percentile:g} <= {sla_ms:g} ms ({base.name}, {options['query_size']})"
    )
    for name in columns.FRONTIER_PRINTED:
        heading = f"p{percentile:g} ms" if name == "best_sla_latency_ms" else columns.column(name).narrow
        table.add_column(heading, justify="right")
    for r in rows:
        table.add_row(*(columns.fmt(name, r.get(name)) for name in columns.FRONTIER_PRINTED))
    console().print(table)
    console().print(_answer(rows, percentile, sla_ms))
    console().print(f"run directory: {run_dir}")


def _answer(frontier: list[dict[str, str | float | bool | None]], percentile: float, sla_ms: float) -> str:
    """The search's answer: the rate a LoadGen Server run certified, never a rate that did not hold."""
    best = next((r for r in frontier if r["best"]), None)
    bound = f"p{percentile:g} <= {sla_ms:g} ms"
    if best is None:
        return f"answer: no configuration met {bound}"
    claimed = f"the search's probes claimed {best['best_qps']:,.1f}"
    if best.get("held_qps"):
        claimed += f", the lab's open loop held {best['held_qps']:,.1f} as long"
    if best.get("certified_qps") is None:
        return f"answer: {best['best_qps']:,.1f} queries/s under {bound}, not certified (--certify-duration 0)"
    if not best["certified_qps"]:
        return f"answer: no certified rate under {bound} ({claimed}; {best['outcome']})"
    return (
        f"answer: {best['certified_qps']:,.1f} queries/s ({best['certified_samples_per_s']:,.0f} samples/s) "
        f"under {bound}, certified by a {best['certify_s']:g} s MLPerf LoadGen Server run "
        f"({best['certified_result']}; {claimed})"
    )


@app.command("builds")
@command(*INFER_BUILDS)
def builds_command(options: OptionValues) -> None:
    """Every serving build of one model side by side on this machine: cost per batch and per sample, fraction of
    roof, accuracy. Which engine serves this model best here."""
    from dlrm_lab.commands import builds_setup
    from dlrm_lab.infer.build_table import compare_builds

    served, table, seed = builds_setup(options)
    out = console(stderr=True)
    rows = compare_builds(
        served,
        builds=table.build_list(),
        sizes=table.size_list(),
        repeats=table.repeats,
        seed=seed,
        log=lambda msg: out.print(msg, highlight=False),
    )
    sizes = table.size_list()
    view = Table(
        title=f"{served.name}: serving builds on this machine ({served.threads} thread"
        f"{'s' if served.threads != 1 else ''})"
    )
    for col in (
        "build",
        "computes in",
        *[f"{n} ms" for n in sorted(set(sizes))],
        "ms/batch",
        "us/sample",
        "of roof",
        "AUC kept",
        "accuracy",
    ):
        view.add_column(col, justify="left" if col in ("build", "computes in", "accuracy") else "right")
    for r in rows:
        if r.get("skipped"):
            view.add_row(r["build"], "-", *["-"] * len(set(sizes)), "-", "-", "-", "-", f"not made: {r['skipped']}")
            continue
        roof = "-" if r["fraction_of_roof"] is None else f"{r['fraction_of_roof']:.2f}"
        view.add_row(
            r["build"],
            r["precision"],
            *[f"{r['batch_ms'][n]:.3f}" for n in sorted(set(sizes))],
            f"{r['per_batch_ms']:.3f}",
            f"{r['per_sample_us']:.2f}",
            roof,
            f"{r['auc_kept']:.4%}",
            ("pass" if r["accuracy_passed"] else "FAIL") + f" ({r['labels']} labels)",
        )
    console().print(view)

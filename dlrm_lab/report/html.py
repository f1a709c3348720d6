"""`write_report`: run directories in, PNG plots and one self-contained index.html out.

The page has inline CSS and no scripts or external assets; it refers only to the PNGs
written next to it and to each run's manifest, copied to `manifests/<run_id>.json` so
that the exact configuration of every row is one click away.
"""

from __future__ import annotations

import html
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from dlrm_lab.errors import FieldError
from dlrm_lab.metrics import columns
from dlrm_lab.report import plots
from dlrm_lab.report.figures import BUILDERS, TITLES
from dlrm_lab.report.load import (
    MANIFEST,
    ReportData,
    ReportRow,
    RunInfo,
    collect,
    config_label,
    discover,
    run_of,
)
from dlrm_lab.report.plots import Drawn


@dataclass
class ReportResult:
    index: Path
    plots: dict[str, Path] = field(default_factory=dict)  # plot name -> PNG
    skipped: dict[str, str] = field(default_factory=dict)  # plot name -> why it was not drawn
    notes: dict[str, list[str]] = field(default_factory=dict)  # plot name -> caveats shown under it
    drawn: dict[str, Drawn] = field(default_factory=dict)  # plot name -> what the plot function returned
    runs: list[RunInfo] = field(default_factory=list)


def write_report(paths: list[str | Path] | str | Path, out: str | Path) -> ReportResult:
    """Find every run under `paths`, draw what their data allows into `out`, write `out/index.html`."""
    runs = discover(paths)
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise FieldError("out", f"{out}: exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    links = _copy_manifests(runs, out)
    data = collect(runs)
    result = ReportResult(out / "index.html", runs=runs)
    for base, build in BUILDERS:
        try:
            made = build(data, out)
        except Exception as exc:  # noqa: BLE001 - one plot's odd data must not cost the whole report
            made = f"drawing failed ({type(exc).__name__}: {exc})"
        if isinstance(made, str):
            result.skipped[base] = made
            continue
        for name, (drawn, notes) in made.items():
            result.plots[name], result.drawn[name], result.notes[name] = drawn.path, drawn, notes
    result.index.write_text(_page(paths, data, result, links))
    return result


def _copy_manifests(runs: list[RunInfo], out: Path) -> dict[Path, str]:
    """Each run's manifest.json as manifests/<run_id>.json; run dir -> relative link."""
    target = out / "manifests"
    target.mkdir(exist_ok=True)
    links: dict[Path, str] = {}
    used: set[str] = set()
    for run in runs:
        name = run.run_id.replace("/", "_")
        k = 2
        while name in used:  # the same run id twice (a copied directory): keep both
            name, k = f"{run.run_id}-{k}", k + 1
        used.add(name)
        try:
            shutil.copyfile(run.dir / MANIFEST, target / f"{name}.json")
        except OSError as exc:
            run.note(f"manifest not copied ({exc.strerror})")
            continue
        links[run.dir] = f"manifests/{name}.json"
    return links


# ----------------------------------------------------------------------------- HTML

CSS = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; max-width: 1400px; }
h1 { font-size: 1.6em; } h2 { border-bottom: 1px solid #ccc; padding-bottom: .2em; margin-top: 2em; }
table { border-collapse: collapse; margin: .8em 0; font-size: .85em; }
th, td { border: 1px solid #ccc; padding: .25em .6em; text-align: left; vertical-align: top; }
th { background: #f0f0f0; } td.n { text-align: right; white-space: nowrap; }
tr:nth-child(even) td { background: #fafafa; }
img { max-width: 100%; border: 1px solid #ddd; }
.note { color: #a15c00; font-size: .85em; } .muted { color: #777; font-size: .85em; }
"""


_NUMERIC = re.compile(r"^-?[\d.,]+(\s|$|&plusmn;)|^-$")


def _e(v: Any) -> str:
    return html.escape(str(v))


def _f(v: Any, spec: str = ",.1f") -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, (int, float)):
        return "-" if v != v else format(v, spec)  # NaN
    return _e(v)


def _table(headers: list[str], rows: list[list[str]]) -> str:
    """Headers are plain text (escaped here); cells are already HTML. Numbers align right."""
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    body = "".join(
        "<tr>" + "".join(f"<td{' class=n' if _NUMERIC.match(c) else ''}>{c}</td>" for c in row) + "</tr>"
        for row in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _page(paths: Any, data: ReportData, result: ReportResult, links: dict[Path, str]) -> str:
    def run_link(run: RunInfo) -> str:
        href = links.get(run.dir)
        return f'<a href="{_e(href)}">{_e(run.run_id)}</a>' if href else _e(run.run_id)

    def notes(run: RunInfo) -> str:
        return "<br>".join(f'<span class="note">{_e(n)}</span>' for n in run.notes)

    given = [paths] if isinstance(paths, (str, Path)) else list(paths)
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8"><title>dlrm-lab report</title>',
        f"<style>{CSS}</style></head><body>",
        "<h1>dlrm-lab report</h1>",
        f'<p class="muted">{len(data.runs)} run(s) under {_e(", ".join(str(p) for p in given))}; generated '
        f"{_e(datetime.now(timezone.utc).isoformat(timespec='seconds'))}. Every run id links its manifest "
        "(command line, resolved config, versions, hardware). Columns and units: docs/metrics.md; "
        "plots: docs/reports.md.</p>",
        "<h2>Runs</h2>",
        _table(
            ["run (manifest)", "kind", "status", "inside run", "started (UTC)", "duration (s)", "notes"],
            [
                [
                    run_link(r),
                    _e(r.kind),
                    _f(r.status),
                    _f(r.parent),
                    _f(r.manifest.get("start_time")),
                    _f(r.manifest.get("duration_s")),
                    notes(r),
                ]
                for r in data.runs
            ],
        ),
    ]
    parts += _kind_tables(data, run_link, notes)
    parts.append("<h2>Plots</h2>")
    for name, path in result.plots.items():
        base = name.split("-", 1)[0]
        suffix = f" ({name.split('-', 1)[1]})" if "-" in name else ""
        parts.append(f"<h3>{_e(TITLES.get(base, name) + suffix)}</h3>")
        parts.append(f'<img src="{_e(path.name)}" alt="{_e(name)}">')
        parts += [f'<p class="note">{_e(n)}</p>' for n in result.notes.get(name, [])]
    if result.skipped:
        parts.append("<h2>Plots not drawn</h2><ul>")
        parts += [f"<li><b>{_e(TITLES.get(k, k))}</b>: {_e(v)}</li>" for k, v in result.skipped.items()]
        parts.append("</ul>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def _kind_tables(data: ReportData, run_link: Callable[[RunInfo], str], notes: Callable[[RunInfo], str]) -> list[str]:
    parts: list[str] = []
    by_run = {r.run_id: r for r in data.runs}

    def table(
        names: tuple[str, ...],
        rows: list[ReportRow],
        run: str = "run (manifest)",
        tail: tuple[str, ...] = ("notes",),
    ) -> str:
        """A table of registered columns between the run's link and the notes."""
        headers = [run, *(columns.column(n).heading for n in names), *tail]
        body = [
            [
                run_link(run_of(r)),
                *(_e(columns.fmt(n, r.get(n))) for n in names),
                *(_e(run_of(r).status) if t == "status" else notes(run_of(r)) for t in tail),
            ]
            for r in rows
        ]
        return _table(headers, body)

    if data.train:
        parts.append("<h2>Training runs</h2>")
        parts.append(table(columns.TRAIN_TABLE, data.train, tail=("status", "notes")))
    if data.infer:
        parts.append("<h2>Inference runs</h2>")
        parts.append(table(columns.INFER_TABLE, data.infer))
    if data.search:
        parts.append("<h2>Latency-bounded searches (frontier)</h2>")
        rows = []
        for s in data.search:
            for r in s.frontier or [{}]:
                unc = r.get("best_qps_uncertainty")
                cells = {n: _e(columns.fmt(n, r.get(n))) for n in columns.FRONTIER_TABLE}
                if unc is not None:
                    cells["best_qps"] += f" &plusmn; {_e(columns.fmt('best_qps_uncertainty', unc))}"
                config = config_label(r) if r else "-"
                rows.append(
                    [
                        run_link(s.run),
                        cells.pop("model"),
                        _e(config),
                        *cells.values(),
                        "chosen" if r.get("best") else "",
                        notes(s.run),
                    ]
                )
        names = [n for n in columns.FRONTIER_TABLE if n != "model"]
        headers = [
            "run (manifest)",
            columns.column("model").heading,
            "configuration",
            *(columns.column(n).heading for n in names),
            "best",
            "notes",
        ]
        parts.append(_table(headers, rows))
    from dlrm_lab.report.machines import machine_rows

    if machines := machine_rows(data):
        parts.append("<h2>Machines side by side (ranked by cost per 1M inferences)</h2>")
        headers = [
            "rank",
            "machine",
            "CPU",
            "GEMM flags",
            "cores",
            "GPUs",
            "model",
            "bound",
            "queries/s",
            "samples/s",
            "samples/s per core",
            "fraction of roof",
            "cost per 1M inferences",
            "cost per 1M samples",
            "J per inference",
            "from",
        ]
        body = [
            [
                _f(r["rank"], "d"),
                _e(r["machine"]),
                _e(r["cpu_model"]),
                _e(r["gemm_flags"]),
                _f(r["cores"], "d"),
                _e(r["gpus"]),
                _e(r["model"]),
                _e(f"p{r['sla_percentile']:g} <= {r['sla_ms']:g} ms"),
                _f(r["queries_per_s"]),
                _f(r["samples_per_s"], ",.0f"),
                _f(r["samples_per_s_per_core"], ",.1f"),
                _f(r["roofline_fraction"], ".2f"),
                f"{_f(r['cost_per_1m_queries'], ',.4g')} {_e(r['currency'] or '')}",
                _f(r["cost_per_1m_samples"], ",.4g"),
                _f(r["energy_per_query_j"], ".3g"),
                f"{_e(r['source'])}, {run_link(by_run[r['run_id']])}",
            ]
            for r in machines
        ]
        parts.append(_table(headers, body))
    if data.scale:
        parts.append("<h2>Scaling sweeps</h2>")
        parts.append(table(columns.SCALE_TABLE, data.scale))
    by_id = {r.run_id: r for r in data.runs}
    for run, summary in data.sweeps:
        metrics = [c[: -len("_median")] for c in summary.column_names if c.endswith("_median")]
        rows = summary.to_pylist()
        labels = plots.point_labels(rows)
        children = data.sweep_children.get(run.run_id, {})
        parts.append(f"<h2>Sweep {run_link(run)}</h2>")
        if run.notes:
            parts.append(f"<p>{notes(run)}</p>")
        headers = ["point", "parameters", "runs (manifests)"]
        headers += [f"{m} median [CI] ({columns.unit_of(m) or '-'})" for m in metrics]
        body = []
        for r, label in zip(rows, labels, strict=True):
            ids = children.get(r.get("point"), [])
            runs = " ".join(run_link(by_id[c]) if c in by_id else _e(c) for c in ids) or "-"
            point_cells = [_f(r.get("point"), "d"), _e(label), runs]
            for m in metrics:
                cell = (
                    f"{_f(r.get(f'{m}_median'), '.4g')} [{_f(r.get(f'{m}_ci_low'), '.4g')}, "
                    f"{_f(r.get(f'{m}_ci_high'), '.4g')}]"
                )
                if r.get(f"{m}_unstable"):
                    cell += ' <span class="note">unstable</span>'
                point_cells.append(cell)
            body.append(point_cells)
        parts.append(_table(headers, body))
    return parts

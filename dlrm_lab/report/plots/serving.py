"""Inference figures: latency CDFs, QPS against the bound's percentile, batching x co-location."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from matplotlib.figure import Figure

from dlrm_lab.report.plots.common import MAX_CURVES, as_number, as_text, save_figure

if TYPE_CHECKING:
    from dlrm_lab.report.load import ReportRow


def _floor_line(draw: Any, label: str, floors: dict[str, float] | None, color: Any, drawn: dict[str, float]) -> None:
    """A curve's latency floor as a dotted line in its colour (`draw`: the axes' axvline or
    axhline), noted in `drawn`; nothing for a missing or non-positive floor."""
    floor = as_number((floors or {}).get(label))
    if floor is not None and floor > 0:
        drawn[label] = floor
        draw(floor, color=color, linestyle=":", linewidth=1.2)


# ----------------------------------------------------------------------------- 1. latency CDFs


@dataclass
class CdfPlot:
    path: Path
    curves: dict[str, tuple[np.ndarray, np.ndarray]]  # label -> (latency ms ascending, cumulative fraction)
    sla_ms: list[float]
    left_out: int
    floors: dict[str, float] = field(default_factory=dict)  # label -> latency floor drawn (ms)


def latency_cdf(
    latencies: Mapping[str, Sequence[float] | np.ndarray],
    out: Path,
    sla_ms: Sequence[float] = (),
    left_out: int = 0,
    max_points: int = 2000,
    floors: dict[str, float] | None = None,
) -> CdfPlot:
    """Empirical CDF of each curve's latencies on a log-x axis, the bounds as vertical lines
    and each curve's latency floor (its query at the bound's percentile at the roofline) as
    a dotted vertical line in the curve's colour.

    Curves past `MAX_CURVES` are not drawn (added to `left_out`); long curves are thinned
    to `max_points` steps, always keeping the last one (the maximum, at 1.0)."""
    labels = list(latencies)[:MAX_CURVES]
    left_out += len(latencies) - len(labels)
    fig = Figure(figsize=(11, 5.5), layout="constrained")
    ax = fig.subplots()
    curves: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    drawn_floors: dict[str, float] = {}
    for label in labels:
        x = np.sort(np.asarray(latencies[label], dtype=np.float64))
        x = x[np.isfinite(x)]
        if not len(x):
            continue
        y = np.arange(1, len(x) + 1) / len(x)
        if len(x) > max_points:
            keep = np.unique(np.linspace(0, len(x) - 1, max_points).astype(np.int64))
            x, y = x[keep], y[keep]
        curves[label] = (x, y)
        (line,) = ax.step(x, y, where="post", label=as_text(f"{label} (n={len(latencies[label])})"))
        _floor_line(ax.axvline, label, floors, line.get_color(), drawn_floors)
    if drawn_floors:
        ax.plot([], [], color="gray", linestyle=":", label="latency floor (dotted, curve's colour)")
    for b in sla_ms:
        ax.axvline(b, color="red", linestyle="--", linewidth=1.2, label=f"SLA bound {b:g} ms")
    ax.set_xscale("log")
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("latency (ms, log scale)")
    ax.set_ylabel("fraction of completed queries")
    more = f" ({left_out} more curve(s) not drawn)" if left_out else ""
    ax.set_title(f"Latency CDF of completed queries{more}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7)
    return CdfPlot(save_figure(fig, out), curves, list(sla_ms), left_out, drawn_floors)


# ----------------------------------------------------------------------------- 2. QPS against p99


@dataclass
class QpsPlot:
    path: Path
    series: dict[str, list[tuple[float, float]]]  # label -> (queries/s, latency at the percentile) by rate
    chosen: list[tuple[str, float, float]]  # (label, best_qps, best_sla_latency_ms)
    bounds: list[float]
    left_out: int = 0
    floors: dict[str, float] = field(default_factory=dict)  # label -> latency floor drawn (ms)


def qps_latency(
    series: dict[str, Sequence[tuple[float, float]]],
    out: Path,
    bounds: Sequence[float] = (),
    chosen: Sequence[tuple[str, float, float]] = (),
    percentile: float | None = None,
    floors: dict[str, float] | None = None,
) -> QpsPlot:
    """Achieved queries/s against the latency at the bound's percentile, one line per
    configuration; the bounds as horizontal lines, each configuration's latency floor as a
    dotted line in its colour, and each search's chosen point starred."""
    labels = list(series)[:MAX_CURVES]
    fig = Figure(figsize=(11, 5.5), layout="constrained")
    ax = fig.subplots()
    drawn: dict[str, list[tuple[float, float]]] = {}
    drawn_floors: dict[str, float] = {}
    for label in labels:
        pts = sorted(
            (x, y)
            for x, y in ((as_number(a), as_number(b)) for a, b in series[label])
            if x is not None and y is not None
        )
        if not pts:
            continue
        drawn[label] = pts
        (line,) = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=4, label=as_text(label))
        _floor_line(ax.axhline, label, floors, line.get_color(), drawn_floors)
    if drawn_floors:
        ax.plot([], [], color="gray", linestyle=":", label="latency floor (dotted, line's colour)")
    for b in bounds:
        ax.axhline(b, color="red", linestyle="--", linewidth=1.2, label=f"bound {b:g} ms")
    marked = []
    for label, qps, lat in chosen:
        if as_number(qps) is None or as_number(lat) is None:
            continue
        marked.append((label, float(qps), float(lat)))
        ax.plot(
            [qps],
            [lat],
            marker="*",
            markersize=18,
            color="gold",
            markeredgecolor="black",
            linestyle="none",
            label=as_text(f"chosen: {label}"),
        )
        ax.annotate(f"{qps:,.1f} q/s, {lat:.2f} ms", (qps, lat), textcoords="offset points", xytext=(8, 8), fontsize=8)
    ax.set_xlabel("achieved throughput (queries/s)")
    pct = f"p{percentile:g}" if percentile is not None else "the bound's percentile"
    ax.set_ylabel(f"latency at {pct} (ms)")
    more = f" ({len(series) - len(labels)} more configuration(s) not drawn)" if len(series) > len(labels) else ""
    ax.set_title(f"Throughput against tail latency{more}")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7)
    return QpsPlot(save_figure(fig, out), drawn, marked, list(bounds), len(series) - len(labels), drawn_floors)


# ----------------------------------------------------------------------------- 3. batching x co-location


@dataclass
class Heatmap:
    path: Path
    rows: list[str]  # layouts "instances x threads"
    cols: list[int]  # max_batch
    delays: list[float]  # one panel per max_delay_ms
    matrices: dict[float, np.ndarray]  # delay -> best_samples_per_s[row, col] (NaN: not searched)
    best: tuple[str, int, float] | None = None  # the frontier's chosen (layout, max_batch, delay)


def batching_heatmap(frontier: Sequence[ReportRow], out: Path, title: str = "") -> Heatmap:
    """Latency-bounded samples/s per layout (rows) and max batch (columns), one panel per
    max delay: the delay is a third axis, and a best-over-delays panel would hide it."""
    rows_key = sorted({(r["instances"], r["threads_per_instance"]) for r in frontier})
    cols = sorted({r["max_batch"] for r in frontier})
    delays = sorted({r["max_delay_ms"] for r in frontier})
    row_names = [f"{i} x {t}" for i, t in rows_key]
    matrices = {d: np.full((len(rows_key), len(cols)), np.nan) for d in delays}
    best = None
    for r in frontier:
        v = as_number(r.get("best_samples_per_s"))
        i, j = rows_key.index((r["instances"], r["threads_per_instance"])), cols.index(r["max_batch"])
        matrices[r["max_delay_ms"]][i, j] = np.nan if v is None else v
        if r.get("best"):
            best = (row_names[i], r["max_batch"], r["max_delay_ms"])
    finite = [m[np.isfinite(m)] for m in matrices.values()]
    vmax = max((float(f.max()) for f in finite if len(f)), default=1.0) or 1.0
    fig = Figure(
        figsize=(min(5 + 4 * len(delays) * max(1, len(cols)) / 4, 24), 1.5 + 0.6 * len(rows_key)), layout="constrained"
    )
    axes = np.atleast_1d(fig.subplots(1, len(delays), squeeze=False)[0])
    image = None
    for ax, d in zip(axes, delays, strict=True):
        m = matrices[d]
        image = ax.imshow(m, cmap="viridis", vmin=0, vmax=vmax, aspect="auto")
        for i in range(m.shape[0]):
            for j in range(m.shape[1]):
                cell = m[i, j]
                text = "-" if not np.isfinite(cell) else f"{cell:,.0f}"
                dark = np.isfinite(cell) and cell < 0.6 * vmax
                ax.text(j, i, text, ha="center", va="center", fontsize=8, color="white" if dark else "black")
        if best is not None and best[2] == d:
            bi, bj = row_names.index(best[0]), cols.index(best[1])
            ax.add_patch(_box(bj, bi))
        ax.set_xticks(range(len(cols)), [str(c) for c in cols])
        ax.set_yticks(range(len(row_names)), row_names)
        ax.set_xlabel("max batch (samples)")
        ax.set_title(f"max delay {d:g} ms", fontsize=10)
    axes[0].set_ylabel("instances x threads")
    if image is not None:
        fig.colorbar(image, ax=list(axes), label="best samples/s under the bound")
    fig.suptitle(as_text(title or "Latency-bounded throughput by batching and co-location"), fontsize=11)
    return Heatmap(save_figure(fig, out), row_names, cols, delays, matrices, best)


def _box(x: int, y: int) -> Any:
    from matplotlib.patches import Rectangle

    return Rectangle((x - 0.5, y - 0.5), 1, 1, fill=False, edgecolor="red", linewidth=2.5)


# ----------------------------------------------------------------------------- 4. the tail's latency in parts


@dataclass
class LatencyParts:
    path: Path
    labels: list[str]
    ms: dict[str, list[float]]  # part -> mean ms over each point's tail queries, one value per bar (0 where absent)
    floors: list[float | None]


def latency_parts(rows: Sequence[ReportRow], parts: Sequence[str], out: Path) -> LatencyParts:
    """One bar per point: the mean latency of its tail queries (at or above the bound's percentile) cut
    into `parts` (`tail_<part>_ms`, which add up to it), the point's latency floor marked on the bar."""
    from dlrm_lab.report.plots.common import MAX_BARS

    rows = [r for r in rows if any(as_number(r.get(f"tail_{p}_ms")) for p in parts)][:MAX_BARS]
    ms = {p: [as_number(r.get(f"tail_{p}_ms")) or 0.0 for r in rows] for p in parts}
    labels = [str(r.get("label", r.get("run_id"))) for r in rows]
    floors = [as_number(r.get("latency_floor_ms")) for r in rows]
    fig = Figure(figsize=(max(7, 1 + 0.8 * len(rows)), 6), layout="constrained")
    ax = fig.subplots()
    x = np.arange(len(rows))
    bottom = np.zeros(len(rows))
    for p in parts:
        vals = np.array(ms[p])
        if vals.any():
            ax.bar(x, vals, bottom=bottom, label=p.replace("_", " "))
            bottom += vals
    for i, f in enumerate(floors):
        if f:
            ax.hlines(f, i - 0.4, i + 0.4, colors="black", linestyles=":", linewidth=1.5)
    ax.set_xticks(x, [as_text(lb) for lb in labels], rotation=30 if len(rows) > 4 else 0, ha="right", fontsize=8)
    ax.set_ylabel("ms (mean over the tail's queries)")
    ax.set_title("Where the tail's latency went (dotted: the latency floor)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    return LatencyParts(save_figure(fig, out), labels, ms, floors)

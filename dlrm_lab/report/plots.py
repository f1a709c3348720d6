"""The report's plots: each takes plain data, writes one PNG and returns what it drew.

Figures are built on `matplotlib.figure.Figure` directly (rendered by Agg when saved),
so no pyplot state, GUI backend or screen is involved and plots can be drawn anywhere.
The returned dataclasses hold the drawn values, so tests check content, not just files.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
from matplotlib.figure import Figure

from dlrm_lab.metrics.columns import PHASES, unit_of

MAX_CURVES = 12
MAX_BARS = 40
MAX_LABELS = 20  # roofline points annotated with their name
MAX_PANELS = 12  # sweep metrics drawn
DPI = 100


def _text(s: Any) -> str:
    return str(s).replace("$", r"\$")  # a pair of $ would start matplotlib's mathtext


def _save(fig: Figure, out: Path) -> Path:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=DPI)
    return out


def _num(v: Any) -> float | None:
    """A finite float, or None (null, NaN, infinite)."""
    if v is None:
        return None
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if np.isfinite(f) else None


# ----------------------------------------------------------------------------- 1. latency CDFs


@dataclass
class CdfPlot:
    path: Path
    curves: dict[str, tuple[np.ndarray, np.ndarray]]  # label -> (latency ms ascending, cumulative fraction)
    sla_ms: list[float]
    left_out: int


def latency_cdf(
    latencies: dict[str, Sequence[float]],
    out: Path,
    sla_ms: Sequence[float] = (),
    left_out: int = 0,
    max_points: int = 2000,
) -> CdfPlot:
    """Empirical CDF of each curve's latencies on a log-x axis, the bounds as vertical lines.

    Curves past `MAX_CURVES` are not drawn (added to `left_out`); long curves are thinned
    to `max_points` steps, always keeping the last one (the maximum, at 1.0)."""
    labels = list(latencies)[:MAX_CURVES]
    left_out += len(latencies) - len(labels)
    fig = Figure(figsize=(11, 5.5), layout="constrained")
    ax = fig.subplots()
    curves: dict[str, tuple[np.ndarray, np.ndarray]] = {}
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
        ax.step(x, y, where="post", label=_text(f"{label} (n={len(latencies[label])})"))
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
    return CdfPlot(_save(fig, out), curves, list(sla_ms), left_out)


# ----------------------------------------------------------------------------- 2. QPS against p99


@dataclass
class QpsPlot:
    path: Path
    series: dict[str, list[tuple[float, float]]]  # label -> (queries/s, latency at the percentile) by rate
    chosen: list[tuple[str, float, float]]  # (label, best_qps, best_sla_latency_ms)
    bounds: list[float]
    left_out: int = 0


def qps_latency(
    series: dict[str, Sequence[tuple[float, float]]],
    out: Path,
    bounds: Sequence[float] = (),
    chosen: Sequence[tuple[str, float, float]] = (),
    percentile: float | None = None,
) -> QpsPlot:
    """Achieved queries/s against the latency at the bound's percentile, one line per
    configuration; the bounds as horizontal lines and each search's chosen point starred."""
    labels = list(series)[:MAX_CURVES]
    fig = Figure(figsize=(11, 5.5), layout="constrained")
    ax = fig.subplots()
    drawn: dict[str, list[tuple[float, float]]] = {}
    for label in labels:
        pts = sorted(
            (x, y) for x, y in ((_num(a), _num(b)) for a, b in series[label]) if x is not None and y is not None
        )
        if not pts:
            continue
        drawn[label] = pts
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=4, label=_text(label))
    for b in bounds:
        ax.axhline(b, color="red", linestyle="--", linewidth=1.2, label=f"bound {b:g} ms")
    marked = []
    for label, qps, lat in chosen:
        if _num(qps) is None or _num(lat) is None:
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
            label=_text(f"chosen: {label}"),
        )
        ax.annotate(f"{qps:,.1f} q/s, {lat:.2f} ms", (qps, lat), textcoords="offset points", xytext=(8, 8), fontsize=8)
    ax.set_xlabel("achieved throughput (queries/s)")
    pct = f"p{percentile:g}" if percentile is not None else "the bound's percentile"
    ax.set_ylabel(f"latency at {pct} (ms)")
    more = f" ({len(series) - len(labels)} more configuration(s) not drawn)" if len(series) > len(labels) else ""
    ax.set_title(f"Throughput against tail latency{more}")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7)
    return QpsPlot(_save(fig, out), drawn, marked, list(bounds), len(series) - len(labels))


# ----------------------------------------------------------------------------- 3. batching x co-location


@dataclass
class Heatmap:
    path: Path
    rows: list[str]  # layouts "instances x threads"
    cols: list[int]  # max_batch
    delays: list[float]  # one panel per max_delay_ms
    matrices: dict[float, np.ndarray]  # delay -> best_samples_per_s[row, col] (NaN: not searched)
    best: tuple[str, int, float] | None = None  # the frontier's chosen (layout, max_batch, delay)


def batching_heatmap(frontier: Sequence[dict[str, Any]], out: Path, title: str = "") -> Heatmap:
    """Latency-bounded samples/s per layout (rows) and max batch (columns), one panel per
    max delay: the delay is a third axis, and a best-over-delays panel would hide it."""
    rows_key = sorted({(r["instances"], r["threads_per_instance"]) for r in frontier})
    cols = sorted({r["max_batch"] for r in frontier})
    delays = sorted({r["max_delay_ms"] for r in frontier})
    row_names = [f"{i} x {t}" for i, t in rows_key]
    matrices = {d: np.full((len(rows_key), len(cols)), np.nan) for d in delays}
    best = None
    for r in frontier:
        v = _num(r.get("best_samples_per_s"))
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
                v = m[i, j]
                text = "-" if not np.isfinite(v) else f"{v:,.0f}"
                dark = np.isfinite(v) and v < 0.6 * vmax
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
    fig.suptitle(_text(title or "Latency-bounded throughput by batching and co-location"), fontsize=11)
    return Heatmap(_save(fig, out), row_names, cols, delays, matrices, best)


def _box(x: int, y: int) -> Any:
    from matplotlib.patches import Rectangle

    return Rectangle((x - 0.5, y - 0.5), 1, 1, fill=False, edgecolor="red", linewidth=2.5)


# ----------------------------------------------------------------------------- 4. training phases


@dataclass
class PhaseBars:
    path: Path
    labels: list[str]
    ms: dict[str, list[float]]  # segment -> ms per step, one value per bar (0 where absent)
    step_time_ms: list[float]
    samples_per_s: list[float | None]
    left_out: int = 0


SEGMENTS = (*PHASES, "other", "unattributed")


def training_phases(rows: Sequence[dict[str, Any]], out: Path) -> PhaseBars:
    """One bar per run: ms per step in each phase = `<phase>_share` x step_time_ms_mean.

    Time the shares do not cover is `other`; a pipelined run (phases overlap, shares
    null) is one `unattributed` segment. Each bar is therefore its step_time_ms_mean."""
    rows = [r for r in rows if _num(r.get("step_time_ms_mean"))][:MAX_BARS]
    ms: dict[str, list[float]] = {s: [] for s in SEGMENTS}
    for r in rows:
        step = float(r["step_time_ms_mean"])
        shares = {p: _num(r.get(f"{p}_share")) for p in PHASES}
        known = any(v is not None for v in shares.values())
        for p in PHASES:
            ms[p].append((shares[p] or 0.0) * step)
        ms["other"].append(max(0.0, step - sum(ms[p][-1] for p in PHASES)) if known else 0.0)
        ms["unattributed"].append(0.0 if known else step)
    labels = [str(r.get("label", r.get("run_id"))) for r in rows]
    fig = Figure(figsize=(max(7, 1 + 0.7 * len(rows)), 6), layout="constrained")
    ax = fig.subplots()
    x = np.arange(len(rows))
    bottom = np.zeros(len(rows))
    colors = {"other": "#bbbbbb", "unattributed": "#dddddd"}
    for seg in SEGMENTS:
        vals = np.array(ms[seg])
        if not vals.any():
            continue
        ax.bar(x, vals, bottom=bottom, label=seg.replace("_", " "), color=colors.get(seg))
        bottom += vals
    sps = [_num(r.get("samples_per_s")) for r in rows]
    for i, v in enumerate(sps):
        if v is not None:
            ax.annotate(
                f"{v:,.0f}\nsamples/s",
                (i, bottom[i]),
                textcoords="offset points",
                xytext=(0, 3),
                ha="center",
                fontsize=7,
            )
    ax.set_xticks(x, [_text(lb) for lb in labels], rotation=30 if len(rows) > 4 else 0, ha="right", fontsize=8)
    ax.set_ylabel("ms per step (mean over measured steps)")
    ax.set_ylim(0, max(bottom.max() * 1.2 if len(rows) else 1.0, 1e-9))
    ax.set_title("Training step time by phase, throughput on top")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    steps = [float(r["step_time_ms_mean"]) for r in rows]
    return PhaseBars(_save(fig, out), labels, ms, steps, sps)


# ----------------------------------------------------------------------------- 5. scaling


@dataclass
class ScalingPlot:
    path: Path
    lines: dict[str, dict[str, list[float]]]  # label -> ranks, efficiency, speedup (by ranks)


def scaling_efficiency(rows: Sequence[dict[str, Any]], out: Path) -> ScalingPlot:
    """Efficiency (and speedup) against ranks, one line per `label` (the sweep's mode)."""
    lines: dict[str, dict[str, list[float]]] = {}
    for r in sorted(rows, key=lambda r: r["ranks"]):
        if _num(r.get("efficiency")) is None:
            continue
        line = lines.setdefault(str(r.get("label") or r.get("mode")), {"ranks": [], "efficiency": [], "speedup": []})
        line["ranks"].append(int(r["ranks"]))
        line["efficiency"].append(float(r["efficiency"]))
        line["speedup"].append(_num(r.get("speedup")) or float("nan"))
    fig = Figure(figsize=(11, 4.5), layout="constrained")
    eff_ax, sp_ax = fig.subplots(1, 2)
    ranks = sorted({n for line in lines.values() for n in line["ranks"]})
    for label, line in lines.items():
        eff_ax.plot(line["ranks"], line["efficiency"], marker="o", label=_text(label))
        sp_ax.plot(line["ranks"], line["speedup"], marker="o", label=_text(label))
    eff_ax.axhline(1.0, color="black", linestyle="--", linewidth=1, label="ideal")
    if ranks:
        sp_ax.plot(ranks, ranks, color="black", linestyle="--", linewidth=1, label="ideal")
    for ax, name in ((eff_ax, "efficiency (speedup / ranks)"), (sp_ax, "speedup (x one rank)")):
        ax.set_xlabel("ranks")
        ax.set_ylabel(name)
        ax.set_xticks(ranks)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    eff_ax.set_ylim(0, max([1.1, *[v * 1.1 for line in lines.values() for v in line["efficiency"]]]))
    fig.suptitle("Weak and strong scaling")
    return ScalingPlot(_save(fig, out), lines)


# ----------------------------------------------------------------------------- 6. roofline


@dataclass
class RooflinePoint:
    label: str
    intensity: float  # FLOP per byte of embedding rows
    flops_per_s: float
    fraction: float | None
    bound_by: str | None
    ceiling_id: str | None
    ceiling: float | None  # the roof at this intensity: min(GEMM peak, gather bandwidth x intensity)


@dataclass
class RooflinePlot:
    path: Path
    points: list[RooflinePoint]
    ceilings: dict[str, dict[str, Any]]


def roof_at(ceiling: dict[str, Any], intensity: float, precision: str | None) -> float:
    compute = ceiling["compute"]
    peak = compute.get(precision or "fp32") or compute.get("fp32") or max(compute.values())
    return min(peak, ceiling["gather_bytes_per_s"] * intensity)


def roofline(points: Sequence[dict[str, Any]], ceilings: dict[str, dict[str, Any]], out: Path) -> RooflinePlot:
    """Each run at (flops_per_sample / bytes_per_sample, achieved_flops_per_s), log-log,
    under the ceilings of its machine profile: per precision min(GEMM peak, gather x I).
    `points[i]["ceiling"]` names its entry of `ceilings` (None: no profile, no roof)."""
    placed: list[RooflinePoint] = []
    for p in points:
        flops, nbytes, achieved = (
            _num(p.get(k)) for k in ("flops_per_sample", "bytes_per_sample", "achieved_flops_per_s")
        )
        if not flops or not nbytes or not achieved:
            continue
        intensity = flops / nbytes
        cid = p.get("ceiling") if p.get("ceiling") in ceilings else None
        roof = roof_at(ceilings[cid], intensity, p.get("precision")) if cid else None
        placed.append(
            RooflinePoint(
                str(p.get("label")),
                intensity,
                achieved,
                _num(p.get("roofline_fraction")),
                p.get("roofline_bound_by"),
                cid,
                roof,
            )
        )
    fig = Figure(figsize=(10, 6.5), layout="constrained")
    ax = fig.subplots()
    xs = [pt.intensity for pt in placed]
    ridges = [max(c["compute"].values()) / c["gather_bytes_per_s"] for c in ceilings.values() if c["compute"]]
    lo, hi = min(xs + ridges) / 10, max(xs + ridges) * 10
    grid = np.logspace(np.log10(lo), np.log10(hi), 200)
    styles = ["-", "--", ":", "-."]
    for k, (cid, c) in enumerate(ceilings.items()):
        for prec, peak in sorted(c["compute"].items()):
            ax.plot(
                grid,
                np.minimum(peak, c["gather_bytes_per_s"] * grid),
                linestyle=styles[k % len(styles)],
                linewidth=1.3,
                label=_text(
                    f"{cid} {prec}: {peak / 1e9:,.0f} GFLOP/s, gather {c['gather_bytes_per_s'] / 1e9:,.1f} GB/s"
                ),
            )
    ax.scatter(xs, [pt.flops_per_s for pt in placed], color="crimson", zorder=5, label="runs")
    for (x, y), group in _coincident(placed[:MAX_LABELS]).items():
        pt = group[0]
        extra = []
        if pt.fraction is not None:
            extra.append(f"{pt.fraction:.0%} of roof")
        if pt.bound_by:
            extra.append(f"{pt.bound_by}-bound")
        names = ", ".join(p.label for p in group[:3]) + (f" +{len(group) - 3} more" if len(group) > 3 else "")
        text = names + (f"\n{', '.join(extra)}" if extra else "")
        ax.annotate(_text(text), (x, y), textcoords="offset points", xytext=(6, -4), fontsize=7)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP per byte of embedding rows)")
    ax.set_ylabel("achieved FLOP/s")
    title = "Roofline" if ceilings else "Roofline (no machine profile: points without ceilings)"
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(fontsize=7, loc="lower right")
    return RooflinePlot(_save(fig, out), placed, dict(ceilings))


def _coincident(points: list[RooflinePoint]) -> dict[tuple[float, float], list[RooflinePoint]]:
    """Points drawn on top of each other (repeats, one model at several points) share one label."""
    groups: dict[tuple[float, float], list[RooflinePoint]] = {}
    for pt in points:
        key = (round(float(np.log10(pt.intensity)), 2), round(float(np.log10(pt.flops_per_s)), 2))
        groups.setdefault(key, []).append(pt)
    return {(g[0].intensity, g[0].flops_per_s): g for g in groups.values()}


# ----------------------------------------------------------------------------- 7. energy


@dataclass
class EnergyPlot:
    path: Path
    samples_per_s_per_w: dict[str, float]
    energy_per_query_j: dict[str, float]


def energy(rows: Sequence[dict[str, Any]], out: Path) -> EnergyPlot:
    """Samples/s per watt per run or point, and joules per query where it is inference."""
    eff = {str(r["label"]): v for r in rows if (v := _num(r.get("samples_per_s_per_w"))) is not None}
    per_query = {str(r["label"]): v for r in rows if (v := _num(r.get("energy_per_query_j"))) is not None}
    panels = [("samples/s per W (higher is better)", eff)]
    if per_query:
        panels.append(("J per query (lower is better)", per_query))
    n = max(len(eff), len(per_query), 1)
    fig = Figure(figsize=(6 * len(panels) + 2, 1.5 + 0.35 * n), layout="constrained")
    axes = np.atleast_1d(fig.subplots(1, len(panels), squeeze=False)[0])
    for ax, (name, values) in zip(axes, panels, strict=True):
        labels = list(values)
        ax.barh(range(len(labels)), [values[k] for k in labels], color="seagreen")
        ax.set_yticks(range(len(labels)), [_text(lb) for lb in labels], fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel(name)
        ax.grid(True, axis="x", alpha=0.3)
        for i, k in enumerate(labels):
            ax.annotate(f"{values[k]:,.3g}", (values[k], i), textcoords="offset points", xytext=(3, -3), fontsize=7)
    fig.suptitle("Energy efficiency (measured sensors only)")
    return EnergyPlot(_save(fig, out), eff, per_query)


# ----------------------------------------------------------------------------- 8. sweeps


@dataclass
class SweepPlot:
    path: Path
    labels: list[str]  # x: one per point, from params_json
    metrics: dict[str, dict[str, list[Any]]] = field(default_factory=dict)  # median, ci_low, ci_high, unstable
    left_out: list[str] = field(default_factory=list)  # metrics beyond MAX_PANELS
    empty: list[str] = field(default_factory=list)  # metrics without a single median (not drawn)


def point_labels(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Short x labels of sweep summary rows: the parameters that differ between points (all
    of them if none do), plus the child's point/model/mode when a point has several rows
    (an inference point serving several models, or alone and together)."""
    params: list[Any] = []
    for r in rows:
        raw = r.get("params_json")
        try:
            params.append(json.loads(raw) if raw else None)
        except (TypeError, ValueError):
            params.append(raw)
    if params and all(isinstance(p, dict) for p in params):
        keys = list(dict.fromkeys(k for p in params for k in p))
        varying = [k for k in keys if len({json.dumps(p.get(k), sort_keys=True) for p in params}) > 1] or keys
        labels = [", ".join(f"{k}={_fmt(p.get(k))}" for k in varying) for p in params]
    else:
        labels = [str(p) if p is not None else f"p{r.get('point')}" for p, r in zip(params, rows, strict=True)]
    if len({r.get("point") for r in rows}) < len(rows):  # several rows per point: say which child row
        for k, r in enumerate(rows):
            child = [str(r[c]) for c in ("child_model", "child_mode") if r.get(c) is not None]
            if r.get("child_point") is not None:
                child.insert(0, f"p{r['child_point']}")
            if child:
                labels[k] += f" [{' '.join(child)}]"
    return labels


def _fmt(v: Any) -> str:
    return v if isinstance(v, str) else json.dumps(v, separators=(",", ":"))


def sweep_medians(table: pa.Table | Sequence[dict[str, Any]], out: Path, title: str = "") -> SweepPlot:
    """Per metric with `<metric>_median`: the median and its CI against the point's
    parameters; points flagged `_unstable` drawn as red open markers."""
    rows = table.to_pylist() if isinstance(table, pa.Table) else list(table)
    names = list(rows[0]) if rows else []
    metrics = [c[: -len("_median")] for c in names if c.endswith("_median")]
    empty = [m for m in metrics if all(_num(r.get(f"{m}_median")) is None for r in rows)]
    with_values = [m for m in metrics if m not in empty]
    drawn, left_out = with_values[:MAX_PANELS], with_values[MAX_PANELS:]
    labels = point_labels(rows)
    ncols = min(3, max(1, len(drawn)))
    nrows = -(-max(1, len(drawn)) // ncols)
    width = max(4.5 * ncols, min(0.35 * len(rows) * ncols, 24))
    fig = Figure(figsize=(width, 3.6 * nrows + 0.8), layout="constrained")
    axes = np.atleast_1d(fig.subplots(nrows, ncols, squeeze=False).ravel())
    x = np.arange(len(rows))
    step = max(1, len(rows) // 30)  # at most ~30 tick labels
    result: dict[str, dict[str, list[Any]]] = {}
    for ax, m in zip(axes, drawn, strict=False):
        med = [_num(r.get(f"{m}_median")) for r in rows]
        low = [_num(r.get(f"{m}_ci_low")) for r in rows]
        high = [_num(r.get(f"{m}_ci_high")) for r in rows]
        unstable = [bool(r.get(f"{m}_unstable")) for r in rows]
        result[m] = {"median": med, "ci_low": low, "ci_high": high, "unstable": unstable}
        y = np.array([np.nan if v is None else v for v in med])
        below = [0.0 if v is None or lo is None else max(0.0, v - lo) for v, lo in zip(med, low, strict=True)]
        above = [0.0 if v is None or hi is None else max(0.0, hi - v) for v, hi in zip(med, high, strict=True)]
        err = np.array([below, above])
        ax.errorbar(
            x, y, yerr=err, fmt="o", color="steelblue", ecolor="gray", capsize=3, markersize=4, label="median, CI"
        )
        bad = np.array(unstable)
        if bad.any():
            ax.plot(
                x[bad],
                y[bad],
                "o",
                markersize=11,
                markerfacecolor="none",
                markeredgecolor="red",
                markeredgewidth=1.5,
                label="unstable",
            )
        ax.set_title(_text(f"{m} ({unit_of(m)})" if unit_of(m) else m), fontsize=10)
        ax.set_xticks(x[::step], [_text(lb) for lb in labels[::step]], rotation=45, ha="right", fontsize=7)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    for ax in axes[len(drawn) :]:
        ax.set_visible(False)
    more = f" ({len(left_out)} more metric(s) in the table only)" if left_out else ""
    fig.suptitle(_text((title or "Sweep") + more), fontsize=11)
    return SweepPlot(_save(fig, out), labels, result, left_out, empty)

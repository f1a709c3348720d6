"""Figures against the machine: roofline placement, energy efficiency."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from matplotlib.figure import Figure

from dlrm_lab.report.plots.common import MAX_LABELS, as_number, as_text, save_figure

if TYPE_CHECKING:
    from dlrm_lab.report.load import Ceilings, ReportRow
    from dlrm_lab.report.machines import MachineRow

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
    ceilings: dict[str, Ceilings]
    lines: list[str]  # the ceilings drawn, as the legend names them


def roof_at(ceiling: Ceilings, intensity: float, precision: str | None) -> float:
    compute = ceiling["compute"]
    peak = compute.get(precision or "fp32") or compute.get("fp32") or max(compute.values())
    return min(peak, ceiling["gather_bytes_per_s"] * intensity)


def roofline(points: Sequence[ReportRow], ceilings: dict[str, Ceilings], out: Path) -> RooflinePlot:
    """Each run at (flops_per_sample / bytes_per_sample, achieved_flops_per_s), log-log,
    under the ceilings of its machine profile: per precision min(GEMM peak, gather x I).
    `points[i]["ceiling"]` names its entry of `ceilings` (None: no profile, no roof)."""
    placed: list[RooflinePoint] = []
    for p in points:
        flops, nbytes, achieved = (
            as_number(p.get(k)) for k in ("flops_per_sample", "bytes_per_sample", "achieved_flops_per_s")
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
                as_number(p.get("roofline_fraction")),
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
        rows = c.get("gather_rows_per_s")
        for prec, peak in sorted(c["compute"].items()):
            ax.plot(
                grid,
                np.minimum(peak, c["gather_bytes_per_s"] * grid),
                linestyle=styles[k % len(styles)],
                linewidth=1.3,
                label=as_text(
                    f"{cid} {prec}: {peak / 1e9:,.0f} GFLOP/s, gather {c['gather_bytes_per_s'] / 1e9:,.1f} GB/s"
                    + (f", {rows / 1e6:,.0f} M rows/s" if rows else "")
                ),
            )
        base = c.get("gather_base_bytes_per_s")
        if base and base < c["gather_bytes_per_s"] / 1.05:  # tables left on 4 KiB pages meet a lower roof
            ax.plot(
                grid,
                np.minimum(max(c["compute"].values()), base * grid),
                linestyle=":",
                color="grey",
                linewidth=1.0,
                label=as_text(f"{cid}: gather on 4 KiB pages {base / 1e9:,.1f} GB/s"),
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
        ax.annotate(as_text(text), (x, y), textcoords="offset points", xytext=(6, -4), fontsize=7)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP per byte of embedding rows)")
    ax.set_ylabel("achieved FLOP/s")
    title = "Roofline" if ceilings else "Roofline (no machine profile: points without ceilings)"
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(fontsize=7, loc="lower right")
    lines = [str(line.get_label()) for line in ax.get_lines()]
    return RooflinePlot(save_figure(fig, out), placed, dict(ceilings), lines)


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


def energy(rows: Sequence[ReportRow], out: Path) -> EnergyPlot:
    """Samples/s per watt per run or point, and joules per query where it is inference."""
    eff = {str(r["label"]): v for r in rows if (v := as_number(r.get("samples_per_s_per_w"))) is not None}
    per_query = {str(r["label"]): v for r in rows if (v := as_number(r.get("energy_per_query_j"))) is not None}
    panels = [("samples/s per W (higher is better)", eff)]
    if per_query:
        panels.append(("J per query (lower is better)", per_query))
    n = max(len(eff), len(per_query), 1)
    fig = Figure(figsize=(6 * len(panels) + 2, 1.5 + 0.35 * n), layout="constrained")
    axes = np.atleast_1d(fig.subplots(1, len(panels), squeeze=False)[0])
    for ax, (name, values) in zip(axes, panels, strict=True):
        labels = list(values)
        ax.barh(range(len(labels)), [values[k] for k in labels], color="seagreen")
        ax.set_yticks(range(len(labels)), [as_text(lb) for lb in labels], fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel(name)
        ax.grid(True, axis="x", alpha=0.3)
        for i, k in enumerate(labels):
            ax.annotate(f"{values[k]:,.3g}", (values[k], i), textcoords="offset points", xytext=(3, -3), fontsize=7)
    fig.suptitle("Energy efficiency (measured sensors only)")
    return EnergyPlot(save_figure(fig, out), eff, per_query)


# ----------------------------------------------------------------------------- 8. collectives


@dataclass
class CollectivesPlot:
    path: Path
    lines: dict[str, dict[str, list[tuple[int, float]]]]  # collective -> transport -> (bytes, bus GB/s)


def collectives(transports: dict[str, list[dict[str, Any]]], out: Path) -> CollectivesPlot:
    """Bus bandwidth against message size, one line per transport (`gloo/2`, `mpi/2`, `nccl/8`),
    all-to-all and all-reduce side by side (the machine probe's rows, PARAM/nccl-tests style, as the profile on
    disk holds them)."""
    names = ("all_to_all", "all_reduce")
    lines: dict[str, dict[str, list[tuple[int, float]]]] = {n: {} for n in names}
    for transport, rows in transports.items():
        for r in sorted(rows, key=lambda r: r["bytes"]):
            if r.get("collective") in lines and as_number(r.get("busbw_bytes_per_s")):
                lines[r["collective"]].setdefault(transport, []).append((int(r["bytes"]), r["busbw_bytes_per_s"] / 1e9))
    fig = Figure(figsize=(11, 4.5), layout="constrained")
    for ax, name in zip(fig.subplots(1, 2), names, strict=True):
        for transport, points in lines[name].items():
            ax.plot([b for b, _ in points], [g for _, g in points], marker="o", label=as_text(transport))
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("bytes per rank")
        ax.set_ylabel("bus bandwidth (GB/s)")
        ax.set_title(name.replace("_", "-"))
        ax.grid(True, which="both", alpha=0.3)
        if lines[name]:
            ax.legend(fontsize=8)
    fig.suptitle("Collectives compared (machine probe)")
    return CollectivesPlot(save_figure(fig, out), lines)


# ----------------------------------------------------------------------------- 9. machines side by side


@dataclass
class CostPlot:
    path: Path
    lines: dict[str, list[tuple[float, float]]]  # "machine model" -> (bound ms, cost per 1M inferences)


def cost_per_bound(rows: Sequence[MachineRow], out: Path) -> CostPlot:
    """Cost per 1M inferences against the latency bound, one line per machine and model (`report.machines`)."""
    lines: dict[str, list[tuple[float, float]]] = {}
    for r in rows:
        bound, cost = as_number(r.get("sla_ms")), as_number(r.get("cost_per_1m_queries"))
        if bound is not None and cost is not None:
            lines.setdefault(f"{r['machine']} {r['model']}", []).append((bound, cost))
    fig = Figure(figsize=(7, 4.5), layout="constrained")
    ax = fig.subplots()
    currency = next((r.get("currency") for r in rows if r.get("currency")), "")
    for label, points in lines.items():
        points.sort()
        ax.plot([b for b, _ in points], [c for _, c in points], marker="o", label=as_text(label))
    ax.set_xlabel("latency bound (ms, at its percentile)")
    ax.set_ylabel(f"cost per 1M inferences ({as_text(currency)}, lower is better)")
    ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(fontsize=7)
    ax.set_title("Cost per 1M inferences against the latency bound, per machine")
    return CostPlot(save_figure(fig, out), lines)

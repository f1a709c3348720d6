"""Training figures: step phases per run, scaling efficiency."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from matplotlib.figure import Figure

from dlrm_lab.metrics.columns import PHASES
from dlrm_lab.report.plots.common import MAX_BARS, as_number, as_text, save_figure

if TYPE_CHECKING:
    from matplotlib.typing import ColorType

    from dlrm_lab.config.hstu import RankerShape
    from dlrm_lab.report.load import ReportRow

# ----------------------------------------------------------------------------- 4. training phases


@dataclass
class PhaseBars:
    path: Path
    labels: list[str]
    ms: dict[str, list[float]]  # segment -> ms per step, one value per bar (0 where absent)
    step_time_ms: list[float]
    samples_per_s: list[float | None]
    left_out: int = 0
    floor_ms: dict[str, list[float]] | None = None  # phase -> its floor (`<phase>_floor_ms`), where a profile placed it


SEGMENTS = (*PHASES, "other", "unattributed")


def training_phases(rows: Sequence[ReportRow], out: Path) -> PhaseBars:
    """One bar per run: ms per step in each phase = `<phase>_share` x step_time_ms_mean.

    Time the shares do not cover is `other`; a pipelined run (phases overlap, shares
    null) is one `unattributed` segment. Each bar is therefore its step_time_ms_mean. Where the runs were placed
    on the machine's peaks, a hatched bar beside each stacks its phases' floors (`<phase>_floor_ms`, each phase at its
    own bound): each phase against its bound, and the phase-sum floor's fraction on top."""
    rows = [r for r in rows if as_number(r.get("step_time_ms_mean"))][:MAX_BARS]
    ms: dict[str, list[float]] = {s: [] for s in SEGMENTS}
    for r in rows:
        step = float(r["step_time_ms_mean"])
        shares = {p: as_number(r.get(f"{p}_share")) for p in PHASES}
        known = any(v is not None for v in shares.values())
        for p in PHASES:
            ms[p].append((shares[p] or 0.0) * step)
        ms["other"].append(max(0.0, step - sum(ms[p][-1] for p in PHASES)) if known else 0.0)
        ms["unattributed"].append(0.0 if known else step)
    labels = [str(r.get("label", r.get("run_id"))) for r in rows]
    floors = {p: [as_number(r.get(f"{p}_floor_ms")) or 0.0 for r in rows] for p in PHASES}
    placed = any(as_number(r.get("phase_floor_ms")) for r in rows)
    fig = Figure(figsize=(max(7, 1 + 0.7 * len(rows)), 6), layout="constrained")
    ax = fig.subplots()
    x = np.arange(len(rows))
    bottom = np.zeros(len(rows))
    colors = {"other": "#bbbbbb", "unattributed": "#dddddd"}
    width = 0.4 if placed else 0.8
    measured_x = x - 0.2 if placed else x
    drawn: dict[str, ColorType] = {}
    for seg in SEGMENTS:
        vals = np.array(ms[seg])
        if not vals.any():
            continue
        bars = ax.bar(measured_x, vals, width, bottom=bottom, label=seg.replace("_", " "), color=colors.get(seg))
        drawn[seg] = bars.patches[0].get_facecolor()
        bottom += vals
    if placed:
        floor_bottom = np.zeros(len(rows))
        for p in PHASES:
            vals = np.array(floors[p])
            if vals.any():
                ax.bar(
                    x + 0.2,
                    vals,
                    width,
                    bottom=floor_bottom,
                    color=drawn.get(p, "#888888"),
                    hatch="//",
                    alpha=0.6,
                    edgecolor="black",
                    linewidth=0.3,
                )
                floor_bottom += vals
        for i, r in enumerate(rows):
            if (fraction := as_number(r.get("phase_floor_fraction"))) is not None:
                ax.annotate(
                    f"floor\n{fraction:.2f}",
                    (x[i] + 0.2, floor_bottom[i]),
                    textcoords="offset points",
                    xytext=(0, 3),
                    ha="center",
                    fontsize=6,
                )
    sps = [as_number(r.get("samples_per_s")) for r in rows]
    for i, v in enumerate(sps):
        if v is not None:
            ax.annotate(
                f"{v:,.0f}\nsamples/s",
                (measured_x[i], bottom[i]),
                textcoords="offset points",
                xytext=(0, 3),
                ha="center",
                fontsize=7,
            )
    ax.set_xticks(x, [as_text(lb) for lb in labels], rotation=30 if len(rows) > 4 else 0, ha="right", fontsize=8)
    ax.set_ylabel("ms per step (mean over measured steps)")
    ax.set_ylim(0, max(bottom.max() * 1.2 if len(rows) else 1.0, 1e-9))
    ax.set_title(
        "Training step time by phase, throughput on top"
        + (" (hatched: each phase at its own bound, the phase-sum floor's fraction on top)" if placed else ""),
        fontsize=9 if placed else None,
    )
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    steps = [float(r["step_time_ms_mean"]) for r in rows]
    return PhaseBars(save_figure(fig, out), labels, ms, steps, sps, floor_ms=floors if placed else None)


# ----------------------------------------------------------------------------- 5. scaling


@dataclass
class ScalingPlot:
    path: Path
    lines: dict[str, dict[str, list[float]]]  # label -> ranks, efficiency, speedup, predicted, ceiling (by ranks)


def scaling_efficiency(rows: Sequence[ReportRow], out: Path) -> ScalingPlot:
    """Efficiency (and speedup) against ranks, one line per `label` (the sweep's mode)."""
    lines: dict[str, dict[str, list[float]]] = {}
    for r in sorted(rows, key=lambda r: r["ranks"]):
        if as_number(r.get("efficiency")) is None:
            continue
        line = lines.setdefault(
            str(r.get("label") or r.get("mode")),
            {"ranks": [], "efficiency": [], "speedup": [], "predicted": [], "ceiling": []},
        )
        line["ranks"].append(int(r["ranks"]))
        line["efficiency"].append(float(r["efficiency"]))
        line["speedup"].append(as_number(r.get("speedup")) or float("nan"))
        # predicted efficiency: same per-rank work, so it scales as measured / predicted step time
        measured, predicted = as_number(r.get("rank_step_ms")), as_number(r.get("predicted_step_ms"))
        line["predicted"].append(float(r["efficiency"]) * measured / predicted if measured and predicted else math.nan)
        line["ceiling"].append(as_number(r.get("ceiling_efficiency")) or math.nan)
    fig = Figure(figsize=(11, 4.5), layout="constrained")
    eff_ax, sp_ax = fig.subplots(1, 2)
    ranks = sorted({n for line in lines.values() for n in line["ranks"]})
    for label, line in lines.items():
        drawn = eff_ax.plot(line["ranks"], line["efficiency"], marker="o", label=as_text(label))
        sp_ax.plot(line["ranks"], line["speedup"], marker="o", label=as_text(label))
        colour = drawn[0].get_color()
        if any(not math.isnan(v) for v in line["predicted"]):
            eff_ax.plot(
                line["ranks"],
                line["predicted"],
                marker="s",
                linestyle=":",
                color=colour,
                label=as_text(f"{label}: predicted"),
            )
        if any(not math.isnan(v) for v in line["ceiling"]):
            eff_ax.plot(
                line["ranks"],
                line["ceiling"],
                marker="_",
                markersize=14,
                linestyle="none",
                color=colour,
                label=as_text(f"{label}: machine ceiling"),
            )
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
    return ScalingPlot(save_figure(fig, out), lines)


# ----------------------------------------------------------------------------- HSTU: a request's FLOPs


@dataclass
class RequestFlopsPlot:
    path: Path
    history: list[int]
    curves: dict[str, dict[str, list[float]]]  # model label -> {"jagged": GFLOP, "padded": GFLOP} per history
    marks: dict[str, tuple[float, float]]  # run label -> (its mean history, its GFLOP at it)


def request_flops(
    models: dict[str, tuple[RankerShape, int, int]], runs: dict[str, tuple[str, float]], out: Path
) -> RequestFlopsPlot:
    """Forward GFLOP of one request against its history (log-log), per HSTU model (`models`: label ->
    (RankerShape, candidates, longest history)): valid attention pairs (jagged) and the padded n x n;
    each run (`runs`: label -> (model label, mean history)) marked where its requests sit."""
    top = max(int(longest) for _, _, longest in models.values())
    history = np.unique(np.geomspace(1, max(top, 2), 24).astype(int)).tolist()
    curves, marks = {}, {}
    fig = Figure(figsize=(7.5, 4.5), layout="constrained")
    ax = fig.subplots()
    for label, (shape, cands, _) in models.items():
        jag = [shape.request_flops(h, cands) / 1e9 for h in history]
        pad = [shape.request_flops(h, cands, path="padded") / 1e9 for h in history]
        curves[label] = {"jagged": jag, "padded": pad}
        line = ax.plot(history, jag, label=as_text(f"{label}: valid pairs (jagged)"))
        ax.plot(history, pad, linestyle=":", color=line[0].get_color(), label=as_text(f"{label}: padded n x n"))
    for run, (model, mean) in runs.items():
        shape, cands, _ = models[model]
        y = shape.request_flops(round(mean), cands) / 1e9
        marks[run] = (mean, y)
        ax.plot([max(mean, 1)], [y], marker="o", color="black")
        ax.annotate(as_text(run), (max(mean, 1), y), fontsize=7, xytext=(4, -10), textcoords="offset points")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("history items per request")
    ax.set_ylabel("forward GFLOP per request")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.suptitle("HSTU ranker: a request's FLOPs grow with its history squared (attention)")
    return RequestFlopsPlot(save_figure(fig, out), history, curves, marks)

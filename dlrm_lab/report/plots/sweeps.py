"""Sweep figures: each metric's median and CI per point."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
from matplotlib.figure import Figure

from dlrm_lab.metrics.columns import unit_of
from dlrm_lab.report.plots.common import MAX_PANELS, as_number, as_text, save_figure

# ----------------------------------------------------------------------------- 8. sweeps


@dataclass
class SweepPlot:
    path: Path
    labels: list[str]  # x: one per point, from params_json
    metrics: dict[str, dict[str, list[Any]]] = field(default_factory=dict)  # median, ci_low, ci_high, unstable
    left_out: list[str] = field(default_factory=list)  # metrics beyond MAX_PANELS
    empty: list[str] = field(default_factory=list)  # metrics without a single median (not drawn)


def point_labels(rows: Sequence[dict[str, str | float | bool | None]]) -> list[str]:  # summary.parquet's
    """Short x labels of sweep summary rows: the parameters that differ between points (all
    of them if none do), plus the child's point/model/mode when a point has several rows
    (an inference point serving several models, or alone and together)."""
    params: list[Any] = []
    for r in rows:
        raw: Any = r.get("params_json")  # a JSON string as the sweep wrote it; anything else is caught below
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


def sweep_medians(
    table: pa.Table | Sequence[dict[str, str | float | bool | None]], out: Path, title: str = ""
) -> SweepPlot:
    """Per metric with `<metric>_median`: the median and its CI against the point's
    parameters; points flagged `_unstable` drawn as red open markers."""
    rows = table.to_pylist() if isinstance(table, pa.Table) else list(table)
    names = list(rows[0]) if rows else []
    metrics = [c[: -len("_median")] for c in names if c.endswith("_median")]
    empty = [m for m in metrics if all(as_number(r.get(f"{m}_median")) is None for r in rows)]
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
        med = [as_number(r.get(f"{m}_median")) for r in rows]
        low = [as_number(r.get(f"{m}_ci_low")) for r in rows]
        high = [as_number(r.get(f"{m}_ci_high")) for r in rows]
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
        ax.set_title(as_text(f"{m} ({unit_of(m)})" if unit_of(m) else m), fontsize=10)
        ax.set_xticks(x[::step], [as_text(lb) for lb in labels[::step]], rotation=45, ha="right", fontsize=7)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    for ax in axes[len(drawn) :]:
        ax.set_visible(False)
    more = f" ({len(left_out)} more metric(s) in the table only)" if left_out else ""
    fig.suptitle(as_text((title or "Sweep") + more), fontsize=11)
    return SweepPlot(save_figure(fig, out), labels, result, left_out, empty)

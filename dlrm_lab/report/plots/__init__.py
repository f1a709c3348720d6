"""The report's plots: each takes plain data, writes one PNG and returns what it drew.

Figures are built on `matplotlib.figure.Figure` directly (rendered by Agg when saved),
so no pyplot state, GUI backend or screen is involved and plots can be drawn anywhere.
The returned dataclasses hold the drawn values, so tests check content, not just files.
One module per family of figures; this package is where the report finds them all.
"""

from typing import Union

from dlrm_lab.report.plots.canary import MAX_RUNS as MAX_RUNS_CANARY
from dlrm_lab.report.plots.canary import CanaryPlot, CanarySeries, canary_timeline
from dlrm_lab.report.plots.common import MAX_BARS, MAX_CURVES, MAX_LABELS, MAX_PANELS
from dlrm_lab.report.plots.machine import (
    CollectivesPlot,
    CostPlot,
    EnergyPlot,
    RooflinePlot,
    RooflinePoint,
    collectives,
    cost_per_bound,
    energy,
    roof_at,
    roofline,
)
from dlrm_lab.report.plots.serving import (
    CdfPlot,
    Heatmap,
    LatencyParts,
    QpsPlot,
    batching_heatmap,
    latency_cdf,
    latency_parts,
    qps_latency,
)
from dlrm_lab.report.plots.sweeps import SweepPlot, point_labels, sweep_medians
from dlrm_lab.report.plots.training import (
    SEGMENTS,
    PhaseBars,
    RequestFlopsPlot,
    ScalingPlot,
    request_flops,
    scaling_efficiency,
    training_phases,
)

# What a plot function returned, kept by plot name (`report.html.ReportResult.drawn`)
Drawn = Union[
    CanaryPlot,
    CdfPlot,
    CollectivesPlot,
    CostPlot,
    EnergyPlot,
    Heatmap,
    LatencyParts,
    PhaseBars,
    QpsPlot,
    RequestFlopsPlot,
    RooflinePlot,
    ScalingPlot,
    SweepPlot,
]

__all__ = [
    "MAX_BARS",
    "MAX_RUNS_CANARY",
    "MAX_CURVES",
    "MAX_LABELS",
    "MAX_PANELS",
    "SEGMENTS",
    "CanaryPlot",
    "CanarySeries",
    "canary_timeline",
    "CdfPlot",
    "CollectivesPlot",
    "EnergyPlot",
    "Drawn",
    "Heatmap",
    "LatencyParts",
    "collectives",
    "latency_parts",
    "PhaseBars",
    "QpsPlot",
    "RequestFlopsPlot",
    "request_flops",
    "RooflinePlot",
    "RooflinePoint",
    "ScalingPlot",
    "SweepPlot",
    "batching_heatmap",
    "energy",
    "latency_cdf",
    "point_labels",
    "qps_latency",
    "roof_at",
    "roofline",
    "scaling_efficiency",
    "sweep_medians",
    "training_phases",
    "CostPlot",
    "cost_per_bound",
]

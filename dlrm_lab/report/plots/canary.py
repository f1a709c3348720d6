"""The speed canary beside the run's own rate, over the run's time (`metrics.canary`): a run that slowed because
the host did shows both falling together; one that slowed on its own shows the canary flat."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from matplotlib.figure import Figure

from dlrm_lab.report.plots.common import as_text, save_figure

MAX_RUNS = 4  # panels, one a run


@dataclass
class CanarySeries:
    """One run's canary and rate over its time (seconds since its first reading or step)."""

    times_s: list[float]  # of the canary's readings
    ratios: list[float]  # each reading against quiet (`metrics.canary.ratios`)
    foreign: list[float | None]  # the machine's CPU share that went elsewhere, by reading
    rate_times_s: list[float]  # of the run's own rate: a step, or a second of completed queries
    rates: list[float]  # the run's rate there, over its median (1: its typical speed)
    phase: str | None = None  # the summary's line (`canary_phase`)


@dataclass
class CanaryPlot:
    path: Path
    runs: dict[str, CanarySeries] = field(default_factory=dict)  # drawn, by label
    left_out: int = 0


def canary_timeline(series: dict[str, CanarySeries], out: Path) -> CanaryPlot:
    """One panel a run (at most MAX_RUNS): its rate over its median, its canary against quiet and the machine's
    share left to the run (1 - foreign load), against seconds into the run."""
    drawn = dict(list(series.items())[:MAX_RUNS])
    fig = Figure(figsize=(9, 2.4 * max(1, len(drawn))))
    for k, (label, s) in enumerate(drawn.items()):
        ax = fig.add_subplot(len(drawn), 1, k + 1)
        ax.plot(s.rate_times_s, s.rates, color="0.6", lw=1, label="the run's rate / its median")
        ax.plot(s.times_s, s.ratios, "o-", color="tab:red", ms=3, label="canary / its best in the run")
        free = [(t, 1.0 - f) for t, f in zip(s.times_s, s.foreign, strict=True) if f is not None]
        if free:
            ax.plot(*zip(*free, strict=True), "s--", color="tab:blue", ms=3, label="machine left to the run")
        ax.set_ylim(0, max([1.2, *s.rates[:1000], *s.ratios]) * 1.05)
        ax.set_ylabel("fraction")
        ax.set_title(as_text(label + (f": {s.phase}" if s.phase else "")), fontsize=8, loc="left")
        if k == 0:
            ax.legend(fontsize=7, loc="lower left")
    if drawn:
        fig.axes[-1].set_xlabel("seconds into the run")
    fig.tight_layout()
    return CanaryPlot(save_figure(fig, out), drawn, max(0, len(series) - len(drawn)))

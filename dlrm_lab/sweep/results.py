"""What a sweep's point-repeats came to: each one's status, run directory, time and attempts (`PointResult`), and
the sweep's list of them (`SweepResult`), from which its tables are rebuilt."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from dlrm_lab.config.values import OptionValues


@dataclass
class PointResult:
    point: int
    repeat: int
    params: OptionValues  # the point's: option values by name, as its grid gives them
    status: str  # ok | failed | interrupted | pending
    child_dir: Path | None = None
    seconds: float | None = None
    attempts: int = 0
    skipped: bool = False  # done by an earlier invocation


@dataclass
class SweepResult:
    dir: Path
    points: list[PointResult] = field(default_factory=list)

    @property
    def failed(self) -> list[PointResult]:
        return [p for p in self.points if p.status != "ok"]

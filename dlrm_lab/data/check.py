"""One measured quantity of a dataset against the value its spec predicts (`data stats`), and what `data stats`
reports of a dataset (`DatasetStats`).

Below both `data.stats` (DLRM datasets) and `data.request_files` (HSTU requests), which both check.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypedDict


@dataclass
class Check:
    feature: str
    quantity: str
    measured: float
    expected: float
    tolerance: float

    @property
    def ok(self) -> bool:
        return abs(self.measured - self.expected) <= self.tolerance


class FeatureStats(TypedDict):
    """One sparse feature of a DLRM dataset as measured (`data.stats.dataset_stats`)."""

    feature: str
    table_rows: int
    samples: int
    lookups: int
    unique_ids: int
    top1pct_share: float  # share of the lookups on the table's most looked-up 1% of rows
    zipf_alpha_fit: float | None  # None: too few well-measured ranks to fit
    pooling_mean: float
    pooling_p99: float | None


class _StatsRequired(TypedDict):
    path: str
    problems: list[str]  # one line each; any: nothing below is measured
    checks: list[Check]


class DatasetStats(_StatsRequired, total=False):
    """What `data stats` reports of a dataset: a DLRM dataset's features (`data.stats.dataset_stats`), or an HSTU
    requests dataset's quantities (`data.request_files.request_stats`, with `kind` "requests"). A dataset with
    problems has path, problems and checks (empty) and no measurements."""

    kind: str
    source: str
    samples: int
    label_rate: float
    teacher_auc: float | None
    features: list[FeatureStats]
    quantities: dict[str, int | float | str | None] | list[object]  # an empty list where problems stopped measuring

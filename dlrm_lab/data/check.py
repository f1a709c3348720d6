"""One measured quantity of a dataset against the value its spec predicts (`data stats`).

Below both `data.stats` (DLRM datasets) and `data.request_files` (HSTU requests), which both check.
"""

from __future__ import annotations

from dataclasses import dataclass


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

"""What `infer search` is given: the configurations it tries (`SearchSpace` -> `SearchGrid`: layouts x max batch x
max delay) and how it probes and certifies each (`SearchOptions`); each field is also its option. The lab
(`infer.search`) takes these; the CLI parses text into them."""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from typing import Any

from dlrm_lab.config.options import OptionChange, option
from dlrm_lab.errors import FieldError
from dlrm_lab.infer.options import number_list


@dataclass
class SearchGrid:
    """Configurations to search: every (instances, threads) x max_batch x max_delay_ms."""

    layouts: list[tuple[int, int]]  # (instances, threads per instance)
    max_batch: list[int]
    max_delay_ms: list[float]

    def configs(self) -> list[tuple[int, int, int, float]]:
        return [(i, t, b, d) for (i, t), b, d in itertools.product(self.layouts, self.max_batch, self.max_delay_ms)]


@dataclass
class SearchOptions:
    """How `infer search` probes each configuration (`infer.search.search`); each field is also its option."""

    repeats: int = option(2, "Load points per probed rate (the median decides).")
    steps: int = option(6, "Bisection probes per configuration at most.")
    # relative to the bracket's top
    tolerance: float = option(0.05, "Stop when the bracket is this narrow (relative).")
    # the closed-loop saturation run that bounds the search
    capacity_s: float = option(1.0, "Seconds of the closed-loop capacity run.", flags=("--capacity-duration",))
    # a probe lasts long enough for this many queries (p99 = the 5th worst of 500) ...
    min_queries: int = option(500, "A probe lasts until this many queries arrived (for a stable percentile)...")
    max_duration_s: float = option(20.0, "... but at most this many seconds.", flags=("--max-probe-duration",))
    # A configuration whose capacity (samples/s) x (1 + prune_margin) is below the best rate
    # found under the bound is not bisected: it cannot win (capacity bounds every passing
    # rate; the margin covers run-to-run noise). 0 would prune hardest; < 0 turns it off.
    prune_margin: float = option(
        0.10, "Skip a configuration whose capacity x (1 + this) is below the best rate found (< 0: off)."
    )
    early_stop: bool = option(
        True,
        "End a probe once decided: its load when more queries were late than its percentile allows, its repeats "
        "when all lie 25% or more on one side of the bound.",
    )
    # The best rate is certified under MLPerf LoadGen's Server scenario (0: not certified): at that rate, backed
    # off until one holds, then bisected to 5% (infer.certify.certify); each run this long, or as long as
    # LoadGen's early-stopping estimate needs at its rate
    certify_s: float = option(
        5.0,
        "Seconds at least of each MLPerf LoadGen Server run that certifies the best rate (longer where LoadGen's "
        "early stopping needs more queries); 0: not certified.",
        flags=("--certify-duration",),
    )
    certify_tries: int = option(
        8, "Certification runs at most: backed off by 0.85x until one holds, then bisected to within 5%."
    )

    def __post_init__(self) -> None:
        if self.repeats < 1 or self.steps < 1 or self.min_queries < 1:
            raise FieldError(
                "repeats",
                f"{self.repeats}, {{steps}} {self.steps}, {{min_queries}} {self.min_queries}: must be >= 1",
                "steps",
                "min_queries",
            )
        if not 0 < self.tolerance < 1:
            raise FieldError("tolerance", f"{self.tolerance}: must be in (0, 1)")
        if not 0 <= self.certify_s <= 3600 or self.certify_tries < 1:
            raise FieldError(
                "certify_s",
                f"{self.certify_s}: must be in [0, 3600] s (0: no certification); "
                f"{{certify_tries}} {self.certify_tries}: must be >= 1",
                "certify_tries",
            )
        if not (self.capacity_s > 0 and self.max_duration_s > 0):
            raise FieldError(
                "capacity_s",
                f"{self.capacity_s}, {{max_duration_s}} {self.max_duration_s}: must be > 0",
                "max_duration_s",
            )


@dataclass(frozen=True)
class SearchSpace:
    """What `infer search` explores at one query size and latency bound: the layouts and batching
    policies it tries (each field is also its option)."""

    query_size: str = option("fixed:1", "Samples per query (see `infer run --help`).")
    sla_ms: float | None = option(
        None,
        "Latency bound in ms (default: the preset's MLPerf Server bound where it declares one, dlrmv3: 80; else 10).",
    )
    max_batch: str = option("64,256,1024", "Largest batches to try, in samples.")
    max_delay_ms: str = option("0.5,2", "Batching delays to try, in ms.")
    layouts: str | None = option(
        None, "instances x threads to try, e.g. 1x1,2x1 (default: all with instances x threads <= cores)."
    )

    def grid(self) -> Any:
        """The configurations tried (`SearchGrid`)."""
        grid = SearchGrid(
            parse_layouts(self.layouts),
            number_list(self.max_batch, int, "max_batch"),
            number_list(self.max_delay_ms, float, "max_delay_ms"),
        )
        if any(b < 1 for b in grid.max_batch) or any(d < 0 for d in grid.max_delay_ms):
            raise FieldError("max_batch", "values must be >= 1 and {max_delay_ms} values >= 0", "max_delay_ms")
        return grid


# `infer search`'s own words for options it shares with `infer run`
SEARCH_CHANGES: dict[str, OptionChange] = {
    "scenario": {"help": "Load of each probe: open-loop (our generator) or server (MLPerf LoadGen)."},
    "target": {
        "help": (
            "The system under test (see `infer run --help`); a remote server is searched as it serves: its rate alone, "
            "--layouts, --max-batch and --max-delay-ms apply in process."
        )
    },
    "duration": {"default": 1.0},
}


def available_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def default_layouts(cores: int) -> list[tuple[int, int]]:
    """Every instances x threads that uses at most the cores, fewest instances first (arXiv
    1908.04705: more co-located instances beat more threads per instance for small-batch DLRM
    inference, and oversubscribing cores only adds interference)."""
    return [(i, t) for i in range(1, cores + 1) for t in range(1, cores // i + 1)]


def parse_layouts(text: str | None, cores: int | None = None) -> list[tuple[int, int]]:
    """Layouts `1x2,2x1` as (instances, threads) pairs; none given: `default_layouts`."""
    if not text:
        return default_layouts(cores or available_cores())
    parsed = []
    for item in text.split(","):
        i, _, t = item.strip().partition("x")
        if not (i.isdigit() and t.isdigit() and int(i) >= 1 and int(t) >= 1):
            raise FieldError("layouts", f"{item!r}: expected INSTANCESxTHREADS, e.g. 2x1")
        parsed.append((int(i), int(t)))
    return parsed

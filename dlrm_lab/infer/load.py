"""What the load looks like: query sizes, arrival times, a model's stream, the driver's settings
and what a driver did (pure numpy, seeded).

A *query* is one request holding `size` samples (user-item pairs to rank). Sizes and
arrival schedules are drawn up front, so a run's load is known before it starts and the
same seed gives the same load to every configuration compared.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np

from dlrm_lab.errors import FieldError, UserError
from dlrm_lab.metrics.columns import InferSummaryRow
from dlrm_lab.metrics.stats import percentile

SIZE_KINDS = ("fixed", "normal", "lognormal", "uniform", "mlperf")
ARRIVAL_KINDS = ("poisson", "constant", "bursty")
SAMPLE_ORDERS = ("random", "time")
# MLPerf Inference DLRMv2's samples per query: the inverse CDF in steps of 0.05 that its reference and every
# submission's run script pass as `--samples-to-aggregate-quantile-file` (tools/dist_quantile.txt), one of the
# 20 drawn uniformly per query: 100 to 700, mean 270.
MLPERF_QUANTILE = (100, 100, 200, 200, 200, 200, 200, 200, 200, 200, 200, 200, 200, 200, 300, 300, 400, 500, 600, 700)
MLPERF_MIN, MLPERF_MAX = MLPERF_QUANTILE[0], MLPERF_QUANTILE[-1]
# Memory a point holds per planned query: its place in the schedule (time, model, size, offset and their
# temporaries, ~100 B) and its row until the point is summarised (a dict of ~50 fields, ~2.3 KB measured)
BYTES_PER_QUERY = 2500
MEMORY_SHARE = 0.5  # of the memory available now: what a point's queries may take


def check_planned(qps: float, duration_s: float, available_bytes: int | None = None, field: str = "qps") -> None:
    """Refuse, before any memory is spent, a load whose queries would not fit in memory: the rate
    x the duration, at BYTES_PER_QUERY each, against MEMORY_SHARE of the memory available."""
    import psutil

    available = psutil.virtual_memory().available if available_bytes is None else available_bytes
    planned = qps * duration_s
    limit = MEMORY_SHARE * available / BYTES_PER_QUERY
    if planned > limit:
        raise FieldError(
            field,
            f"{qps:g} for {{duration_s}} {duration_s:g} s: {planned:.3g} queries planned, about "
            f"{planned * BYTES_PER_QUERY / 2**30:,.1f} GiB of schedule and rows; this machine has "
            f"{available / 2**30:.1f} GiB available: at most {limit:.3g} queries a point (lower the rate or the "
            "duration)",
            "duration_s",
        )


@dataclass(frozen=True)
class QuerySizes:
    """Samples per query. Text form (`--query-size`):

    - `fixed:N`
    - `normal:MEAN,STD` and `lognormal:MEDIAN,SIGMA` (rounded, at least 1, at most `max`)
    - `uniform:LO,HI` (integers, both ends included)
    - `mlperf`: MLPerf Inference DLRMv2's 100 to 700 samples per query (mean 270), drawn from
      the quantile table its reference and submissions run with (`MLPERF_QUANTILE`).
    """

    kind: str
    a: float = 1.0
    b: float = 0.0
    max: int = 65536

    @classmethod
    def parse(cls, text: str, field: str = "query_size") -> QuerySizes:
        kind, _, args = text.partition(":")
        if kind not in SIZE_KINDS:
            raise FieldError(field, f"{text!r}: kind must be one of {', '.join(SIZE_KINDS)}")
        try:
            values = [float(v) for v in args.split(",")] if args else []
        except ValueError:
            raise FieldError(field, f"{text!r}: parameters must be numbers") from None
        if not all(np.isfinite(values)):
            raise FieldError(field, f"{text!r}: parameters must be finite numbers")
        need = {"fixed": 1, "normal": 2, "lognormal": 2, "uniform": 2, "mlperf": 0}[kind]
        if len(values) != need:
            usage = {
                "fixed": "fixed:N",
                "normal": "normal:MEAN,STD",
                "lognormal": "lognormal:MEDIAN,SIGMA",
                "uniform": "uniform:LO,HI",
                "mlperf": "mlperf",
            }[kind]
            raise FieldError(field, f"{text!r}: expected {usage}")
        if kind == "mlperf":
            return cls("mlperf", MLPERF_MIN, MLPERF_MAX)
        if kind in ("fixed", "lognormal", "normal") and values[0] < 1:
            raise FieldError(field, f"{text!r}: the size must be at least 1 sample")
        if kind == "uniform" and not 1 <= values[0] <= values[1]:
            raise FieldError(field, f"{text!r}: need 1 <= LO <= HI")
        if kind in ("normal", "lognormal") and values[1] < 0:
            raise FieldError(field, f"{text!r}: the spread must be >= 0")
        if kind == "fixed" and values[0] != int(values[0]):
            raise FieldError(field, f"{text!r}: the size must be a whole number of samples")
        return cls(kind, values[0]) if len(values) == 1 else cls(kind, values[0], values[1])  # `need` of them

    def __str__(self) -> str:
        if self.kind == "fixed":
            return f"fixed:{int(self.a)}"
        if self.kind == "uniform":
            return f"uniform:{int(self.a)},{int(self.b)}"
        if self.kind == "mlperf":
            return "mlperf"
        return f"{self.kind}:{self.a:g},{self.b:g}"

    @property
    def mean(self) -> float:
        """Expected samples per query (before rounding and clipping)."""
        if self.kind == "fixed":
            return self.a
        if self.kind == "uniform":
            return (self.a + self.b) / 2
        if self.kind == "mlperf":
            return float(np.mean(MLPERF_QUANTILE))
        if self.kind == "normal":
            return self.a
        return self.a * float(np.exp(self.b**2 / 2))

    def quantile(self, q: float) -> int:
        """The size at quantile q of the distribution (exact for fixed and uniform; from 100,000 seeded draws else)."""
        if self.kind == "fixed":
            return int(self.a)
        if self.kind == "uniform":
            return int(np.ceil(self.a + q * (self.b - self.a)))
        if self.kind == "mlperf":  # the table is the inverse CDF itself: x such that F(x) >= q
            return MLPERF_QUANTILE[min(max(int(np.ceil(q * len(MLPERF_QUANTILE))) - 1, 0), len(MLPERF_QUANTILE) - 1)]
        return int(cast(float, percentile(self.draw(100_000, np.random.default_rng(0)), 100 * q)))  # of 100,000

    @property
    def largest(self) -> int:
        if self.kind == "fixed":
            return int(self.a)
        if self.kind in ("uniform", "mlperf"):
            return int(self.b)
        return self.max

    def draw(self, n: int, rng: np.random.Generator) -> np.ndarray:
        if self.kind == "fixed":
            sizes = np.full(n, self.a)
        elif self.kind == "uniform":
            sizes = rng.integers(int(self.a), int(self.b), endpoint=True, size=n)
        elif self.kind == "mlperf":
            sizes = np.asarray(MLPERF_QUANTILE)[rng.integers(0, len(MLPERF_QUANTILE), size=n)]
        elif self.kind == "normal":
            sizes = rng.normal(self.a, self.b, size=n)
        else:
            sizes = self.a * np.exp(rng.normal(0.0, self.b, size=n))
        return np.clip(np.rint(sizes), 1, self.max).astype(np.int64)


@dataclass(frozen=True)
class Arrivals:
    """When queries arrive, as offsets in seconds from the start of a run.

    - `poisson`: exponential gaps (independent users; DeepRecSys, MLPerf Server).
    - `constant`: evenly spaced.
    - `bursty`: a two-state modulated Poisson process: bursts at `burst_factor` times the
      mean rate for `burst_share` of the time, the rest slower so that the mean rate is kept.
    """

    kind: str = "poisson"
    burst_factor: float = 4.0
    burst_share: float = 0.1
    burst_length_s: float = 0.05

    def __post_init__(self) -> None:
        if self.kind not in ARRIVAL_KINDS:
            raise FieldError("arrival", f"{self.kind!r}: allowed: {', '.join(ARRIVAL_KINDS)}")
        ok = self.burst_factor > 1 and 0 < self.burst_share * self.burst_factor < 1 and self.burst_length_s > 0
        if self.kind == "bursty" and not ok:
            raise FieldError(
                "arrival",
                f"bursty:{self.burst_factor:g},{self.burst_share:g},{self.burst_length_s * 1e3:g}: need "
                "FACTOR > 1, SHARE x FACTOR < 1 and LENGTH_MS > 0",
            )

    @classmethod
    def parse(cls, text: str, field: str = "arrival") -> Arrivals:
        """`poisson`, `constant`, `bursty` (4x the mean rate 10% of the time, bursts of 50 ms) or
        `bursty:FACTOR,SHARE,LENGTH_MS`."""
        kind, _, args = text.partition(":")
        if not args:
            return cls(kind)
        if kind != "bursty":
            raise FieldError(field, f"{text!r}: only bursty takes parameters (bursty:FACTOR,SHARE,LENGTH_MS)")
        try:
            factor, share, length_ms = (float(v) for v in args.split(","))
        except ValueError:
            raise FieldError(field, f"{text!r}: expected bursty:FACTOR,SHARE,LENGTH_MS (three numbers)") from None
        return cls("bursty", factor, share, length_ms / 1e3)

    def schedule(self, qps: float, duration_s: float, rng: np.random.Generator) -> np.ndarray:
        """Arrival offsets in [0, duration_s), sorted, at mean rate `qps`."""
        if qps <= 0 or duration_s <= 0:
            raise UserError(f"the target rate and duration must be positive (got {qps} QPS, {duration_s} s)")
        check_planned(qps, duration_s)
        expected = qps * duration_s
        if self.kind == "constant":
            times = np.arange(int(np.ceil(expected))) / qps
            return times[times < duration_s]  # 100 x 1.1 is 110.00000000000001 in floats
        if self.kind == "poisson":
            gaps = rng.exponential(1.0 / qps, size=int(expected + 6 * np.sqrt(expected) + 16))
            times = np.cumsum(gaps) - gaps[0]
            return times[times < duration_s]
        # bursty: alternate calm and burst periods, Poisson within each
        hi = qps * self.burst_factor
        lo = qps * (1 - self.burst_share * self.burst_factor) / (1 - self.burst_share)
        out, t = [], 0.0
        calm_length = self.burst_length_s * (1 - self.burst_share) / self.burst_share
        while t < duration_s:
            for rate, length in ((lo, rng.exponential(calm_length)), (hi, rng.exponential(self.burst_length_s))):
                end = min(t + length, duration_s)
                n = rng.poisson(rate * (end - t))
                out.append(np.sort(rng.uniform(t, end, size=n)))
                t = end
        return np.concatenate(out) if out else np.empty(0)


@dataclass
class Stream:
    """One model's load: a target rate, query sizes and an arrival process."""

    model: str
    qps: float
    sizes: QuerySizes
    arrivals: Arrivals = field(default_factory=Arrivals)
    sla_ms: float | None = None  # this model's latency bound (default: the run's)
    # which library samples the queries take: "random" ranges, or "time": the library's next samples in
    # its order, continuing across loads (an HSTU library is in time order: MLPerf DLRMv3 issues so)
    order: str = "random"

    def __post_init__(self) -> None:
        if self.order not in SAMPLE_ORDERS:
            raise FieldError("order", f"{self.order!r}: allowed: {', '.join(SAMPLE_ORDERS)}")

    def offsets(self, sizes: np.ndarray, library: Any, rng: np.random.Generator) -> np.ndarray:
        """Offsets in `library` (a SampleLibrary) of queries of these sizes (each at most its size):
        random, or its next samples in time order (`LoadedSamples.in_time_order`)."""
        if self.order == "random":
            return rng.integers(0, library.size - sizes + 1)
        return library.in_time_order(sizes)


@dataclass(frozen=True)
class Scenario:
    """A way of issuing load, as its driver declares it: the driver (built as `driver(sut, streams,
    settings)`) and the rules a run checks and follows for it, so no caller names a scenario."""

    name: str
    driver: Any
    rate: bool = True  # the load has a target rate (a closed loop keeps queries outstanding instead)
    probes_rate: bool = False  # --qps auto: a rate probed open loop can drive it
    one_model: bool = False  # it drives one model (LoadGen)
    sized_by_early_stopping: bool = False  # its duration is sized up to LoadGen's early-stopping estimate
    queues_whole_load: bool = False  # it issues every query at once (LoadGen offline): queues hold them all
    stops_early: bool = False  # a search may end a probe that fails already (LoadGen cannot be interrupted)

    def check(self, models: int, qps_auto: bool, probed: Sequence[str] = ()) -> None:
        """The run's models and rate fit this scenario: one line naming the rule otherwise."""
        if self.one_model and models > 1:
            raise FieldError("scenario", f"{self.name}: LoadGen drives one model; use open-loop for several")
        if qps_auto and (models > 1 or not self.probes_rate):
            raise FieldError(
                "qps", f"auto: one {{model}}, with {' or '.join(probed)} load (the rate is probed open loop)", "model"
            )


@dataclass(frozen=True)
class LoadSettings:
    """How a driver issues the load: the scenario names the driver (`infer.drivers.DRIVERS`),
    the rest are its settings (MLPerf LoadGen's TestSettings, and ours)."""

    scenario: str = "open-loop"
    duration_s: float = 5.0
    seed: int = 0
    concurrency: int = 1  # closed loop: queries outstanding at all times
    think_ms: float = 0.0  # closed loop: a finished query's next is issued this long after it (the server idles)
    sla_ms: float = 10.0  # LoadGen: the latency bound it checks (server, single- and multi-stream)
    sla_percentile: float = 99.0
    log_dir: Path | None = None  # LoadGen: where its summary and detail logs go
    # open loop: stop issuing once a query would leave this late (the issuer, not the server,
    # has fallen behind: the load is no longer what was asked); None: never
    max_issue_lag_ms: float | None = 1000.0


@dataclass
class DriverStats:
    """What the driver actually did, per model, so a run shows its load was what it claims."""

    target_queries: dict[str, float] = field(default_factory=dict)
    issued: dict[str, int] = field(default_factory=dict)
    lag_ms: dict[str, list[float]] = field(default_factory=dict)
    duration_s: float = 0.0
    loadgen: InferSummaryRow = field(default_factory=InferSummaryRow)  # LoadGen's verdict, as summary columns
    arrival: dict[str, str] = field(default_factory=dict)  # per model: the arrival process, or who scheduled it
    issue_stopped: str | None = None  # why the load stopped before its schedule ended (issue lag)

    def accuracy(self, model: str) -> InferSummaryRow:
        lag = np.asarray(self.lag_ms.get(model, []), dtype=np.float64)
        target = self.target_queries.get(model)
        return InferSummaryRow(
            {
                "achieved_rate_ratio": self.issued.get(model, 0) / target if target else None,
                "issue_lag_p50_ms": percentile(lag, 50),
                "issue_lag_p99_ms": percentile(lag, 99),
                "issue_lag_max_ms": float(lag.max()) if len(lag) else None,
                "issue_stopped": self.issue_stopped,
            }
        )

"""Load the machine can honour: capacity, unloaded latency, and a rate chosen under a bound.

`infer run --qps auto` asks the lab to pick its own load point instead of guessing one that
this machine may not sustain (a rate beyond capacity gives a tail of seconds, not a
measurement). On the running server, before the measured point:

1. unloaded latency: the latency percentile of queries that each meet an idle server (one at a time, each
   IDLE_GAP_MS after the last finished: no queueing, and each pays the idle server's wake and cold memory, as
   every query at a low load does: the floor of what any load can reach on this server). Back to back the server
   never idles: on 2 Zen 5 cores that p99 was 3.0 ms where 16 queries/s held 8.8, and a bound of 2.5x it was met
   by no rate;
2. the bound: the one given (`--sla-ms`), or with `--sla-ms auto` 2.5x the unloaded
   percentile, rounded up to a whole ms: room for batching and queueing at a useful load
   (on 2 AVX2 cores with MLPerf-sized kaggle queries, p99 at a third of capacity was already
   1.6-1.9x the unloaded p99, with +-15% between 2 s probes: 2x left too little margin);
   what of the serving policy depends on the bound (an auto max batch) is set now (`settle`),
   so that what follows measures the policy served;
3. capacity: completed queries/s of a closed loop that keeps every instance busy; what of the
   policy depends on the load (auto delay and spin) is then chosen at half of it (`tune_at`);
4. the rate: a short bisection over open-loop rates in (0, capacity], each probe passing
   when its percentile (dropped queries infinitely late) is within the bound, until the bracket
   round a passing rate is within `KNEE_TOLERANCE` of its top (at most `probes`): four fixed
   probes reported 7/16 of capacity wherever C/2 missed, their resolution rather than the knee;
   the point then runs at `HEADROOM` x the highest passing rate, so that the noise between a
   probe and the measured point does not decide the verdict;
5. its roof: the highest rate an ideal server with the instances' warm batch cost and the lab's
   batching rule holds under the same bound (`infer.queueing`): what queueing alone allows.

Each step is recorded (`LoadChoice.to_dict`, in the run's manifest) and said in one line.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import TypedDict, cast

import numpy as np

from dlrm_lab.config.values import JsonObject
from dlrm_lab.infer.batching import BatchCost
from dlrm_lab.infer.drivers import drive, make_driver
from dlrm_lab.infer.load import LoadSettings, Stream
from dlrm_lab.infer.queueing import queueing_roof, roof_line
from dlrm_lab.infer.records import summarize, sustained_latency
from dlrm_lab.infer.sut import LoadDriver, SystemUnderTest
from dlrm_lab.metrics.columns import QueryRow
from dlrm_lab.metrics.stats import percentile as nearest_rank

# The measured point runs at this share of the highest passing probe rate. Since capacity and the probes are of the
# policy served, the knee lies near capacity, where p99 climbs steeply: at 0.8, 7 of 8 make-run points met the
# bound and one, in a slow phase (canary 0.75), missed it (p99 10.19 ms under 9)
HEADROOM = 0.7
# the bisection stops once (failing - passing) / failing rate is this close. At 0.1 it stopped at 0.69 of capacity
# in 4 of 6 make-run repeats whose 0.69 probe met the bound by 1.3-4.4 ms and 0.75 missed: the figure was the
# bracket's resolution. At 0.05, one more probe of ~2 s.
KNEE_TOLERANCE = 0.05
SLA_FACTOR = 2.5  # --sla-ms auto: this multiple of the unloaded latency percentile
# The unloaded latency's queries each come this long after the last finished: an instance idle for ~20 ms has lost
# what a longer gap loses (2 Zen 5 cores: a batch's compute 2.2x its warm time after gaps under 20 ms, 2.8-3.0x
# after 20 ms to 1 s)
IDLE_GAP_MS = 20.0


def knee_found(passing: float, failing: float, tolerance: float = KNEE_TOLERANCE) -> bool:
    """Whether the bisection's bracket (the highest passing rate, the lowest failing one) holds the knee to within
    `tolerance` of its top: where `choose_load` stops probing."""
    return passing > 0 and (failing - passing) / failing <= tolerance


def capacity_qps(server: SystemUnderTest, stream: Stream, seconds: float, seed: int, drain_s: float = 30.0) -> float:
    """Completed queries/s of a closed loop with enough queries outstanding to keep every
    instance's batches full (no latency bound: the ceiling a bounded rate is sought under)."""
    served = server.describe().models[stream.model]
    # a server that does not say how it batches (a third-party one) is filled as if by one instance of batch 64
    per_batch = max(1, (served.max_batch or 64) // max(1, int(stream.sizes.mean)))
    concurrency = (served.instances or 1) * per_batch * 2
    return _closed_loop(server, stream, concurrency, seconds, seed, drain_s)[0]


def drive_records(server: SystemUnderTest, driver: LoadDriver, drain_s: float) -> tuple[list[QueryRow], float]:
    """Run `driver` against `server` to its end and drain: the records of its queries alone,
    and the seconds from its start to the last completion."""
    server.take_records()  # nothing from before
    t0 = time.monotonic()
    records: list[QueryRow] = []
    drive(server, driver, drain_s=drain_s, take=records.extend)
    records += server.take_records()
    return records, time.monotonic() - t0


def _closed_loop(
    server: SystemUnderTest,
    stream: Stream,
    concurrency: int,
    seconds: float,
    seed: int,
    drain_s: float,
    think_ms: float = 0.0,
) -> tuple[float, list[QueryRow]]:
    """A closed loop's completed queries/s, and every query's record (failed and dropped ones too)."""
    settings = LoadSettings("closed-loop", duration_s=seconds, seed=seed, concurrency=concurrency, think_ms=think_ms)
    records, wall = drive_records(server, make_driver(server, [stream], settings), drain_s)
    done = sum(r["status"] == "ok" for r in records)
    return (done / wall if wall > 0 else 0.0), records


def _open_loop_percentile(
    server: SystemUnderTest,
    stream: Stream,
    qps: float,
    seconds: float,
    percentile: float,
    sla_ms: float,
    seed: int,
    drain_s: float,
) -> float:
    """The latency percentile `seconds` of open-loop load at `qps` held (`infer.records.sustained_latency`; dropped =
    inf)."""
    settings = LoadSettings("open-loop", duration_s=seconds, seed=seed)
    records, _ = drive_records(server, make_driver(server, [replace(stream, qps=qps)], settings), drain_s)
    if not records:
        return math.inf
    row = summarize(records, duration_s=seconds, sla_ms=sla_ms, sla_percentile=percentile)
    value = sustained_latency(row)  # a queue still growing over the probe: its later half's
    return math.inf if value is None else float(value)


class LoadProbe(TypedDict):
    """One open-loop rate `choose_load` probed: its latency percentile (None: none completed) against the bound."""

    qps: float
    latency_ms: float | None
    passed: bool
    seconds: float


@dataclass
class LoadChoice:
    """The load point the lab chose, and the measurements that chose it."""

    qps: float
    sla_ms: float
    sla_chosen: bool  # True: the bound came from the unloaded latency (--sla-ms auto)
    percentile: float
    capacity_qps: float
    unloaded_latency_ms: float
    best_passing_qps: float
    # how long the server idled before each query of the unloaded latency (0: back to back, before 2026-12-02)
    unloaded_idle_ms: float = 0.0
    probes: list[LoadProbe] = field(default_factory=list)
    reason: str = ""
    # what queueing alone allows under the bound (`infer.queueing`); None where the server measured no batch cost
    queueing_roof: JsonObject | None = None
    roof_reason: str = ""

    def to_dict(self) -> JsonObject:
        return {**asdict(self), "headroom": HEADROOM, "sla_factor": SLA_FACTOR if self.sla_chosen else None}


def choose_load(
    server: SystemUnderTest,
    stream: Stream,
    *,
    sla_ms: float | None,
    percentile: float = 99.0,
    probes: int = 7,
    probe_s: float = 2.0,
    min_queries: int = 300,
    seed: int = 0,
    drain_s: float = 30.0,
    settle: Callable[[float], object] | None = None,
    tune_at: Callable[[float, float], object] | None = None,
) -> LoadChoice:
    """Pick a rate (and with `sla_ms` None, a bound) this server honours; see the module
    docstring for the steps. `settle(bound)` sets what of the serving policy depends on the bound
    (an auto max batch) before capacity is measured: capacity and probes are then of the policy
    served, not of a placeholder (a max batch of 256 read 876 queries/s where 576 served 1,337).
    `tune_at(rate, bound)` then chooses what depends on the load (the batching delay, the spin) at half
    of capacity, where the bisection starts, so that its probes too run the policy served (a placeholder
    delay of 1 ms cost 1.2 ms of p99 at the knee where 0 was then chosen)."""
    described = server.describe()
    served = described.models[stream.model]
    instances = max(1, served.instances or 1)
    cost = described.batch_costs.get(stream.model)
    unloaded = _unloaded_percentile(
        server, stream, cost, instances, percentile, probe_s, min_queries, seed + 1, drain_s
    )
    sla_chosen = sla_ms is None
    if sla_ms is None:
        sla_ms = float(math.ceil(SLA_FACTOR * unloaded)) if math.isfinite(unloaded) else 1000.0
    if settle is not None:
        settle(sla_ms)
    capacity = capacity_qps(server, stream, probe_s, seed, drain_s)
    if tune_at is not None and capacity > 0:
        tune_at(capacity / 2, sla_ms)
    lo, hi = 0.0, capacity
    tried: list[LoadProbe] = []
    for k in range(probes):
        if knee_found(lo, hi):
            break
        qps = hi / 2 if lo == 0 else (lo + hi) / 2
        if qps <= 0:
            break
        span = min(max(probe_s, min_queries / qps), 4 * probe_s)
        p = _open_loop_percentile(server, stream, qps, span, percentile, sla_ms, seed + 2 + k, drain_s)
        passed = p <= sla_ms
        tried.append(LoadProbe(qps=qps, latency_ms=None if math.isinf(p) else p, passed=passed, seconds=span))
        lo, hi = (qps, hi) if passed else (lo, qps)
    where = f"p{percentile:g} <= {sla_ms:g} ms"
    unloaded_line = f"a query meeting a server idle {IDLE_GAP_MS:g} ms ({unloaded:.1f} ms)"
    bound = (
        f"bound {sla_ms:g} ms = {SLA_FACTOR:g} x the p{percentile:g} of {unloaded_line}"
        if sla_chosen
        else f"bound {sla_ms:g} ms as given"
    )
    if lo > 0:
        qps = HEADROOM * lo
        reason = (
            f"load chosen by the lab: {qps:.1f} queries/s = {HEADROOM:.0%} of {lo:.1f}, the highest of "
            f"{len(tried)} probed rates meeting {where} (closed-loop capacity {capacity:.1f} queries/s); {bound}"
        )
    else:
        qps = min(t["qps"] for t in tried) if tried else max(capacity / 10, 0.1)
        reason = (
            f"no probed rate met {where} (lowest {qps:.1f} queries/s; capacity {capacity:.1f} queries/s, "
            f"p{percentile:g} of {unloaded_line}): running at the lowest; {bound}"
        )
    roof, roof_reason = _roof(server, stream, lo, capacity, sla_ms, percentile)
    return LoadChoice(
        qps=qps,
        sla_ms=sla_ms,
        sla_chosen=sla_chosen,
        percentile=percentile,
        capacity_qps=capacity,
        unloaded_latency_ms=unloaded,
        unloaded_idle_ms=IDLE_GAP_MS,
        best_passing_qps=lo,
        probes=tried,
        reason=reason,
        queueing_roof=roof,
        roof_reason=roof_reason,
    )


def _unloaded_percentile(
    server: SystemUnderTest,
    stream: Stream,
    cost: BatchCost | None,
    instances: int,
    percentile: float,
    probe_s: float,
    min_queries: int,
    seed: int,
    drain_s: float,
) -> float:
    """The latency percentile of queries that each meet an idle server: one at a time, each issued IDLE_GAP_MS after
    the last finished (a closed loop of one that thinks), for long enough that the percentile means something
    (`min_queries`, at most 4 probes long; a query's time from the batch cost the server measured, where it did)."""
    warm_ms = cost.ms(math.ceil(stream.sizes.mean / instances)) if cost is not None else 0.0
    seconds = min(max(probe_s, min_queries * (warm_ms + IDLE_GAP_MS) / 1e3), 4 * probe_s)
    _, records = _closed_loop(server, stream, 1, seconds, seed, drain_s, think_ms=IDLE_GAP_MS)
    lat = np.array([r["latency_ms"] if r["status"] == "ok" else math.inf for r in records], dtype=np.float64)
    # a percentile of some values is a number (None only of none)
    return cast(float, nearest_rank(lat, percentile)) if len(lat) else math.inf


def _roof(
    server: SystemUnderTest, stream: Stream, best_qps: float, capacity: float, sla_ms: float, percentile: float
) -> tuple[JsonObject | None, str]:
    """The queueing roof of the bounded rate under the policy served, and its line."""
    described = server.describe()
    cost, served = described.batch_costs.get(stream.model), described.models[stream.model]
    if cost is None or not served.max_batch:
        return None, "no queueing roof: the server measured no batch cost (a remote or third-party server)"
    instances = max(1, served.instances or 1)
    largest = max(served.largest_query, stream.sizes.largest)
    roof = queueing_roof(
        cost,
        stream.sizes,
        instances=instances,
        max_batch=served.max_batch,
        min_piece=served.min_piece or 1,
        limit=max(served.max_batch, -(-largest // instances)),
        sla_ms=sla_ms,
        percentile=percentile,
        measured_capacity_qps=capacity,
    )
    return roof.to_dict(), roof_line(best_qps, capacity, roof)

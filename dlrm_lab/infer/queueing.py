"""The queueing roof of a latency-bounded rate: what an ideal server could hold under a bound.

A bounded rate is limited by two things: the machine's cost per batch, and queueing. Even a
server with no overhead at all, whose batches always take their warm time, must let a query
wait behind the one before it, and with MLPerf's 100-700-sample queries that wait grows long
well before the instances are busy. So "0.4 of closed-loop capacity under p99 <= 8 ms" says
nothing until it stands beside what queueing alone allows at that bound.

`queueing_roof` simulates that ideal server: Poisson arrivals of the stream's query sizes, the
instances' warm batch cost (`BatchCost`, measured at start), and the lab's own batching rule, run by the server's
own `BatchClock` (`next_batch` and `whole_enough`: pieces sized to end together, the utilisation
term, a query cut into at most one piece an instance), with nothing else: no assembly, no
completion, no wake, no host. It bisects the highest rate whose latency percentile meets the
bound. That rate is the roof of the measured bounded rate, and the roof over the ideal server's
own capacity (full batches back to back) is the roof of the bounded rate's share of capacity.
The start-up cost is of the host's phase at start; where the real server's closed loop then outruns the ideal
server built on it, the cost was of a slower phase than the probes', and it is scaled to the capacity measured
(`phase_scaled`, its factor told): a run that beats its roof means the roof is wrong.

Why by hand: the roof must run the lab's own batching rule and clock; an event
simulation library would add a dependency and nothing the 40 lines below need.
"""

from __future__ import annotations

import collections
import math
from dataclasses import asdict, dataclass
from typing import cast

import numpy as np

from dlrm_lab.config.values import JsonObject
from dlrm_lab.infer.batching import BatchClock, BatchCost, whole_enough
from dlrm_lab.infer.load import QuerySizes
from dlrm_lab.metrics.stats import percentile as nearest_rank

ROOF_QUERIES = 12_000  # queries a simulated rate runs: its p99 is then the 108th largest of the measured part
ROOF_WARMUP = 0.1  # share of them left out of the percentile: the queue starts empty
ROOF_STEPS = 12  # bisection steps: the roof to within capacity / 2^12


@dataclass(frozen=True)
class QueueingRoof:
    """The ideal server's highest rate under a bound, and its own capacity (queries/s)."""

    rate_qps: float
    capacity_qps: float
    sla_ms: float
    percentile: float
    cost: BatchCost
    instances: int
    max_batch: int
    min_piece: int
    # the instances' start-up cost over the one the roof ran (`phase_scaled`): above 1 where the measured closed loop
    # outran the ideal server built on that cost (the cost was of a slower phase of the host than the probes')
    slowdown: float = 1.0

    @property
    def share(self) -> float:
        """The roof of a bounded rate's share of capacity: what queueing alone leaves."""
        return self.rate_qps / self.capacity_qps if self.capacity_qps > 0 else 0.0

    def to_dict(self) -> JsonObject:
        return {**asdict(self), "cost": asdict(self.cost), "share": self.share}


@dataclass
class _Head:
    """The oldest waiting query as `whole_enough` reads it."""

    size: int
    dispatched: int


def ideal_capacity_qps(cost: BatchCost, sizes: QuerySizes, instances: int, max_batch: int) -> float:
    """Queries/s of the ideal server with every instance running full batches back to back."""
    return instances * max_batch / cost.ms(max_batch) * 1000.0 / sizes.mean


def simulated_latencies(
    qps: float,
    cost: BatchCost,
    sizes: QuerySizes,
    *,
    instances: int,
    max_batch: int,
    min_piece: int,
    limit: int | None = None,
    queries: int = ROOF_QUERIES,
    seed: int = 0,
) -> np.ndarray:
    """Each query's latency (ms) on the ideal server at `qps` Poisson arrivals, the first
    `ROOF_WARMUP` of them left out. The same `seed` gives the same arrivals, scaled by the rate,
    so that latency grows with the rate and a bisection over it is stable. `limit`: the largest
    piece `whole_enough` may cut (the server's largest warmed batch; default `max_batch`)."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0, queries)) * (1000.0 / qps)
    drawn: np.ndarray = sizes.draw(queries, rng).astype(np.int64)
    finished = np.zeros(queries)
    free_at = [0.0] * instances  # ms: when each instance's batch ends
    waiting: collections.deque[list[int]] = collections.deque()  # [query, samples left], oldest first
    samples_waiting = 0
    # the server's own clock of its instances' batches: their time left and the utilisation term, as it batches
    clock = BatchClock(instances, cost=cost)
    nxt, now = 0, 0.0
    while nxt < queries or waiting:
        k = min(range(instances), key=free_at.__getitem__)
        now = max(now, free_at[k] if waiting else max(free_at[k], arrivals[nxt]))  # an idle instance's is past
        while nxt < queries and arrivals[nxt] <= now:
            waiting.append([nxt, int(drawn[nxt])])
            samples_waiting += int(drawn[nxt])
            nxt += 1
        for j in sorted(clock.busy, key=free_at.__getitem__):  # batches that ended since, in the order they did
            if free_at[j] <= now:
                clock.finished(j, int(free_at[j] * 1e6), clock.busy[j][1], None)
        now_ns = int(now * 1e6)
        n = clock.next_batch(
            samples_waiting, instances - len(clock.busy), now_ns, max_batch=max_batch, min_piece=min_piece
        )
        head = waiting[0]
        n = min(
            whole_enough(n, _Head(int(drawn[head[0]]), int(drawn[head[0]]) - head[1]), instances, limit or max_batch),
            samples_waiting,
        )
        free_at[k] = now + cost.ms(n)
        clock.sent(k, now_ns, n)
        samples_waiting -= n
        while n > 0:
            head = waiting[0]
            piece = min(head[1], n)
            head[1] -= piece
            n -= piece
            if head[1] == 0:
                finished[head[0]] = free_at[k]
                waiting.popleft()
    return (finished - arrivals)[int(ROOF_WARMUP * queries) :]


def queueing_roof(
    cost: BatchCost,
    sizes: QuerySizes,
    *,
    instances: int,
    max_batch: int,
    min_piece: int,
    sla_ms: float,
    limit: int | None = None,
    percentile: float = 99.0,
    seed: int = 0,
    queries: int = ROOF_QUERIES,
    measured_capacity_qps: float | None = None,
) -> QueueingRoof:
    """The highest Poisson rate at which the ideal server (module docstring) holds its latency
    `percentile` within `sla_ms`, bisected to within its capacity / 2^ROOF_STEPS; 0 when even a
    lone query misses the bound. With `measured_capacity_qps` (the real server's closed loop), a cost slower than
    that run's phase is scaled to it first (`phase_scaled`): a roof never sits below what the server measured."""
    slowdown = phase_scaled(cost, sizes, instances, max_batch, measured_capacity_qps) if measured_capacity_qps else 1.0
    cost = BatchCost(cost.fixed_ms / slowdown, cost.per_sample_ms / slowdown)
    capacity = ideal_capacity_qps(cost, sizes, instances, max_batch)

    def meets(qps: float) -> bool:
        lat = simulated_latencies(
            qps,
            cost,
            sizes,
            instances=instances,
            max_batch=max_batch,
            min_piece=min_piece,
            limit=limit,
            queries=queries,
            seed=seed,
        )
        return cast(float, nearest_rank(lat, percentile)) <= sla_ms  # of `queries` latencies: a number

    lo, hi = 0.0, capacity
    for _ in range(ROOF_STEPS):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if meets(mid) else (lo, mid)
    return QueueingRoof(
        rate_qps=lo,
        capacity_qps=capacity,
        sla_ms=sla_ms,
        percentile=percentile,
        cost=cost,
        instances=instances,
        max_batch=max_batch,
        min_piece=min_piece,
        slowdown=slowdown,
    )


def phase_scaled(cost: BatchCost, sizes: QuerySizes, instances: int, max_batch: int, capacity_qps: float) -> float:
    """How much slower the start-up `cost` is than the phase a closed loop measured `capacity_qps` in: the ideal
    server on that cost holding less than the real server held means the cost is stale (measured at start, in a
    slower phase of a drifting host), and a roof built on it would sit below the run; 1 where the ideal holds
    at least as much (a real server's own overheads are never scaled away)."""
    ideal = ideal_capacity_qps(cost, sizes, instances, max_batch)
    return max(1.0, capacity_qps / ideal) if ideal > 0 else 1.0


def roof_line(measured_qps: float, capacity_qps: float, roof: QueueingRoof) -> str:
    """One line: the bounded rate's share of capacity beside what queueing alone allows."""
    share = measured_qps / capacity_qps if capacity_qps > 0 else math.nan
    of_roof = measured_qps / roof.rate_qps if roof.rate_qps > 0 else math.inf
    scaled = (
        f", their start-up cost over {roof.slowdown:.2f}: the closed loop outran an ideal server on it"
        if roof.slowdown > 1
        else ""
    )
    return (
        f"queueing roof: an ideal server with the instances' warm batch cost ({roof.cost.fixed_ms:.3f} ms + "
        f"{1000 * roof.cost.per_sample_ms:.2f} us a sample{scaled}) and this batching rule holds "
        f"{roof.rate_qps:.1f} queries/s under p{roof.percentile:g} <= {roof.sla_ms:g} ms, {roof.share:.2f} of its "
        f"own capacity {roof.capacity_qps:.1f}; the bounded rate found here, {measured_qps:.1f} ({share:.2f} of "
        f"capacity), is {of_roof:.2f} of that roof"
    )

"""How big the next batch is and which queries it holds: the batching rule of `infer.server`, apart
from its threads.

An instance's batch time is modelled as fixed + per-sample cost (`BatchCost`, measured by
every instance at start). When an instance is free, the samples waiting are shared out so
that they all finish as early as possible: over the free instances and the busy ones about
to finish, each given a piece that makes them end together (a busy instance's piece is
smaller by its remaining time). A piece below `min_piece` samples is not worth its fixed
cost, so fewer instances are used; under load the smallest piece grows as
min_piece / (1 - utilisation): each extra piece adds a fixed cost of work that later
queries queue behind, and queueing grows as 1 / (1 - utilisation). When the free
instances cannot take all that waits in full batches, batches are `max_batch`.

Why by hand: dynamic batchers (Triton, TorchServe) size batches by count and delay only;
splitting one query over instances by their expected finish is DeepRecSys' query
splitting made latency-aware, which no library does.
"""

from __future__ import annotations

import collections
import itertools
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from dlrm_lab.infer.sut import Query

MIN_IDLE_SHARE = 0.05  # the utilisation term's cap: pieces at most 20x min_piece
UTILISATION_WINDOW_S = 1.0  # the recent past whose busy share scales the smallest piece
AFFINITY_SCAN = 256  # waiting queries an instance looks through for its own users' (history affinity)
SLOWDOWN_WEIGHT = 0.2  # weight of the newest batch in the running ratio of measured to modelled batch time


@dataclass(frozen=True)
class BatchCost:
    """An instance's batch time, modelled as fixed_ms + per_sample_ms x samples (measured at
    start): what splitting a query over instances trades against."""

    fixed_ms: float
    per_sample_ms: float

    @classmethod
    def between(cls, small: int, small_ms: float, large: int, large_ms: float) -> BatchCost:
        """The line through a `small`-sample batch's time and a `large` one's (per sample: their difference over
        the samples between; fixed: what the small batch took beyond its samples), neither part below 0."""
        per_sample = max(large_ms - small_ms, 0.0) / max(large - small, 1)
        return cls(fixed_ms=max(small_ms - small * per_sample, 0.0), per_sample_ms=per_sample)

    def break_even(self) -> int:
        """The batch whose per-sample time equals the fixed time: a piece smaller than this
        spends more on the per-batch cost than on its samples."""
        if self.per_sample_ms <= 0:
            return 1
        return max(1, math.ceil(self.fixed_ms / self.per_sample_ms))

    def ms(self, samples: int) -> float:
        return self.fixed_ms + self.per_sample_ms * samples


def next_batch(
    waiting: int,
    free: int,
    busy_left_ms: Sequence[float],
    *,
    max_batch: int,
    min_piece: int,
    cost: BatchCost | None,
    utilisation: float = 0.0,
) -> int:
    """Samples for the next batch, which goes to one of `free` idle instances.

    `waiting`: samples queued; `busy_left_ms`: the expected time left of each busy
    instance's batch. The waiting samples are spread over the k instances that finish
    them soonest, all ending at the same time T:
        sum over the k of (T - left_j - fixed) / per_sample = waiting,
    adding instances in order of readiness while the smallest piece stays >= `min_piece` /
    (1 - `utilisation`) (the instances' busy share of the recent past, in [0, 1)).
    The free instance's piece is (T - fixed) / per_sample. Without a cost (nothing
    measured), idle instances share the samples equally and busy ones are not counted.
    """
    if free < 1 or waiting < 1:
        return max_batch
    if waiting > free * max_batch:  # more than the free instances take: full batches
        return max_batch
    smallest = max(1, min_piece) / max(1.0 - utilisation, MIN_IDLE_SHARE)  # the smallest piece worth an instance
    if cost is None or cost.per_sample_ms <= 0:
        pieces = max(1, min(free, int(waiting // smallest)))
        return min(max_batch, -(-waiting // pieces))
    fixed, per = cost.fixed_ms, cost.per_sample_ms
    ready = [0.0] * free + sorted(max(0.0, b) for b in busy_left_ms)
    finish = fixed + per * waiting  # k = 1: the free instance takes everything
    total = fixed  # sum over the k used instances of (left_j + fixed)
    for k in range(2, len(ready) + 1):
        total += ready[k - 1] + fixed
        t_k = (per * waiting + total) / k
        if (t_k - ready[k - 1] - fixed) / per < smallest:  # the last instance's piece
            break
        finish = t_k
    piece = math.ceil((finish - fixed) / per - 1e-9)
    return max(1, min(max_batch, waiting, piece))


@dataclass
class BatchClock:
    """What a batcher knows of its instances' batches in time (one per served model; the
    caller holds its lock): the warm batch cost measured at start, the batches in flight,
    the recent ones, and the running ratio of measured to modelled batch times."""

    instances: int
    cost: BatchCost | None = None  # of one batch on one instance, measured at start
    busy: dict[int, tuple[int, int]] = field(default_factory=dict)  # instance -> (sent at ns, samples)
    slowdown: float = 1.0  # measured batch times over `cost`'s (cores that slept run slower)
    done: collections.deque = field(default_factory=collections.deque)  # (ended at, took), ns: recent batches
    done_ns: int = 0  # their sum of took
    arrivals: collections.deque = field(default_factory=collections.deque)  # when queries came, ns: the recent ones

    def expected_cost(self) -> BatchCost | None:
        c = self.cost
        return None if c is None else BatchCost(c.fixed_ms * self.slowdown, c.per_sample_ms * self.slowdown)

    def utilisation(self, now_ns: int) -> float:
        """The instances' busy share of the last UTILISATION_WINDOW_S: batches that ended in it
        (`done`, pruned here) and those in flight."""
        since = now_ns - int(UTILISATION_WINDOW_S * 1e9)
        while self.done and self.done[0][0] < since:
            self.done_ns -= self.done.popleft()[1]
        busy = self.done_ns + sum(now_ns - max(sent, since) for sent, _ in self.busy.values())
        return min(1.0, busy / (self.instances * UTILISATION_WINDOW_S * 1e9))

    def arrived(self, now_ns: int) -> None:
        self.arrivals.append(now_ns)
        self._forget_arrivals(now_ns)

    def worth_waiting(self, left_s: float, now_ns: int) -> bool:
        """Whether a query at the head of the queue, with an instance free, should wait up to `left_s` more for
        companions: only while the arrival rate of the last UTILISATION_WINDOW_S expects one within that time.
        A lone query at 3 queries/s waits for nothing (it waited the whole delay, a floor's worth of p99); under
        load the queue fills the batch as before."""
        self._forget_arrivals(now_ns)
        return len(self.arrivals) / UTILISATION_WINDOW_S * left_s >= 1.0

    def _forget_arrivals(self, now_ns: int) -> None:
        since = now_ns - int(UTILISATION_WINDOW_S * 1e9)
        while self.arrivals and self.arrivals[0] < since:
            self.arrivals.popleft()

    def busy_left_ms(self, now_ns: int) -> list[float]:
        """Expected time left of every busy instance's batch (0 when overdue)."""
        cost = self.expected_cost()
        if cost is None:
            return []
        return [max(0.0, cost.ms(n) - (now_ns - sent) / 1e6) for sent, n in self.busy.values()]

    def next_batch(self, waiting: int, free: int, now_ns: int, *, max_batch: int, min_piece: int) -> int:
        """`next_batch` with what this clock knows at `now_ns`."""
        return next_batch(
            waiting,
            free,
            self.busy_left_ms(now_ns),
            max_batch=max_batch,
            min_piece=min_piece,
            cost=self.expected_cost(),
            utilisation=self.utilisation(now_ns),
        )

    def sent(self, instance: int, now_ns: int, samples: int) -> None:
        self.busy[instance] = (now_ns, samples)

    def finished(self, instance: int, now_ns: int, samples: int, batch_ms: float | None) -> float | None:
        """The instance's batch came back (`batch_ms`: its time on the instance, None when it
        failed); returns that batch's time as the warm cost model has it."""
        sent = self.busy.pop(instance, None)
        if sent is not None:
            self.done.append((now_ns, now_ns - sent[0]))
            self.done_ns += now_ns - sent[0]
        if self.cost is None:
            return None
        expected = self.cost.ms(samples)
        if batch_ms is not None:
            self.slowdown += SLOWDOWN_WEIGHT * (batch_ms / expected - self.slowdown)
        return expected


class QueryProgress(Protocol):
    """What `whole_enough` reads of the oldest waiting query (`infer.sut.Query`, or the ideal server's)."""

    size: int
    dispatched: int


def whole_enough(size: int, head: QueryProgress, instances: int, limit: int) -> int:
    """The batch size, grown so that the oldest query is cut into no more pieces than there are
    instances: pieces beyond that would run one after another, each paying the batch's fixed cost
    (a 700-sample query on one instance at max batch 256 ran as 3 batches, 7.9 ms against 2.45 ms
    whole). At most `limit` samples (the largest batch the instances warmed up for)."""
    left = head.size - head.dispatched
    if left <= size:
        return size
    return max(size, min(limit, -(-left // max(1, instances))))


def take_batch(pool: Any, max_batch: int, instance: int | None = None) -> list[tuple[Query, int, int]]:
    """Pieces (query, lo, hi) of the next batch of at most `max_batch` samples (`next_batch`) for
    `instance`, taken from `pool` (the server's pool of one model: its `waiting` queries, their
    `waiting_samples`, the instances of its users' `homes`); called with the pool's lock held.

    With history affinity the instance first takes whole waiting queries whose user it holds
    (among the first AFFINITY_SCAN), oldest first; only when none wait does it take the queue's
    head, so no instance idles while queries wait.

    Whole queries are packed while they fit. A query larger than `max_batch` is split
    (DeepRecSys' query splitting): a full batch of its samples goes now, the rest stays
    at the head of the queue for the next free instance, so co-located instances work
    on one large query in parallel. An oversized query (more than one piece for every instance
    at once) goes behind the others after each piece: it advances a piece per turn of the queue.
    """
    if pool.homes and instance is not None:
        own = _own_queries(pool, max_batch, instance)
        if own:
            return own
    head = pool.waiting[0]
    if head.size - head.dispatched > max_batch:
        lo = head.dispatched
        head.pieces += 1
        head.dispatched += max_batch
        pool.waiting_samples -= max_batch
        served = pool.served
        if head.size > served.instances * served.piece_limit() and len(pool.waiting) > 1:
            pool.waiting.rotate(-1)  # an oversized query takes its turns behind the others: it cannot starve them
        return [(head, lo, lo + max_batch)]
    pieces: list[tuple[Query, int, int]] = []
    samples = 0
    while pool.waiting:
        q = pool.waiting[0]
        rest = q.size - q.dispatched
        if pieces and samples + rest > max_batch:
            break
        if pieces and q.deadline_ns is not None and q.deadline_ns <= time.monotonic_ns():
            break  # expired: the server drops it at the head of the queue, uncomputed
        pool.waiting.popleft()
        pieces.append((q, q.dispatched, q.size))
        q.pieces += 1
        q.dispatched = q.size
        samples += rest
    pool.waiting_samples -= samples
    return pieces


def _own_queries(pool: Any, max_batch: int, instance: int) -> list[tuple[Query, int, int]]:
    picked, samples = [], 0
    for q in itertools.islice(pool.waiting, AFFINITY_SCAN):
        if q.home != instance or q.dispatched:
            continue
        if samples + q.size > max_batch:
            break
        picked.append(q)
        samples += q.size
    for q in picked:
        pool.waiting.remove(q)
        q.pieces, q.dispatched = q.pieces + 1, q.size
    pool.waiting_samples -= samples
    return [(q, 0, q.size) for q in picked]

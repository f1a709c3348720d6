"""Batch completions: what the server makes of an instance's answer to a batch. Each piece's scores go into its
query, the instance goes back to its model's free list, the batch's time is set against what its model expects (one
held far beyond it is a stall), and each query whose last piece came back becomes one record (`infer.sut.query_row`)
and its caller's callback; the records and stalls are taken from here, point by point.

`QueryRecords` holds what the server records of its queries; `BatchCompletions` runs the completion thread over the
instances' pipes (`infer.instance_processes.InstanceProcesses`) and the server's pools; the server
(`infer.server.InferenceServer`) holds one of each.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_connections
from typing import Any, NamedTuple, TypedDict, cast

import numpy as np

from dlrm_lab.config.values import JsonObject
from dlrm_lab.infer.instance import CANARY, TRACE, BatchResult
from dlrm_lab.infer.instance_processes import InstanceProcesses
from dlrm_lab.infer.pools import Pool
from dlrm_lab.infer.served import ServedModel
from dlrm_lab.infer.serving_parts import serving_of
from dlrm_lab.infer.sut import Query, Stall, finishing_together, query_row
from dlrm_lab.metrics.columns import BATCH_STAGES, QueryRow

# A batch that an instance holds this long, and this many times its warm time, is a stall (the process was stopped or
# starved of its core), not a slow batch: said per point
STALL_MS = 500.0
STALL_FACTOR = 20.0
CANARY_KEPT = 10_000  # speed-canary readings held for the next `take_canary` (about 5 hours of one instance)


class InstanceStates(NamedTuple):
    """A model's instances and queue at one moment (`instance_states`)."""

    alive: int  # started and not lost
    busy: int  # holding a batch
    # holding one beyond STALL_MS and STALL_FACTOR x its warm time (beyond STALL_MS where none was measured)
    stalled: int
    waiting: int  # queries queued for a batch


class QueryRecords:
    """What the server records of its queries: a row for each as it finishes (and its caller's callback), the batches
    an instance held far beyond their warm time, the instances' speed-canary readings; and how many queries are
    still out (`drain`). `failed(why)` is told when a caller's callback raises."""

    def __init__(self, models: dict[str, ServedModel], failed: Callable[[str], None]) -> None:
        self.models, self.failed = models, failed
        self.epoch_ns = time.monotonic_ns()  # records' times are ms from here (the server resets it as it starts)
        self._lock = threading.Lock()
        self._records: list[QueryRow] = []
        self._stalls: list[Stall] = []
        # the instances' readings, each with its model; a `serve` nobody takes them from keeps the last
        self._canary: collections.deque[JsonObject] = collections.deque(maxlen=CANARY_KEPT)
        self._outstanding = 0  # submitted, not yet finished
        self._idle = threading.Condition()

    def opened(self) -> None:
        """One more query submitted, to be finished."""
        with self._idle:
            self._outstanding += 1

    def drain(self, timeout_s: float, broken: Callable[[], bool]) -> bool:
        """Wait until every submitted query finished; False on timeout or as soon as `broken()`."""
        deadline = time.monotonic() + timeout_s
        with self._idle:
            while self._outstanding > 0:
                left = deadline - time.monotonic()
                if left <= 0 or broken():
                    return False
                self._idle.wait(min(left, 0.5))
        return True

    def wake(self) -> None:
        """Wake a `drain` (the server broke)."""
        with self._idle:
            self._idle.notify_all()

    def stall(self, stall: Stall) -> None:
        with self._lock:
            self._stalls.append(stall)

    def canary(self, reading: JsonObject) -> None:
        with self._lock:
            self._canary.append(reading)

    def take_records(self) -> list[QueryRow]:
        with self._lock:
            out, self._records = self._records, []
        return out

    def take_stalls(self) -> list[Stall]:
        """Batches since the last call that an instance held far beyond their warm time (STALL_MS, STALL_FACTOR):
        its process was stopped, or starved of its core."""
        with self._lock:
            out, self._stalls = self._stalls, []
        return out

    def take_canary(self) -> list[JsonObject]:
        """The instances' speed-canary readings since the last call (`metrics.canary`), each naming its model."""
        with self._lock:
            out = list(self._canary)
            self._canary.clear()
        return out

    def callback_failed(self, exc: Exception) -> None:
        self.failed(f"completion callback failed: {type(exc).__name__}: {exc}")

    def finish(
        self,
        q: Query,
        status: str,
        *,
        now: int,
        error: str | None = None,
        scores: np.ndarray | None = None,
        batch_samples: int | None = None,
        instance: int | None = None,
        **batch: Any,
    ) -> None:
        """A finished query told to its driver, then recorded (the batch fields are those of its last piece)."""
        self.tell(q, status, error=error, scores=scores, batch_samples=batch_samples, instance=instance)
        self.record(q, status, now=now, error=error, batch_samples=batch_samples, instance=instance, **batch)

    def tell(
        self,
        q: Query,
        status: str,
        *,
        error: str | None = None,
        scores: np.ndarray | None = None,
        batch_samples: int | None = None,
        instance: int | None = None,
    ) -> None:
        """A finished query's driver told (`on_done`), before its row is built: a driver's clock (MLPerf LoadGen's)
        runs until it hears, and the rows of a batch's queries cost tens of us each (`record`)."""
        q.status, q.error, q.batch_samples, q.instance = status, error, batch_samples, instance  # the gRPC answer's
        if q.on_done is not None:
            try:
                q.on_done(q, status, scores)
            except Exception as exc:  # noqa: BLE001 - a driver callback must not stop completions
                self.callback_failed(exc)

    def record(self, q: Query, status: str, *, now: int, error: str | None = None, **batch: Any) -> None:
        """A told query's row (`tell` first), with the fields of the batch that finished it (`batch_columns`'s)."""
        self.record_finished([(q, status, error, now)], self.batch_columns(**batch))

    def batch_columns(
        self,
        *,
        batch_id: int | None = None,
        batch_samples: int | None = None,
        batch_queries: int | None = None,
        instance: int | None = None,
        batch_compute_ms: float | None = None,
        batch_expected_ms: float | None = None,
        batch_start_ns: int | None = None,
        batch_stages: tuple[float | None, ...] | None = None,
        batch_completion_ms: float | None = None,
    ) -> dict[str, Any]:
        """A batch's columns, the same in the row of every query it finished: made once a batch."""
        out: dict[str, Any] = {
            "batch_id": batch_id,
            "batch_samples": batch_samples,
            "batch_queries": batch_queries,
            "instance": instance,
            "batch_compute_ms": batch_compute_ms,
            "batch_expected_ms": batch_expected_ms,
            "batch_start_ms": None if batch_start_ns is None else (batch_start_ns - self.epoch_ns) / 1e6,
            "batch_completion_ms": batch_completion_ms,
        }
        for k, stage in enumerate(BATCH_STAGES):
            out[f"batch_{stage}_ms"] = None if batch_stages is None else batch_stages[k]
        return out

    def record_finished(self, finished: list[tuple[Query, str, str | None, int]], batch: dict[str, Any]) -> None:
        """The rows of told queries (each: the query, its status, error and end) that one batch of one model finished
        (`batch`: its `batch_columns`), added under one lock; the last query's wakes whoever waits for every query to
        finish. A query's own columns are all that is made per query (the serving process's completion thread makes
        them while the load runs: its time is the issue and batching threads' wait)."""
        if not finished:
            return
        e = self.epoch_ns
        served = self.models[finished[0][0].model]  # a batch is one model's
        count = serving_of(served.spec).count_columns
        rows = []
        for q, status, error, now in finished:
            start_ns = q.first_start_ns
            columns = dict(batch)
            columns["start_ms"] = None if start_ns is None else (start_ns - e) / 1e6
            columns["queue_ms"] = None if start_ns is None else (start_ns - q.issued_ns) / 1e6
            columns["compute_ms"] = q.compute_ns / 1e6 if start_ns is not None else None
            columns["pieces"] = q.pieces
            counted = count(served, q.counts)  # what the model's family counted of it
            if counted:
                columns.update(counted)
            rows.append(
                query_row(
                    q.query_id,
                    q.model,
                    q.size,
                    status,
                    epoch_ns=e,
                    scheduled_ns=q.scheduled_ns,
                    issued_ns=q.issued_ns,
                    end_ns=now,
                    error=error,
                    columns=columns,
                )
            )
        with self._lock:
            self._records.extend(rows)
        with self._idle:
            self._outstanding -= len(rows)
            if self._outstanding == 0:
                self._idle.notify_all()


InFlight = dict[int, tuple[str, list[tuple[Query, int, int]], int]]  # batch id -> its model, pieces and instance


class _BatchFields(TypedDict, total=False):
    """What a finished batch tells each of its queries' records (`QueryRecords.finish`'s batch fields)."""

    batch_id: int
    batch_samples: int
    batch_queries: int
    instance: int
    batch_compute_ms: float
    batch_start_ns: int
    batch_stages: tuple[float | None, ...] | None
    batch_completion_ms: float
    batch_expected_ms: float | None  # set once the batch's instance is free again


class BatchCompletions:
    """The completion thread: each instance's answer to a batch into its queries, its instance back to its model's
    pool, its time set against what the model expects; the instances' other messages (canary readings, trace
    answers) to where they belong. `check()` (the server's) is run when no answer came for half a second."""

    # Told each batch's model and samples as it comes back, on the completion thread (`serve --metrics-port`): one
    # call a batch, which must be cheap and must not raise
    batch_observer: Callable[[str, int], None] | None = None

    def __init__(
        self,
        pools: dict[str, Pool],
        in_flight: InFlight,
        instances: InstanceProcesses,
        records: QueryRecords,
        check: Callable[[], None],
    ) -> None:
        self.pools, self.in_flight, self.instances = pools, in_flight, instances
        self.records, self.check = records, check

    def instance_states(self) -> dict[str, InstanceStates]:
        """Per model, its instances alive, busy and stalled now, and its queries waiting (read when scraped)."""
        now = time.monotonic_ns()
        out: dict[str, InstanceStates] = {}
        for name, pool in self.pools.items():
            with pool.cond:
                busy = [(sent, n) for i, (sent, n) in pool.clock.busy.items() if not self.instances.is_lost(i)]
                cost, waiting = pool.clock.cost, len(pool.waiting)
            stalled = sum(
                (now - sent) / 1e6 > max(STALL_MS, STALL_FACTOR * (cost.ms(n) if cost is not None else 0.0))
                for sent, n in busy
            )
            out[name] = InstanceStates(len(self.instances.live(name)), len(busy), stalled, waiting)
        return out

    def loop(self, stopping: Callable[[], bool]) -> None:
        conns = {id(c): c for c in self.instances.connections()}
        while not stopping() and conns:
            ready = cast(list[Connection], wait_connections(list(conns.values()), timeout=0.5))  # of those given
            if not ready:
                try:
                    self.check()
                except RuntimeError:
                    self.records.wake()
                continue
            told: list[tuple[Query, int, _BatchFields]] = []  # recorded once every driver heard
            with finishing_together(self.records.callback_failed):  # the batches that arrived together, together
                for conn in ready:
                    try:
                        msg: Any = conn.recv()
                    except (EOFError, OSError):
                        del conns[id(conn)]  # instance gone; check() names it
                        continue
                    if isinstance(msg, tuple) and msg[0] == CANARY:
                        self.records.canary({**msg[2], "model": self.instances.info[msg[1]]["model"]})
                    elif isinstance(msg, tuple) and msg[0] == TRACE:
                        self.instances.traced(msg[1], msg[2])
                    else:
                        told.extend(self.answer(msg))
            self.record(told)

    def complete(self, msg: BatchResult) -> None:
        """A batch's answer into its queries, each finished one told to its driver and recorded."""
        self.record(self.answer(msg))

    def record(self, told: list[tuple[Query, int, _BatchFields]]) -> None:
        """The told queries' rows, a batch's columns made once for all the queries it finished (`answer` gives
        each of a batch's queries the same `_BatchFields`, one batch after another)."""
        for _, group in itertools.groupby(told, key=lambda t: id(t[2])):
            batch = list(group)
            finished = [(q, q.status, q.error, now) for q, now, _ in batch]
            self.records.record_finished(finished, self.records.batch_columns(**batch[0][2]))

    def answer(self, msg: BatchResult) -> list[tuple[Query, int, _BatchFields]]:
        """A batch's answer into its queries, each finished one told to its driver (`QueryRecords.tell`); returns
        those queries, with the time and batch fields their rows take, for `record` once the batches that arrived
        together were told: their rows cost tens of us a query, which a driver's clock would count."""
        now = time.monotonic_ns()
        entry = self.in_flight.pop(msg.batch_id, None)
        if entry is None:  # failed already, with the instance that died holding it
            return []
        name, pieces, _ = entry
        pool = self.pools[name]
        samples = sum(hi - lo for _, lo, hi in pieces)
        batch: _BatchFields = {
            "batch_id": msg.batch_id,
            "batch_samples": samples,
            "batch_queries": len(pieces),
            "instance": msg.instance,
            "batch_compute_ms": (msg.end_ns - msg.start_ns) / 1e6,
            "batch_start_ns": msg.start_ns,
            "batch_stages": msg.stages,
            "batch_completion_ms": (now - msg.end_ns) / 1e6,
        }
        pos = 0  # into the batch's scores
        for k, (q, lo, hi) in enumerate(pieces):
            if q.first_start_ns is None or msg.start_ns < q.first_start_ns:
                q.first_start_ns = msg.start_ns
            q.compute_ns += msg.end_ns - msg.start_ns
            if msg.error is not None:
                q.status, q.error = "failed", msg.error
            else:
                if msg.scores is not None:
                    if pool.one_score_per_sample:
                        total, a, n = q.size, lo, hi - lo
                    else:  # HSTU: one score per candidate of each request
                        counts = pool.library.output_counts(q.offset, q.size)
                        total, a, n = int(counts.sum()), int(counts[:lo].sum()), int(counts[lo:hi].sum())
                    if q.scores is None:
                        q.scores = np.empty(total, dtype=np.float32)
                    q.scores[a : a + n] = msg.scores[pos : pos + n]
                    pos += n
                if msg.counts is not None:
                    q.counts = msg.counts[k] if q.counts is None else q.counts + msg.counts[k]
        with pool.cond:  # the batcher may be dispatching a query's next piece meanwhile
            if not self.instances.is_lost(msg.instance):
                pool.free.append(msg.instance)
            sent_ns = pool.clock.busy.get(msg.instance, (msg.start_ns, 0))[0]
            batch["batch_expected_ms"] = pool.clock.finished(
                msg.instance, now, samples, None if msg.error is not None else batch["batch_compute_ms"]
            )
            pool.cond.notify()
            finished = []
            for q, _, _ in pieces:
                q.done_pieces += 1
                if q.dispatched == q.size and q.done_pieces == q.pieces:
                    finished.append(q)
        took_ms = (msg.end_ns - sent_ns) / 1e6  # sent to answered, on the instance's side
        expected = batch["batch_expected_ms"]
        if expected is not None and took_ms > max(STALL_MS, STALL_FACTOR * expected):
            self.records.stall(
                Stall(
                    instance=msg.instance,
                    model=name,
                    took_ms=took_ms,
                    expected_ms=expected,
                    at_ms=(sent_ns - self.records.epoch_ns) / 1e6,
                )
            )
        if self.batch_observer is not None:
            self.batch_observer(name, samples)
        for q in finished:
            self.records.tell(q, q.status, error=q.error, scores=q.scores, batch_samples=samples, instance=msg.instance)
        return [(q, now, batch) for q in finished]

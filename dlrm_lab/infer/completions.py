"""Batch completions: what the server makes of an instance's answer to a batch. Each piece's scores go into its
query, the instance goes back to its model's free list, the batch's time is set against what its model expects (one
held far beyond it is a stall), and each query whose last piece came back becomes one record (`infer.sut.query_row`)
and its caller's callback; the records and stalls are taken from here, point by point.

`BatchCompletions` is a part of `infer.server.InferenceServer`, whose `__init__` sets the state these methods share.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from multiprocessing.connection import wait as wait_connections
from typing import NamedTuple

import numpy as np

from dlrm_lab.config.family import family_of
from dlrm_lab.config.values import JsonObject
from dlrm_lab.infer.instance import CANARY, TRACE, BatchResult
from dlrm_lab.infer.sut import Query, Stall, finishing_together, query_row
from dlrm_lab.metrics.columns import BATCH_STAGES, QueryRow

# A batch that an instance holds this long, and this many times its warm time, is a stall (the process was stopped or
# starved of its core), not a slow batch: said per point
STALL_MS = 500.0
STALL_FACTOR = 20.0


class InstanceStates(NamedTuple):
    """A model's instances and queue at one moment (`instance_states`)."""

    alive: int  # started and not lost
    busy: int  # holding a batch
    # holding one beyond STALL_MS and STALL_FACTOR x its warm time (beyond STALL_MS where none was measured)
    stalled: int
    waiting: int  # queries queued for a batch


class BatchCompletions:
    """The server's completion thread and the query records it writes (see the module's docstring)."""

    # Told each batch's model and samples as it comes back, on the completion thread (`serve --metrics-port`): one
    # call a batch, which must be cheap and must not raise
    batch_observer: Callable[[str, int], None] | None = None

    def instance_states(self) -> dict[str, InstanceStates]:
        """Per model, its instances alive, busy and stalled now, and its queries waiting (read when scraped)."""
        now = time.monotonic_ns()
        out: dict[str, InstanceStates] = {}
        for name, pool in self._pools.items():
            mine = [info["instance"] for info in self.instance_info if info["model"] == name]
            with pool.cond:
                busy = [(sent, n) for i, (sent, n) in pool.clock.busy.items() if i not in self._lost]
                cost, waiting = pool.clock.cost, len(pool.waiting)
            stalled = sum(
                (now - sent) / 1e6 > max(STALL_MS, STALL_FACTOR * (cost.ms(n) if cost is not None else 0.0))
                for sent, n in busy
            )
            out[name] = InstanceStates(sum(i not in self._lost for i in mine), len(busy), stalled, waiting)
        return out

    def _count_columns(self, q: Query) -> dict[str, int | None]:
        """What the query's model's family counted of it, as its query columns (none for a DLRM)."""
        served = self.models[q.model]
        return family_of(served.spec).count_columns(served, q.counts)

    def take_records(self) -> list[QueryRow]:
        with self._records_lock:
            out, self._records = self._records, []
        return out

    def take_stalls(self) -> list[Stall]:
        """Batches since the last call that an instance held far beyond their warm time (STALL_MS, STALL_FACTOR):
        its process was stopped, or starved of its core."""
        with self._records_lock:
            out, self._stalls = self._stalls, []
        return out

    def take_canary(self) -> list[JsonObject]:
        """The instances' speed-canary readings since the last call (`metrics.canary`), each naming its model."""
        with self._records_lock:
            out = list(self._canary)
            self._canary.clear()
        return out

    def _complete_loop(self) -> None:
        conns = {id(c): c for c in self._conns.values()}
        while not self._stopping and conns:
            ready = wait_connections(list(conns.values()), timeout=0.5)
            if not ready:
                try:
                    self.check()
                except RuntimeError:
                    with self._idle:
                        self._idle.notify_all()
                continue
            with finishing_together(self._callback_failed):  # the batches that arrived together are reported together
                for conn in ready:
                    try:
                        msg: BatchResult = conn.recv()
                    except (EOFError, OSError):
                        del conns[id(conn)]  # instance gone; check() names it
                        continue
                    if isinstance(msg, tuple) and msg[0] == CANARY:
                        with self._records_lock:
                            self._canary.append({**msg[2], "model": self.instance_info[msg[1]]["model"]})
                        continue
                    if isinstance(msg, tuple) and msg[0] == TRACE:
                        with self._traced_cond:
                            self._traced[msg[1]] = msg[2]
                            self._traced_cond.notify_all()
                        continue
                    self._complete(msg)

    def _complete(self, msg: BatchResult) -> None:
        now = time.monotonic_ns()
        entry = self._in_flight.pop(msg.batch_id, None)
        if entry is None:  # failed already, with the instance that died holding it
            return
        name, pieces, _ = entry
        pool = self._pools[name]
        samples = sum(hi - lo for _, lo, hi in pieces)
        batch = {
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
            if msg.instance not in self._lost:
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
            with self._records_lock:
                self._stalls.append(
                    Stall(
                        instance=msg.instance,
                        model=name,
                        took_ms=took_ms,
                        expected_ms=expected,
                        at_ms=(sent_ns - self.epoch_ns) / 1e6,
                    )
                )
        if self.batch_observer is not None:
            self.batch_observer(name, samples)
        for q in finished:
            self._finish(q, q.status, now=now, error=q.error, scores=q.scores, **batch)

    def _callback_failed(self, exc: Exception) -> None:
        self._error = f"completion callback failed: {type(exc).__name__}: {exc}"

    def _finish(
        self,
        q: Query,
        status: str,
        *,
        now: int,
        error: str | None = None,
        scores: np.ndarray | None = None,
        batch_id: int | None = None,
        batch_samples: int | None = None,
        batch_queries: int | None = None,
        instance: int | None = None,
        batch_compute_ms: float | None = None,
        batch_expected_ms: float | None = None,
        batch_start_ns: int | None = None,
        batch_stages: tuple[float | None, ...] | None = None,
        batch_completion_ms: float | None = None,
    ) -> None:
        """Record a finished query (the batch fields are those of its last piece)."""
        # for on_done (the gRPC response carries them)
        q.status, q.error, q.batch_samples, q.instance = status, error, batch_samples, instance
        e = self.epoch_ns
        start_ns = q.first_start_ns
        record = query_row(
            q.query_id,
            q.model,
            q.size,
            status,
            epoch_ns=e,
            scheduled_ns=q.scheduled_ns,
            issued_ns=q.issued_ns,
            end_ns=now,
            error=error,
            start_ms=None if start_ns is None else (start_ns - e) / 1e6,
            queue_ms=None if start_ns is None else (start_ns - q.issued_ns) / 1e6,
            compute_ms=q.compute_ns / 1e6 if start_ns is not None else None,
            pieces=q.pieces,
            batch_id=batch_id,
            batch_samples=batch_samples,
            batch_queries=batch_queries,
            instance=instance,
            batch_compute_ms=batch_compute_ms,
            batch_expected_ms=batch_expected_ms,
            **self._count_columns(q),
            batch_start_ms=None if batch_start_ns is None else (batch_start_ns - e) / 1e6,
            **{
                f"batch_{stage}_ms": None if batch_stages is None else batch_stages[k]
                for k, stage in enumerate(BATCH_STAGES)
            },
            batch_completion_ms=batch_completion_ms,
        )
        with self._records_lock:
            self._records.append(record)
        if q.on_done is not None:
            try:
                q.on_done(q, status, scores)
            except Exception as exc:  # noqa: BLE001 - a driver callback must not stop completions
                self._callback_failed(exc)
        with self._idle:
            self._outstanding -= 1
            if self._outstanding == 0:
                self._idle.notify_all()

"""Several client connections, each in a process of its own, as one system under test.

One Python process serialising and decoding for many clients is limited by its GIL, which would be
measured as transfer cost: beyond one connection each is a worker process with its own channel and
`RemoteServer`. The load's driver stays in the runner's process, so a point has one schedule and one
set of rows: `submit` hands a query's identity (model, samples, scheduled arrival) to the worker with
the fewest queries outstanding, over a pipe; the worker sends it on its own channel and its row comes
back with the answer. Arrival and latency count from the parent's schedule (time.monotonic_ns is
system-wide on Linux), so the pipe's hop is part of the query's issue delay, as it is of a client's.

Hand-written: no library fans a load generator's queries over client processes.
"""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from dlrm_lab.errors import (
    BadAnswer,
    ClientLost,
    FieldError,
    RemoteFailure,
    ServerLost,
    end_with_parent,
    exit_description,
    interrupt_blocked,
)
from dlrm_lab.infer.sut import NoInstancesHere, Query, SutDescription
from dlrm_lab.metrics.columns import QueryRow

START_TIMEOUT_S = 300.0  # a worker imports its libraries and unpickles its samples before it is ready
# A client worker's private memory (USS: its imports, no torch since it is handed its sample libraries, and its
# channel; shared pages counted once), measured with the tiny preset on 2026-11-28 (36 MiB; RSS 87 MiB; 267 MB while
# it imported torch to generate them), rounded up
WORKER_RUNTIME_BYTES = 48 << 20


def check_workers_fit(concurrency: int, library_bytes: int, available_bytes: int | None = None) -> None:
    """Refuse, naming --concurrency and the most that fit, client workers that would not fit in this machine's
    available memory (each holds its runtime and its own copy of the sample libraries), as serving's instances
    are refused (`infer.memory.check_fits`)."""
    import psutil

    available = psutil.virtual_memory().available if available_bytes is None else available_bytes
    each = WORKER_RUNTIME_BYTES + library_bytes
    if concurrency * each > available:
        fit = max(1, int(available // each))
        raise FieldError(
            "concurrency",
            f"{concurrency}: {concurrency} client processes need "
            f"{concurrency * each / 2**30:.2f} GiB ({each / 2**20:.0f} MiB each: the runtime and the "
            f"sample libraries) but this machine has {available / 2**30:.2f} GiB available: at most "
            f"{fit} here",
        )


@dataclass(frozen=True)
class WorkerPlan:
    """What a worker needs to open its own connection: picklable."""

    worker: int
    connect: Callable[[int], Any]  # worker index -> its RemoteServer (a module-level function or partial)
    epoch_ns: int


class ClientPool(NoInstancesHere):
    """`concurrency` RemoteServers in worker processes behind one SystemUnderTest (module docstring)."""

    def __init__(
        self,
        plans: list[WorkerPlan],
        libraries: Mapping[str, Any],
        description: SutDescription,
        unavailable_s: float,
    ) -> None:
        self.libraries, self._description, self.unavailable_s = dict(libraries), description, unavailable_s
        ctx = mp.get_context("spawn")
        self._workers: list[tuple[Any, Any]] = []
        self._send_locks: list[threading.Lock] = []
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._waiting: dict[int, tuple[Query, int]] = {}  # pool id -> (query, worker)
        self._outstanding = [0] * len(plans)
        self._rows: list[QueryRow] = []
        self._lost: RemoteFailure | None = None
        self._next = 0
        try:
            for plan in plans:
                parent_end, child_end = ctx.Pipe()
                proc = ctx.Process(
                    target=_worker_main, args=(plan, child_end), daemon=True, name=f"dlrm-lab-client-{plan.worker}"
                )
                with interrupt_blocked():  # a Ctrl-C while it imports is the parent's to handle
                    proc.start()
                child_end.close()
                self._workers.append((proc, parent_end))
                self._send_locks.append(threading.Lock())  # one sender at a time per pipe
            for k, (_proc, conn) in enumerate(self._workers):
                if not conn.poll(START_TIMEOUT_S):
                    raise RuntimeError(f"client worker {k} did not start within {START_TIMEOUT_S:g} s")
                _, why = conn.recv()
                if why:  # one line, as a single connection's failure to connect is
                    raise FieldError("target", f"{description.target}: client connection {k}: {why}")
        except BaseException:
            self.close()
            raise
        self._readers = [
            threading.Thread(target=self._read, args=(k,), name=f"client-pool-{k}", daemon=True)
            for k in range(len(self._workers))
        ]
        for t in self._readers:
            t.start()

    # SystemUnderTest

    def library(self, model: str) -> Any:
        return self.libraries[model]

    def describe(self) -> SutDescription:
        return self._description

    def submit(self, q: Query) -> None:
        if not q.scheduled_ns:
            q.scheduled_ns = time.monotonic_ns()
        with self._lock:
            pool_id = self._next
            self._next += 1
            k = min(range(len(self._outstanding)), key=self._outstanding.__getitem__)
            self._outstanding[k] += 1
            self._waiting[pool_id] = (q, k)
        with self._send_locks[k]:
            self._workers[k][1].send(("query", pool_id, q.query_id, q.model, q.size, q.offset, q.scheduled_ns))

    def drain(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        with self._idle:
            while self._waiting and time.monotonic() < deadline and self._lost is None:
                self._idle.wait(min(0.25, max(0.0, deadline - time.monotonic())))
            return not self._waiting

    def take_records(self) -> list[QueryRow]:
        with self._lock:
            out, self._rows = self._rows, []
        return out

    def check(self) -> None:
        if self._lost is not None:
            raise self._lost

    def close(self) -> None:
        for (_proc, conn), lock in zip(self._workers, self._send_locks, strict=True):
            try:
                with lock:
                    conn.send(("stop",))
            except (OSError, ValueError):  # a worker already gone
                pass
        for proc, conn in self._workers:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
            conn.close()
        self._workers = []

    def __enter__(self) -> ClientPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # the answers

    def _read(self, k: int) -> None:
        conn = self._workers[k][1]
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                proc = self._workers[k][0] if k < len(self._workers) else None
                if proc is not None:
                    proc.join(timeout=1.0)  # its exit code says how it ended
                with self._idle:
                    if self._waiting and self._lost is None:
                        how = "ended" if proc is None else f"(pid {proc.pid}) {exit_description(proc.exitcode)}"
                        self._lost = ClientLost(f"the lab's client worker {k} {how}; the server was not at fault")
                    self._idle.notify_all()
                return
            if message[0] == "done":
                _, pool_id, status, scores, row = message
                with self._lock:
                    q, worker = self._waiting.pop(pool_id)
                    self._outstanding[worker] -= 1
                    self._rows.append(row)
                if q.on_done is not None:
                    q.on_done(q, status, scores)
                with self._idle:
                    self._idle.notify_all()
            elif message[0] == "fault":
                _, kind, why = message
                with self._idle:
                    self._lost = (BadAnswer if kind == "BadAnswer" else ServerLost)(f"client worker {k}: {why}")
                    self._idle.notify_all()
            elif message[0] == "closed":
                return


def _worker_main(plan: WorkerPlan, conn: Any) -> None:
    """A client worker: its own connection; queries in from the pipe, rows and answers back."""
    end_with_parent()  # Ctrl-C reaches the parent, which stops us; a killed parent takes us with it
    try:
        remote = plan.connect(plan.worker)
        remote.epoch_ns = plan.epoch_ns
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which fails the run with it
        conn.send(("ready", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", None))
    send_lock = threading.Lock()

    def done(q: Query, status: str, scores: Any) -> None:
        remote.take_records()  # each row travels with its own answer (q.record): the list is only emptied
        with send_lock:
            conn.send(("done", q.tag, status, scores, q.record))

    while True:
        message = conn.recv()
        if message[0] == "stop":
            break
        _, pool_id, query_id, model, size, offset, scheduled_ns = message
        remote.submit(Query(query_id, model, size, offset, scheduled_ns=scheduled_ns, on_done=done, tag=pool_id))
        try:
            remote.check()
        except RemoteFailure as exc:
            with send_lock:
                conn.send(("fault", type(exc).__name__, str(exc)))
    remote.drain(remote.timeout_s + 1.0)
    remote.close()
    with send_lock:
        conn.send(("closed",))

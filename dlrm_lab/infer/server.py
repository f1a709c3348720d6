"""The system under test: dynamic batching in front of co-located instances.

    submit(query) -> bounded queue per model -> batcher thread -> pipe of a free instance
    instance pipes -> completion thread -> query records, callbacks

A batcher packs queued queries into a batch (a larger query is split into pieces that
instances serve in parallel; `infer.batching.next_batch` sizes each batch) and sends it once an
instance is free and either `max_batch` samples wait or the oldest query has waited `max_delay_ms`.
Only free instances get batches, so while all are busy queries keep accumulating into larger batches, as in
DeepRecSys' and Triton's dynamic batchers. Beyond `max_queue` waiting queries a new
query is dropped at once (recorded), so memory stays bounded under overload.

`InferenceServer` implements `infer.sut.SystemUnderTest`: the lab's drivers reach it only
through that interface. Each model's sample library is generated once here, written to the
snapshot with its tables, and mapped by its instances and by this process (`library(model)`).
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import multiprocessing as mp
import shutil
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import wait as wait_connections
from pathlib import Path
from typing import Any

import numpy as np

from dlrm_lab.config.family import family_of
from dlrm_lab.errors import ServingFault, UserError, exit_description
from dlrm_lab.infer.batches import QueryRef
from dlrm_lab.infer.batching import BatchClock, BatchCost, take_batch, whole_enough
from dlrm_lab.infer.instance import (
    SPIN,
    TRACE,
    BatchResult,
    InstancePlan,
    instance_main,
    map_library,
    remove_stale_snapshots,
    snapshot_dir_for,
    write_snapshot,
)
from dlrm_lab.infer.library import PackedLibrary, payload_for
from dlrm_lab.infer.placement import Placement, place_instances
from dlrm_lab.infer.plan import ServingPlan, plan_serving
from dlrm_lab.infer.requests import RequestLibrary
from dlrm_lab.infer.served import ServedModel
from dlrm_lab.infer.sut import Query, SutDescription, finishing_together, query_row
from dlrm_lab.metrics.columns import BATCH_STAGES

# A batch that an instance holds this long, and this many times its warm time, is a stall (the process was stopped or
# starved of its core), not a slow batch: said per point
STALL_MS = 500.0
STALL_FACTOR = 20.0

GIL_SWITCH_S = 0.0005  # the serving process's GIL switch interval while it serves (see start)


@dataclass
class _Pool:
    served: ServedModel
    library: PackedLibrary | RequestLibrary  # mapped from the snapshot the instances map
    cond: threading.Condition = field(default_factory=threading.Condition)
    waiting: collections.deque = field(default_factory=collections.deque)
    waiting_samples: int = 0
    free: collections.deque = field(default_factory=collections.deque)  # idle instance numbers
    thread: threading.Thread | None = None
    clock: BatchClock = field(init=False)  # its batches in time (infer.batching)
    # history affinity (HSTU with reuse, several instances): this model's instances, a user's home among them
    homes: list[int] = field(default_factory=list)
    one_score_per_sample: bool = field(init=False)  # DLRM; an HSTU request scores each candidate
    rows: list[int] = field(init=False)  # per sparse feature, its table's rows (DLRM): what a sent id may be

    def __post_init__(self) -> None:
        self.clock = BatchClock(self.served.instances)
        self.one_score_per_sample = isinstance(self.library, PackedLibrary)
        self.rows = family_of(self.served.spec).id_rows(self.served.spec)


class InferenceServer:
    """Serve one or more models; `with InferenceServer([...]) as server: server.submit(q)`.

    Records (one dict per finished query, `infer.sut.query_row`) accumulate
    until `take_records()`; times are ms from `server.epoch_ns`.
    """

    def __init__(
        self,
        models: list[ServedModel] | ServingPlan,
        *,
        device: str = "cpu",
        pin_cores: bool = True,
        seed: int = 0,
        start_timeout_s: float = 300.0,
        log: Callable[[str], None] | None = None,
        route_around_dead: bool = False,
    ) -> None:
        # a resolved plan (`infer.plan`) is served as it is; models alone are planned at start()
        self._plan = models if isinstance(models, ServingPlan) else None
        if self._plan is not None:
            models, device, seed = list(self._plan.models.values()), self._plan.device, self._plan.seed
        names = [m.name for m in models]
        if not models or len(set(names)) != len(names):
            raise UserError(f"served models need distinct names, got {names}")
        self.models = {m.name: m for m in models}
        self.device = device
        self.pin_cores = pin_cores
        self.seed = seed
        self.start_timeout_s = start_timeout_s
        self.log = log or (lambda _msg: None)
        self.epoch_ns = time.monotonic_ns()
        self._ctx = mp.get_context("spawn")  # fork after torch's OpenMP pool was used can hang
        self._conns: dict[int, Any] = {}  # instance -> parent end of its pipe
        self._procs: list[Any] = []
        self._pools: dict[str, _Pool] = {}
        self._in_flight: dict[int, tuple[str, list[tuple[Query, int, int]], int]] = {}  # batch: model, pieces, instance
        # A dead instance fails the server (a measurement cannot be trusted beyond it), or, for a server that
        # serves on (`serve`), is routed around while its model has another: its batch in flight fails
        self.route_around_dead = route_around_dead
        self._lost: dict[int, str] = {}  # instance -> how it ended
        self._loss_lock = threading.Lock()
        self.lost: list[dict[str, Any]] = []  # the instances routed around, for the records
        self._records: list[dict[str, Any]] = []
        self._records_lock = threading.Lock()
        self._stalls: list[dict[str, Any]] = []
        self._batch_ids = itertools.count()  # shared by every batcher thread; next() is atomic
        self._outstanding = 0  # submitted, not yet finished
        self._idle = threading.Condition()
        self._stopping = False
        self._error: str | None = None
        self._completion: threading.Thread | None = None
        self._snapshots: list[Path] = []
        self.instance_info: list[dict[str, Any]] = []
        self.snapshot_bytes: dict[str, int] = {}
        self.precision_choices: dict[str, dict[str, Any]] = {}  # per model: what ran and why (manifest)
        self._switch_interval: float | None = None  # the process's GIL switch interval before start()
        self._send_locks: dict[int, threading.Lock] = {}  # one writer at a time per instance pipe
        self._traced: dict[int, str] = {}  # instance -> its trace file (or why none), as it answers
        self._traced_cond = threading.Condition()

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> InferenceServer:
        """Execute the serving plan (made by `infer.plan` before, or here for a server given models alone): snapshot
        each model, spawn its instances where `infer.placement` puts them, wait until they are ready, start the
        batcher and completion threads. Policy is the plan's and the placement's; this is the mechanism."""
        for stale in remove_stale_snapshots():
            self.log(f"removed {stale}, left by a serving process that was killed")
        plan = self._plan or plan_serving(list(self.models.values()), device=self.device, seed=self.seed, log=self.log)
        self._plan = None  # its modules are snapshotted below and then dropped: a plan is served once
        self.models.update(plan.models)
        self.precision_choices.update(plan.precision_choices)
        places = place_instances(self.models.values(), self.device, self.pin_cores)
        try:
            for m in self.models.values():
                snap = snapshot_dir_for(f"{m.name}-{id(self)}")
                library = plan.libraries[m.name]  # mapped by the instances and, below, this process
                self._snapshots.append(snap)
                self.snapshot_bytes[m.name] = write_snapshot(snap, plan.modules.pop(m.name), library)
                self._pools[m.name] = _Pool(served=m, library=map_library(snap, m.spec))
                for place in places[m.name]:
                    self._spawn(m, place, snap, warmup_batch=min(m.piece_limit(), library.size))
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        # The load generator, batcher and completion threads share this process's GIL: a
        # thread that wants it waits up to the switch interval (5 ms by default), which
        # becomes queueing in every query's latency (tiny, 4,000 queries/s, 2 instances on
        # 2 cores: p99 18.3 -> 12.1 ms with 0.5 ms, medians of 3). Restored by stop().
        self._switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(GIL_SWITCH_S)
        self._completion = threading.Thread(target=self._complete_loop, name="dlrm-lab-completion", daemon=True)
        self._completion.start()
        for name, pool in self._pools.items():
            pool.thread = threading.Thread(target=self._batch_loop, args=(name,), name=f"batcher-{name}", daemon=True)
            pool.thread.start()
        self.epoch_ns = time.monotonic_ns()
        return self

    def _spawn(self, m: ServedModel, place: Placement, snap: Path, warmup_batch: int) -> None:
        """Start one instance of `m` where `place` says, serving the snapshot `snap`; it joins its model's pool."""
        instance = InstancePlan(
            model=m.name, index=place.index, snapshot_dir=str(snap), spec=m.spec.to_dict(), threads=m.threads,
            cores=place.cores, device=place.device, precision=m.precision, table_precision=m.table_precision,
            warmup_batch=warmup_batch, spin_ms=m.spin_ms, history_cache_mb=m.history_cache_mb, build=m.build,
            keep_warm_ms=m.keep_warm_ms,
        )  # fmt: skip
        mine_end, theirs = self._ctx.Pipe(duplex=True)
        proc = self._ctx.Process(
            target=instance_main, args=(instance, theirs), daemon=True, name=f"dlrm-lab-instance-{place.index}"
        )
        proc.start()
        theirs.close()
        self._conns[place.index] = mine_end
        self._send_locks[place.index] = threading.Lock()
        pool = self._pools[m.name]
        pool.free.append(place.index)
        if m.history_cache_mb and m.history_affinity and m.instances > 1:
            pool.homes.append(place.index)
        self._procs.append(proc)
        self.instance_info.append(
            {"instance": place.index, "model": m.name, "pid": proc.pid, "cores": list(place.cores)}
        )

    def _count_columns(self, q: Query) -> dict[str, Any]:
        """What the query's model's family counted of it, as its query columns (none for a DLRM)."""
        served = self.models[q.model]
        return family_of(served.spec).count_columns(served, q.counts)

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        waiting = dict(self._conns)
        costs: dict[str, list[BatchCost]] = {name: [] for name in self._pools}
        while waiting:
            for conn in wait_connections(list(waiting.values()), timeout=0.5):
                index = next(i for i, c in waiting.items() if c is conn)
                try:
                    _, error, cost = conn.recv()
                except (EOFError, OSError):
                    error = exit_description(self._procs[index].exitcode)
                if error:
                    raise ServingFault(f"instance {index} (pid {self._procs[index].pid}) failed to start: {error}")
                del waiting[index]
                costs[self.instance_info[index]["model"]].append(cost)
                self.log(f"instance {index} ready: a batch takes {cost.fixed_ms:.2f} ms + "
                         f"{cost.per_sample_ms * 1e3:.1f} us per sample")  # fmt: skip
            if time.monotonic() > deadline:
                raise ServingFault(f"instances {sorted(waiting)} not ready after {self.start_timeout_s:.0f} s")
        for name, measured in costs.items():
            pool = self._pools[name]
            pool.clock.cost = BatchCost(
                fixed_ms=float(np.median([c.fixed_ms for c in measured])),
                per_sample_ms=float(np.median([c.per_sample_ms for c in measured])),
            )
            if not pool.served.min_piece:
                self.configure(name, min_piece=0)
                self.log(f"{name}: queries split over idle instances in pieces of >= {pool.served.min_piece} samples")

    def stop(self) -> None:
        """Stop batchers and instances; queries still waiting are recorded as unfinished."""
        self._stopping = True
        for pool in self._pools.values():
            with pool.cond:
                pool.cond.notify_all()
            if pool.thread is not None:
                pool.thread.join(timeout=5)
        for conn in self._conns.values():
            try:
                conn.send(None)
            except (OSError, ValueError):
                pass
        for proc in self._procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        if self._completion is not None:
            self._completion.join(timeout=5)
        for conn in self._conns.values():
            conn.close()
        now = time.monotonic_ns()
        unfinished = {id(q): q for pool in self._pools.values() for q in pool.waiting}
        unfinished.update({id(q): q for _, pieces, _ in self._in_flight.values() for q, _, _ in pieces})
        for pool in self._pools.values():
            pool.waiting.clear()
        for q in unfinished.values():
            self._finish(q, "unfinished", now=now, error="server stopped")
        self._in_flight.clear()
        for snap in self._snapshots:
            shutil.rmtree(snap, ignore_errors=True)
        self._snapshots.clear()
        if self._switch_interval is not None:
            sys.setswitchinterval(self._switch_interval)
            self._switch_interval = None

    def __enter__(self) -> InferenceServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # ------------------------------------------------------------------ serving

    def library(self, model: str) -> PackedLibrary | RequestLibrary:
        return self._pools[model].library

    def describe(self) -> SutDescription:
        return SutDescription(
            models={name: m.description() for name, m in self.models.items()},
            processes=list(self.instance_info),
            snapshot_bytes=dict(self.snapshot_bytes),
            batch_costs={name: pool.clock.cost for name, pool in self._pools.items() if pool.clock.cost is not None},
        )

    def configure(
        self,
        model: str,
        *,
        max_batch: int | None = None,
        max_delay_ms: float | None = None,
        max_queue: int | None = None,
        min_piece: int | None = None,
        spin_ms: float | None = None,
    ) -> None:
        """Change a model's batching policy between load points (instances stay up)."""
        m = self.models[model]
        pool = self._pools[model]
        if spin_ms is not None:
            m.spin_ms = spin_ms
            for info in self.instance_info:
                if info["model"] == model and info["instance"] not in self._lost:
                    with self._send_locks[info["instance"]], contextlib.suppress(OSError, ValueError):
                        self._conns[info["instance"]].send((SPIN, spin_ms))  # a dead one: check() says so
        with pool.cond:
            if max_batch is not None:
                m.max_batch = max_batch
            if max_delay_ms is not None:
                m.max_delay_ms = max_delay_ms
            if max_queue is not None:
                m.max_queue = max_queue
            if min_piece is not None:  # 0: the measured break-even
                m.min_piece = min_piece or (pool.clock.cost.break_even() if pool.clock.cost else 1)
            pool.cond.notify()

    def submit(self, q: Query) -> None:
        """Queue a query (thread-safe, returns at once). Drops it when the queue is full."""
        if self._error is not None:
            raise ServingFault(self._error)
        q.issued_ns = time.monotonic_ns()
        if not q.scheduled_ns:
            q.scheduled_ns = q.issued_ns
        pool = self._pools.get(q.model)
        if pool is None:
            raise UserError(f"query {q.query_id}: unknown model {q.model!r}; served: {', '.join(self._pools)}")
        if pool.homes:  # the instance that served this user last holds their encoded history
            q.home = pool.homes[int(pool.library.user[q.offset]) % len(pool.homes)]
        with self._idle:
            self._outstanding += 1
        if q.size > pool.served.max_query_samples:
            q.payload = None
            self._finish(q, "rejected", now=q.issued_ns, error=f"{q.size} samples: at most "
                         f"{pool.served.max_query_samples} a query (--max-query-samples)")  # fmt: skip
            return
        if q.payload is not None:
            packed = self._check_payload(q, pool)
            if isinstance(packed, str):
                q.payload = None
                self._finish(q, "rejected", now=q.issued_ns, error=packed)
                return
            q.payload = packed
        with pool.cond:
            if len(pool.waiting) >= pool.served.max_queue:
                dropped = True
            else:
                dropped = False
                pool.waiting.append(q)
                pool.waiting_samples += q.size
                pool.cond.notify()
        if dropped:
            self._finish(q, "dropped", now=q.issued_ns, error=f"queue full ({pool.served.max_queue} queries)")

    def _check_payload(self, q: Query, pool: _Pool) -> PackedLibrary | str:
        """A query's own samples packed as its instance reads them, or why it cannot be served. Checked
        here, once, in the submitting thread: the instances trust what their server sends."""
        if not pool.one_score_per_sample:
            return "an HSTU model serves requests of its sample library only (no samples sent inline)"
        return payload_for(q.payload, q.size, pool.served.spec, pool.rows)

    def drain(self, timeout_s: float) -> bool:
        """Wait until every submitted query finished; False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._idle:
            while self._outstanding > 0:
                left = deadline - time.monotonic()
                if left <= 0 or self._error is not None:
                    return False
                self._idle.wait(min(left, 0.5))
        return True

    def take_records(self) -> list[dict[str, Any]]:
        with self._records_lock:
            out, self._records = self._records, []
        return out

    def take_stalls(self) -> list[dict[str, Any]]:
        """Batches since the last call that an instance held far beyond their warm time (STALL_MS, STALL_FACTOR):
        its process was stopped, or starved of its core."""
        with self._records_lock:
            out, self._stalls = self._stalls, []
        return out

    @property
    def error(self) -> str | None:
        return self._error

    def check(self) -> None:
        """Raise if an instance died (the run cannot be trusted beyond that point)."""
        if self._error is None:
            for info, proc in zip(self.instance_info, self._procs, strict=True):
                if proc.exitcode is not None and not self._stopping and info["instance"] not in self._lost:
                    how = f"instance {info['instance']} (pid {proc.pid}) {exit_description(proc.exitcode)}"
                    if self.route_around_dead:
                        self._lose(info["instance"], how)
                    else:
                        self._error = how
        if self._error is not None:
            raise ServingFault(self._error)

    def _lose(self, index: int, how: str) -> None:
        """Serve on without instance `index` (`route_around_dead`): it gets no more batches, its batch in flight
        fails naming it; with no instance of its model left, the server fails."""
        with self._loss_lock:
            if index in self._lost:
                return
            self._lost[index] = how
        info = self.instance_info[index]
        name, pool = info["model"], self._pools[info["model"]]
        with pool.cond:
            if index in pool.free:
                pool.free.remove(index)
        live = [i["instance"] for i in self.instance_info if i["model"] == name and i["instance"] not in self._lost]
        self.lost.append({"instance": index, "pid": info["pid"], "model": name, "how": how,
                          "at_ms": (time.monotonic_ns() - self.epoch_ns) / 1e6, "live_instances": live})  # fmt: skip
        if not live:
            self._error = f"{how}; no instance of {name} is left"
        else:
            self.log(f"warning: {how}; {name} is served on by instance(s) {', '.join(map(str, live))}")
        now = time.monotonic_ns()
        for batch_id, (_, _, instance) in list(self._in_flight.items()):
            if instance == index:
                self._complete(BatchResult(batch_id, index, now, now, None, f"{how} with this batch"))

    # ------------------------------------------------------------------ threads

    def _batch_loop(self, name: str) -> None:
        pool = self._pools[name]
        m = pool.served
        expired: list[Query] = []
        while True:
            for q in expired:  # outside the lock: their rows and answers
                self._finish(q, "expired", now=time.monotonic_ns(), error=q.error)
            expired = []
            with pool.cond:
                while True:
                    if self._stopping:
                        return
                    expired = _drop_expired(pool, time.monotonic_ns())
                    if expired:
                        break
                    if pool.waiting and pool.free:
                        head = pool.waiting[0]
                        waited_s = (time.monotonic_ns() - head.issued_ns) / 1e9
                        left_s = m.max_delay_ms / 1e3 - waited_s
                        if pool.waiting_samples >= m.max_batch or left_s <= 0 or head.dispatched:
                            break
                        pool.cond.wait(left_s)
                    else:
                        pool.cond.wait()
                if expired:
                    continue  # finished at the loop's top, outside the lock
                now = time.monotonic_ns()
                size = pool.clock.next_batch(pool.waiting_samples, len(pool.free), now, max_batch=m.max_batch,
                                             min_piece=m.min_piece)  # fmt: skip
                size = whole_enough(size, pool.waiting[0], m.instances, m.piece_limit())
                instance = pool.free.popleft()
                pieces = take_batch(pool, size, instance)
                pool.clock.sent(instance, now, sum(hi - lo for _, lo, hi in pieces))
                batch_id = next(self._batch_ids)
                self._in_flight[batch_id] = (name, pieces, instance)
            # a query with its own samples sends them whole (a few arrays: one copy each), its piece by offset
            refs = [QueryRef(q.query_id, hi - lo, lo if q.payload is not None else q.offset + lo, q.payload)
                    for q, lo, hi in pieces]  # fmt: skip
            try:
                with self._send_locks[instance]:
                    self._conns[instance].send((batch_id, refs))
            except (OSError, ValueError):
                if not self.route_around_dead:
                    return  # the instance is gone: check() reports it
                info = self.instance_info[instance]
                self._lose(instance, f"instance {instance} (pid {info['pid']}) stopped answering (its pipe closed)")
                if self._error is not None:
                    return

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
                    if isinstance(msg, tuple) and msg[0] == TRACE:
                        with self._traced_cond:
                            self._traced[msg[1]] = msg[2]
                            self._traced_cond.notify_all()
                        continue
                    self._complete(msg)

    # ------------------------------------------------------------------ tracing

    def start_trace(self) -> None:
        """Every instance starts torch.profiler; each batch it serves is marked `batch <id>`."""
        for index, conn in self._conns.items():
            with self._send_locks[index]:
                conn.send((TRACE, None))

    def stop_trace(self, directory: Path, timeout_s: float = 120.0) -> tuple[dict[int, Path], dict[int, str]]:
        """Every instance stops its profiler and exports its Chrome trace to `directory/instance-<k>.json`:
        the files written, and per instance why none was (an error, or no answer in `timeout_s`)."""
        directory.mkdir(parents=True, exist_ok=True)
        with self._traced_cond:
            self._traced.clear()
        for index, conn in self._conns.items():
            with self._send_locks[index]:
                conn.send((TRACE, str(directory / f"instance-{index}.json")))
        deadline = time.monotonic() + timeout_s
        with self._traced_cond:
            while len(self._traced) < len(self._conns) and time.monotonic() < deadline:
                self._traced_cond.wait(0.5)
            answers = dict(self._traced)
        written = {k: Path(v) for k, v in answers.items() if not v.startswith("error:")}
        missing = {k: answers.get(k, f"no answer in {timeout_s:.0f} s") for k in self._conns if k not in written}
        return written, missing

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
                self._stalls.append({"instance": msg.instance, "model": name, "took_ms": took_ms,
                                     "expected_ms": expected, "at_ms": (sent_ns - self.epoch_ns) / 1e6})  # fmt: skip
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
            q.query_id, q.model, q.size, status, epoch_ns=e, scheduled_ns=q.scheduled_ns, issued_ns=q.issued_ns,
            end_ns=now, error=error,
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
        )  # fmt: skip
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


def _drop_expired(pool: _Pool, now_ns: int) -> list[Query]:
    """Take the queries at the head of `pool`'s queue whose sender's deadline has passed out of it (the pool's
    lock held): their samples not yet sent are never computed. Returns those with no piece in flight, to be
    finished `expired` now; the others end `expired` with their last piece."""
    out = []
    while pool.waiting and (deadline := pool.waiting[0].deadline_ns) is not None and deadline <= now_ns:
        q = pool.waiting.popleft()
        left = q.size - q.dispatched
        pool.waiting_samples -= left
        q.dispatched = q.size
        q.status, q.error = "expired", f"its deadline passed with {left} of {q.size} samples not begun"
        if q.done_pieces == q.pieces:
            out.append(q)
    return out

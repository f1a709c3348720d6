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

Here are the server's queues, their batchers, its lifecycle and what an instance's death means; it is composed of its
instance processes (`infer.instance_processes.InstanceProcesses`: spawning them, their readiness, their pipes,
tracing), its query records and completion thread (`infer.completions`: `QueryRecords`, `BatchCompletions`) and one
`infer.pools.Pool` per model, each part holding its own state.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import numpy as np

from dlrm_lab.config.values import JsonObject, Log
from dlrm_lab.errors import ServingFault, UserError, stops_deferred
from dlrm_lab.infer.batches import QueryRef
from dlrm_lab.infer.batching import BatchCost, take_batch, whole_enough
from dlrm_lab.infer.completions import BatchCompletions, InFlight, InstanceStates, QueryRecords
from dlrm_lab.infer.instance import KEEP_WARM, SPIN, BatchResult, InstancePlan
from dlrm_lab.infer.instance_processes import InstanceProcesses, LostInstance
from dlrm_lab.infer.library import LoadedSamples, PackedLibrary, payload_for
from dlrm_lab.infer.placement import Placement, pin_threads, place_instances, spare_cores, unpin_threads
from dlrm_lab.infer.plan import ServingPlan
from dlrm_lab.infer.pools import Pool, drop_expired
from dlrm_lab.infer.requests import RequestLibrary
from dlrm_lab.infer.served import ServedModel
from dlrm_lab.infer.snapshot import (
    map_library,
    refused_pages,
    remove_snapshot,
    remove_stale_snapshots,
    say_pages,
    snapshot_dir_for,
    write_snapshot,
)
from dlrm_lab.infer.sut import Query, ServingProcess, Stall, SutDescription
from dlrm_lab.metrics.columns import QueryRow

GIL_SWITCH_S = 0.00005  # the serving process's GIL switch interval while it serves (see start)


class InferenceServer:
    """Serve the models of a plan (`infer.plan.plan_serving`: every choice made); `with InferenceServer(plan) as
    server: server.submit(q)`.

    Records (one dict per finished query, `infer.sut.query_row`) accumulate
    until `take_records()`; times are ms from `server.epoch_ns`.
    """

    def __init__(
        self,
        plan: ServingPlan,
        *,
        pin_cores: bool = True,
        start_timeout_s: float = 300.0,
        log: Log | None = None,
        route_around_dead: bool = False,
    ) -> None:
        self._plan: ServingPlan | None = plan  # served as it is, once (its modules are dropped once snapshotted)
        if not plan.models:
            raise UserError("a server needs a model to serve")
        self.models = dict(plan.models)
        self.device = plan.device
        self.pin_cores = pin_cores
        self.seed = plan.seed
        self.log = log or (lambda _msg: None)
        # A dead instance fails the server (a measurement cannot be trusted beyond it), or, for a server that
        # serves on (`serve`), is routed around while its model has another: its batch in flight fails
        self.route_around_dead = route_around_dead
        self._pools: dict[str, Pool] = {}
        self._in_flight: InFlight = {}  # batch id -> its model, pieces and instance
        self._error: str | None = None
        self._stopping = False
        self.instances = InstanceProcesses(self.log, start_timeout_s)
        self.records = QueryRecords(self.models, self._fail)
        self.completions = BatchCompletions(self._pools, self._in_flight, self.instances, self.records, self.check)
        self._completion: threading.Thread | None = None
        self._batch_ids = itertools.count()  # shared by every batcher thread; next() is atomic
        self._snapshots: list[Path] = []
        self.snapshot_bytes: dict[str, int] = {}
        self.precision_choices: dict[str, JsonObject] = {}  # per model: what ran and why (manifest)
        self._switch_interval: float | None = None  # the process's GIL switch interval before start()
        self._threads_before: dict[int, set[int]] = {}  # this process's threads' affinity before start()

    # ------------------------------------------------------------------ its parts, as the lab reads them

    @property
    def epoch_ns(self) -> int:
        """Records' times are ms from here (set as the server starts serving)."""
        return self.records.epoch_ns

    @property
    def instance_info(self) -> list[ServingProcess]:
        return self.instances.info

    @property
    def lost(self) -> list[LostInstance]:
        """The instances routed around (`route_around_dead`), for the records."""
        return self.instances.losses

    @property
    def batch_observer(self) -> Callable[[str, int], None] | None:
        return self.completions.batch_observer

    @batch_observer.setter
    def batch_observer(self, observe: Callable[[str, int], None] | None) -> None:
        self.completions.batch_observer = observe

    def instance_states(self) -> dict[str, InstanceStates]:
        return self.completions.instance_states()

    def take_records(self) -> list[QueryRow]:
        return self.records.take_records()

    def take_stalls(self) -> list[Stall]:
        return self.records.take_stalls()

    def take_canary(self) -> list[JsonObject]:
        return self.records.take_canary()

    def start_trace(self) -> None:
        self.instances.start_trace()

    def stop_trace(self, directory: Path, timeout_s: float = 120.0) -> tuple[dict[int, Path], dict[int, str]]:
        return self.instances.stop_trace(directory, timeout_s)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> InferenceServer:
        """Execute the serving plan (`infer.plan`): snapshot each model, spawn its instances where `infer.placement`
        puts them, wait until they are ready, start the batcher and completion threads. Policy is the plan's and the
        placement's; this is the mechanism."""
        for stale in remove_stale_snapshots():
            self.log(f"removed {stale}, left by a serving process that was killed")
        if self._plan is None:
            raise RuntimeError("a server's plan is served once: make a new plan (`plan_serving`) for another start")
        plan, self._plan = self._plan, None  # its modules are snapshotted below and then dropped
        self.precision_choices.update(plan.precision_choices)
        places = place_instances(self.models.values(), self.device, self.pin_cores)
        try:
            for m in self.models.values():
                snap = snapshot_dir_for(f"{m.name}-{id(self)}")
                library = plan.libraries[m.name]  # mapped by the instances and, below, this process
                self._snapshots.append(snap)
                self.snapshot_bytes[m.name], no_huge = write_snapshot(
                    snap, plan.modules.pop(m.name), library, m.table_pages
                )
                if no_huge is not None:  # asked, and refused at the mount: served on the directory's pages, said
                    self.models[m.name] = m = replace(m, table_pages="base")
                    refused_pages(self.precision_choices, m.name, no_huge, self.log)
                self._pools[m.name] = Pool(served=m, library=map_library(snap, m.spec))
                for place in places[m.name]:
                    self._spawn(m, place, snap, warmup_batch=min(m.largest_batch(), library.size))
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        for m, snap in zip(self.models.values(), self._snapshots, strict=True):
            if m.table_pages == "huge":
                pids = [info["pid"] for info in self.instances.info if info["model"] == m.name]
                say_pages(m.name, snap, pids, self.snapshot_bytes[m.name], self.precision_choices, self.log)
        # The load generator, batcher and completion threads share this process's GIL: a
        # thread that wants it waits up to the switch interval (5 ms by default), which
        # becomes queueing in every query's latency (tiny, 4,000 queries/s, 2 instances on
        # 2 cores: p99 18.3 -> 12.1 ms with 0.5 ms, medians of 3; tiny, aoti, 1x1, 8,000 queries/s: 17.7 and
        # 13.5 ms at 0.1 ms, 12.9 and 9.6 at 0.05, interleaved). Restored by stop().
        self._switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(GIL_SWITCH_S)
        # This process's threads on the cores no instance has: unpinned, the scheduler woke them on an instance's
        # core and preempted its batch (tiny, aoti, 1x1 on 2 cores, 5,000 queries/s: batches at p99 4.35x their
        # warm time, p99 37 ms). Restored by stop().
        spare = spare_cores(places) if self.pin_cores else ()
        if spare:
            self._threads_before = pin_threads(spare)
            self.log(
                f"serving process: its threads pinned to core{'s' if len(spare) > 1 else ''} "
                f"{', '.join(map(str, spare))}, beside the instances'"
            )
        self._completion = threading.Thread(
            target=self.completions.loop, args=(lambda: self._stopping,), name="dlrm-lab-completion", daemon=True
        )
        self._completion.start()
        for name, pool in self._pools.items():
            pool.thread = threading.Thread(target=self._batch_loop, args=(name,), name=f"batcher-{name}", daemon=True)
            pool.thread.start()
        self.records.epoch_ns = time.monotonic_ns()
        return self

    @stops_deferred()  # runs whole: a stop signal meanwhile is raised after it, the snapshot removed first
    def stop(self) -> None:
        """Stop batchers and instances; queries still waiting are recorded as unfinished."""
        self._stopping = True
        for pool in self._pools.values():
            with pool.cond:
                pool.cond.notify_all()
            if pool.thread is not None:
                pool.thread.join(timeout=5)
        completion = self._completion
        self.instances.stop(before_close=lambda: completion.join(timeout=5) if completion is not None else None)
        now = time.monotonic_ns()
        unfinished = {id(q): q for pool in self._pools.values() for q in pool.waiting}
        unfinished.update({id(q): q for _, pieces, _ in self._in_flight.values() for q, _, _ in pieces})
        for pool in self._pools.values():
            pool.waiting.clear()
        for q in unfinished.values():
            self.records.finish(q, "unfinished", now=now, error="server stopped")
        self._in_flight.clear()
        while self._snapshots:
            remove_snapshot(self._snapshots.pop())
        if self._switch_interval is not None:
            sys.setswitchinterval(self._switch_interval)
            self._switch_interval = None
        unpin_threads(self._threads_before)
        self._threads_before = {}

    def __enter__(self) -> InferenceServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def _spawn(self, m: ServedModel, place: Placement, snap: Path, warmup_batch: int) -> None:
        """Start one instance of `m` where `place` says, serving the snapshot `snap`; it joins its model's pool."""
        index = self.instances.spawn(
            InstancePlan(
                model=m.name,
                index=place.index,
                snapshot_dir=str(snap),
                spec=m.spec.to_dict(),
                threads=m.threads,
                cores=place.cores,
                device=place.device,
                precision=m.precision,
                table_precision=m.table_precision,
                warmup_batch=warmup_batch,
                spin_ms=m.spin_ms,
                history_cache_mb=m.history_cache_mb,
                build=m.build,
                finalists=m.finalists,
                keep_warm_ms=m.keep_warm_ms,
                idle_hold=m.idle_hold,
                batch_memory=m.batch_memory,
                allocator=m.allocator,
            )
        )
        pool = self._pools[m.name]
        pool.free.append(index)
        if m.history_cache_mb and m.history_affinity and m.instances > 1:
            pool.homes.append(index)

    def _wait_ready(self) -> None:
        """Every instance warmed up; each model's batch cost, the median of its instances' own."""
        costs = self.instances.wait_ready()
        for name, pool in self._pools.items():
            measured = [costs[info["instance"]] for info in self.instances.info if info["model"] == name]
            chosen = {i["batch_memory"]["batch_memory"] for i in self.instances.info if i["model"] == name}
            if len(chosen) == 1:  # served as its instances chose (auto: where they differ, each says in the manifest)
                pool.served.batch_memory = chosen.pop()
            self._final_build(pool.served)
            pool.clock.cost = BatchCost(
                fixed_ms=float(np.median([c.fixed_ms for c in measured])),
                per_sample_ms=float(np.median([c.per_sample_ms for c in measured])),
            )
            if not pool.served.min_piece:
                self.configure(name, min_piece=0)
                self.log(f"{name}: queries split over idle instances in pieces of >= {pool.served.min_piece} samples")

    def _final_build(self, served: ServedModel) -> None:
        """The build `served` is served in once its instances chose between the plan's and its finalists
        (`infer.finalists`): theirs where they agree; where they differ, the plan's stays the model's, and each
        instance's is said here and in the manifest."""
        if not served.finalists:
            return
        chosen = {i["instance"]: i["build"]["build"] for i in self.instances.info if i["model"] == served.name}
        if len(set(chosen.values())) == 1:
            (build,) = set(chosen.values())
            if build != served.build:
                self.log(f"{served.name}: served as {build}: every instance timed it faster than {served.build}")
            served.build = build
        else:
            each = ", ".join(f"instance {i} {b}" for i, b in sorted(chosen.items()))
            self.log(f"{served.name}: its instances serve different builds, each the faster in its process: {each}")

    def check(self) -> None:
        """Raise if an instance died (the run cannot be trusted beyond that point); a server that serves on
        (`route_around_dead`) loses it instead, and fails only when its model has none left."""
        if self._error is None and not self._stopping:
            for index, how in self.instances.dead():
                if self.route_around_dead:
                    self._lose(index, how)
                else:
                    self._error = how
        if self._error is not None:
            raise ServingFault(self._error)

    def _lose(self, index: int, how: str) -> None:
        """Serve on without instance `index`: it gets no more batches, its batch in flight fails naming it; with no
        instance of its model left, the server fails."""
        lost = self.instances.lose(index, how, self.epoch_ns)
        if lost is None:
            return
        pool = self._pools[lost["model"]]
        with pool.cond:
            if index in pool.free:
                pool.free.remove(index)
        if not lost["live_instances"]:
            self._error = f"{how}; no instance of {lost['model']} is left"
        else:
            self.log(f"warning: {how}; {lost['model']} is served on by instance(s) "
                     f"{', '.join(map(str, lost['live_instances']))}")  # fmt: skip
        now = time.monotonic_ns()
        for batch_id, (_, _, instance) in list(self._in_flight.items()):
            if instance == index:
                self.completions.complete(BatchResult(batch_id, index, now, now, None, f"{how} with this batch"))

    def _fail(self, why: str) -> None:
        self._error = why

    # ------------------------------------------------------------------ serving

    def library(self, model: str) -> LoadedSamples:
        return self._pools[model].library

    def describe(self) -> SutDescription:
        return SutDescription(
            models={name: m.description() for name, m in self.models.items()},
            processes=list(self.instance_info),
            snapshot_bytes=dict(self.snapshot_bytes),
            batch_costs={name: pool.clock.cost for name, pool in self._pools.items() if pool.clock.cost is not None},
            record={"instances": self.instance_info, "precision_choices": self.precision_choices},
            traces=True,
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
        keep_warm_ms: float | None = None,
    ) -> None:
        """Change a model's batching policy between load points (instances stay up)."""
        m = self.models[model]
        pool = self._pools[model]
        for kind, value, name in ((SPIN, spin_ms, "spin_ms"), (KEEP_WARM, keep_warm_ms, "keep_warm_ms")):
            if value is None:
                continue
            setattr(m, name, value)
            for index in self.instances.live(model):
                with contextlib.suppress(OSError, ValueError):
                    self.instances.send(index, (kind, value))  # a dead one: check() says so
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
            user = cast(RequestLibrary, pool.library).user  # homes: the HSTU ranker's, whose library is of requests
            q.home = pool.homes[int(user[q.offset]) % len(pool.homes)]
        self.records.opened()
        if q.size > pool.served.max_query_samples:
            q.payload = None
            self.records.finish(
                q,
                "rejected",
                now=q.issued_ns,
                error=f"{q.size} samples: at most {pool.served.max_query_samples} a query (--max-query-samples)",
            )
            return
        if q.payload is not None:
            packed = self._check_payload(q, pool)
            if isinstance(packed, str):
                q.payload = None
                self.records.finish(q, "rejected", now=q.issued_ns, error=packed)
                return
            q.payload = packed
        with pool.cond:
            # an arrival whether or not it finds room: a burst that fills the queue says companions are coming (the
            # batcher's wait for them reads the arrival rate; counting only the admitted hid a burst of 12 behind 2)
            pool.clock.arrived(q.issued_ns)
            if len(pool.waiting) >= pool.served.max_queue:
                dropped = True
            else:
                dropped = False
                pool.waiting.append(q)
                pool.waiting_samples += q.size
                pool.cond.notify()
        if dropped:
            self.records.finish(q, "dropped", now=q.issued_ns, error=f"queue full ({pool.served.max_queue} queries)")

    def _check_payload(self, q: Query, pool: Pool) -> PackedLibrary | str:
        """A query's own samples packed as its instance reads them, or why it cannot be served. Checked
        here, once, in the submitting thread: the instances trust what their server sends."""
        if not pool.one_score_per_sample:
            return "an HSTU model serves requests of its sample library only (no samples sent inline)"
        return payload_for(q.payload, q.size, pool.served.spec, pool.rows)

    def drain(self, timeout_s: float) -> bool:
        """Wait until every submitted query finished; False on timeout."""
        return self.records.drain(timeout_s, lambda: self._error is not None)

    @property
    def error(self) -> str | None:
        return self._error

    # ------------------------------------------------------------------ threads

    def _batch_loop(self, name: str) -> None:
        pool = self._pools[name]
        m = pool.served
        expired: list[Query] = []
        while True:
            for q in expired:  # outside the lock: their rows and answers
                self.records.finish(q, "expired", now=time.monotonic_ns(), error=q.error)
            expired = []
            with pool.cond:
                while True:
                    if self._stopping:
                        return
                    expired = drop_expired(pool, time.monotonic_ns())
                    if expired:
                        break
                    if pool.waiting and pool.free:
                        head, now = pool.waiting[0], time.monotonic_ns()
                        left_s = m.max_delay_ms / 1e3 - (now - head.issued_ns) / 1e9
                        if pool.waiting_samples >= m.max_batch or left_s <= 0 or head.dispatched:
                            break
                        if not pool.clock.worth_waiting(left_s, now):  # no companion expected in time
                            break
                        pool.cond.wait(left_s)
                    else:
                        pool.cond.wait()
                if expired:
                    continue  # finished at the loop's top, outside the lock
                now = time.monotonic_ns()
                size = pool.clock.next_batch(
                    pool.waiting_samples, len(pool.free), now, max_batch=m.max_batch, min_piece=m.min_piece
                )
                size = whole_enough(size, pool.waiting[0], m.instances, m.piece_limit())
                instance = pool.free.popleft()
                pieces = take_batch(pool, size, instance)
                pool.clock.sent(instance, now, sum(hi - lo for _, lo, hi in pieces))
                batch_id = next(self._batch_ids)
                self._in_flight[batch_id] = (name, pieces, instance)
            # a query with its own samples sends them whole (a few arrays: one copy each), its piece by offset
            refs = [
                QueryRef(q.query_id, hi - lo, lo if q.payload is not None else q.offset + lo, q.payload)
                for q, lo, hi in pieces
            ]
            try:
                self.instances.send(instance, (batch_id, refs))
            except (OSError, ValueError):
                if not self.route_around_dead:
                    return  # the instance is gone: check() reports it
                info = self.instance_info[instance]
                self._lose(instance, f"instance {instance} (pid {info['pid']}) stopped answering (its pipe closed)")
                if self._error is not None:
                    return

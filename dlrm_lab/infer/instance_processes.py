"""The server's side of its instance processes (what runs inside one is `infer.instance`): each spawned where its
placement puts it, with a pipe to the server; waited for until it has warmed up and measured its batch cost; watched
for dying (the server then fails, or serves on without it); and asked to profile the batches it serves (`--trace`).

`InstanceProcesses` is a part of `infer.server.InferenceServer`, whose `__init__` sets the state these methods share.
"""

from __future__ import annotations

import threading
import time
from multiprocessing.connection import wait as wait_connections
from pathlib import Path
from typing import TypedDict

import numpy as np

from dlrm_lab.errors import ServingFault, exit_description
from dlrm_lab.infer.batching import BatchCost
from dlrm_lab.infer.instance import TRACE, BatchResult, InstancePlan, instance_main
from dlrm_lab.infer.placement import Placement
from dlrm_lab.infer.served import ServedModel
from dlrm_lab.infer.sut import ServingProcess


class LostInstance(TypedDict):
    """An instance the server served on without (`route_around_dead`), for the manifest's `instance_losses`."""

    instance: int
    pid: int
    model: str
    how: str  # how it ended
    at_ms: float  # since the server's epoch
    live_instances: list[int]  # its model's instances left


class InstanceProcesses:
    """The server's methods on its instance processes (see the module's docstring)."""

    def _spawn(self, m: ServedModel, place: Placement, snap: Path, warmup_batch: int) -> None:
        """Start one instance of `m` where `place` says, serving the snapshot `snap`; it joins its model's pool."""
        instance = InstancePlan(
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
            keep_warm_ms=m.keep_warm_ms,
            idle_hold=m.idle_hold,
        )
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
            ServingProcess(instance=place.index, model=m.name, pid=proc.pid, cores=list(place.cores))
        )

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
                self.log(
                    f"instance {index} ready: a batch takes {cost.fixed_ms:.2f} ms + "
                    f"{cost.per_sample_ms * 1e3:.1f} us per sample"
                )
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
        self.lost.append(
            LostInstance(
                instance=index,
                pid=info["pid"],
                model=name,
                how=how,
                at_ms=(time.monotonic_ns() - self.epoch_ns) / 1e6,
                live_instances=live,
            )
        )
        if not live:
            self._error = f"{how}; no instance of {name} is left"
        else:
            self.log(f"warning: {how}; {name} is served on by instance(s) {', '.join(map(str, live))}")
        now = time.monotonic_ns()
        for batch_id, (_, _, instance) in list(self._in_flight.items()):
            if instance == index:
                self._complete(BatchResult(batch_id, index, now, now, None, f"{how} with this batch"))

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

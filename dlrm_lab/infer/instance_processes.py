"""The server's side of its instance processes (what runs inside one is `infer.instance`): each spawned where its
placement puts it, with a pipe to the server; waited for until it has warmed up and measured its batch cost; watched
for dying; and asked to profile the batches it serves (`--trace`).

`InstanceProcesses` owns the processes, their pipes (one writer at a time each) and what became of each; the server
(`infer.server.InferenceServer`) holds one and decides what a death means (fail, or serve on without it).
"""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_connections
from pathlib import Path
from typing import Any, TypedDict, cast

from dlrm_lab.config.values import Log
from dlrm_lab.errors import ServingFault, exit_description
from dlrm_lab.infer.allocator import library_of, preloaded
from dlrm_lab.infer.batching import BatchCost
from dlrm_lab.infer.instance import TRACE, InstancePlan, instance_main
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
    """The instance processes of one server: `spawn` each, `wait_ready` for all, `send` them batches and orders,
    `dead` names those that ended, `lose` marks one served on without; `stop` ends them all."""

    def __init__(self, log: Log, start_timeout_s: float) -> None:
        self.log, self.start_timeout_s = log, start_timeout_s
        self._ctx = mp.get_context("spawn")  # fork after torch's OpenMP pool was used can hang
        self._conns: dict[int, Connection] = {}  # instance -> the server's end of its pipe
        self._procs: list[Any] = []
        self._send_locks: dict[int, threading.Lock] = {}  # one writer at a time per instance pipe
        self.info: list[ServingProcess] = []  # per instance, in order: its model, pid and cores
        self._lost: dict[int, str] = {}  # instance -> how it ended, for those served on without
        self._loss_lock = threading.Lock()
        self.losses: list[LostInstance] = []  # the instances routed around, for the records
        self._traced: dict[int, str] = {}  # instance -> its trace file (or why none), as it answers
        self._traced_cond = threading.Condition()

    def spawn(self, plan: InstancePlan) -> int:
        """Start one instance as `plan` says; its index."""
        mine_end, theirs = self._ctx.Pipe(duplex=True)
        proc = self._ctx.Process(
            target=instance_main, args=(plan, theirs), daemon=True, name=f"dlrm-lab-instance-{plan.index}"
        )
        with preloaded(library_of(plan.allocator)):  # the allocator it runs: a process takes it only as it starts
            proc.start()
        theirs.close()
        self._conns[plan.index] = mine_end
        self._send_locks[plan.index] = threading.Lock()
        self._procs.append(proc)
        pid = cast(int, proc.pid)  # started: it has one
        self.info.append(
            ServingProcess(
                instance=plan.index, model=plan.model, pid=pid, cores=list(plan.cores), allocator=plan.allocator
            )
        )
        return plan.index

    def wait_ready(self) -> dict[int, BatchCost]:
        """Wait until every instance has warmed up and measured itself: each one's batch cost."""
        deadline = time.monotonic() + self.start_timeout_s
        waiting = dict(self._conns)
        costs: dict[int, BatchCost] = {}
        while waiting:
            # of the connections given, those ready
            for conn in cast(list[Connection], wait_connections(list(waiting.values()), timeout=0.5)):
                index = next(i for i, c in waiting.items() if c is conn)
                try:
                    _, error, cost, memory, served = conn.recv()
                except (EOFError, OSError):
                    error = exit_description(self._procs[index].exitcode)
                if error:
                    raise ServingFault(f"instance {index} (pid {self._procs[index].pid}) failed to start: {error}")
                del waiting[index]
                costs[index] = cost
                self.info[index]["batch_memory"] = memory
                self.info[index]["build"] = served
                said = f"; batch memory {memory['reason']}" if memory["ms"] else ""  # what auto measured
                said += f"; build {served['reason']}" if served["ms"] else ""  # what its finalists measured
                self.log(
                    f"instance {index} ready: a batch takes {cost.fixed_ms:.2f} ms + "
                    f"{cost.per_sample_ms * 1e3:.1f} us per sample{said}"
                )
            if time.monotonic() > deadline:
                raise ServingFault(f"instances {sorted(waiting)} not ready after {self.start_timeout_s:.0f} s")
        return costs

    def connections(self) -> list[Connection]:
        return list(self._conns.values())

    def send(self, index: int, message: Any) -> None:
        """Send one instance a batch or an order (raises OSError/ValueError where its pipe is gone)."""
        with self._send_locks[index]:
            self._conns[index].send(message)

    def live(self, model: str) -> list[int]:
        """`model`'s instances not lost."""
        return [i["instance"] for i in self.info if i["model"] == model and i["instance"] not in self._lost]

    def is_lost(self, index: int) -> bool:
        return index in self._lost

    def dead(self) -> list[tuple[int, str]]:
        """The instances that ended and are not yet marked lost, each with how."""
        return [
            (info["instance"], f"instance {info['instance']} (pid {proc.pid}) {exit_description(proc.exitcode)}")
            for info, proc in zip(self.info, self._procs, strict=True)
            if proc.exitcode is not None and info["instance"] not in self._lost
        ]

    def lose(self, index: int, how: str, epoch_ns: int) -> LostInstance | None:
        """Mark instance `index` served on without; its record (None: it was already)."""
        with self._loss_lock:
            if index in self._lost:
                return None
            self._lost[index] = how
        info = self.info[index]
        lost = LostInstance(
            instance=index,
            pid=info["pid"],
            model=info["model"],
            how=how,
            at_ms=(time.monotonic_ns() - epoch_ns) / 1e6,
            live_instances=self.live(info["model"]),
        )
        self.losses.append(lost)
        return lost

    def traced(self, index: int, answer: str) -> None:
        """An instance's answer to `stop_trace` (its file, or why none), as the completion thread reads it."""
        with self._traced_cond:
            self._traced[index] = answer
            self._traced_cond.notify_all()

    def start_trace(self) -> None:
        """Every instance starts torch.profiler; each batch it serves is marked `batch <id>`."""
        for index in self._conns:
            self.send(index, (TRACE, None))

    def stop_trace(self, directory: Path, timeout_s: float = 120.0) -> tuple[dict[int, Path], dict[int, str]]:
        """Every instance stops its profiler and exports its Chrome trace to `directory/instance-<k>.json`:
        the files written, and per instance why none was (an error, or no answer in `timeout_s`)."""
        directory.mkdir(parents=True, exist_ok=True)
        with self._traced_cond:
            self._traced.clear()
        for index in self._conns:
            self.send(index, (TRACE, str(directory / f"instance-{index}.json")))
        deadline = time.monotonic() + timeout_s
        with self._traced_cond:
            while len(self._traced) < len(self._conns) and time.monotonic() < deadline:
                self._traced_cond.wait(0.5)
            answers = dict(self._traced)
        written = {k: Path(v) for k, v in answers.items() if not v.startswith("error:")}
        missing = {k: answers.get(k, f"no answer in {timeout_s:.0f} s") for k in self._conns if k not in written}
        return written, missing

    def stop(self, before_close: Callable[[], None] = lambda: None) -> None:
        """Tell every instance to end, wait for each (killing one that does not), run `before_close` (the completion
        thread's join: it reads these pipes), then close the pipes."""
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
        before_close()
        for conn in self._conns.values():
            conn.close()

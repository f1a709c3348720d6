"""One serving instance: a worker process that runs batches of queries through a model.

Instances of a model share its embedding tables and its sample library: the parent
writes both once to a snapshot on a RAM file system (`/dev/shm`) and every instance maps
it (`torch.load(mmap=True)`), so co-locating N instances does not multiply table memory.
(torch.multiprocessing's own tensor sharing cannot pickle fbgemm's quantised table
modules, whose empty cache buffers fail to map, hence the file.)

Messages go through one duplex pipe per instance (sent by the caller's thread: no feeder
thread to wake, unlike multiprocessing queues); payloads are small for library queries:
    instance -> parent: ("ready", error or None, its BatchCost, its BatchMemoryChoice, its FinalChoice) once, then
    BatchResult per batch
    parent -> instance: (batch_id, [QueryRef, ...]) or None to stop
    tracing (`--trace`): parent -> instance (TRACE, None) starts torch.profiler, (TRACE, path) stops
    it and exports its Chrome trace there; instance -> parent (TRACE, index, path or error) when written
    spin (`infer.tune`): parent -> instance (SPIN, ms) sets how long it polls before it blocks
    keep-warm (`infer.tune`): parent -> instance (KEEP_WARM, ms) sets how often it warms itself while idle
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import tempfile
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dlrm_lab.config.family import family_of, spec_from_dict
from dlrm_lab.config.values import JsonObject
from dlrm_lab.errors import end_with_parent
from dlrm_lab.infer import allocator, batch_memory, finalists
from dlrm_lab.infer.batches import PackagedRunner, QueryRef
from dlrm_lab.infer.builds import build_named
from dlrm_lab.infer.library import LoadedSamples
from dlrm_lab.infer.serving_parts import make_runner
from dlrm_lab.infer.snapshot import map_library
from dlrm_lab.metrics.canary import Canary

PRECISIONS = ("fp32", "bf16", "fp16")
# what an idle instance holds while it waits (`IdleHold`)
IDLE_HOLDS = ("none", "cpu-latency", "lock-tables", "keep-memory", "halt-poll")


@dataclass
class BatchResult:
    batch_id: int
    instance: int
    start_ns: int  # time.monotonic_ns(): system-wide on Linux, comparable across processes
    end_ns: int
    scores: np.ndarray | None  # float32 click probability per sample, in query order
    error: str | None = None  # the whole batch failed (the instance lives on)
    # per query of the batch, in order, what its family counts of it (`ModelFamily.query_counts`: the HSTU
    # ranker's history reuse); None where nothing is counted
    counts: np.ndarray | None = None
    # ms of the batch in (assembly, lookup, dense, interaction) on the instance (`metrics.columns.BATCH_STAGES`);
    # None where a build does not separate a stage (or on a GPU, where timing it would add a sync)
    stages: tuple[float | None, ...] | None = None


TRACE = "trace"  # the control message of tracing (module docstring)
SPIN = "spin"  # parent -> instance (SPIN, ms): poll this long for the next batch before blocking
KEEP_WARM = "keep-warm"  # parent -> instance (KEEP_WARM, ms): a warming batch this often while idle (0: off)
CANARY = "canary"  # instance -> parent (CANARY, index, reading): the speed canary (`metrics.canary`), read while idle


@dataclass(frozen=True)
class InstancePlan:
    """Everything an instance process needs to start."""

    model: str  # served model name
    index: int  # instance number within the whole server
    snapshot_dir: str
    spec: JsonObject  # its spec's to_dict()
    threads: int
    cores: tuple[int, ...]  # empty: not pinned
    device: str  # "cpu" or "cuda:N"
    precision: str
    table_precision: str
    warmup_batch: int
    spin_ms: float = 0.0  # poll for the next batch this long before blocking
    keep_warm_ms: float = 0.0  # while idle, a 1-sample batch of the library this often (0: off)
    idle_hold: str = "none"  # IDLE_HOLDS: what it holds while it waits
    batch_memory: str = "release"  # infer.batch_memory.BATCH_MEMORY: whether malloc keeps a batch's freed buffers
    allocator: str = "glibc"  # the C allocator it runs (infer.allocator), preloaded as it was spawned
    history_cache_mb: float = 0.0  # HSTU: keep users' encoded histories (infer.history); 0: off
    build: str = "eager"  # the inference form served (infer.build)
    finalists: tuple[tuple[str, str], ...] = ()  # (build, artefact) timed against it here (infer.finalists)
    # Instances yield to the serving process: when they fill every core, the batcher and
    # completion threads would otherwise wait a scheduler slice (ms) to run.
    nice: int = 5


# ----------------------------------------------------------------------------- process


def instance_main(plan: InstancePlan, conn: Any) -> None:
    """Entry point of an instance process (spawned). Never dies on a bad batch: one whose forward
    raises is reported failed. Queries with their own samples were checked by the server at submit."""
    # its pipe ends with the parent too, but a parent killed mid start-up must not leave it building; Ctrl-C still
    # reaches it (it returns at its next wait, as the parent stops)
    end_with_parent(ignore_interrupt=False)
    try:
        allocator.check_running(plan.allocator)
        if plan.cores and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, plan.cores)
        if plan.nice:
            os.nice(plan.nice)
        torch.set_num_threads(plan.threads)
        spec = spec_from_dict(plan.spec)
        family = family_of(spec)
        device = torch.device(plan.device)
        snapshot = Path(plan.snapshot_dir)
        model = torch.load(snapshot / "model.pt", mmap=True, weights_only=False)
        if device.type == "cuda":
            torch.cuda.set_device(device)
            model = model.to(device)
        model.eval()
        if device.type == "cpu":
            _touch_pages(model)
        model = (
            build_named(plan.build)
            .in_instance(model, device, precision=plan.precision, table_precision=plan.table_precision)
            .eval()
        )
        library = map_library(snapshot, spec)
        largest = min(plan.warmup_batch, family.max_warmup_batch or plan.warmup_batch)
        model, runner, served = _final_build(plan, model, library, device, largest)
        _hold = IdleHold.take(plan.idle_hold, model, library)  # held until the process ends
        memory = batch_memory.choose(
            plan.batch_memory,
            lambda: runner([QueryRef(-1, largest, 0)]),
            largest,
            device=device.type,
            held=plan.idle_hold == "keep-memory",
            allocator=plan.allocator,
        )
        cost = runner.batch_cost(min(family.cost_batch, library.size))
        gc.collect()
        gc.freeze()  # the model's objects never die: keep them out of every later collection
        conn.send(("ready", None, cost, memory, served))
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which fails the run with it
        conn.send(("ready", f"{type(exc).__name__}: {exc}", None, None, None))
        return
    spin_s = plan.spin_ms / 1e3
    keep_warm = KeepWarm(runner, library.size, plan.keep_warm_ms)
    tracer = Tracer()
    canary = Canary(None, f"instance {plan.index}")  # against quiet in the serving process, which has the profile
    while True:
        try:
            if canary.due() and (not conn.poll(0) or canary.overdue()):  # idle, or busy since it was due
                conn.send((CANARY, plan.index, canary.read()))
            if spin_s:  # stay on the core (a core that slept runs the next batch up to 1.6x slower)
                deadline = time.monotonic() + spin_s
                while not conn.poll(0) and time.monotonic() < deadline:
                    pass
            keep_warm.until_ready(conn)
            msg = conn.recv()
        except (EOFError, OSError, KeyboardInterrupt):
            return
        if msg is None:
            return
        if msg[0] == TRACE:  # start, or stop and write to the path given
            if msg[1] is None:
                tracer.start()
            else:
                conn.send((TRACE, plan.index, tracer.export(msg[1])))
            continue
        if msg[0] == SPIN:
            spin_s = msg[1] / 1e3
            continue
        if msg[0] == KEEP_WARM:
            keep_warm.every_s = msg[1] / 1e3
            continue
        batch_id, refs = msg
        start = time.monotonic_ns()
        scores, error, counts, stages = None, None, None, None
        try:
            with tracer.batch(batch_id):
                scores = runner(refs)
            counts = runner.counts
            stages = runner.stages
        except Exception as exc:  # noqa: BLE001 - one failed batch must not end the instance
            error = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
        try:
            conn.send(BatchResult(batch_id, plan.index, start, time.monotonic_ns(), scores, error, counts, stages))
        except (EOFError, OSError):
            return


def _final_build(
    plan: InstancePlan, model: torch.nn.Module, library: LoadedSamples, device: torch.device, largest: int
) -> tuple[torch.nn.Module, Any, finalists.FinalChoice]:
    """The module and runner this instance serves, warmed up to its `largest` batch: the plan's build, or the
    fastest here of it and its finalists (`infer.finalists`), at each batch size where the runners can take each
    other's packages (the others' modules are kept only for the sizes they serve)."""
    modules = {plan.build: model}
    for name, artefact in plan.finalists:
        modules[name] = build_named(name).from_artefact(model, artefact)
    runners = {b: make_runner(m, library, device, plan.precision, plan.history_cache_mb) for b, m in modules.items()}
    for runner in runners.values():
        runner.warm_up(largest)
    # package runners take each other's packages by batch size; others are chosen at the largest batch alone
    packaged = {b: r for b, r in runners.items() if isinstance(r, PackagedRunner)}
    sizes = finalists.sizes_to_time(largest) if len(packaged) == len(runners) else [largest]
    chosen = finalists.choose(plan.build, {b: partial(_one_batch, r) for b, r in runners.items()}, sizes)
    runner = runners[chosen["build"]]
    if chosen["by_size"] and isinstance(runner, PackagedRunner):
        at = {n: packaged[chosen["by_size"].get(n, chosen["build"])] for n in sizes}
        # a size served by a package made for its bucket alone (`aoti_buckets`) is padded to it, as its own runner pads
        exact = max((n for n, r in at.items() if n <= r.exact), default=0)
        runner.route({n: r.run_at(n) for n, r in at.items()}, exact=exact)
    return modules[chosen["build"]], runner, chosen


def _one_batch(runner: Any, samples: int) -> None:
    runner([QueryRef(-1, samples, 0)])


class IdleHold:
    """What an idle instance holds against memory and cores going cold between batches (these guests' idle vCPU
    exits to the host at once), for as long as the instance lives:

    - `cpu-latency`: /dev/cpu_dma_latency held open at 0 (the kernel's PM QoS): where a cpuidle driver runs, the
      idle core polls instead of halting, so it neither exits to the host nor leaves its caches to other work;
      released by the kernel when the file closes, however the process ends. Needs root;
    - `lock-tables`: the tables and the sample library pre-faulted and locked (`mlock`): no page of them is ever
      reclaimed or faulted again; unlocked when the process ends;
    - `keep-memory`: glibc's malloc told never to give freed memory back (no trim, no block mapped on its own): a
      batch's buffers come back warm and mapped, not as fresh pages to fault in;
    - `halt-poll`: the guest's haltpoll idle driver polls up to `HALT_POLL_NS` before it halts the vCPU (these
      guests run it at 0: an idle vCPU exits to the host at once). Machine-wide and needs root: the first instance
      to take it writes the old value to `HALT_POLL_SAVED` and puts it back when it ends; a value left behind by a
      killed instance is put back by the next hold taken. It acts only where the haltpoll driver runs
      (`/sys/devices/system/cpu/cpuidle/current_driver`), which the run records.

    A hold that cannot be taken fails the instance's start with the reason (the server says it on one line)."""

    def __init__(self, kind: str, handle: Any = None) -> None:
        self.kind, self.handle = kind, handle

    @classmethod
    def take(cls, kind: str, model: torch.nn.Module, library: Any) -> IdleHold:
        if kind == "cpu-latency":
            try:
                handle = open("/dev/cpu_dma_latency", "wb", buffering=0)  # noqa: SIM115 - held for the process's life
                handle.write((0).to_bytes(4, "little", signed=True))
            except OSError as exc:
                raise RuntimeError(
                    f"--idle-hold cpu-latency: cannot hold /dev/cpu_dma_latency at 0 "
                    f"({exc.strerror or exc}); it needs root"
                ) from None
            return cls(kind, handle)
        if kind == "lock-tables":
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            regions = [(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in _tensors(model)]
            regions += [(a.ctypes.data, a.nbytes) for a in vars(library).values() if isinstance(a, np.ndarray)]
            for address, size in regions:
                if size and libc.mlock(ctypes.c_void_p(address), ctypes.c_size_t(size)) != 0:
                    err = ctypes.get_errno()
                    raise RuntimeError(
                        f"--idle-hold lock-tables: mlock of {size:,} bytes failed ({os.strerror(err)});"
                        " raise the locked-memory limit (ulimit -l) or run as root"
                    )
            return cls(kind, regions)
        if kind == "keep-memory":
            try:
                batch_memory.keep_batch_memory()  # as --batch-memory keep: no trim, no block mapped on its own
            except RuntimeError as exc:
                raise RuntimeError(f"--idle-hold keep-memory: {exc}") from None
            return cls(kind)
        if kind == "halt-poll":
            return cls(kind, HaltPoll.take())
        return cls(kind)


HALT_POLL = Path("/sys/module/haltpoll/parameters/guest_halt_poll_ns")
HALT_POLL_NS = 10_000_000  # 10 ms: beyond the keep-warm interval, so a kept-warm instance never halts
HALT_POLL_SAVED = Path(tempfile.gettempdir()) / "dlrm-lab-halt-poll"  # "pid old-value" of the hold's owner


class HaltPoll:
    """The haltpoll driver's poll window raised while an instance lives, and put back after (`IdleHold`)."""

    def __init__(self, old: int | None) -> None:
        self.old = old  # None: another instance owns the hold and puts it back
        if old is not None:
            atexit.register(self.release)

    @classmethod
    def take(cls) -> HaltPoll:
        try:
            cls.restore_left_behind()
            old = int(HALT_POLL.read_text())
            try:
                fd = os.open(HALT_POLL_SAVED, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError:  # another live instance owns it
                hold = cls(None)
            else:
                with os.fdopen(fd, "w") as f:
                    f.write(f"{os.getpid()} {old}")
                hold = cls(old)
            HALT_POLL.write_text(str(HALT_POLL_NS))
            return hold
        except OSError as exc:
            raise RuntimeError(
                f"--idle-hold halt-poll: cannot set {HALT_POLL} ({exc.strerror or exc}); it needs root and the "
                "haltpoll module"
            ) from None

    @staticmethod
    def restore_left_behind() -> None:
        """Put back the value a killed owner left changed (its pid no longer runs)."""
        try:
            pid, old = HALT_POLL_SAVED.read_text().split()
        except (OSError, ValueError):
            return
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            HALT_POLL.write_text(old)
            HALT_POLL_SAVED.unlink(missing_ok=True)
        except PermissionError:
            pass

    def release(self) -> None:
        if self.old is not None:
            with contextlib.suppress(OSError):
                HALT_POLL.write_text(str(self.old))
                HALT_POLL_SAVED.unlink(missing_ok=True)
            self.old = None


class KeepWarm:
    """While its instance waits, a 1-sample batch of the library every `every_ms`, each from the next samples: the
    tables' rows and the weights stay in cache (on these hosts memory idle 100 ms reads ~5x slower,
    `metrics.wake.probe_cold_gather`; a core kept busy by spinning does not keep it)."""

    def __init__(self, runner: Any, library_size: int, every_ms: float) -> None:
        self.runner, self.size, self.every_s, self.at = runner, max(1, library_size), every_ms / 1e3, 0

    def until_ready(self, conn: Any) -> None:
        """Return once `conn` has a message, running a warming batch every `every_ms` until then (off: at once)."""
        if not self.every_s:
            return
        while not conn.poll(self.every_s):
            try:
                self.runner([QueryRef(-1, 1, self.at)])
            except Exception:  # noqa: BLE001 - a warming batch that fails must not end the instance
                return
            self.at = (self.at + 97) % self.size  # other rows each time


# An instance's profile holds its first this many batches: a 40 s point at 1,500 queries/s profiled whole held
# 6.18 GB (1.05 GB untraced) and wrote a 427 MB trace.json (issue 44)
MAX_TRACED_BATCHES = 1000


class Tracer:
    """torch.profiler over an instance's batches, each marked `batch <id>` (what puts the profile on the server's
    clock, `metrics.trace`), for at most MAX_TRACED_BATCHES of them: then the profiler stops, its events kept."""

    def __init__(self) -> None:
        self.profiler: Any = None
        self.running, self.batches = False, 0

    def start(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        if self.profiler is None:
            self.profiler = profile(activities=[ProfilerActivity.CPU])
            self.profiler.__enter__()
            self.running, self.batches = True, 0

    def _stop(self) -> None:
        if self.running:
            self.profiler.__exit__(None, None, None)
            self.running = False

    @contextmanager
    def batch(self, batch_id: int) -> Iterator[None]:
        if not self.running:
            yield
            return
        with torch.profiler.record_function(f"batch {batch_id}"):
            yield
        self.batches += 1
        if self.batches >= MAX_TRACED_BATCHES:
            self._stop()

    def export(self, path: str) -> str:
        """Stop and write the Chrome trace to `path`: `path`, or why not (`error: ...`)."""
        try:
            if self.profiler is None:
                raise RuntimeError("tracing was not started")
            self._stop()
            self.profiler.export_chrome_trace(path)
            return path
        except Exception as exc:  # noqa: BLE001 - a trace that cannot be written must not end the instance
            return f"error: {type(exc).__name__}: {exc}"
        finally:
            self.profiler = None


def _tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """Every CPU tensor of a served module (its state and the fused tables' own), one per storage."""
    seen, out = set(), []
    for t in list(model.state_dict().values()) + [
        b for m in model.modules() for b in vars(m).values() if isinstance(b, torch.Tensor)
    ]:
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or t.numel() == 0:
            continue
        if t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            out.append(t)
    return out


def _touch_pages(model: torch.nn.Module) -> None:
    """Map every page of the snapshot now (one byte per 4 KiB page): otherwise the first
    lookups of each row page fault during the measurement."""
    for t in _tensors(model):
        raw = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())
        raw[::4096].sum()

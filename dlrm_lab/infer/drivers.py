"""Load drivers: one class per way of issuing load, chosen by scenario (`make_driver`).

    "open-loop"    OpenLoop: queries on a precomputed arrival schedule (no coordinated omission)
    "closed-loop"  ClosedLoop: `concurrency` queries outstanding (capacity, never latency)
    "server", "offline", "single-stream", "multi-stream"   MLPerf LoadGen (`infer.loadgen`)

Every driver is built as `Driver(sut, streams, settings)` and drives any
`infer.sut.SystemUnderTest` through that interface alone; `drive` is the one poll loop that
runs a driver against a system and collects its records. A new scenario is its driver class and
one `Scenario` declaration in `REGISTRY` (its rules as settings: whether it has a rate, drives one
model, ...); `--scenario`, sweeps and the run's checks read them. Torch-free.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from dlrm_lab.errors import FieldError, UserError
from dlrm_lab.infer.load import DriverStats, LoadSettings, Scenario, Stream
from dlrm_lab.infer.loadgen import SCENARIOS as LOADGEN
from dlrm_lab.infer.sut import LoadDriver, Query, SystemUnderTest
from dlrm_lab.metrics.columns import QueryRow

START_LEAD_S = 0.02  # the first arrival is scheduled this far ahead of the driver's start
POLL_S = 0.25  # `drive` takes records and checks the system this often


class OpenLoop:
    """DeepRecSys-style open-loop load: queries arrive on a precomputed schedule whatever
    the server does, and each query's latency counts from its *scheduled* arrival, so a
    slow server cannot slow its own load down (no coordinated omission).

    One thread issues all streams in arrival order (merged), sleeping until each arrival;
    the issue lag (actual minus scheduled) is recorded per model.
    """

    def __init__(self, sut: SystemUnderTest, streams: list[Stream], settings: LoadSettings) -> None:
        self.sut = sut
        self.streams = streams
        self.duration_s = duration_s = settings.duration_s
        self.max_issue_lag_ms = settings.max_issue_lag_ms
        rng = np.random.default_rng(settings.seed)
        times, models, sizes, offsets = [], [], [], []
        self.stats = DriverStats(duration_s=duration_s)
        for k, s in enumerate(streams):
            t = s.arrivals.schedule(s.qps, duration_s, rng)
            library = sut.library(s.model)
            n = np.minimum(s.sizes.draw(len(t), rng), library.size)
            times.append(t)
            models.append(np.full(len(t), k))
            sizes.append(n)
            offsets.append(s.offsets(n, library, rng))
            self.stats.target_queries[s.model] = s.qps * duration_s
            self.stats.issued[s.model] = 0
            self.stats.lag_ms[s.model] = []
            self.stats.arrival[s.model] = s.arrivals.kind
        all_t = np.concatenate(times)
        order = np.argsort(all_t, kind="stable")
        self._t = all_t[order]
        self._model = np.concatenate(models)[order]
        self._size = np.concatenate(sizes)[order]
        self._offset = np.concatenate(offsets)[order]
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    @property
    def planned(self) -> int:
        return len(self._t)

    def start(self, first_query_id: int = 0) -> OpenLoop:
        self._thread = threading.Thread(target=self._run, args=(first_query_id,), name="open-loop", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def join(self, timeout: float | None = None) -> bool:
        assert self._thread is not None
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self, first_query_id: int) -> None:
        names = [s.model for s in self.streams]
        t0 = time.monotonic_ns() + int(START_LEAD_S * 1e9)
        lag = self.stats.lag_ms
        try:
            for i in range(len(self._t)):
                if self._stop.is_set():
                    break
                due = t0 + int(self._t[i] * 1e9)
                wait = due - time.monotonic_ns()
                if wait > 0:
                    time.sleep(wait / 1e9)
                elif self.max_issue_lag_ms is not None and -wait / 1e6 > self.max_issue_lag_ms:
                    self.stats.issue_stopped = issue_lag_message(
                        -wait / 1e6, i, len(self._t), sum(s.qps for s in self.streams), self.max_issue_lag_ms
                    )
                    break
                model = names[self._model[i]]
                q = Query(first_query_id + i, model, int(self._size[i]), int(self._offset[i]), scheduled_ns=due)
                self.sut.submit(q)
                lag[model].append((q.issued_ns - due) / 1e6)
                self.stats.issued[model] += 1
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            self.error = exc


def issue_lag_message(late_ms: float, index: int, planned: int, qps: float, bound_ms: float) -> str:
    return (
        f"the load stopped at query {index + 1} of {planned}: it was due {late_ms / 1e3:.1f} s ago "
        f"(--max-issue-lag-ms {bound_ms:g}): this process could not issue {qps:g} queries/s"
    )


class ClosedLoop:
    """`settings.concurrency` outstanding queries at all times for `duration_s`: saturates the
    server without an unbounded queue. Used to estimate capacity before a latency-bounded
    search; never for a loaded latency (a closed loop hides queueing, see OpenLoop). With `think_ms`, each finished
    query's next is issued that long after it: one at a time, each meets a server idle that long (the unloaded
    latency of `infer.calibrate`)."""

    def __init__(self, sut: SystemUnderTest, streams: list[Stream], settings: LoadSettings) -> None:
        if len(streams) != 1:
            raise UserError(f"a closed loop drives one model, got {len(streams)} streams")
        (self.stream,) = streams
        self.sut, self.concurrency, self.duration_s = sut, settings.concurrency, settings.duration_s
        self.think_s = settings.think_ms / 1e3
        self.rng = np.random.default_rng(settings.seed)
        self.library = sut.library(self.stream.model)
        self.stats = DriverStats(duration_s=settings.duration_s, arrival={self.stream.model: "closed-loop"})
        self._lock = threading.Lock()
        self._next_id = 0
        self._deadline = 0.0
        self.error: BaseException | None = None

    def _submit(self) -> None:
        with self._lock:
            qid = self._next_id
            self._next_id += 1
            size = np.minimum(self.stream.sizes.draw(1, self.rng), self.library.size)
            offset = int(self.stream.offsets(size, self.library, self.rng)[0])
            size = int(size[0])
        self.sut.submit(Query(qid, self.stream.model, size, offset, on_done=self._done))

    def _done(self, _q: Query, _status: str, _scores: Any) -> None:
        if self.think_s > 0:  # not slept here: this is the server's completion thread
            timer = threading.Timer(self.think_s, self._next)
            timer.daemon = True
            timer.start()
        else:
            self._next()

    def _next(self) -> None:
        """The next query, unless the load's time is up or it was stopped (checked when it is due: after a think)."""
        if time.monotonic() < self._deadline:
            self._submit()

    def start(self) -> ClosedLoop:
        self._deadline = time.monotonic() + self.duration_s
        for _ in range(self.concurrency):
            self._submit()
        return self

    def join(self, timeout: float | None = None) -> bool:
        time.sleep(max(0.0, min(timeout or 0.0, self._deadline - time.monotonic())))
        return time.monotonic() >= self._deadline

    def stop(self) -> None:
        self._deadline = 0.0


# Every scenario as its driver declares it (`infer.load.Scenario`): what `--scenario` accepts.
REGISTRY: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario("open-loop", OpenLoop, probes_rate=True, stops_early=True),
        Scenario("closed-loop", ClosedLoop, rate=False),
        *LOADGEN,
    )
}
SCENARIOS = tuple(REGISTRY)
DRIVERS: dict[str, Callable[[SystemUnderTest, list[Stream], LoadSettings], LoadDriver]] = {
    name: s.driver for name, s in REGISTRY.items()
}


def scenario(name: str) -> Scenario:
    """The declared scenario `name`; one line naming the allowed ones otherwise."""
    if name not in REGISTRY:
        raise FieldError("scenario", f"{name!r}: allowed: {', '.join(SCENARIOS)}")
    return REGISTRY[name]


def check_scenario(name: str, models: int, qps_auto: bool) -> Scenario:
    """`name`'s own checks of a run of `models` models (`Scenario.check`)."""
    probed = [s.name for s in REGISTRY.values() if s.probes_rate]
    chosen = scenario(name)
    chosen.check(models, qps_auto, probed)
    return chosen


def make_driver(sut: SystemUnderTest, streams: list[Stream], settings: LoadSettings) -> LoadDriver:
    """The driver of `settings.scenario`, ready to start against `sut`."""
    return scenario(settings.scenario).driver(sut, streams, settings)


def drive(
    sut: SystemUnderTest,
    driver: LoadDriver,
    *,
    drain_s: float,
    take: Callable[[list[QueryRow]], None] | None = None,
    poll: Callable[[], bool | None] | None = None,
    poll_s: float = POLL_S,
) -> bool:
    """Start `driver` and wait for its load to end, then for `sut` to finish every query
    (up to `drain_s`); True when all finished. Every `poll_s` the records finished so far go
    to `take`, `sut.check()` raises if the system failed, and `poll()` runs (True: end the
    load now, then drain). An error (the driver's, the system's, or `poll`'s) stops the
    driver, hands the records so far to `take` and is raised. The caller takes the rest."""
    driver.start()
    try:
        while not driver.join(timeout=poll_s):
            if take is not None:
                take(sut.take_records())
            sut.check()
            if poll is not None and poll():
                driver.stop()
                driver.join(timeout=1.0)  # LoadGen cannot be stopped: its queries keep coming a while
                break
        if driver.error is not None:
            raise driver.error
        if sut.drain(drain_s):
            return True
        sut.check()
        return False
    except BaseException:
        driver.stop()
        if take is not None:
            take(sut.take_records())
        raise

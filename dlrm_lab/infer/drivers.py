"""Load drivers: our open-loop generator and an MLPerf LoadGen system-under-test adapter."""

from __future__ import annotations

import itertools
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dlrm_lab.errors import UserError
from dlrm_lab.infer.load import Arrivals, QuerySizes
from dlrm_lab.infer.server import InferenceServer, Query

LOADGEN_SCENARIOS = ("server", "offline", "single-stream", "multi-stream")
SCENARIOS = ("open-loop", *LOADGEN_SCENARIOS)
START_LEAD_S = 0.02  # the first arrival is scheduled this far ahead of the driver's start


@dataclass
class Stream:
    """One model's load: a target rate, query sizes and an arrival process."""

    model: str
    qps: float
    sizes: QuerySizes
    arrivals: Arrivals = field(default_factory=Arrivals)
    sla_ms: float | None = None  # this model's latency bound (default: the run's)


@dataclass
class DriverStats:
    """What the driver actually did, per model, so a run shows its load was what it claims."""

    target_queries: dict[str, float] = field(default_factory=dict)
    issued: dict[str, int] = field(default_factory=dict)
    lag_ms: dict[str, list[float]] = field(default_factory=dict)
    duration_s: float = 0.0
    loadgen: dict[str, Any] = field(default_factory=dict)

    def accuracy(self, model: str) -> dict[str, Any]:
        lag = np.asarray(self.lag_ms.get(model, []), dtype=np.float64)
        target = self.target_queries.get(model)
        return {
            "achieved_rate_ratio": self.issued.get(model, 0) / target if target else None,
            "issue_lag_p50_ms": float(np.percentile(lag, 50)) if len(lag) else None,
            "issue_lag_p99_ms": float(np.percentile(lag, 99)) if len(lag) else None,
            "issue_lag_max_ms": float(lag.max()) if len(lag) else None,
        }


class OpenLoop:
    """DeepRecSys-style open-loop load: queries arrive on a precomputed schedule whatever
    the server does, and each query's latency counts from its *scheduled* arrival, so a
    slow server cannot slow its own load down (no coordinated omission).

    One thread issues all streams in arrival order (merged), sleeping until each arrival;
    the issue lag (actual minus scheduled) is recorded per model.
    """

    def __init__(self, server: InferenceServer, streams: list[Stream], duration_s: float, seed: int) -> None:
        self.server = server
        self.streams = streams
        self.duration_s = duration_s
        rng = np.random.default_rng(seed)
        times, models, sizes, offsets = [], [], [], []
        self.stats = DriverStats(duration_s=duration_s)
        for k, s in enumerate(streams):
            t = s.arrivals.schedule(s.qps, duration_s, rng)
            lib = server.library_samples(s.model)
            n = s.sizes.draw(len(t), rng)
            n = np.minimum(n, lib)
            times.append(t)
            models.append(np.full(len(t), k))
            sizes.append(n)
            offsets.append(rng.integers(0, lib - n + 1))
            self.stats.target_queries[s.model] = s.qps * duration_s
            self.stats.issued[s.model] = 0
            self.stats.lag_ms[s.model] = []
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
                model = names[self._model[i]]
                q = Query(first_query_id + i, model, int(self._size[i]), int(self._offset[i]), scheduled_ns=due)
                self.server.submit(q)
                lag[model].append((q.issued_ns - due) / 1e6)
                self.stats.issued[model] += 1
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            self.error = exc


class ClosedLoop:
    """`concurrency` outstanding queries at all times for `duration_s`: saturates the server
    without an unbounded queue. Used to estimate capacity before a latency-bounded search;
    never for latency (a closed loop hides queueing, see OpenLoop)."""

    def __init__(self, server: InferenceServer, stream: Stream, concurrency: int, duration_s: float, seed: int) -> None:
        self.server, self.stream, self.concurrency, self.duration_s = server, stream, concurrency, duration_s
        self.rng = np.random.default_rng(seed)
        self.lib = server.library_samples(stream.model)
        self.stats = DriverStats(duration_s=duration_s)
        self._lock = threading.Lock()
        self._next_id = 0
        self._deadline = 0.0
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def _submit(self) -> None:
        with self._lock:
            qid = self._next_id
            self._next_id += 1
            size = int(min(self.stream.sizes.draw(1, self.rng)[0], self.lib))
            offset = int(self.rng.integers(0, self.lib - size + 1))
        self.server.submit(Query(qid, self.stream.model, size, offset, on_done=self._done))

    def _done(self, _q: Query, _status: str, _scores: Any) -> None:
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


class LoadGenDriver:
    """MLPerf LoadGen drives one served model: LoadGen's "sample" is one of our queries
    (a template of `size` library samples, as in MLPerf DLRM), our server is its SUT.

    LoadGen keeps its own schedule and latency accounting; its summary and detail logs
    are written to `log_dir` and its verdict is recorded. Queries our server drops under
    overload are reported complete to LoadGen (it has no notion of failure) and the
    verdict is then marked INVALID with the count, so shedding load never passes.
    """

    TEMPLATES = 4096

    def __init__(
        self,
        server: InferenceServer,
        stream: Stream,
        scenario: str,
        *,
        duration_s: float,
        sla_ms: float,
        sla_percentile: float,
        log_dir: Path,
        seed: int,
    ) -> None:
        try:
            import mlperf_loadgen  # noqa: F401
        except ImportError:
            raise UserError(
                f"--scenario {scenario}: MLPerf LoadGen is not installed (pip install mlcommons-loadgen)"
            ) from None
        if scenario not in LOADGEN_SCENARIOS:
            raise UserError(f"--scenario {scenario!r}: allowed: {', '.join(SCENARIOS)}")
        self.server, self.stream, self.scenario = server, stream, scenario
        self.duration_s, self.sla_ms, self.sla_percentile = duration_s, sla_ms, sla_percentile
        self.log_dir = log_dir
        rng = np.random.default_rng(seed)
        lib = server.library_samples(stream.model)
        self.sizes = np.minimum(stream.sizes.draw(self.TEMPLATES, rng), lib)
        self.offsets = rng.integers(0, lib - self.sizes + 1)
        self.stats = DriverStats(duration_s=duration_s)
        self._ids = itertools.count()  # LoadGen issues from its own threads; next() is atomic
        self.dropped = 0
        self._dropped_lock = threading.Lock()  # drops are finished in whichever thread submits
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def settings(self) -> Any:
        import mlperf_loadgen as lg

        s = lg.TestSettings()
        s.mode = lg.TestMode.PerformanceOnly
        s.min_duration_ms = int(self.duration_s * 1000)
        s.max_duration_ms = int(self.duration_s * 1000 * 4 + 10_000)
        s.min_query_count = 1
        sla_ns = int(self.sla_ms * 1e6)
        pct = self.sla_percentile / 100
        if self.scenario == "server":
            s.scenario = lg.TestScenario.Server
            s.server_target_qps = self.stream.qps
            s.server_target_latency_ns = sla_ns
            s.server_target_latency_percentile = pct
        elif self.scenario == "offline":
            s.scenario = lg.TestScenario.Offline
            s.offline_expected_qps = self.stream.qps
        elif self.scenario == "single-stream":
            s.scenario = lg.TestScenario.SingleStream
            s.single_stream_expected_latency_ns = max(1, int(1e9 / self.stream.qps))
            s.single_stream_target_latency_percentile = pct
        else:
            s.scenario = lg.TestScenario.MultiStream
            s.multi_stream_samples_per_query = 8
            s.multi_stream_expected_latency_ns = max(1, int(8e9 / self.stream.qps))
            s.multi_stream_target_latency_percentile = pct
        return s

    def start(self) -> LoadGenDriver:
        self._thread = threading.Thread(target=self._run, name="loadgen", daemon=True)
        self._thread.start()
        return self

    def join(self, timeout: float | None = None) -> bool:
        assert self._thread is not None
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def stop(self) -> None:
        """LoadGen cannot be interrupted; it ends at its max duration."""

    def _run(self) -> None:
        import mlperf_loadgen as lg

        model = self.stream.model
        self.stats.issued[model] = 0
        self.stats.lag_ms[model] = []

        def done(q: Query, status: str, _scores: Any) -> None:
            if status != "ok":  # dropped, failed, or a gRPC error code from a remote server
                with self._dropped_lock:
                    self.dropped += 1
            lg.QuerySamplesComplete([lg.QuerySampleResponse(q.tag, 0, 0)])

        def issue(samples: list[Any]) -> None:
            for s in samples:
                q = Query(
                    next(self._ids), model, int(self.sizes[s.index]), int(self.offsets[s.index]), on_done=done, tag=s.id
                )
                self.server.submit(q)
            self.stats.issued[model] += len(samples)

        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = lg.LogSettings()
        log.log_output.outdir = str(self.log_dir)
        log.log_output.copy_summary_to_stdout = False
        log.enable_trace = False
        sut = lg.ConstructSUT(issue, lambda: None)
        qsl = lg.ConstructQSL(self.TEMPLATES, self.TEMPLATES, lambda _idx: None, lambda _idx: None)
        try:
            start = time.monotonic()
            lg.StartTestWithLogSettings(sut, qsl, self.settings(), log)
            self.stats.duration_s = time.monotonic() - start
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            self.error = exc
        finally:
            lg.DestroyQSL(qsl)
            lg.DestroySUT(sut)
        self.stats.loadgen = parse_loadgen_summary(self.log_dir / "mlperf_log_summary.txt")
        if self.dropped and self.stats.loadgen.get("loadgen_result"):
            self.stats.loadgen["loadgen_result"] = f"INVALID (server dropped or failed {self.dropped} queries)"


def parse_loadgen_summary(path: Path) -> dict[str, Any]:
    """VALID/INVALID, LoadGen's throughput and its p99 from `mlperf_log_summary.txt`."""
    if not path.exists():
        return {"loadgen_result": None, "loadgen_queries_per_s": None, "loadgen_p99_ms": None}
    text = path.read_text()

    def grab(pattern: str) -> str | None:
        m = re.search(pattern, text, re.MULTILINE)
        return m.group(1).strip() if m else None

    rate = (
        grab(r"^Completed samples per second\s*:\s*([\d.]+)")
        or grab(r"^Samples per second\s*:\s*([\d.]+)")
        or grab(r"^Scheduled samples per second\s*:\s*([\d.]+)")
    )
    if rate is None:  # single- and multi-stream report LoadGen queries/s; each holds samples_per_query
        qps = grab(r"^QPS w/ loadgen overhead\s*:\s*([\d.]+)")
        per_query = grab(r"^samples_per_query\s*:\s*(\d+)") or "1"
        rate = str(float(qps) * int(per_query)) if qps else None
    p99 = grab(r"^99\.00 percentile latency \(ns\)\s*:\s*(\d+)")
    return {
        "loadgen_result": grab(r"^Result is\s*:\s*(\w+)"),
        "loadgen_queries_per_s": float(rate) if rate else None,
        "loadgen_p99_ms": int(p99) / 1e6 if p99 else None,
    }

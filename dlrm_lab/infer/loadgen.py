"""MLPerf LoadGen as a load driver: its scenarios drive any `infer.sut.SystemUnderTest`.

LoadGen's "sample" is one of our queries (a range of `size` library samples, as MLPerf
DLRM's samples are user queries of 100-700 rows), its query sample library is the model's
sample library (`QuerySampleLibrary`), and its system under test forwards every sample to
ours. LoadGen keeps its own schedule and latency accounting; its summary and detail logs
are written to the settings' `log_dir` and its verdict is recorded.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import math
import multiprocessing as mp
import os
import re
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np

from dlrm_lab.errors import FieldError, ServingFault, exit_description, interrupt_blocked
from dlrm_lab.infer.load import DriverStats, LoadSettings, QuerySizes, Scenario, Stream
from dlrm_lab.infer.loadgen_process import END, loadgen_main, log_settings, test_settings
from dlrm_lab.infer.sut import Query, SampleLibrary, SystemUnderTest, report_after
from dlrm_lab.metrics.columns import InferSummaryRow

# LoadGen's TestSettings of each scenario: its TestScenario, the samples in one LoadGen query,
# and which of the run's quantities (see `LoadGenDriver.test_settings`) sets which field.
SCENARIO_SETTINGS: dict[str, tuple[str, int, dict[str, str]]] = {
    "server": (
        "Server",
        1,
        {
            "server_target_qps": "qps",
            "server_target_latency_ns": "sla_ns",
            "server_target_latency_percentile": "percentile",
        },
    ),
    "offline": ("Offline", 1, {"offline_expected_qps": "qps"}),
    "single-stream": (
        "SingleStream",
        1,
        {
            "single_stream_expected_latency_ns": "expected_latency_ns",
            "single_stream_target_latency_percentile": "percentile",
        },
    ),
    "multi-stream": (
        "MultiStream",
        8,
        {
            "multi_stream_samples_per_query": "samples_per_query",
            "multi_stream_expected_latency_ns": "expected_latency_ns",
            "multi_stream_target_latency_percentile": "percentile",
        },
    ),
}
LOADGEN_SCENARIOS = tuple(SCENARIO_SETTINGS)
OWN_PROCESS = frozenset({"server", "offline"})  # the scenarios whose LoadGen runs in its own process
_running = 0  # LoadGen tests in progress in this process (`running`)
_running_lock = threading.Lock()


def running() -> bool:
    """A LoadGen test is still in progress here. It cannot be stopped, and an interpreter that exits with its C++
    threads alive aborts (`terminate called without an active exception`): the process must end by `os._exit`."""
    return _running > 0


class QuerySampleLibrary:
    """LoadGen's QSL over one model's sample library: LoadGen's sample k is query k, samples
    [offsets[k], offsets[k] + sizes[k]) of the library. There are as many queries as library
    samples, all loadable at once (the library is in memory); LoadGen's load_samples and
    unload_samples load and unload the library samples their queries cover."""

    def __init__(self, library: SampleLibrary, sizes: QuerySizes, rng: np.random.Generator) -> None:
        self.library = library
        n = library.size
        self.sizes = np.minimum(sizes.draw(n, rng), n)
        self.offsets = rng.integers(0, n - self.sizes + 1)

    @property
    def total_sample_count(self) -> int:
        return len(self.sizes)

    @property
    def performance_sample_count(self) -> int:
        return len(self.sizes)

    def query(self, index: int) -> tuple[int, int]:
        """(size, offset) of LoadGen's sample `index`."""
        return int(self.sizes[index]), int(self.offsets[index])

    def load_samples(self, indices: Iterable[int]) -> None:
        self.library.load(self._ranges(indices))

    def unload_samples(self, indices: Iterable[int]) -> None:
        self.library.unload(self._ranges(indices))

    def _ranges(self, indices: Iterable[int]) -> list[tuple[int, int]]:
        k = np.fromiter(indices, dtype=np.int64)
        return list(zip(self.offsets[k].tolist(), (self.offsets[k] + self.sizes[k]).tolist(), strict=True))


class LoadGenDriver:
    """MLPerf LoadGen drives one model of a system under test in one of its scenarios.

    Queries the system drops under overload are reported complete to LoadGen (it has no
    notion of failure) and the verdict is then marked INVALID with the count, so shedding
    load never passes.
    """

    def __init__(
        self, sut: SystemUnderTest, streams: list[Stream], settings: LoadSettings, own_process: bool | None = None
    ) -> None:
        try:
            import mlperf_loadgen  # noqa: F401
        except ImportError:
            raise FieldError(
                "scenario", f"{settings.scenario}: MLPerf LoadGen is not installed (pip install mlcommons-loadgen)"
            ) from None
        if settings.scenario not in SCENARIO_SETTINGS:
            raise FieldError("scenario", f"{settings.scenario!r}: LoadGen's are {', '.join(LOADGEN_SCENARIOS)}")
        if len(streams) != 1:
            raise FieldError("scenario", f"{settings.scenario}: LoadGen drives one model; use open-loop for several")
        if settings.log_dir is None:
            raise ValueError("LoadGenDriver: settings.log_dir is where LoadGen writes its logs; none given")
        self.sut, (self.stream,), self.settings = sut, streams, settings
        self.qsl = QuerySampleLibrary(
            sut.library(self.stream.model), self.stream.sizes, np.random.default_rng(settings.seed)
        )
        self.stats = DriverStats(duration_s=settings.duration_s, arrival={self.stream.model: "loadgen"})
        self._ids = itertools.count()  # LoadGen issues from its own threads; next() is atomic
        self.dropped = 0
        self._finished_lock = threading.Lock()  # queries are finished in whichever thread submits or completes
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None
        # LoadGen's thread alone in its process (`infer.loadgen_process`) where it issues at a rate and two cores are
        # free of instances (one for the serving process, one for LoadGen's). With one, the two processes shared it
        # and the pipes cost more than the GIL did (tiny, aoti, 1x1 on 2 cores, LoadGen Server at 12,000 and 16,000
        # queries/s: p99 11.1, 9.5 and 13.5, 13.0 ms in its own process against 8.3, 8.2 and 10.5, 9.2 in this one,
        # interleaved). Single- and multi-stream time one query at a time: a pipe's hop would be in every figure.
        if own_process is None:
            own_process = settings.scenario in OWN_PROCESS and free_cores(sut) >= 2
        self.own_process = own_process
        if own_process:  # recorded: the arrival column says who scheduled the queries, and where
            self.stats.arrival[self.stream.model] = "loadgen, its own process"
        self.loadgen_pid: int | None = None  # its process, where it has one

    def test_fields(self) -> dict[str, Any]:
        """LoadGen's TestSettings for this run, as plain values (`infer.loadgen_process.test_settings` builds them)."""
        scenario, per_query, fields = SCENARIO_SETTINGS[self.settings.scenario]
        out: dict[str, Any] = {
            "mode": "PerformanceOnly",
            "scenario": scenario,
            "min_duration_ms": int(self.settings.duration_s * 1000),
            "max_duration_ms": int(self.settings.duration_s * 1000 * 4 + 10_000),
            "min_query_count": 1,
        }
        qps = self.stream.qps
        quantities = {
            "qps": qps,
            "sla_ns": int(self.settings.sla_ms * 1e6),
            "percentile": self.settings.sla_percentile / 100,
            "samples_per_query": per_query,
            "expected_latency_ns": max(1, int(per_query * 1e9 / qps)),  # a query every per_query / qps s
        }
        for name, quantity in fields.items():
            out[name] = quantities[quantity]
        if scenario == "Server":  # queries that fell due together are issued in one call, as MLPerf allows
            out["server_coalesce_queries"] = True
        return out

    def test_settings(self) -> Any:
        return test_settings(self.test_fields())

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
        model = self.stream.model
        self.stats.issued[model] = 0
        self.stats.lag_ms[model] = []
        log_dir = Path(self.settings.log_dir)  # type: ignore[arg-type]
        log_dir.mkdir(parents=True, exist_ok=True)
        # Everything alive now (a search's earlier probes' rows) is kept out of the collections during the run:
        # a full collection over them pauses every thread, the issue and completion paths included.
        gc.collect()
        gc.freeze()
        try:
            if self.own_process:
                self._run_own_process(log_dir)
            else:
                self._run_in_process(log_dir)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            self.error = exc
        finally:
            gc.unfreeze()
        self._verdict(log_dir)

    def _issuer(self, respond: Callable[[list[int]], None]) -> Callable[[list[int], list[int], int | None], None]:
        """What submits LoadGen's issued samples to the system under test: (tags, sample indices, scheduled ns or
        None: now). `respond(tags)` hears the finished queries' tags, once for the queries the server finished
        together."""
        model = self.stream.model
        finished: list[int] = []  # tags not yet reported to LoadGen

        def report() -> None:
            with self._finished_lock:
                tags = finished[:]
                finished.clear()
            if tags:
                respond(tags)

        def done(q: Query, status: str, _scores: Any) -> None:
            with self._finished_lock:
                if status != "ok":  # dropped, failed, or a gRPC error code from a remote server
                    self.dropped += 1
                finished.append(q.tag)
            report_after(self, report)  # once for a batch's queries, where the server finishes them together

        in_time_order = self.stream.order == "time"
        sizes, offsets = self.qsl.sizes.tolist(), self.qsl.offsets.tolist()  # plain ints: no numpy scalar a query
        submit = self.sut.submit

        def issue(tags: list[int], indices: list[int], scheduled_ns: int | None) -> None:
            # LoadGen's FastSUT hands the samples as two lists (no QuerySample object each), and with
            # `server_coalesce_queries` several queries that fell due together in one call.
            # In time order LoadGen's sample index gives the query's size only: its requests are the
            # library's next (LoadGen picks indices at random; MLPerf's DLRMv3 harness likewise serves
            # its requests by timestamp). Every sample is loaded, so any range is.
            starts = (
                self.qsl.library.in_time_order(np.array([sizes[k] for k in indices])).tolist()
                if in_time_order
                else [offsets[k] for k in indices]
            )
            at = scheduled_ns or 0
            for tag, k, start in zip(tags, indices, starts, strict=True):
                submit(Query(next(self._ids), model, sizes[k], start, on_done=done, tag=tag, scheduled_ns=at))
            self.stats.issued[model] += len(tags)

        return issue

    def _run_in_process(self, log_dir: Path) -> None:
        """LoadGen's thread in this process, calling the issue path directly."""
        import mlperf_loadgen as lg

        issue = self._issuer(lambda tags: lg.QuerySamplesComplete([lg.QuerySampleResponse(t, 0, 0) for t in tags]))
        sut = lg.ConstructFastSUT(lambda tags, indices: issue(tags, indices, None), lambda: None)  # as Intel's runner
        qsl = self.qsl
        lg_qsl = lg.ConstructQSL(
            qsl.total_sample_count, qsl.performance_sample_count, qsl.load_samples, qsl.unload_samples
        )
        global _running
        with _running_lock:
            _running += 1
        try:
            start = time.monotonic()
            lg.StartTestWithLogSettings(sut, lg_qsl, self.test_settings(), log_settings(str(log_dir)))
            self.stats.duration_s = time.monotonic() - start
        finally:
            with _running_lock:
                _running -= 1
            lg.DestroyQSL(lg_qsl)
            lg.DestroyFastSUT(sut)

    def _run_own_process(self, log_dir: Path) -> None:
        """LoadGen in a process of its own (`infer.loadgen_process`); this thread relays what it issues. Every sample
        is loaded before it starts (LoadGen would load them all: the performance set is the whole library)."""
        ctx = mp.get_context("spawn")
        issue_r, issue_w = ctx.Pipe(duplex=False)
        done_r, done_w = ctx.Pipe(duplex=False)
        send_lock = threading.Lock()  # the server's threads finish queries: one writer at a time

        def respond(tags: list[int]) -> None:
            with send_lock, contextlib.suppress(OSError, ValueError):  # gone: its end is reported below
                done_w.send(tags)

        issue = self._issuer(respond)
        everything = range(self.qsl.total_sample_count)
        self.qsl.load_samples(everything)
        args = (self.test_fields(), self.qsl.total_sample_count, str(log_dir), issue_w, done_r)
        proc = ctx.Process(target=loadgen_main, args=args, name="dlrm-lab-loadgen", daemon=True)
        try:
            with interrupt_blocked():  # a Ctrl-C while it imports is the run's to handle
                proc.start()
            self.loadgen_pid = proc.pid
            issue_w.close()
            done_r.close()
            while True:
                try:
                    msg = issue_r.recv()
                except (EOFError, OSError):
                    proc.join(5)
                    raise ServingFault(
                        f"MLPerf LoadGen's process (pid {proc.pid}) ended before its test did: it "
                        f"{exit_description(proc.exitcode)}"
                    ) from None
                if msg[0] == END:
                    _, error, self.stats.duration_s = msg
                    if error:
                        raise ServingFault(f"MLPerf LoadGen: {error}")
                    break
                _, tags, indices, scheduled_ns = msg
                issue(tags, indices, scheduled_ns)
        finally:
            with send_lock, contextlib.suppress(OSError, ValueError):
                done_w.send(None)
            done_w.close()
            issue_r.close()
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
            self.qsl.unload_samples(everything)

    def _verdict(self, log_dir: Path) -> None:
        self.stats.loadgen = parse_loadgen_summary(log_dir / "mlperf_log_summary.txt")
        if self.dropped and self.stats.loadgen.get("loadgen_result"):
            why = f"the server dropped or failed {self.dropped} queries"
            prior = self.stats.loadgen.get("loadgen_reason")
            self.stats.loadgen.update(
                {"loadgen_result": "INVALID", "loadgen_reason": f"{why}; {prior}" if prior else why}
            )  # as |= does (Row.__ior__: update, then itself)
        reason = self.stats.loadgen.get("loadgen_reason") or ""
        served = self.stats.loadgen.get("loadgen_queries_per_s")
        if self.settings.scenario == "offline" and "min duration not met" in reason and served:
            # Offline issues qps x duration x 1.1 queries at once: a server faster than the qps given ends early
            self.stats.loadgen["loadgen_reason"] = (
                f"{reason} (Offline issued its queries for {self.stream.qps:g} queries/s and they completed at "
                f"{served:.1f}: give --qps {math.ceil(1.2 * served)} or more)"
            )


def free_cores(sut: SystemUnderTest) -> int:
    """How many of this process's cores no instance of `sut` runs on (each unpinned one counted as taking a core;
    all of them for a system on another host)."""
    if not hasattr(os, "sched_getaffinity"):
        return 0
    processes = sut.describe().processes
    pinned = {c for p in processes for c in p["cores"]}
    unpinned = sum(1 for p in processes if not p["cores"])
    return max(0, len(set(os.sched_getaffinity(0)) - pinned) - unpinned)


EARLY_STOPPING_CONFIDENCE = 0.99  # LoadGen's early-stopping estimate of a latency percentile


def early_stopping_queries(percentile: float) -> int:
    """The fewest queries for which LoadGen's early-stopping estimate can pass at `percentile` (in %), with every
    query within the bound: n with (percentile / 100)^n <= 1 - confidence (459 at p99: the 58 queries of a 3 s
    run at 20 queries/s "would need at least 401 more")."""
    p = percentile / 100
    if p >= 1:
        return 1
    return math.ceil(math.log(1 - EARLY_STOPPING_CONFIDENCE) / math.log(p) - 1e-9)


def loadgen_duration(qps: float, duration_s: float, percentile: float) -> float:
    """`duration_s`, or longer (10% beyond the need, whole seconds) where it holds too few queries at `qps` for
    LoadGen's early-stopping estimate: the lab sizes up the runs it plans itself (a search's certification,
    an auto rate)."""
    need = early_stopping_queries(percentile)
    if qps <= 0 or qps * duration_s >= need:
        return duration_s
    return float(math.ceil(1.1 * need / qps))


def check_loadgen_duration(qps: float, duration_s: float, percentile: float) -> None:
    """Refuse a LoadGen Server run too short for any verdict but INVALID, saying how long it must be."""
    need = early_stopping_queries(percentile)
    if qps * duration_s < need:
        raise FieldError(
            "scenario",
            f"server: {{qps}} {qps:g} for {{duration_s}} {duration_s:g} s is {qps * duration_s:.0f} queries; "
            f"LoadGen's early-stopping estimate of the p{percentile:g} needs at least {need} (all within the bound): "
            f"{{duration_s}} {math.ceil(need / qps)} or more",
            "qps",
            "duration_s",
        )


def queries_needed(reason: str | None) -> int | None:
    """How many more queries LoadGen's early-stopping estimate asked for (its INVALID reason), or None."""
    m = re.search(r"would need at least (\d+) more", reason or "")
    return int(m.group(1)) if m else None


def parse_loadgen_summary(path: Path) -> InferSummaryRow:
    """VALID/INVALID, LoadGen's throughput and its p99 from `mlperf_log_summary.txt`, as summary columns."""
    if not path.exists():
        return InferSummaryRow(
            loadgen_result=None, loadgen_queries_per_s=None, loadgen_p99_ms=None, loadgen_reason=None
        )
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
    unmet = [m.strip().lower() for m in re.findall(r"^\s*(.+?)\s*:\s*(?:No|NO)\s*$", text, re.MULTILINE)]
    processed, more = grab(r"Processed (\d+) queries"), grab(r"Would need to run at least (\d+) more queries")
    reason = "; ".join(f"{u.replace(' satisfied', '')} not met" for u in unmet) or None
    if reason and more:
        reason += f" (processed {processed} queries, would need at least {more} more, all within the bound)"
    return InferSummaryRow(
        {
            "loadgen_reason": reason,
            "loadgen_result": grab(r"^Result is\s*:\s*(\w+)"),
            "loadgen_queries_per_s": float(rate) if rate else None,
            "loadgen_p99_ms": int(p99) / 1e6 if p99 else None,
        }
    )


# LoadGen's scenarios as the lab runs them: one model each; the server's rate can be probed open loop and
# its duration is sized to LoadGen's early-stopping estimate; offline issues every query at once.
SCENARIOS = tuple(
    Scenario(
        name,
        LoadGenDriver,
        one_model=True,
        probes_rate=name == "server",
        sized_by_early_stopping=name == "server",
        queues_whole_load=name == "offline",
    )
    for name in SCENARIO_SETTINGS
)

"""The system-under-test boundary: drivers know only `SystemUnderTest` and `SampleLibrary`.

A fake system in this process (answers from a thread, no model) is driven by every driver
the scenario factory makes, LoadGen's query sample library is checked against the library
it loads from, and both real systems (in process, gRPC) implement the interface.
"""

from __future__ import annotations

import os
import queue
import signal
import sys
import threading
import time
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dlrm_lab.errors import UserError
from dlrm_lab.infer.drivers import DRIVERS, SCENARIOS, drive, make_driver
from dlrm_lab.infer.library import PackedLibrary
from dlrm_lab.infer.load import LoadSettings, QuerySizes, Stream
from dlrm_lab.infer.loadgen import LOADGEN_SCENARIOS, QuerySampleLibrary
from dlrm_lab.infer.sut import (
    LoadDriver,
    NoInstancesHere,
    Query,
    SampleLibrary,
    SutDescription,
    SystemUnderTest,
    finishing_together,
    report_after,
)

LIBRARY = 512  # samples


def small_library(n: int = LIBRARY) -> PackedLibrary:
    """n samples of one dense value (the sample's index) and one id per sample."""
    return PackedLibrary(
        dense=np.arange(n, dtype=np.float32).reshape(n, 1),
        lengths=np.ones((1, n), dtype=np.int32),
        starts=np.arange(n, dtype=np.int64).reshape(1, n),
        values=np.arange(n, dtype=np.int64),
    )


class RecordingLibrary(PackedLibrary):
    """A library that remembers the ranges loaded and not yet unloaded."""

    def __init__(self, n: int = LIBRARY) -> None:
        base = small_library(n)
        super().__init__(base.dense, base.lengths, base.starts, base.values)
        self.held: list[tuple[int, int]] = []
        self.load_calls = self.unload_calls = 0

    def load(self, ranges):
        ranges = list(ranges)
        super().load(ranges)
        self.held += ranges
        self.load_calls += 1

    def unload(self, ranges):
        ranges = list(ranges)
        super().unload(ranges)
        for r in ranges:
            self.held.remove(r)
        self.unload_calls += 1


class FakeSut(NoInstancesHere):
    """A system under test without a model: a thread answers each query with its samples'
    dense values as scores and records it as the InferenceServer does."""

    def __init__(self, library: PackedLibrary, served: Any = None, *, fail: str | None = None) -> None:
        self.lib = library
        self.served = served
        self.fail = fail  # check() raises this
        self.epoch_ns = time.monotonic_ns()
        self.submitted: list[Query] = []
        self.outside: list[Query] = []  # queries naming samples outside the library
        self.not_loaded: list[Query] = []  # queries of samples a RecordingLibrary does not hold
        self._queue: queue.Queue[Query | None] = queue.Queue()
        self._records: list[dict[str, Any]] = []
        self._idle = threading.Condition()
        self._outstanding = 0
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def library(self, model: str) -> PackedLibrary:
        return self.lib

    def configure(self, model: str, **policy: Any) -> None:
        if asked := [k for k, v in policy.items() if v is not None]:
            raise ValueError(f"the fake sets no {', '.join(asked)}")

    def submit(self, q: Query) -> None:
        q.issued_ns = time.monotonic_ns()
        q.scheduled_ns = q.scheduled_ns or q.issued_ns
        if q.offset < 0 or q.offset + q.size > self.lib.size:
            self.outside.append(q)
        held = getattr(self.lib, "held", None)
        if held is not None and not any(lo <= q.offset and q.offset + q.size <= hi for lo, hi in list(held)):
            self.not_loaded.append(q)
        with self._idle:
            self._outstanding += 1
            self.submitted.append(q)
        self._queue.put(q)

    def _serve(self) -> None:
        while (q := self._queue.get()) is not None:
            now = time.monotonic_ns() + self.service()
            e = self.epoch_ns
            scores = self.lib.dense[q.offset : q.offset + q.size, 0].copy()
            self._records.append({
                "query_id": q.query_id, "model": q.model, "samples": q.size, "status": "ok",
                "scheduled_ms": (q.scheduled_ns - e) / 1e6, "issued_ms": (q.issued_ns - e) / 1e6,
                "start_ms": (q.issued_ns - e) / 1e6, "end_ms": (now - e) / 1e6,
                "latency_ms": (now - q.scheduled_ns) / 1e6, "queue_ms": 0.0, "compute_ms": (now - q.issued_ns) / 1e6,
                "pieces": 1, "batch_id": q.query_id, "batch_samples": q.size, "batch_queries": 1, "instance": 0,
                "error": None,
            })  # fmt: skip
            if q.on_done is not None:
                q.on_done(q, "ok", scores)
            with self._idle:
                self._outstanding -= 1
                self._idle.notify_all()

    def service(self) -> int:
        """Serve a query: returns ns its answer is later than now (none here)."""
        return 0

    def drain(self, timeout_s: float) -> bool:
        with self._idle:
            return self._idle.wait_for(lambda: self._outstanding == 0, timeout_s)

    def take_records(self) -> list[dict[str, Any]]:
        out, self._records = self._records, []  # list swap: atomic under the GIL
        return out

    def check(self) -> None:
        if self.fail:
            raise RuntimeError(self.fail)

    def describe(self) -> SutDescription:
        return SutDescription(models={"m": self.served.description()} if self.served is not None else {})

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)


@pytest.fixture
def sut():
    s = FakeSut(small_library())
    yield s
    s.close()


def test_the_fake_the_library_and_every_driver_implement_the_interfaces(sut, tmp_path):
    assert isinstance(sut, SystemUnderTest) and isinstance(sut.library("m"), SampleLibrary)
    stream = Stream("m", 100.0, QuerySizes.parse("fixed:2"))
    for scenario in DRIVERS:
        if scenario in LOADGEN_SCENARIOS:
            pytest.importorskip("mlperf_loadgen")
        driver = make_driver(sut, [stream], LoadSettings(scenario, duration_s=0.1, log_dir=tmp_path))
        assert isinstance(driver, LoadDriver), scenario


def test_in_process_and_grpc_servers_are_systems_under_test():
    import grpc

    from dlrm_lab.config import load_preset
    from dlrm_lab.infer.plan import ServingPlan
    from dlrm_lab.infer.served import ServedModel
    from dlrm_lab.infer.server import InferenceServer
    from dlrm_lab.serve.remote import RemoteServer

    plan = ServingPlan({"tiny": ServedModel("tiny", load_preset("tiny"))})  # not started: nothing built, no processes
    in_process = InferenceServer(plan)
    with grpc.insecure_channel("127.0.0.1:1") as channel:  # connects lazily: no server needed
        remote = RemoteServer(channel, {"tiny": small_library()})
        assert isinstance(remote, SystemUnderTest) and remote.library("tiny").size == LIBRARY
    assert isinstance(in_process, SystemUnderTest)


@pytest.mark.parametrize(
    ("scenario", "sizes"),
    [("open-loop", "uniform:1,600"), ("closed-loop", "fixed:3"), *[(s, "uniform:1,8") for s in LOADGEN_SCENARIOS]],
)
def test_every_scenario_drives_a_system_through_the_interface_alone(sut, tmp_path, scenario, sizes):
    if scenario in LOADGEN_SCENARIOS:
        pytest.importorskip("mlperf_loadgen")
    settings = LoadSettings(scenario, duration_s=0.3, seed=1, concurrency=4, sla_ms=1000.0, log_dir=tmp_path)
    driver = make_driver(sut, [Stream("m", 200.0, QuerySizes.parse(sizes))], settings)
    records: list[dict[str, Any]] = []
    assert drive(sut, driver, drain_s=30, take=records.extend, poll_s=0.05)
    records += sut.take_records()
    assert sut.submitted and not sut.outside  # queries name samples of the library, even those larger than it
    assert sorted(r["query_id"] for r in records) == sorted(q.query_id for q in sut.submitted)
    assert driver.stats.arrival["m"].startswith(
        {"open-loop": "poisson", "closed-loop": "closed-loop"}.get(scenario, "loadgen")
    )
    if scenario in LOADGEN_SCENARIOS:
        assert driver.stats.loadgen["loadgen_result"] in ("VALID", "INVALID")
        assert driver.stats.issued["m"] == len(sut.submitted)


@pytest.mark.parametrize("scenario", ["open-loop", "closed-loop", "server", "offline"])
def test_in_time_order_every_driver_issues_consecutive_library_samples(sut, tmp_path, scenario):
    if scenario in LOADGEN_SCENARIOS:
        pytest.importorskip("mlperf_loadgen")
    settings = LoadSettings(scenario, duration_s=0.3, seed=1, concurrency=1, sla_ms=1000.0, log_dir=tmp_path)
    stream = Stream("m", 300.0, QuerySizes.parse("uniform:1,60"), order="time")
    assert drive(sut, make_driver(sut, [stream], settings), drain_s=30, take=lambda _rows: None, poll_s=0.05)
    queries = sorted(sut.submitted, key=lambda q: q.query_id)
    assert len(queries) > 20 and queries[0].offset == 0 and not sut.outside
    for before, q in zip(queries, queries[1:], strict=False):  # each starts where the last ended, or wraps to 0
        assert q.offset == (before.offset + before.size if before.offset + before.size + q.size <= LIBRARY else 0)


def test_a_closed_loop_that_thinks_issues_each_query_after_the_last_finished(sut):
    """`think_ms`: one query at a time, each issued that long after the last finished (the server idles between)."""
    settings = LoadSettings("closed-loop", duration_s=0.4, seed=1, concurrency=1, think_ms=20.0)
    driver = make_driver(sut, [Stream("m", 1.0, QuerySizes.parse("fixed:2"))], settings)
    assert drive(sut, driver, drain_s=30, take=lambda _rows: None, poll_s=0.05)
    issued = sorted(q.issued_ns for q in sut.submitted)
    assert 3 <= len(issued) <= 0.4 / 0.02 + 1
    assert min(b - a for a, b in zip(issued, issued[1:], strict=False)) >= 20e6  # never sooner than the think time
    # stopped while a query's next is thinking: it is not issued when its think ends
    stopped = make_driver(sut, [Stream("m", 1.0, QuerySizes.parse("fixed:2"))],
                          LoadSettings("closed-loop", duration_s=5.0, concurrency=1, think_ms=100.0))  # fmt: skip
    before = len(sut.submitted)
    stopped.start()
    deadline = time.monotonic() + 5
    while sut._outstanding:  # the first query answered: its next thinks for 100 ms
        assert time.monotonic() < deadline
        time.sleep(0.005)
    stopped.stop()
    time.sleep(0.2)
    assert len(sut.submitted) == before + 1


def test_completions_finished_together_are_reported_once_per_reporter():
    calls: list[str] = []
    report_after("a", lambda: calls.append("a"))  # outside a batch: at once
    assert calls == ["a"]
    with finishing_together():
        for _ in range(3):
            report_after("a", lambda: calls.append("a"))
            with finishing_together():  # nested: the outermost reports
                report_after("b", lambda: calls.append("b"))
        assert calls == ["a"]
    assert calls == ["a", "a", "b"]

    def broken() -> None:
        raise RuntimeError("LoadGen said no")

    errors: list[Exception] = []  # a report that raises goes to on_error; the others are still made
    with finishing_together(errors.append):
        report_after("x", broken)
        report_after("y", lambda: calls.append("y"))
    assert [str(e) for e in errors] == ["LoadGen said no"] and calls[-1] == "y"
    with pytest.raises(RuntimeError, match="LoadGen said no"), finishing_together():  # without: raised after all
        report_after("x", broken)
        report_after("z", lambda: calls.append("z"))
    assert calls[-1] == "z"
    seen = []  # another thread finishing queries meanwhile reports its own at once
    with finishing_together():
        t = threading.Thread(target=report_after, args=("c", lambda: seen.append("c")))
        t.start()
        t.join()
        assert seen == ["c"]


def test_time_goes_on_from_one_load_to_the_next_and_wraps_at_the_librarys_end():
    lib = small_library(10)
    assert lib.in_time_order(np.array([3, 3])).tolist() == [0, 3]
    assert lib.in_time_order(np.array([3, 2, 1])).tolist() == [6, 0, 2]  # 6 + 2 > 10: the stream starts again


def test_a_sample_order_is_one_of_the_known():
    with pytest.raises(UserError, match="^order 'shuffled': allowed: random, time"):
        Stream("m", 1.0, QuerySizes.parse("fixed:1"), order="shuffled")


def test_a_failing_system_stops_the_load_and_hands_over_its_records(tmp_path):
    failing = FakeSut(small_library(), fail="instance 0 exited with code -9")
    try:
        stream = Stream("m", 20.0, QuerySizes.parse("fixed:1"))
        driver = make_driver(failing, [stream], LoadSettings("open-loop", duration_s=60.0))
        taken: list[dict[str, Any]] = []
        with pytest.raises(RuntimeError, match="exited with code -9"):
            drive(failing, driver, drain_s=5, take=taken.extend, poll_s=0.05)
        assert driver.join(timeout=5)  # a minute of arrivals, ended by the failure
        assert len(driver.stats.lag_ms["m"]) < driver.planned
    finally:
        failing.close()


def test_the_caller_can_end_the_load_early_and_the_queries_in_flight_still_finish(sut):
    driver = make_driver(sut, [Stream("m", 20.0, QuerySizes.parse("fixed:1"))], LoadSettings(duration_s=60.0))
    records: list[dict[str, Any]] = []
    assert drive(sut, driver, drain_s=30, take=records.extend, poll=lambda: True, poll_s=0.05)
    records += sut.take_records()
    assert driver.join(timeout=5) and driver.planned > len(sut.submitted) == len(records)


def test_unknown_scenarios_and_loadgen_with_several_models_are_refused(sut, tmp_path):
    stream = Stream("m", 10.0, QuerySizes.parse("fixed:1"))
    with pytest.raises(UserError, match="allowed: " + ", ".join(SCENARIOS)):
        make_driver(sut, [stream], LoadSettings("bogus"))
    pytest.importorskip("mlperf_loadgen")
    with pytest.raises(UserError, match="LoadGen drives one model"):
        make_driver(sut, [stream, stream], LoadSettings("server", log_dir=tmp_path))


# ---------------------------------------------------------------------------- LoadGen's QSL


def test_the_query_sample_library_counts_loads_and_unloads_library_samples():
    library = small_library()
    qsl = QuerySampleLibrary(library, QuerySizes.parse("uniform:1,600"), np.random.default_rng(0))
    assert qsl.total_sample_count == qsl.performance_sample_count == library.size  # from the library
    queries = [qsl.query(k) for k in range(qsl.total_sample_count)]
    assert all(1 <= size and 0 <= offset and offset + size <= LIBRARY for size, offset in queries)
    (s0, o0), (s1, o1) = queries[3], queries[7]
    qsl.load_samples([3, 7])
    assert library.loaded == len(set(range(o0, o0 + s0)) | set(range(o1, o1 + s1)))
    qsl.unload_samples([7])
    assert library.loaded == s0
    qsl.unload_samples([3])
    assert library.loaded == 0
    with pytest.raises(ValueError, match="not loaded"):
        qsl.unload_samples([3])
    with pytest.raises(ValueError, match=r"\[500, 600\) is not a non-empty range of \[0, 512\)"):
        library.load([(500, 600)])


def _stand_in_loadgen(start_test, complete) -> types.SimpleNamespace:
    """What the driver uses of mlperf_loadgen, with `start_test` as the test and `complete` taking completions."""
    return types.SimpleNamespace(
        TestSettings=types.SimpleNamespace, TestMode=types.SimpleNamespace(PerformanceOnly=0),
        TestScenario=types.SimpleNamespace(Server="Server", Offline="Offline"),
        LogSettings=lambda: types.SimpleNamespace(log_output=types.SimpleNamespace()),
        ConstructFastSUT=lambda issue, flush: types.SimpleNamespace(issue=issue),
        ConstructQSL=lambda total, performance, load, unload: types.SimpleNamespace(
            total=total, performance=performance, load=load, unload=unload),
        StartTestWithLogSettings=start_test, DestroyQSL=lambda q: None, DestroyFastSUT=lambda s: None,
        QuerySampleResponse=lambda sample_id, data, size: sample_id, QuerySamplesComplete=complete,
    )  # fmt: skip


def _driven(recording: FakeSut, stream: Stream, scenario: str, tmp_path) -> FakeSut:
    """`recording` after a 0.1 s LoadGen `scenario` of `stream` drove it (its driver kept as `.driver`), closed."""
    try:
        recording.driver = make_driver(recording, [stream], LoadSettings(scenario, duration_s=0.1, log_dir=tmp_path))
        recording.driver.own_process = False  # the stand-in LoadGen lives in this process only
        assert drive(recording, recording.driver, drain_s=10, poll_s=0.05)
    finally:
        recording.close()
    return recording


def test_loadgen_issues_only_samples_its_qsl_loaded_and_unloads_them(tmp_path, monkeypatch):
    """With a stand-in for mlperf_loadgen that does what LoadGen does with a QSL: load the
    performance samples, issue queries of them, unload them."""
    issued: list[Any] = []

    def start_test(sut, qsl, settings, log):
        qsl.load(list(range(qsl.performance)))
        indices = list(range(0, qsl.performance, 7))
        sut.issue([1000 + k for k in indices], indices)  # FastSUT's two lists: LoadGen's ids, its sample indices
        while len(issued) < len(indices):  # completions arrive from the system's thread
            time.sleep(0.01)
        qsl.unload(list(range(qsl.performance)))

    monkeypatch.setitem(sys.modules, "mlperf_loadgen", _stand_in_loadgen(start_test, issued.extend))
    library = RecordingLibrary()
    recording = _driven(FakeSut(library), Stream("m", 50.0, QuerySizes.parse("uniform:1,64")), "server", tmp_path)
    assert library.load_calls == library.unload_calls == 1 and library.loaded == 0 and not library.held
    assert recording.submitted and not recording.not_loaded  # every query's samples were loaded when issued
    assert sorted(issued) == [1000 + k for k in range(0, LIBRARY, 7)]  # each LoadGen sample completed once


class DroppingSut(FakeSut):
    """Answers every `drop_every`-th query `dropped`, as a full queue does."""

    drop_every = 0

    def submit(self, q: Query) -> None:
        if self.drop_every and q.query_id % self.drop_every == 0:
            with self._idle:
                self.submitted.append(q)
            q.on_done(q, "dropped", None)
            return
        super().submit(q)


@pytest.mark.parametrize(("drop_every", "own_process"), [(0, False), (5, False), (0, True), (5, True)])
def test_loadgens_fast_sut_coalesces_server_queries_and_its_verdict_counts_what_was_dropped(
    tmp_path, drop_every, own_process
):
    """Real LoadGen, through its FastSUT (ids and indices as two lists, queries that fell due together coalesced),
    in this process or in its own (the Server scenario's default): a system that answers at once is VALID at 500
    queries/s; one that drops a fifth of them is INVALID, saying so."""
    lg = pytest.importorskip("mlperf_loadgen")
    constructed = []
    fast = lg.ConstructFastSUT
    with pytest.MonkeyPatch.context() as m:
        m.setattr(lg, "ConstructFastSUT", lambda issue, flush: constructed.append(1) or fast(issue, flush))
        m.setattr(lg, "ConstructSUT", None)  # the slow path is not taken
        system = DroppingSut(small_library())
        system.drop_every = drop_every
        settings = LoadSettings("server", duration_s=1.0, seed=1, sla_ms=50.0, sla_percentile=99.0, log_dir=tmp_path)
        try:
            driver = make_driver(system, [Stream("m", 500.0, QuerySizes.parse("uniform:1,8"))], settings)
            # the Server scenario's LoadGen runs beside the serving process where two cores are free of instances
            assert driver.own_process == (len(os.sched_getaffinity(0)) >= 2)  # (this system has none)
            driver.own_process = own_process
            assert driver.test_settings().server_coalesce_queries
            assert drive(system, driver, drain_s=30, poll_s=0.05)
        finally:
            system.close()
    stats = driver.stats
    assert stats.issued["m"] == len(system.submitted) >= 459
    if own_process:  # LoadGen ran elsewhere, and each query's latency counts from when LoadGen issued it there
        assert driver.loadgen_pid not in (None, os.getpid()) and constructed == []
        assert all(0 < q.scheduled_ns <= q.issued_ns for q in system.submitted if q.issued_ns)
    else:
        assert constructed == [1] and driver.loadgen_pid is None
    if drop_every:
        assert stats.loadgen["loadgen_result"] == "INVALID"
        assert stats.loadgen["loadgen_reason"].startswith(f"the server dropped or failed {driver.dropped}")
        assert driver.dropped == sum(q.query_id % drop_every == 0 for q in system.submitted)
    else:
        assert stats.loadgen["loadgen_result"] == "VALID", stats.loadgen


def test_loadgens_own_process_killed_mid_test_is_one_error_naming_it(tmp_path):
    """LoadGen in its own process, killed during its test: the run fails with one line naming that process, and no
    process is left behind."""
    pytest.importorskip("mlperf_loadgen")
    from dlrm_lab.errors import ServingFault

    system = DroppingSut(small_library())
    settings = LoadSettings("server", duration_s=30.0, seed=1, sla_ms=50.0, sla_percentile=99.0, log_dir=tmp_path)
    driver = make_driver(system, [Stream("m", 200.0, QuerySizes.parse("fixed:1"))], settings)
    driver.own_process = True

    def kill_once_issuing() -> bool:
        if driver.loadgen_pid and system.submitted:
            os.kill(driver.loadgen_pid, signal.SIGKILL)
        return False

    try:
        with pytest.raises(ServingFault, match=r"MLPerf LoadGen's process \(pid \d+\) ended before its test did"):
            drive(system, driver, drain_s=10, poll=kill_once_issuing, poll_s=0.05)
    finally:
        system.close()
    assert driver.loadgen_pid and not Path(f"/proc/{driver.loadgen_pid}").exists()


def test_an_offline_run_that_ends_before_its_duration_says_which_qps_to_give(tmp_path, monkeypatch):
    """LoadGen's Offline issues qps x duration x 1.1 queries at once; a server faster than that qps finishes them
    early and LoadGen says only "min duration not met". The reason names the rate to give instead."""
    summary = "Result is : INVALID\n  Min duration satisfied : NO\n  Min queries satisfied : Yes\n"
    summary += "Samples per second: 40.0\n"

    def start_test(sut, qsl, settings, log):
        Path(log.log_output.outdir, "mlperf_log_summary.txt").write_text(summary)

    monkeypatch.setitem(sys.modules, "mlperf_loadgen", _stand_in_loadgen(start_test, lambda responses: None))
    stream = Stream("m", 20.0, QuerySizes.parse("fixed:2"))
    recording = _driven(FakeSut(RecordingLibrary()), stream, "offline", tmp_path)
    assert recording.driver.stats.loadgen["loadgen_reason"] == (
        "min duration not met (Offline issued its queries for 20 queries/s and they completed at 40.0: give --qps 48 "
        "or more)"
    )


# ---------------------------------------------------------------------------- measure


@pytest.mark.parametrize("scenario", ["offline", "server"])
def test_an_offline_point_gets_a_queue_that_holds_all_its_queries_then_the_bound_is_restored(scenario):
    from dlrm_lab.infer.lab import queue_room
    from dlrm_lab.infer.load_point import Point

    models = {"m": types.SimpleNamespace(max_queue=16)}  # a server that says its bound (`describe`) and sets it
    server = types.SimpleNamespace(
        describe=lambda: types.SimpleNamespace(models=models),
        configure=lambda m, max_queue: setattr(models[m], "max_queue", max_queue),
    )
    point = Point(0, [Stream("m", 200.0, QuerySizes.parse("fixed:1"))], scenario=scenario)
    with queue_room(server, point, duration_s=2.0):
        held = models["m"].max_queue
    assert held >= 400 if scenario == "offline" else held == 16  # LoadGen's offline issues all 400 at once
    assert models["m"].max_queue == 16
    silent = FakeSut(small_library())  # says no bound (a remote server's queue is its own): nothing is set
    silent.describe = lambda: types.SimpleNamespace(models={"m": types.SimpleNamespace(max_queue=None)})
    try:
        with queue_room(silent, point, duration_s=2.0):
            pass
    finally:
        silent.close()


def test_a_point_is_measured_through_the_interface_alone(tmp_path):
    """`measure` needs no server: any system that describes its served models will do. Its
    untimed warm-up (here a quarter of the point) reaches the system but not the records."""
    import pyarrow.parquet as pq

    from dlrm_lab.config import load_preset
    from dlrm_lab.infer.lab import InferConfig
    from dlrm_lab.infer.load_point import Point, measure
    from dlrm_lab.infer.served import ServedModel
    from dlrm_lab.metrics.columns import schema_of
    from dlrm_lab.metrics.run import Run

    fake = FakeSut(small_library(), served=ServedModel("m", load_preset("tiny")))
    rows = []
    try:
        with Run.create(tmp_path, "infer", {}) as run:
            queries = run.table("queries", schema_of("queries"))
            for k, warmup_s in enumerate((0.0, 1.0)):
                before = len(fake.submitted)
                cfg = InferConfig(duration_s=0.4, sla_ms=1000.0, warmup_s=warmup_s)
                (row,) = measure(fake, Point(k, [Stream("m", 100.0, QuerySizes.parse("fixed:2"))]), cfg,
                                 queries, run.dir)  # fmt: skip
                rows.append((row, len(fake.submitted) - before))
            run_dir = run.dir
    finally:
        fake.close()
    (cold, cold_submitted), (warm, warm_submitted) = rows
    assert cold["model"] == "m" and cold["preset"] == "tiny" and cold["arrival"] == "poisson"
    assert cold["completed_queries"] == cold_submitted > 0 and cold["sla_met"] and cold["warmup_s"] == 0
    assert cold["snapshot_mb"] == 0  # this system keeps no snapshot
    assert warm["warmup_s"] == 0.1  # capped at a quarter of the 0.4 s point
    assert 0 < warm["completed_queries"] < warm_submitted  # the warm-up's queries were served, not counted
    recorded = pq.read_table(run_dir / "queries.parquet").to_pylist()
    assert len(recorded) == cold["completed_queries"] + warm["completed_queries"]


def test_a_points_cost_is_its_rate_at_the_machines_price_and_a_remote_hosts_price_is_given(tmp_path, monkeypatch):
    """Cost per 1M samples = price per hour / 3600 / samples/s x 1e6 at the point's measured rate; the price stored
    with this machine's profile prices a server on this machine only (a remote host's must be given)."""
    import dataclasses
    import json

    from conftest import store_profile

    from dlrm_lab.config import load_preset
    from dlrm_lab.infer.lab import InferConfig
    from dlrm_lab.infer.load_point import Point, measure, point_price
    from dlrm_lab.infer.served import ServedModel
    from dlrm_lab.metrics.columns import schema_of
    from dlrm_lab.metrics.run import Run

    monkeypatch.setenv("DLRM_LAB_MACHINE_DIR", str(tmp_path / "machines"))
    profile = store_profile(tmp_path / "machines")
    fake = FakeSut(small_library(), served=ServedModel("m", load_preset("tiny")))
    try:
        with Run.create(tmp_path / "runs", "infer", {}) as run:
            cfg = InferConfig(duration_s=0.4, sla_ms=1000.0, warmup_s=0.0, price_per_hour=3.6, currency="EUR")
            (row,) = measure(fake, Point(0, [Stream("m", 100.0, QuerySizes.parse("fixed:2"))]), cfg,
                             run.table("queries", schema_of("queries")), run.dir)  # fmt: skip
    finally:
        fake.close()
    assert row["price_per_hour"] == 3.6 and row["currency"] == "EUR" and row["cost_rate"] == "measured"
    assert row["cost_per_1m_samples"] == pytest.approx(3.6 / 3600 / row["samples_per_s"] * 1e6)
    assert row["cost_per_1m_queries"] == pytest.approx(3.6 / 3600 / row["queries_per_s"] * 1e6)
    assert row["energy_cost_per_1m_samples"] is None  # no energy measured here: never 0
    stored = {**profile, "price": {"per_hour": 1.0, "currency": "USD", "source": "given with dlrm-lab machine price"}}
    (tmp_path / "machines" / f"{profile['fingerprint_id']}.json").write_text(json.dumps(stored))
    desc = ServedModel("m", load_preset("tiny")).description()
    here, there = SutDescription(models={"m": desc}), SutDescription(
        models={"m": dataclasses.replace(desc, on_this_host=False)})  # fmt: skip
    from dlrm_lab.metrics.roofline import load_profile

    assert point_price(load_profile(), InferConfig(), here).per_hour == 1.0
    assert point_price(load_profile(), InferConfig(), there) is None
    assert point_price(load_profile(), InferConfig(price_per_hour=2.0), there).per_hour == 2.0


class ServiceSut(FakeSut):
    """A fake whose one worker takes a fixed service time per query, set by the max batch
    it is configured with: a system of known capacity (1 / service) for the search."""

    def __init__(self, library: PackedLibrary, served: Any, service_ms: dict[int, tuple[float, float]]) -> None:
        self.service_ms = service_ms  # max batch -> (ms the worker is busy, ms more until the answer)
        super().__init__(library, served)

    def configure(self, model: str, *, max_batch: int | None = None, max_delay_ms: float | None = None) -> None:
        if max_batch is not None:
            self.served.max_batch = max_batch
        if max_delay_ms is not None:
            self.served.max_delay_ms = max_delay_ms

    def service(self) -> int:
        busy, later = self.service_ms[self.served.max_batch]
        time.sleep(busy / 1e3)
        return int(later * 1e6)

    def __enter__(self) -> ServiceSut:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _search(tmp_path, service_ms: dict[int, tuple[float, float]], options, sla_ms: float = 30.0,
            scenario: str = "open-loop"):  # fmt: skip
    import pyarrow.parquet as pq

    from dlrm_lab.config import load_preset
    from dlrm_lab.infer.lab import InferConfig
    from dlrm_lab.infer.search import SearchGrid, search
    from dlrm_lab.infer.served import ServedModel

    base = ServedModel("m", load_preset("tiny"), precision="fp32")
    grid = SearchGrid([(1, 1)], sorted(service_ms), [0.0])
    cfg = InferConfig(scenario=scenario, duration_s=0.3, sla_ms=sla_ms, drain_timeout_s=10.0)
    run_dir = search(base, Stream("m", 1.0, QuerySizes.parse("fixed:1")), grid, cfg, options, metrics_dir=tmp_path,
                     serve=lambda m: ServiceSut(small_library(), m, service_ms))  # fmt: skip
    frontier = pq.read_table(run_dir / "frontier.parquet").to_pylist()
    summary = pq.read_table(run_dir / "summary.parquet").to_pylist()
    return frontier, summary


def test_the_search_spends_almost_nothing_on_configurations_that_cannot_win(tmp_path):
    """Three configurations of known behaviour (busy 4 ms: ~250 queries/s; busy 6 ms but every
    answer 31 ms late: ~170 queries/s; busy 32 ms: ~30 queries/s), bound 30 ms: the most capable is
    bisected first; the late one fails its one probe at the best rate / (1 + margin); the slow
    one's capacity cannot reach the best rate, so it gets no probe at all. (Service times 1.5x apart
    and of several ms: a busy host's sleep overshoot cannot reorder them, as it did 2 ms against 2.5.)"""
    from dlrm_lab.infer.search import SearchOptions

    options = SearchOptions(repeats=1, steps=3, capacity_s=0.5, min_queries=30, max_duration_s=0.5, prune_margin=1.0,
                            certify_s=0)  # fmt: skip
    frontier, summary = _search(tmp_path, {64: (4.0, 0.0), 32: (6.0, 31.0), 8: (32.0, 0.0)}, options)
    fast, late, slow = (next(r for r in frontier if r["max_batch"] == b) for b in (64, 32, 8))
    assert 100 < fast["capacity_queries_per_s"] < 300 and slow["capacity_queries_per_s"] < 40
    assert late["capacity_queries_per_s"] < fast["capacity_queries_per_s"]  # searched after the fast one
    assert fast["best"] and fast["outcome"] == "best" and fast["best_qps"] > 1.5 * slow["capacity_queries_per_s"]
    assert late["outcome"].startswith("lower: the bound missed") and late["probes"] == 1 and late["best_qps"] == 0
    assert slow["outcome"].startswith("pruned") and slow["probe_points"] == 0 and slow["best_qps"] is None
    assert {r["max_batch"] for r in summary} == {64, 32}  # no load point was spent on the pruned one
    assert fast["min_piece"] == 0  # this system measures no batch cost: as given
    assert fast["certified_qps"] is None  # --certify-duration 0


def test_the_best_rate_is_certified_by_loadgen_backing_off_then_bisecting_to_within_5_percent(tmp_path, monkeypatch):
    """The claimed rate is first held by the lab's own open loop for as long as LoadGen will run (backed off where
    it does not hold), then run under LoadGen's Server scenario from the rate held; where that does not hold, 0.85x
    the rate before until one holds, then the bracket is bisected until within 5%: the answer is within 5% of
    the rate LoadGen holds; a rate that never held is not the answer."""
    from dlrm_lab.infer import certify as certify_module
    from dlrm_lab.infer.certify import CERTIFY_BACKOFF
    from dlrm_lab.infer.search import SearchOptions

    runs, opened = [], []  # LoadGen's runs, the open loop's
    far: dict = {}  # where set, a failed run's p99s lie this far beyond the bound; or LoadGen asks for more queries

    def fake_measure(server, point, cfg, *a, **k):  # LoadGen holds up to 80 queries/s, the open loop up to 100
        (stream,) = point.streams
        if point.scenario == "open-loop":
            opened.append((point.duration_s, stream.qps))
            ok = stream.qps <= far.get("open", 100.0)
            return [{"target_qps": stream.qps, "samples_per_s": stream.qps, "load_stopped_early": False,
                     "issue_stopped": False, "sla_met": ok, "sla_latency_ms": 5.0 if ok else 20.0}]  # fmt: skip
        runs.append((point.scenario, point.duration_s, stream.qps))
        if far.get("more") and len(runs) <= far["more"]:  # the p99 within the bound, LoadGen's estimate unsure
            need = far.get("need", 500 // len(runs))
            unsure = f"early stopping not met (processed 100 queries, would need at least {need} more)"
            return [{"target_qps": stream.qps, "samples_per_s": stream.qps, "loadgen_result": "INVALID",
                     "loadgen_reason": unsure, "sla_met": True, "sla_latency_ms": 9,
                     "loadgen_p99_ms": 9.5}]  # fmt: skip
        if far.get("p99") and stream.qps > 80.0:
            return [{"target_qps": stream.qps, "samples_per_s": stream.qps, "loadgen_result": "INVALID",
                     "loadgen_reason": "performance constraints not met", "sla_met": False, "sla_latency_ms": 30.0,
                     "loadgen_p99_ms": far["p99"]}]  # fmt: skip
        ok = stream.qps <= 80.0
        return [{"target_qps": stream.qps, "samples_per_s": stream.qps, "loadgen_result": "VALID" if ok else "INVALID",
                 "loadgen_reason": None if ok else "early stopping not met", "sla_met": ok,
                 "sla_latency_ms": 5.0 if ok else 10.5, "loadgen_p99_ms": 6.0 if ok else 11.0}]  # fmt: skip

    monkeypatch.setattr(certify_module, "measure", fake_measure)

    class Table:
        def extend(self, rows):
            pass

        def flush(self):
            pass

    def certify(best_qps, tries, log=None):
        winner = {"instances": 1, "threads_per_instance": 1, "precision": "fp32", "max_batch": 8, "max_delay_ms": 0.0,
                  "best_qps": best_qps, "outcome": "best"}  # fmt: skip
        runs.clear()
        opened.clear()
        options = SearchOptions(certify_s=30.0, certify_tries=tries)
        certify_module.certify(winner, base, stream, cfg, options,
                               lambda m: ServiceSut(small_library(), m, {8: (0, 0)}),
                               None, Table(), None, tmp_path, 0, log, None)  # fmt: skip
        return winner

    from dlrm_lab.config import load_preset
    from dlrm_lab.infer.lab import InferConfig
    from dlrm_lab.infer.served import ServedModel

    base = ServedModel("m", load_preset("tiny"), precision="fp32")
    stream = Stream("m", 1.0, QuerySizes.parse("fixed:1"))
    cfg = InferConfig(scenario="open-loop", duration_s=0.5, sla_ms=10.0)
    held = certify(75.0, 8)
    assert runs == [("server", 30.0, 75.0)] and held["certified_qps"] == 75.0 and held["outcome"] == "best"
    assert opened == [(30.0, 75.0)] and held["held_qps"] == 75.0 and held["held_sla_latency_ms"] == 5.0
    unheld = certify(120.0, 8)  # the open loop holds 100 at most: 120 backs off (its p99 twice the bound: half)
    assert opened == [(30.0, 120.0), (30.0, 60.0)] and unheld["held_qps"] == 60.0 and runs[0][2] == 60.0
    lines: list[str] = []
    backed = certify(95.0, 8, lines.append)  # 95 and 80.75 fail, 68.6 holds; then bisected: 74.5, 77.5 hold
    low = 95.0 * CERTIFY_BACKOFF**2
    assert [q for _, _, q in runs] == pytest.approx([95.0, 95.0 * CERTIFY_BACKOFF, low, (low * 80.75) ** 0.5,
                                                     ((low * 80.75) ** 0.5 * 80.75) ** 0.5])  # fmt: skip
    assert 80.0 / 1.05 <= backed["certified_qps"] <= 80.0 and "claimed 95.0" in backed["outcome"]
    assert "(the lab's open loop, as long as LoadGen's run): p99 5.00 ms: holds" in lines[0]
    # LoadGen's own reason, and both clocks' percentiles: LoadGen's verdict is on its own
    assert "INVALID (early stopping not met), LoadGen's p99 11.00 ms, the lab's p99 10.50 ms: does not hold" in lines[1]
    assert lines[-1].startswith(
        "LoadGen certified 77.5 queries/s, 18% below the rate the lab's open loop held as long 95.0: at 80.8"
    )
    assert "LoadGen's p99 11.00 ms against the lab's 10.50 ms for the same queries: both clocks agree" in lines[-1]
    far.update(p99=40.0, open=1000.0)  # four times the bound: the next rate is half, not 0.85x
    certify(300.0, 8)
    assert [q for _, _, q in runs][:3] == pytest.approx([300.0, 150.0, 75.0])
    far.clear()
    far.update(more=1)  # the same rate again, for the queries LoadGen asked for (500 more at 75 queries/s, +10%)
    again = certify(75.0, 8)
    assert [(q, s) for _, s, q in runs] == [(75.0, 30.0), (75.0, 30.0 + 8)] and again["certified_qps"] == 75.0
    far.update(more=2)  # and again while it asks for more (250 at 38 s: 4 s more), within CERTIFY_MAX_S
    again = certify(75.0, 8)
    assert [(q, s) for _, s, q in runs] == [(75.0, 30.0), (75.0, 38.0), (75.0, 42.0)] and again["certified_qps"] == 75.0
    far.update(more=8, need=3000)  # not where the run would last beyond CERTIFY_MAX_S (74 s): a failure, backed off
    certify(75.0, 8)
    assert [(q, s) for _, s, q in runs][:2] == [(75.0, 30.0), (75.0 * CERTIFY_BACKOFF, 30.0)]
    far.clear()
    never = certify(200.0, 2)  # held at 100 by the open loop, not by LoadGen at 100 or 85
    assert never["certified_qps"] == 0 and never["certified_result"] == "INVALID" and never["held_qps"] == 100.0
    far.update(open=10.0)
    nothing = certify(200.0, 2)  # no rate held by the open loop either: LoadGen asked the claim, for its verdict
    assert nothing["held_qps"] == 0 and nothing["held_sla_latency_ms"] is None and runs[0][2] == 200.0
    assert never["outcome"].startswith("best probed, not certified")


def test_a_probe_that_cannot_pass_ends_its_load_early(tmp_path):
    """Every query takes longer than the bound: the first late query is already more than a
    probe of ~60 queries may have at p99, so each probe's load ends at the next poll."""
    from dlrm_lab.infer.search import SearchOptions

    options = SearchOptions(repeats=3, steps=2, capacity_s=0.5, min_queries=60, max_duration_s=4.0, certify_s=0)
    frontier, summary = _search(tmp_path, {8: (40.0, 0.0)}, options, sla_ms=30.0)
    (only,) = frontier
    assert only["outcome"] == "no probed rate met the bound" and only["best_qps"] == 0
    assert summary and all(r["load_stopped_early"] and r["passed"] is False for r in summary)
    assert all(r["duration_s"] < 2.0 for r in summary)  # ended at a poll, not after the planned 2.5-4 s
    # of 3 repeats, one clearly beyond the bound settles the probe (SETTLE_MARGIN)
    assert only["probes"] == 2 and only["probe_points"] == len(summary) == 2


def test_a_loadgen_probe_is_never_cut_short(tmp_path):
    """LoadGen cannot be interrupted: a Server-scenario probe that fails runs to its end
    (cutting it would start the next LoadGen test while this one still runs)."""
    pytest.importorskip("mlperf_loadgen")
    from dlrm_lab.infer.search import SearchOptions

    options = SearchOptions(repeats=1, steps=1, capacity_s=0.3, min_queries=10, max_duration_s=0.6, certify_s=0)
    frontier, summary = _search(tmp_path, {8: (40.0, 0.0)}, options, scenario="server")
    assert frontier[0]["outcome"] == "no probed rate met the bound"
    assert summary and not any(r["load_stopped_early"] for r in summary)


class SlowIssueSut(FakeSut):
    """Each submit holds the issuing thread `submit_ms` (a client slower than its schedule)."""

    submit_ms = 20.0

    def submit(self, q: Query) -> None:
        time.sleep(self.submit_ms / 1e3)
        super().submit(q)


def test_an_issuer_that_falls_behind_its_schedule_stops_the_load_and_keeps_its_queries():
    slow = SlowIssueSut(small_library())
    try:
        stream = Stream("m", 1000.0, QuerySizes.parse("fixed:1"))  # 1 ms apart, each taking 20 ms to issue
        driver = make_driver(slow, [stream], LoadSettings("open-loop", duration_s=30.0, max_issue_lag_ms=100.0))
        records: list[dict[str, Any]] = []
        assert drive(slow, driver, drain_s=5, take=records.extend, poll_s=0.05)
        records += slow.take_records()
        stopped = driver.stats.issue_stopped
        assert stopped and stopped.startswith("the load stopped at query ") and "(--max-issue-lag-ms 100)" in stopped
        assert "could not issue 1000 queries/s" in stopped
        assert len(records) == len(slow.submitted) == driver.stats.issued["m"] < driver.planned / 100
        assert max(driver.stats.lag_ms["m"]) <= 100.0 + 2 * SlowIssueSut.submit_ms  # none issued past the bound
        assert driver.stats.accuracy("m")["issue_stopped"] == stopped
        # without a bound the same issuer keeps going (ended here by the caller)
        unbounded = make_driver(slow, [stream], LoadSettings("open-loop", duration_s=30.0, max_issue_lag_ms=None))
        polls = iter(range(6))
        drive(slow, unbounded, drain_s=5, poll=lambda: next(polls) == 5, poll_s=0.05)
        assert unbounded.stats.issue_stopped is None and max(unbounded.stats.lag_ms["m"]) > 100.0
    finally:
        slow.close()


class KnownTimesSut(FakeSut):
    """A fake whose every query waits 1 ms for its batch, which takes 3 ms on its instance against a
    warm 2 ms, and whose scores reach the server 0.5 ms after the batch ends (stamps, not waits)."""

    def _serve(self) -> None:
        while (q := self._queue.get()) is not None:
            e = self.epoch_ns
            issued = (q.issued_ns - e) / 1e6
            start = issued + 1.0
            end = start + 3.0 + 0.5
            self._records.append({
                "query_id": q.query_id, "model": q.model, "samples": q.size, "status": "ok",
                "scheduled_ms": (q.scheduled_ns - e) / 1e6, "issued_ms": issued, "start_ms": start, "end_ms": end,
                "latency_ms": end - (q.scheduled_ns - e) / 1e6, "queue_ms": 1.0, "compute_ms": 3.0, "pieces": 1,
                "batch_id": q.query_id, "batch_samples": q.size, "batch_queries": 1, "instance": 0, "error": None,
                "batch_start_ms": start, "batch_compute_ms": 3.0, "batch_expected_ms": 2.0,
                "batch_completion_ms": 0.5,
            })  # fmt: skip
            if q.on_done is not None:
                q.on_done(q, "ok", self.lib.dense[q.offset : q.offset + q.size, 0].copy())
            with self._idle:
                self._outstanding -= 1
                self._idle.notify_all()


@pytest.mark.parametrize("flush_seconds", [None, "0.1"])
def test_a_points_rows_are_written_once_its_load_ended_and_none_while_it_runs(tmp_path, monkeypatch, flush_seconds):
    """While the load runs the records are only kept (the serving process's threads would wait for their parts and
    the table's writes, measured as tail latency); every row is written after the last query was issued, with its
    point and late flag, and the load's polls still see every record (a probe's early verdict). Told
    DLRM_LAB_FLUSH_SECONDS (what a SIGKILL may lose, bounded first), rows are written as the load runs."""
    from dlrm_lab.metrics.tables import FLUSH_SECONDS_ENV

    if flush_seconds is None:
        monkeypatch.delenv(FLUSH_SECONDS_ENV, raising=False)
    else:
        monkeypatch.setenv(FLUSH_SECONDS_ENV, flush_seconds)
    import pyarrow.parquet as pq

    from dlrm_lab.config import load_preset
    from dlrm_lab.infer.lab import InferConfig
    from dlrm_lab.infer.load_point import Point, measure
    from dlrm_lab.infer.served import ServedModel
    from dlrm_lab.metrics.columns import schema_of
    from dlrm_lab.metrics.run import Run

    fake = FakeSut(small_library(), served=ServedModel("m", load_preset("tiny")))
    submitted_at_write, seen_by_polls = [], []

    def decided(records):
        seen_by_polls.append(len(records))
        return False

    try:
        with Run.create(tmp_path, "infer", {}) as run:
            queries = run.table("queries", schema_of("queries"))
            extend = queries.extend

            def counted(rows):
                submitted_at_write.append(len(fake.submitted))
                extend(rows)

            queries.extend = counted
            cfg = InferConfig(duration_s=0.8, sla_ms=1000.0, warmup_s=0.0)
            (row,) = measure(fake, Point(3, [Stream("m", 200.0, QuerySizes.parse("fixed:2"))]), cfg, queries,
                             run.dir, decided=decided)  # fmt: skip
            run_dir = run.dir
    finally:
        fake.close()
    assert len(seen_by_polls) >= 2 and max(seen_by_polls) > 0  # the polls saw records while the load ran
    if flush_seconds is None:
        assert submitted_at_write and set(submitted_at_write) == {len(fake.submitted)}  # all after the last issue
    else:
        assert min(submitted_at_write) < len(fake.submitted)  # some while queries were still issued
    recorded = pq.read_table(run_dir / "queries.parquet").to_pylist()
    assert len(recorded) == row["completed_queries"] > 0
    assert all(r["point"] == 3 and r["late"] is False for r in recorded)  # parts: the known-times test below


def test_a_querys_latency_parts_sum_to_it_on_a_system_of_known_times(tmp_path, monkeypatch):
    import pyarrow.parquet as pq
    from conftest import store_profile

    from dlrm_lab.config import load_preset
    from dlrm_lab.infer.lab import InferConfig
    from dlrm_lab.infer.load_point import Point, measure
    from dlrm_lab.infer.records import batch_roof
    from dlrm_lab.infer.served import ServedModel
    from dlrm_lab.metrics.columns import LATENCY_PARTS, schema_of
    from dlrm_lab.metrics.roofline import load_profile, peaks_for
    from dlrm_lab.metrics.run import Run

    monkeypatch.setenv("DLRM_LAB_MACHINE_DIR", str(tmp_path / "machines"))
    store_profile(tmp_path / "machines", gflops=1e-3)  # 1 MFLOP/s: the roof of 4 tiny samples is ~5.6 ms
    served = ServedModel("m", load_preset("tiny"), precision="fp32", build="eager")
    roof = batch_roof(served.spec, "fp32", peaks_for(load_profile(), "cpu", "fp32", 1))(4)
    assert 2.0 < roof  # above the warm time: the warm batch is all roof, beyond_roof 0
    fake = KnownTimesSut(small_library(), served=served)
    try:
        with Run.create(tmp_path, "infer", {}) as run:
            cfg = InferConfig(duration_s=0.3, sla_ms=1000.0, warmup_s=0.0)
            (row,) = measure(fake, Point(0, [Stream("m", 200.0, QuerySizes.parse("fixed:4"))]), cfg,
                             run.table("queries", schema_of("queries")), run.dir)  # fmt: skip
            run_dir = run.dir
    finally:
        fake.close()
    rows = pq.read_table(run_dir / "queries.parquet").to_pylist()
    assert rows
    for r in rows:
        assert r["lat_queue_ms"] == pytest.approx(1.0) and r["lat_completion_ms"] == pytest.approx(0.5)
        assert r["lat_roof_ms"] == pytest.approx(min(roof, 3.0))
        assert r["lat_beyond_roof_ms"] == pytest.approx(0.0)  # the roof is above the warm time
        assert r["lat_slowdown_ms"] == pytest.approx(3.0 - min(roof, 3.0))
        assert r["lat_issue_ms"] == pytest.approx(r["issued_ms"] - r["scheduled_ms"])
        assert r["lat_transport_ms"] is None  # in process: no network
        parts = sum(r[f"lat_{p}_ms"] or 0.0 for p in LATENCY_PARTS)
        assert parts == pytest.approx(r["latency_ms"], abs=1e-9)
    tail = [r for r in rows if r["latency_ms"] >= row["latency_p99_ms"]]
    assert sum(row[f"tail_{p}_ms"] or 0.0 for p in LATENCY_PARTS) == pytest.approx(
        np.mean([r["latency_ms"] for r in tail])
    )
    assert row["batch_completion_mean_ms"] == pytest.approx(0.5)


def test_latency_parts_split_a_batch_at_its_roof_and_its_warm_time():
    from dlrm_lab.infer.records import latency_parts

    record = {"status": "ok", "scheduled_ms": 0.0, "issued_ms": 0.5, "batch_start_ms": 2.0, "batch_compute_ms": 5.0,
              "batch_expected_ms": 3.0, "end_ms": 7.25, "latency_ms": 7.25}  # fmt: skip
    parts = latency_parts(record, roof_ms=1.0)
    assert parts == {"lat_issue_ms": 0.5, "lat_queue_ms": 1.5, "lat_roof_ms": 1.0, "lat_beyond_roof_ms": 2.0,
                     "lat_slowdown_ms": 2.0, "lat_completion_ms": 0.25, "lat_transport_ms": None}  # fmt: skip
    faster = latency_parts({**record, "batch_compute_ms": 2.5}, roof_ms=1.0)  # quicker than warm: no slowdown
    assert faster["lat_slowdown_ms"] == 0 and faster["lat_beyond_roof_ms"] == 1.5
    assert latency_parts({**record, "status": "dropped"}, roof_ms=1.0)["lat_queue_ms"] is None
    no_profile = latency_parts(record, roof_ms=None)
    assert no_profile["lat_roof_ms"] == 0 and no_profile["lat_beyond_roof_ms"] == 3.0


def test_scenarios_are_declared_settings_and_their_rules_come_from_the_declaration():
    from dlrm_lab.infer.drivers import REGISTRY, check_scenario, scenario

    assert SCENARIOS == tuple(REGISTRY) and all(DRIVERS[n] is s.driver for n, s in REGISTRY.items())
    assert not scenario("closed-loop").rate and scenario("open-loop").stops_early
    assert scenario("offline").queues_whole_load and scenario("server").sized_by_early_stopping
    with pytest.raises(UserError, match="^scenario offline: LoadGen drives one model; use open-loop for several"):
        check_scenario("offline", 2, False)
    with pytest.raises(UserError, match=r"^qps auto: one model, with open-loop or server load"):
        check_scenario("closed-loop", 1, True)
    assert check_scenario("server", 1, True) is scenario("server")


def test_closed_loop_and_bursty_arrivals_are_reachable_from_a_sweep_point():
    from dlrm_lab.commands import SETUPS

    _, load, cfg = SETUPS["infer run"]({"model": ["tiny"], "scenario": "closed-loop", "qps": ["50"],
                                        "arrival": "bursty:3,0.2,40", "duration": 1.0})  # fmt: skip
    assert cfg.scenario == "closed-loop"
    a = load.streams[0].arrivals
    assert (a.kind, a.burst_factor, a.burst_share, a.burst_length_s) == ("bursty", 3.0, 0.2, 0.04)


class _DyingClient:
    """A client worker's connection that kills its own process at its first query."""

    epoch_ns = 0

    def submit(self, q: Query) -> None:
        import os
        import signal

        os.kill(os.getpid(), signal.SIGKILL)


def _dying_client(worker: int) -> _DyingClient:
    return _DyingClient()


def test_a_client_worker_that_dies_is_named_with_its_signal_and_the_server_is_not_blamed():
    from dlrm_lab.errors import ClientLost
    from dlrm_lab.serve.pool import ClientPool, WorkerPlan

    pool = ClientPool([WorkerPlan(0, _dying_client, time.monotonic_ns())], {"m": small_library()},
                      SutDescription(models={}), unavailable_s=1.0)  # fmt: skip
    try:
        pool.submit(Query(1, "m", 1))
        assert not pool.drain(30)
        with pytest.raises(ClientLost, match=r"^the lab's client worker 0 \(pid \d+\) was killed by signal SIGKILL; "
                           "the server was not at fault$"):  # fmt: skip
            pool.check()
    finally:
        pool.close()


def test_a_system_whose_instances_are_elsewhere_answers_the_protocol_with_nothing_to_report(sut, tmp_path):
    """A remote server or a pool of its clients sees no stalls and takes no canary readings, and says it cannot
    trace (the runner asks `describe().traces` before `start_trace`), as the protocol asks of every system."""
    assert sut.take_stalls() == [] and sut.take_canary() == [] and not sut.describe().traces
    with pytest.raises(RuntimeError, match="cannot be profiled"):
        sut.start_trace()
    with pytest.raises(RuntimeError, match="cannot be profiled"):
        sut.stop_trace(tmp_path)

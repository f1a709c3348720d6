"""The wake probe: how long an idle thread takes to run again once notified, on a scripted clock; and the
low-load latency floor that adds it at the idle time nearest an instance's gap between queries."""

from __future__ import annotations

import pytest

from dlrm_lab.metrics.wake import IDLE_MS, measure_wake, probe_wake, summarize_wakes, wake_ms_for_gap


class ScriptedClock:
    """Returns the next value of `ticks` (ns) at each call: the probe calls it notify, wake, notify, wake, ..."""

    def __init__(self, ticks):
        self.ticks = iter(ticks)

    def __call__(self) -> int:
        return next(self.ticks)


def test_each_wake_is_the_time_from_the_notify_to_the_waiter_running():
    delays_us = [15, 20, 85, 12]
    ticks = []
    for k, d in enumerate(delays_us):
        start = 1_000_000 * (k + 1)
        ticks += [start, start + d * 1000]
    slept = []
    wakes = measure_wake(10.0, len(delays_us), clock=ScriptedClock(ticks), sleep=slept.append)
    assert wakes == pytest.approx(delays_us)
    assert slept == [0.01] * 4  # the waiter was blocked 10 ms before each notify
    summary = summarize_wakes(wakes)
    assert summary["samples"] == 4 and summary["p50_us"] == pytest.approx(17.5) and summary["max_us"] == 85


def test_the_probe_covers_every_idle_time_and_really_wakes_a_thread():
    slept = []
    profile = probe_wake(quick=True, sleep=slept.append)  # real threads, no real sleeping
    assert sorted(profile, key=float) == [f"{i:g}" for i in IDLE_MS]
    assert all(w["samples"] > 0 and 0 <= w["p50_us"] <= w["p99_us"] <= w["max_us"] < 1e6 for w in profile.values())
    assert sorted(set(slept)) == [i / 1e3 for i in IDLE_MS]


def test_the_floor_adds_the_wake_of_the_nearest_idle_time_at_or_below_the_gap():
    wake = {"1": {"p50_us": 10.0}, "10": {"p50_us": 20.0}, "100": {"p50_us": 90.0}}
    assert wake_ms_for_gap(wake, 333.0) == pytest.approx(0.09)  # 3 queries/s on one instance
    assert wake_ms_for_gap(wake, 50.0) == pytest.approx(0.02)
    assert wake_ms_for_gap(wake, 0.2) == 0.0  # a busy instance never sleeps long
    assert wake_ms_for_gap(None, 333.0) == 0.0  # unprobed


def test_the_latency_floor_includes_the_wake_and_a_floor_below_the_timer_has_no_ratio():
    import dlrm_lab
    from dlrm_lab.infer.records import latency_floor_columns
    from dlrm_lab.metrics.roofline import Peaks

    spec = dlrm_lab.load_preset("kaggle", max_rows=1000)
    wake = {"1": {"p50_us": 10.0}, "10": {"p50_us": 20.0}, "100": {"p50_us": 90.0}}
    peaks = Peaks(1e12, 1e11, 1e10, None, "test", wake)
    row = {"latency_floor_samples": 270, "sla_latency_ms": 8.0, "queries_per_s": 3.0}
    out = latency_floor_columns(spec, "fp32", 1, 1, 256, row, peaks)
    bare = latency_floor_columns(spec, "fp32", 1, 1, 256, row, Peaks(1e12, 1e11, 1e10, None, "test"))
    assert out["latency_floor_wake_ms"] == pytest.approx(0.09)
    assert out["latency_floor_ms"] == pytest.approx(bare["latency_floor_ms"] + 0.09)
    fast = Peaks(1e15, 1e13, 1e13, None, "x")
    tiny = latency_floor_columns(dlrm_lab.load_preset("tiny"), "fp32", 1, 1, 256,
                                 {"latency_floor_samples": 1, "sla_latency_ms": 4.0}, fast)  # fmt: skip
    assert tiny["latency_floor_ms"] < 1e-3 and tiny["latency_floor_ratio"] is None


def test_the_cold_probe_is_the_work_after_idling_over_the_work_back_to_back():
    from dlrm_lab.metrics.wake import cold_factors

    now, idle = [0.0], [0.0]

    def sleep(seconds: float) -> None:
        now[0] += seconds
        idle[0] = seconds

    def work() -> None:  # 1 ms back to back; after an idle of s seconds, 1 ms + 20 ms x s
        now[0] += 1e-3 + 0.02 * idle[0]
        idle[0] = 0.0

    def clock() -> float:
        return now[0]

    factors = cold_factors(work, 4, sleep=sleep, clock=clock)
    assert factors == pytest.approx({"1": 1.02, "10": 1.2, "100": 3.0}, rel=1e-6)  # (1 + 20 x idle s) / 1 ms


def test_the_floor_reads_memory_as_slowly_as_it_is_after_the_instances_gap():
    import dlrm_lab
    from dlrm_lab.infer.records import latency_floor_columns
    from dlrm_lab.metrics.roofline import Peaks
    from dlrm_lab.metrics.wake import cold_factor_for_gap

    cold = {"1": 1.1, "10": 1.5, "100": 4.0}
    assert cold_factor_for_gap(cold, 333.0) == 4.0 and cold_factor_for_gap(cold, 0.5) == 1.0
    spec = dlrm_lab.load_preset("kaggle", max_rows=1000)
    memory_bound = Peaks(1e15, 1e9, 1e9, None, "x")  # compute free: the floor is the memory reads
    row = {"latency_floor_samples": 270, "sla_latency_ms": 8.0, "queries_per_s": 3.0}
    warm = latency_floor_columns(spec, "fp32", 1, 1, 256, row, memory_bound)
    slow = latency_floor_columns(spec, "fp32", 1, 1, 256, row, Peaks(1e15, 1e9, 1e9, None, "x", None, cold))
    assert slow["latency_floor_cold_factor"] == 4.0 and warm["latency_floor_cold_factor"] == 1.0
    assert slow["latency_floor_ms"] == pytest.approx(4.0 * warm["latency_floor_ms"], rel=1e-6)
    busy = latency_floor_columns(spec, "fp32", 1, 1, 256, {**row, "queries_per_s": 5000.0},
                                 Peaks(1e15, 1e9, 1e9, None, "x", None, cold))  # fmt: skip
    assert busy["latency_floor_cold_factor"] == 1.0  # an instance idle 0.2 ms between queries is warm


def test_an_idle_instance_kept_warm_runs_a_batch_of_other_samples_until_its_next_message():
    from dlrm_lab.infer.instance import KeepWarm

    class Conn:  # the next message arrives after three polls
        def __init__(self):
            self.polls: list[float] = []

        def poll(self, timeout: float) -> bool:
            self.polls.append(timeout)
            return len(self.polls) > 3

    ran = []
    conn = Conn()
    KeepWarm(lambda refs: ran.append((refs[0].size, refs[0].offset)), 200, 10.0).until_ready(conn)
    assert conn.polls == [0.01] * 4 and ran == [(1, 0), (1, 97), (1, 194)]  # 1-sample batches of other rows
    off = Conn()
    KeepWarm(lambda refs: ran.append(refs), 200, 0.0).until_ready(off)
    assert off.polls == [] and len(ran) == 3  # off: the instance blocks on its pipe as before


def test_the_floor_of_an_instance_kept_warm_reads_memory_at_its_warming_gap():
    import dlrm_lab
    from dlrm_lab.infer.records import latency_floor_columns
    from dlrm_lab.metrics.roofline import Peaks

    peaks = Peaks(1e15, 1e9, 1e9, None, "x", None, {"1": 1.1, "10": 1.5, "100": 4.0})
    row = {"latency_floor_samples": 270, "sla_latency_ms": 8.0, "queries_per_s": 3.0}
    spec = dlrm_lab.load_preset("kaggle", max_rows=1000)
    cold = latency_floor_columns(spec, "fp32", 1, 1, 256, row, peaks)
    warmed = latency_floor_columns(spec, "fp32", 1, 1, 256, {**row, "keep_warm_ms": 10.0}, peaks)
    assert cold["latency_floor_cold_factor"] == 4.0 and warmed["latency_floor_cold_factor"] == 1.5

"""The speed canary (issue 60): its readings against quiet, the slow-phase line, its columns in a training run's and
a serving point's summary, and a real CPU hog started halfway through a serving run, named by its line."""

from __future__ import annotations

import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from dlrm_lab.metrics.canary import (
    SLOW_PHASE,
    Canary,
    canary_columns,
    foreign_load,
    quiet_canary,
    run_processes,
    shared_phase_line,
    slow_phase_line,
)


def _reading(t: float, speed: float, foreign: float | None = 0.02) -> dict:
    return {
        "time_unix_s": 1e9 + t,
        "source": "rank 0",
        "canary_gemm_flops_per_s": 100e9 * speed,
        "canary_gather_bytes_per_s": 10e9 * min(1.0, speed * 1.1),
        "canary_ms": 0.5,
        "canary_foreign": foreign,
    }


def test_the_canary_reads_the_slower_of_its_gemm_and_gather_against_quiet_and_says_a_slow_phase():
    quiet = {"gemm_flops_per_s": 100e9, "gather_bytes_per_s": 10e9, "ms": 0.5}
    steady = [_reading(t, 1.0) for t in range(10)]
    columns = canary_columns(steady, quiet, elapsed_s=10.0)
    assert columns["canary_readings"] == 10 and columns["canary_ratio"] == pytest.approx(1.0)
    assert columns["canary_phase"] is None and columns["canary_share"] == pytest.approx(0.0005)
    assert columns["canary_basis"] == "the machine profile's quiet canary"
    slow = canary_columns([_reading(t, 0.55) for t in range(10)], quiet, elapsed_s=10.0)
    assert slow["canary_ratio"] == pytest.approx(0.55)
    assert slow["canary_phase"].startswith("measured while this machine ran at 0.55 of its profiled speed (canary)")
    # a hog from 6 s on: the line names when the machine slowed, and how far
    halfway = [_reading(t, 1.0 if t < 6 else 0.5) for t in range(12)]
    line = canary_columns(halfway, quiet, elapsed_s=12.0)["canary_phase"]
    assert line.startswith("this machine slowed to 0.50 of its profiled speed (canary) from 6.0 s into the run")
    # no quiet canary in the profile: against the run's own fastest reading, and said so
    unprobed = canary_columns(halfway, None, elapsed_s=12.0)
    assert "no quiet canary" in unprobed["canary_basis"] and unprobed["canary_phase"].startswith("this machine slowed")
    assert slow_phase_line([SLOW_PHASE + 0.01] * 5, list(range(5))) is None
    assert slow_phase_line([1.0, 1.0, 0.5, 1.0, 1.0, 1.0], list(range(6))) is None  # one slow reading is no phase
    assert canary_columns([], quiet, elapsed_s=1.0)["canary_ratio"] is None


def test_the_canary_says_when_other_processes_took_the_machine():
    """A hog beside the run does not slow a burst (the scheduler runs a task that just woke first), but it takes the
    machine's CPU: the readings' foreign load says from when, and how much."""
    quiet = {"gemm_flops_per_s": 100e9, "gather_bytes_per_s": 10e9, "ms": 0.5}
    hogged = [_reading(t, 1.0, 0.02 if t < 5 else 0.45) for t in range(10)]
    columns = canary_columns(hogged, quiet, elapsed_s=10.0)
    assert columns["canary_ratio"] == pytest.approx(1.0)
    assert columns["canary_phase"].startswith("other processes took 0.45 of this machine's CPU from 5.0 s into the run")
    assert shared_phase_line([0.3] * 4, list(range(4))).startswith("other processes took 0.30 of this machine's CPU")
    assert shared_phase_line([0.05] * 4, list(range(4))) is None
    assert canary_columns([_reading(t, 1.0, None) for t in range(4)], quiet, 4.0)["canary_foreign"] is None
    share, state = foreign_load(None)
    assert share is None and (state is None or state[0][2] > 0)  # the first read: a state to measure from


def test_the_canary_keeps_its_cadence_and_its_quiet_baseline_is_a_reading_of_the_same_work():
    canary = Canary(None, "rank 0", every_s=3600.0)
    assert canary.due()
    reading = canary.maybe_read()
    assert reading is not None and reading["canary_gemm_flops_per_s"] > 0 and reading["canary_ms"] > 0
    assert not canary.due() and canary.maybe_read() is None  # not again for an hour
    assert Canary(None, "rank 0", every_s=0).work is None  # off
    quiet = quiet_canary(repeats=3)
    assert set(quiet) == {"gemm_flops_per_s", "gather_bytes_per_s", "ms"} and quiet["ms"] > 0


def test_a_training_run_records_its_canary_beside_its_steps(tmp_path, monkeypatch):
    import dlrm_lab
    from dlrm_lab.config import TrainConfig
    from dlrm_lab.train import preflight, train

    monkeypatch.setenv("DLRM_LAB_CANARY_S", "0.01")
    # no stored profile: each reading against the run's fastest (<= 1). Another test's profile, probed while the
    # machine was busier than now, put this run at 1.17 of it
    monkeypatch.setenv("DLRM_LAB_MACHINE_DIR", str(tmp_path / "machines"))
    result = train(
        preflight(dlrm_lab.load_preset("tiny"), TrainConfig(steps=30, batch_size=256, prefetch=0, eval_batches=1)),
        metrics_dir=str(tmp_path),
    )
    summary = result.summary
    assert summary["canary_readings"] >= 2 and 0 < summary["canary_ratio"] <= 1.0 + 1e-9
    assert 0 < summary["canary_share"] < 1
    telemetry = pq.read_table(result.run_dir / "telemetry.parquet").to_pandas()
    canary = telemetry[telemetry["channel"] == "canary"]
    assert set(canary["quantity"]) == {"gemm_flops_per_s", "gather_bytes_per_s", "ms", "foreign"}
    assert (canary["quantity"] == "ms").sum() == summary["canary_readings"] and set(canary["source"]) == {"rank 0"}
    assert 0 <= summary["canary_foreign"] <= 1
    # the report draws the canary beside the run's own rate over the run's time
    from dlrm_lab.report.html import write_report

    report = write_report([result.run_dir], tmp_path / "report")
    drawn = report.drawn["canary"]
    (series,) = drawn.runs.values()
    assert drawn.path.is_file() and len(series.ratios) == summary["canary_readings"] == len(series.times_s)
    assert series.rates and statistics.median(series.rates) == pytest.approx(1.0)  # over its median


def test_a_cpu_hog_started_halfway_through_a_serving_run_is_named_by_the_canary_line(tmp_path, monkeypatch):
    """Real hog processes (one a core, a session of their own) start halfway through a busy point: the instance's
    canary readings say other processes took the machine, and from when, in the point's line."""
    import os

    import dlrm_lab
    from dlrm_lab.infer.lab import InferConfig, run_inference
    from dlrm_lab.infer.load import QuerySizes, Stream
    from dlrm_lab.infer.served import ServedModel

    monkeypatch.setenv("DLRM_LAB_CANARY_S", "0.1")
    hogs: list[Path] = []  # each hog's pid file: another user's process, neither ours nor our descendant
    started: list[float] = []  # when the hogs ran, unix seconds: the readings' time base

    def halfway(progress) -> None:
        if progress.elapsed_s >= 2.0 and not hogs:
            # every core this process may run on (a container's host may count more: a hog pinned outside them
            # dies at start, and each one started costs time): this thread may be pinned to the spare one
            for core in sorted(os.sched_getaffinity(0)):
                pid_file = tmp_path / f"hog-{core}.pid"
                hog = (
                    "import os\nif os.fork(): os._exit(0)\nos.setsid()\n"  # reparented away from this process
                    f"os.sched_setaffinity(0, {{{core}}})\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\n"
                    "while True: pass"
                )
                subprocess.run([sys.executable, "-c", hog], check=True)
                hogs.append(pid_file)
                started.append(time.time())

    lines: list[str] = []
    try:
        run_dir = run_inference(
            [ServedModel("tiny", dlrm_lab.load_preset("tiny"), instances=1, build="fused")],  # no builds compiled
            [Stream("tiny", 3000.0, QuerySizes.parse("fixed:64"))],  # the instance busy: a hog takes its turns
            InferConfig(duration_s=4.0, warmup_s=1.0),
            metrics_dir=tmp_path,
            log=lines.append,
            on_progress=halfway,
        )
    finally:
        for pid_file in hogs:
            for _ in range(100):  # the grandchild writes its pid just after it starts
                if pid_file.exists() and pid_file.read_text():
                    os.kill(int(pid_file.read_text()), signal.SIGKILL)
                    break
                time.sleep(0.01)
    (row,) = pq.read_table(run_dir / "summary.parquet").to_pylist()
    assert row["canary_readings"] >= 10
    canary = {k: v for k, v in row.items() if k.startswith("canary")}
    assert hogs and row["canary_phase"] is not None and "other processes took" in row["canary_phase"], canary
    # from about when they started, on the line's clock: seconds since the point's first reading. A slow host runs
    # the callback late and the point long, so the start is read, not assumed
    readings = pq.read_table(run_dir / "telemetry.parquet").to_pandas().query("channel == 'canary'")
    foreign = readings[readings["quantity"] == "foreign"].sort_values("time_unix_s")
    first = readings["time_unix_s"].min()
    start = started[0] - first
    # the foreign load's part of the line: a slower speed (the hogs share the canary's core) may be said first
    (shared,) = [part for part in row["canary_phase"].split("; ") if part.startswith("other processes took")]
    onset = float(shared.split(" s into the run")[0].rsplit(" ", 1)[1])
    timeline = [
        (round(t - first, 2), round(v, 2)) for t, v in zip(foreign["time_unix_s"], foreign["value"], strict=True)
    ]
    assert start - 0.5 <= onset <= start + 1.0, (start, onset, row["canary_phase"], timeline)
    assert any(line == f"tiny: {row['canary_phase']}" for line in lines)


def test_a_choice_stored_in_a_slow_minute_is_measured_again_not_kept(monkeypatch):
    """A measured choice (build, precision, sharding) carries the machine's speed when it was measured; one stored in
    a slow phase, or at a speed far from now's, is measured again (one line says why); one without a canary (stored
    before choices carried one) or at today's speed is kept."""
    from dlrm_lab.metrics import canary, measured

    monkeypatch.setattr(canary, "canary_now", lambda profile: 0.9)
    entry = {"batch_ms": {"aoti": {"1": 0.2}}, "measured_at": "2026-11-29T05:00:00+00:00"}
    profile = {"fingerprint_id": "abc", "build_rates": {"k": {**entry, "canary_ratio": 0.5}}}
    lines: list[str] = []
    assert measured.cached_choice(profile, "build_rates", "k", lines.append) is None
    assert lines == ["build_rates.k: measured while the machine ran at 0.50 of its quiet speed (canary), now 0.90; "
                     "measuring again"]  # fmt: skip
    profile["build_rates"]["k"]["canary_ratio"] = 0.88
    assert measured.cached_choice(profile, "build_rates", "k") is profile["build_rates"]["k"]
    profile["build_rates"]["k"] = entry
    assert measured.cached_choice(profile, "build_rates", "k") is entry
    saved = []
    monkeypatch.setattr(measured, "save_profile", lambda p: saved.append(p) or "here")
    assert measured.store_measured(profile, "build_rates", "k2", entry) == "here"
    assert saved[0]["build_rates"]["k2"]["canary_ratio"] == 0.9


def test_the_canary_now_reads_against_the_profiles_quiet_term():
    import torch

    from dlrm_lab.metrics.canary import canary_now

    threads = torch.get_num_threads()
    quiet = {"gemm_flops_per_s": 1e9, "gather_bytes_per_s": 1e8, "ms": 1.0}  # slower than any machine: ratio > 1
    profile = {"devices": {"cpu": {"threads": {str(threads): {"canary": quiet}}}}}
    assert canary_now(profile) > 1.0 and canary_now({"devices": {}}) is None


def test_one_source_slowing_alone_is_its_core_not_the_machine():
    """Two instances, one of which slowed (its core shared with the run's own serving threads, or a neighbour): the
    line names that instance's core, not the machine; both slowing is the machine."""
    quiet = {"gemm_flops_per_s": 100e9, "gather_bytes_per_s": 10e9, "ms": 0.5}
    one = [_reading(t, 1.0 if t < 5 else 0.5) | {"source": "instance 0"} for t in range(10)]
    other = [_reading(t + 0.5, 1.0) | {"source": "instance 1"} for t in range(10)]
    line = canary_columns(one + other, quiet, elapsed_s=10.0)["canary_phase"]
    assert line.startswith("instance 0 alone (not instance 1): its core, not the machine: its core slowed to 0.50")
    both = one + [_reading(t + 0.5, 1.0 if t < 5 else 0.5) | {"source": "instance 1"} for t in range(10)]
    lines = canary_columns(both, quiet, elapsed_s=10.0)["canary_phase"]
    assert lines.startswith("instance 0: this machine slowed to 0.50") and "instance 1: this machine slowed" in lines


def test_the_run_s_processes_are_its_session_and_its_descendants_not_every_orphan_of_pid_1():
    """In a container PID 1 often shares the run's session; an orphaned process of another user (a daemon that left
    for a session of its own) is its child, and is foreign, while the run's own daemons (mpirun's, sessions of
    their own under the run's root) are the run's."""
    procs = {
        1: (0, 1),  # init, in the run's session (a container's)
        10: (1, 1),  # the run's shell
        11: (10, 1),  # the command: the run's root
        12: (11, 12),  # mpirun's daemon: a session of its own, under the root
        13: (12, 12),  # a rank under it
        20: (1, 20),  # another user's daemon, reparented to init
        21: (20, 20),  # its worker
        30: (0, 30),  # a kernel thread
    }
    assert run_processes(procs, session=1, roots={11}) == {1, 10, 11, 12, 13}
    assert run_processes(procs, session=1, roots={11, 0}) == {1, 10, 11, 12, 13}  # no root: not the kernel's 0
    assert run_processes(procs, session=20, roots={20}) == {20, 21}


def test_a_run_process_that_ends_between_two_readings_is_not_foreign_load(monkeypatch):
    """The run's CPU is counted by process: a client that ran 400 ticks and ended between two readings took none of
    the machine from the run, where a sum over the live ones lost its 400 and called them another user's."""
    import dlrm_lab.metrics.canary as canary

    machine = iter([(1000, 0, 4000), (1100, 0, 4200)])  # (busy, steal, all) ticks at each reading
    run = iter([{10: 500, 11: 400}, {10: 580, 12: 20}])  # 11 ended; 12 started; 10 went on
    monkeypatch.setattr(canary, "cpu_ticks", lambda: next(machine))
    monkeypatch.setattr(canary, "run_ticks", lambda: next(run))
    _, state = foreign_load(None)
    share, _ = foreign_load(state)
    assert share == 0.0  # 100 busy ticks, all the run's (80 + 20)


def test_every_benchmark_results_file_carries_the_canary_of_its_phase(monkeypatch, tmp_path):
    """benchmarks/common.py's header takes a first reading, `canary_mark` one more, named, and write_results a last
    one with the readings' median and range (issue 60: a figure beside the host's speed when it was taken)."""
    import importlib.util
    import json

    from dlrm_lab.metrics import canary

    root = Path(__file__).resolve().parent.parent
    monkeypatch.syspath_prepend(str(root / "benchmarks"))
    found = importlib.util.spec_from_file_location("benchmark_common", root / "benchmarks" / "common.py")
    common = importlib.util.module_from_spec(found)
    found.loader.exec_module(common)
    readings = iter([0.9, 0.6, 0.8])
    monkeypatch.setattr(canary, "canary_now", lambda profile: next(readings))
    results = common.header(shape="kaggle")
    assert common.canary_mark(results, "after the fp32 repeats") == 0.6
    written = json.loads(common.write_results(tmp_path / "r.json", results).read_text())
    assert [r["label"] for r in written["canary"]["readings"]] == ["start", "after the fp32 repeats", "end"]
    assert (written["canary"]["median"], written["canary"]["low"], written["canary"]["high"]) == (0.8, 0.6, 0.9)
    assert written["shape"] == "kaggle" and written["cpu_flags"] is not None
    readings = iter([0.7, 0.9])
    nested = {"header": common.header(), "figures": [1.0]}  # a script that keeps its header under "header"
    written = json.loads(common.write_results(tmp_path / "n.json", nested).read_text())
    assert written["header"]["canary"]["median"] == 0.8 and written["figures"] == [1.0]


def test_a_points_readings_are_read_against_the_quiet_reading_of_their_own_thread_count(monkeypatch):
    """The instances' readings against the quiet canary at the instances' threads; the load generator's (source
    `client`: a server elsewhere) at the client process's own, which reads faster than one thread's quiet and would
    say the host ran at 1.6 of its speed; a server elsewhere's own readings against nothing here."""
    import torch

    from dlrm_lab.infer.load_point import canary_quiet

    quiet = {str(n): {"canary": {"gemm_flops_per_s": n * 1e11, "gather_bytes_per_s": n * 1e10}} for n in (1, 2)}
    profile = {"devices": {"cpu": {"threads": quiet}}}
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    instance, client = [{"source": "instance 0"}], [{"source": "client"}, {"source": "client"}]
    assert canary_quiet(instance, profile, 1, True) == quiet["1"]["canary"]
    assert canary_quiet(client, profile, 1, True) == quiet["2"]["canary"]
    assert canary_quiet(client, profile, 1, False) == quiet["2"]["canary"]  # this host's, wherever the server is
    assert canary_quiet(instance, profile, 1, False) is None


def test_interleaved_medians_reverse_the_order_every_other_round_and_drop_the_warm_up_round():
    from dlrm_lab.metrics.interleaved import interleaved_medians

    calls: list[str] = []
    readings = iter(range(100))

    def timed(way: str) -> float:
        calls.append(way)
        return float(next(readings))

    med = interleaved_medians(("a", "b", "c"), timed, 3)
    assert calls == ["a", "b", "c", "c", "b", "a", "a", "b", "c", "c", "b", "a"]  # a warm-up round, then 3
    assert med == {"a": 6.0, "b": 7.0, "c": 8.0}  # a: 5, 6, 11 (0 dropped); b: 4, 7, 10; c: 3, 8, 9
    calls.clear()
    readings = iter(range(100))
    assert interleaved_medians(("a", "b"), timed, 2, warm_up=False) == {"a": 1.5, "b": 1.5}  # a: 0, 3; b: 1, 2
    assert calls == ["a", "b", "b", "a"]


def test_medians_by_size_time_each_size_on_the_threads_asked_and_put_them_back():
    import torch

    from dlrm_lab.metrics.interleaved import medians_by_size

    before = torch.get_num_threads()
    seen: list[tuple[int, str, int]] = []

    def timer_at(size: int):
        def timed(way: str) -> float:
            seen.append((size, way, torch.get_num_threads()))
            return size * (1.0 if way == "a" else 2.0)

        return timed

    med = medians_by_size(("a", "b"), timer_at, [1, 8], 2, threads=1)
    assert med == {"a": {1: 1.0, 8: 8.0}, "b": {1: 2.0, 8: 16.0}}  # way -> size -> median
    assert {t for _, _, t in seen} == {1} and len(seen) == 2 * 2 * 3  # sizes x ways x (warm-up + 2 rounds)
    assert torch.get_num_threads() == before

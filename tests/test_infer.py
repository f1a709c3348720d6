"""The inference system under test: batching, co-located instances, bad input, overload."""

import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from dlrm_lab.config import load_preset
from dlrm_lab.data import synthetic_generator
from dlrm_lab.data.source import block_to_batch
from dlrm_lab.infer.plan import plan_serving
from dlrm_lab.infer.served import ServedModel
from dlrm_lab.infer.server import InferenceServer
from dlrm_lab.infer.sut import Query
from dlrm_lab.model.dlrm import build_model

SEED = 3


class Collector:
    """on_done callback that keeps (status, scores) per query id."""

    def __init__(self) -> None:
        self.done: dict[int, tuple[str, np.ndarray | None]] = {}
        self.lock = threading.Lock()

    def __call__(self, q: Query, status: str, scores: np.ndarray | None) -> None:
        with self.lock:
            self.done[q.query_id] = (status, None if scores is None else scores.copy())


@pytest.fixture(scope="module")
def server():
    spec = load_preset("tiny")
    served = ServedModel(
        "tiny", spec, instances=2, max_batch=64, max_delay_ms=2.0, library_samples=4096, spin_ms=2.0
    )  # instances poll 2 ms before they sleep: the spin path serves every test here
    with InferenceServer(plan_serving([served], seed=SEED)) as s:
        yield s


def _drain(server: InferenceServer) -> list[dict]:
    assert server.drain(30)
    return server.take_records()


def test_scores_equal_the_model_on_the_same_samples(server):
    spec = server.models["tiny"].spec
    got = Collector()
    queries = [(0, 5), (100, 1), (7, 30), (2000, 64), (3000, 150)]  # the last one is split 64 + 64 + 22
    for k, (offset, size) in enumerate(queries):
        server.submit(Query(k, "tiny", size, offset, on_done=got))
    records = _drain(server)
    assert sorted(r["query_id"] for r in records) == [0, 1, 2, 3, 4]
    assert [r["pieces"] for r in sorted(records, key=lambda r: r["query_id"])] == [1, 1, 1, 1, 3]
    assert all(r["status"] == "ok" for r in records)
    # every batch carries its time and the instances' warm model of it (the summary's compute slowdown)
    assert all(r["batch_compute_ms"] > 0 and r["batch_expected_ms"] > 0 for r in records)
    torch.manual_seed(SEED)
    model = build_model(spec).eval()
    library = synthetic_generator(spec, seed=SEED).samples(0, 4096)
    for k, (offset, size) in enumerate(queries):
        batch = block_to_batch(library.slice(offset, offset + size), spec.feature_names)
        with torch.inference_mode():
            want = torch.sigmoid(model(batch.dense_features, batch.sparse_features)).numpy()
        status, scores = got.done[k]
        assert status == "ok" and scores.shape == (size,)
        np.testing.assert_allclose(scores, want, rtol=1e-5, atol=1e-6)


def test_batcher_packs_queries_up_to_max_batch_and_splits_larger_ones(server):
    server.configure("tiny", max_batch=64, max_delay_ms=20.0)
    try:
        for k in range(40):  # 40 queries of 10 samples arrive together: batches of at most 6 queries
            server.submit(Query(k, "tiny", 10, k))
        server.submit(Query(99, "tiny", 100, 0))  # larger than max_batch: a full piece, the rest packs on
        records = _drain(server)
    finally:
        server.configure("tiny", max_batch=64, max_delay_ms=2.0)
    by_batch: dict[int, list[dict]] = {}
    for r in records:
        assert r["status"] == "ok"
        by_batch.setdefault(r["batch_id"], []).append(r)
    big = next(r for r in records if r["query_id"] == 99)
    assert big["pieces"] == 2 and big["batch_samples"] <= 64  # 64 now, 36 with later queries
    assert all(r["batch_samples"] <= 64 for r in records)
    small = {b: rs for b, rs in by_batch.items() if all(r["query_id"] != 99 for r in rs)}
    assert max(sum(r["samples"] for r in rs) for rs in small.values()) == 60  # six 10-sample queries fill 64
    assert all(len(rs) == rs[0]["batch_queries"] for rs in small.values())
    assert {r["instance"] for r in records} == {0, 1}  # both co-located instances served
    for r in records:  # times are ordered per query
        assert r["scheduled_ms"] <= r["issued_ms"] <= r["start_ms"] <= r["end_ms"]
        assert r["latency_ms"] == pytest.approx(r["end_ms"] - r["scheduled_ms"])


def test_max_delay_sends_a_lone_query_once_it_expires(server):
    """A query waits for companions only where the recent arrivals expect one within its delay
    (`BatchClock.worth_waiting`): after a burst, a query that finds none waits its 50 ms, then goes alone."""
    server.configure("tiny", max_batch=64, max_delay_ms=50.0)
    try:
        for k in range(40):  # 40 arrivals in the last second: ~2 expected within 50 ms
            server.submit(Query(100 + k, "tiny", 64, k))  # full batches: none waits
        _drain(server)
        server.submit(Query(0, "tiny", 1, 0))
        (r,) = _drain(server)
    finally:
        server.configure("tiny", max_delay_ms=2.0)
    assert r["batch_queries"] == 1
    assert 50.0 <= r["queue_ms"] < 1000.0  # waited for the delay, then went alone


def test_instances_share_one_mapped_snapshot(server):
    snap = Path(server._snapshots[0])
    assert (snap / "model.pt").exists() and (snap / "library.pt").exists()
    for info in server.instance_info:
        maps = Path(f"/proc/{info['pid']}/maps").read_text()
        assert str(snap / "model.pt") in maps and str(snap / "library.pt") in maps  # mapped, not copied
    spec = server.models["tiny"].spec
    assert server.snapshot_bytes["tiny"] > spec.embedding_parameters * 4  # the tables are in the snapshot once
    assert len({info["cores"][0] for info in server.instance_info}) == min(2, len(os.sched_getaffinity(0)))


def test_malformed_queries_are_rejected_and_the_instances_live_on(server):
    spec = server.models["tiny"].spec
    good = synthetic_generator(spec, seed=1).samples(0, 4)
    rows = spec.tables[0].num_embeddings
    bad_id = type(good)(0, good.dense, good.labels, list(good.lengths), [v.copy() for v in good.values])
    bad_id.lengths[0] = np.ones(4, dtype=np.int32)
    bad_id.values[0] = np.array([0, 1, rows, 2])  # one id beyond its table
    few_features = type(good)(0, good.dense, good.labels, good.lengths[:-1], good.values[:-1])
    wrong_dense = type(good)(0, good.dense[:, :-1], good.labels, good.lengths, good.values)
    nan_dense = type(good)(0, good.dense.copy(), good.labels, good.lengths, good.values)
    nan_dense.dense[0, 0] = np.nan
    for k, payload in enumerate([bad_id, few_features, wrong_dense, nan_dense, good]):
        server.submit(Query(k, "tiny", 4, payload=payload))
    records = {r["query_id"]: r for r in _drain(server)}
    assert records[4]["status"] == "ok"
    assert records[0]["status"] == "rejected" and f"id {rows} outside its table" in records[0]["error"]
    assert records[1]["status"] == "rejected" and "sparse features" in records[1]["error"]
    assert records[2]["status"] == "rejected" and "dense features" in records[2]["error"]
    assert records[3]["status"] == "rejected" and "not finite" in records[3]["error"]
    for k in range(10):  # both instances still serve
        server.submit(Query(100 + k, "tiny", 2, k))
    assert all(r["status"] == "ok" for r in _drain(server))


def test_overload_drops_beyond_the_queue_bound_and_accounts_every_query(server):
    server.configure("tiny", max_queue=8, max_delay_ms=0.0, max_batch=1)
    try:
        for k in range(300):
            server.submit(Query(k, "tiny", 1, k))
            assert len(server._pools["tiny"].waiting) <= 8
        records = _drain(server)
    finally:
        server.configure("tiny", max_queue=4096, max_delay_ms=2.0, max_batch=64)
    status = [r["status"] for r in records]
    assert len(records) == 300 and set(status) <= {"ok", "dropped"}
    assert status.count("dropped") > 0 and status.count("ok") >= 8
    dropped = [r for r in records if r["status"] == "dropped"]
    assert all(r["batch_id"] is None and "queue full (8 queries)" in r["error"] for r in dropped)


def test_unknown_model_is_a_user_error(server):
    from dlrm_lab.errors import UserError

    with pytest.raises(UserError, match="unknown model 'rm9'"):
        server.submit(Query(0, "rm9", 1))
    assert server.drain(1)  # nothing left outstanding


def test_int8_tables_serve_close_to_fp32():
    """The server's model of int8 tables against the fp32 model it was made from (the server's seed), on the same
    library samples (a served fp32 model scores as that model: test_scores_equal_the_model_on_the_same_samples)."""
    spec = load_preset("tiny")
    got = Collector()
    served = ServedModel("int8", spec, max_delay_ms=0.0, library_samples=1024, table_precision="int8")
    before = os.sched_getaffinity(0)
    with InferenceServer(plan_serving([served], seed=SEED)) as s:
        s.submit(Query(1, "int8", 256, 0, on_done=got))
        assert s.drain(30)
        # the serving process's threads (this one among them) keep off the one instance's core while it serves
        (instance_core,) = s.instance_info[0]["cores"]
        spare = before - {instance_core}
        threads = [int(t) for t in os.listdir("/proc/self/task")]
        assert all(os.sched_getaffinity(t) == (spare or before) for t in threads)
    assert os.sched_getaffinity(0) == before  # given back when it stops
    torch.manual_seed(SEED)
    model = build_model(spec).eval()
    batch = block_to_batch(synthetic_generator(spec, seed=SEED).samples(0, 256), spec.feature_names)
    with torch.inference_mode():
        fp32 = torch.sigmoid(model(batch.dense_features, batch.sparse_features)).numpy()
    status, int8 = got.done[1]
    assert status == "ok" and int8.shape == fp32.shape and not np.array_equal(fp32, int8)  # really quantised
    assert np.abs(fp32 - int8).max() < 0.02


def test_an_instance_killed_during_a_run_is_one_line_naming_it_and_the_queries_are_kept(tmp_path, monkeypatch):
    """`kill -9` of an instance mid-point: one `error:` line naming the instance, its pid and the signal, and
    the run; exit 1; the run failed with that reason; the queries before it in queries.parquet."""
    import json
    import threading

    import pyarrow.parquet as pq

    from tests.conftest import run_cli_in_process

    ready = InferenceServer._wait_ready
    killed: list[int] = []

    def ready_then_kill_later(self):
        ready(self)
        pid = self.instance_info[0]["pid"]
        killed.append(pid)
        threading.Timer(1.5, os.kill, (pid, 9)).start()

    monkeypatch.setattr(InferenceServer, "_wait_ready", ready_then_kill_later)
    code, _, err = run_cli_in_process("infer", "run", "--model", "tiny", "--qps", "200", "--duration", "30",
                                      "--warmup", "0", "--max-batch", "64", "--metrics-dir", str(tmp_path),
                                      "--no-progress")  # fmt: skip
    (run_dir,) = tmp_path.iterdir()
    (pid,) = killed
    lines = [x for x in err.splitlines() if x.startswith("error:")]
    assert code == 1 and "Traceback" not in err
    assert lines == [f"error: instance 0 (pid {pid}) was killed by signal SIGKILL; run {run_dir} marked failed, "
                     "the queries before it kept"]  # fmt: skip
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["status"] == "failed" and "was killed by signal SIGKILL" in manifest["error"]
    assert pq.read_table(run_dir / "queries.parquet").num_rows > 50  # ~1.5 s at 200 queries/s


@pytest.mark.parametrize("scenario", ["offline", "single-stream", "multi-stream"])
def test_loadgen_scenarios_drive_the_server(server, tmp_path, scenario, monkeypatch):
    from dlrm_lab.infer.lab import InferConfig, queue_room
    from dlrm_lab.infer.load import QuerySizes, Stream
    from dlrm_lab.infer.load_point import Point, measure
    from dlrm_lab.infer.loadgen import LoadGenDriver
    from dlrm_lab.metrics.columns import schema_of
    from dlrm_lab.metrics.run import Run

    # the number of queries in each report to LoadGen (one QuerySamplesComplete, here or in LoadGen's process), and
    # how many queries had no row yet when it was made: LoadGen hears before the rows are built (its clock runs on)
    reports, unrecorded = [], []
    issuer = LoadGenDriver._issuer

    def counted(driver, respond):
        def told(tags):
            reports.append(len(tags))
            unrecorded.append(server.records._outstanding)
            respond(tags)

        return issuer(driver, told)

    monkeypatch.setattr(LoadGenDriver, "_issuer", counted)
    cfg = InferConfig(scenario=scenario, duration_s=0.5, sla_ms=50)
    stream = Stream("tiny", 200.0, QuerySizes.parse("fixed:2"))
    point = Point(0, [stream], scenario=scenario)
    with Run.create(tmp_path, "infer", {}) as run, queue_room(server, point, cfg.duration_s):
        (row,) = measure(server, point, cfg, run.table("queries", schema_of("queries")), run.dir)
    assert row["scenario"] == scenario and row["arrival"].startswith("loadgen")
    assert row["loadgen_result"] in ("VALID", "INVALID")
    assert (run.dir / "loadgen" / "point-0" / "mlperf_log_summary.txt").exists()
    assert row["completed_queries"] > 0 and row["dropped_queries"] == 0
    assert row["queries"] == row["completed_queries"] and row["loadgen_p99_ms"] > 0
    if scenario != "multi-stream":  # LoadGen reports no rate for multi-stream
        assert row["loadgen_queries_per_s"] > 0
    assert sum(reports) == row["completed_queries"]  # every query reported to LoadGen once
    assert all(n >= k for n, k in zip(unrecorded, reports, strict=True)), (unrecorded, reports)
    if scenario == "offline":  # every query issued at once, then served in full batches, each reported at once
        assert row["batch_samples_mean"] > 16 and len(reports) < sum(reports) / 4
    if scenario == "single-stream":  # one query at a time: never batched with another
        assert row["batch_queries_mean"] == 1.0
    assert server.models["tiny"].max_queue == 4096  # restored after an offline point


def test_snapshots_of_killed_servers_are_removed_and_live_ones_kept(tmp_path):
    import subprocess
    import sys

    from dlrm_lab.infer.snapshot import remove_stale_snapshots

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f"dlrm-lab-{dead.stdout.strip()}-rm2-1"
    live = tmp_path / f"dlrm-lab-{os.getpid()}-rm2-2"
    for d in (stale, live):
        d.mkdir()
        (d / "model.pt").write_bytes(b"x")
    assert remove_stale_snapshots(tmp_path) == [stale]
    assert not stale.exists() and live.exists()


def test_a_point_is_placed_on_the_roofline_with_its_energy_per_query(server, tmp_path, monkeypatch):
    import pyarrow.parquet as pq
    from conftest import ConstantPower, store_profile

    from dlrm_lab.infer import load_point
    from dlrm_lab.infer.load import QuerySizes, Stream
    from dlrm_lab.metrics.columns import schema_of
    from dlrm_lab.metrics.energy import telemetry_schema
    from dlrm_lab.metrics.run import Run
    from dlrm_lab.model.cost import lookup_bytes_per_sample, sample_cost

    monkeypatch.setenv("DLRM_LAB_MACHINE_DIR", str(tmp_path / "machines"))
    store_profile(tmp_path / "machines", gflops=50.0, gather_gb=4.0)
    monkeypatch.setattr(load_point, "open_power_sources", lambda *a, **k: ([ConstantPower(25.0)], {}))
    cfg = load_point.InferConfig(duration_s=1.0, sla_ms=50)
    stream = Stream("tiny", 150.0, QuerySizes.parse("fixed:4"))
    with Run.create(tmp_path, "infer", {}) as run:
        telemetry = run.table("telemetry", telemetry_schema("point"))
        (row,) = load_point.measure(
            server,
            load_point.Point(0, [stream]),
            cfg,
            run.table("queries", schema_of("queries")),
            run.dir,
            telemetry=telemetry,
        )
    spec = server.models["tiny"].spec
    assert row["flops_per_sample"] == sample_cost(spec).forward_flops == 1392
    assert row["bytes_per_sample"] == lookup_bytes_per_sample(spec) == 224
    assert row["achieved_flops_per_s"] == pytest.approx(row["samples_per_s"] * 1392)
    batch = row["batch_samples_mean"]
    compute_ms = batch * 1392 / 50e9 * 1e3
    memory_ms = (batch * 224 / 4e9 + 4 * spec.dense_parameters / 20e9) * 1e3
    assert row["roofline_compute_ms"] == pytest.approx(compute_ms)
    assert row["roofline_memory_ms"] == pytest.approx(memory_ms)
    assert row["roofline_bound_ms"] == pytest.approx(max(compute_ms, memory_ms))
    assert row["roofline_fraction"] == pytest.approx(max(compute_ms, memory_ms) / row["batch_compute_mean_ms"])
    # one model in the point: 25 W over its queries and samples
    assert row["power_w_mean"] == pytest.approx(25.0)
    assert row["energy_per_query_j"] == pytest.approx(25.0 / row["queries_per_s"])
    assert row["energy_per_sample_j"] == pytest.approx(25.0 / row["samples_per_s"])
    assert row["process_rss_max_mb"] > 0  # the serving process and its instances
    rows = pq.read_table(run.dir / "telemetry.parquet").to_pylist()
    assert {r["point"] for r in rows} == {0} and any(r["quantity"] == "power_w" for r in rows)
    # the build served (chosen at start) and its warm cost; every query's latency in parts that add up
    assert row["build"] in ("eager", "fused", "compiled") and row["batch_fixed_ms"] > 0
    assert server.precision_choices["tiny"]["build_choice"]["accuracy"]["passed"]
    from dlrm_lab.metrics.columns import LATENCY_PARTS

    queries = [q for q in pq.read_table(run.dir / "queries.parquet").to_pylist() if q["status"] == "ok"]
    for q in queries:
        assert sum(q[f"lat_{p}_ms"] or 0.0 for p in LATENCY_PARTS) == pytest.approx(q["latency_ms"], abs=1e-6)
        assert q["lat_roof_ms"] > 0 and q["batch_start_ms"] >= q["start_ms"]
        assert q["batch_assembly_ms"] > 0 and q["batch_lookup_ms"] > 0 and q["batch_completion_ms"] > 0
    assert row["tail_queue_ms"] is not None and row["batch_dense_mean_ms"] > 0


def test_the_lab_chooses_a_bound_and_a_rate_it_measured_this_server_can_honour(server):
    import math

    from dlrm_lab.infer.calibrate import HEADROOM, SLA_FACTOR, choose_load
    from dlrm_lab.infer.load import QuerySizes, Stream

    stream = Stream("tiny", 1.0, QuerySizes.parse("fixed:4"))
    # short probes: what is tested is how the verdicts steer the bisection and the choice, whatever they are
    c = choose_load(server, stream, sla_ms=None, probes=3, probe_s=0.15, min_queries=25, seed=SEED)
    assert c.capacity_qps > 0 and 0 < c.unloaded_latency_ms < math.inf
    assert c.sla_chosen and c.sla_ms == math.ceil(SLA_FACTOR * c.unloaded_latency_ms)
    # of queries that each met a server idle 20 ms
    assert c.unloaded_idle_ms == 20.0 and "a query meeting a server idle 20 ms" in c.reason
    assert c.to_dict()["unloaded_idle_ms"] == 20.0
    assert len(c.probes) == 3 and c.probes[0]["qps"] == pytest.approx(c.capacity_qps / 2)
    for p in c.probes:  # each verdict is the probe's own percentile against the bound (dropped: inf)
        assert p["passed"] == (p["latency_ms"] is not None and p["latency_ms"] <= c.sla_ms)
    for prev, nxt in zip(c.probes, c.probes[1:], strict=False):  # bisection: up after a pass, down after a fail
        assert (nxt["qps"] > prev["qps"]) == prev["passed"]
    passing = [p["qps"] for p in c.probes if p["passed"]]
    assert c.best_passing_qps == (max(passing) if passing else 0.0)
    if passing:
        assert c.qps == pytest.approx(HEADROOM * c.best_passing_qps) and "chosen by the lab" in c.reason
    assert c.to_dict()["sla_ms"] == c.sla_ms and c.to_dict()["headroom"] == HEADROOM
    roof = c.queueing_roof  # the ideal server with these instances' warm batch cost, under the same bound
    assert roof is not None and roof["sla_ms"] == c.sla_ms and 0 <= roof["rate_qps"] <= roof["capacity_qps"]
    assert roof["capacity_qps"] >= c.capacity_qps * (1 - 1e-9)  # never below the server's own closed loop
    assert "queueing roof" in c.roof_reason and c.to_dict()["queueing_roof"] == roof

    impossible = choose_load(server, stream, sla_ms=1e-3, probes=2, probe_s=0.15, min_queries=25, seed=SEED)
    assert impossible.best_passing_qps == 0 and not any(p["passed"] for p in impossible.probes)
    assert impossible.qps == min(p["qps"] for p in impossible.probes) and "no probed rate met" in impossible.reason


def test_infer_run_with_auto_load_records_the_choice_and_runs_at_it(tmp_path):
    import json

    import pyarrow.parquet as pq

    from dlrm_lab.infer import lab
    from dlrm_lab.infer.load import QuerySizes, Stream
    from dlrm_lab.infer.tune import spin_candidates

    served = ServedModel("tiny", load_preset("tiny"), max_batch=32, library_samples=2048)
    cfg = lab.InferConfig(duration_s=0.3, qps_auto=True, sla_auto=True, calibrate_s=0.2, seed=SEED,
                          tune=("max_batch", "spin_ms"))  # fmt: skip
    lines = []
    run_dir = lab.run_inference(
        [served], [Stream("tiny", 0.0, QuerySizes.parse("fixed:2"))], cfg, metrics_dir=tmp_path, log=lines.append
    )
    manifest = json.loads((run_dir / "manifest.json").read_text())
    choice = manifest["load_choice"]
    assert manifest["config"]["streams"][0]["qps"] == "auto"
    (row,) = pq.read_table(run_dir / "summary.parquet").to_pylist()
    assert row["target_qps"] == pytest.approx(choice["qps"]) and choice["qps"] > 0
    assert row["sla_ms"] == choice["sla_ms"] and choice["sla_chosen"]
    assert any(line.startswith(("load chosen by the lab", "no probed rate met")) for line in lines)
    # the policy is chosen once the bound is known, at half of capacity where the bisection starts, so that the
    # probes run it; the point runs with it
    policy = manifest["policy_choices"]["tiny"]
    assert policy["qps"] == pytest.approx(choice["capacity_qps"] / 2) == choice["probes"][0]["qps"]
    assert policy["tuned"] == ["max_batch", "spin_ms"]
    assert [p["spin_ms"] for p in policy["probes"]] == spin_candidates(policy["qps"], 1)
    assert (row["max_batch"], row["spin_ms"], row["max_delay_ms"]) == (policy["max_batch"], policy["spin_ms"], 1.0)
    assert policy["max_batch"] % 64 == 0 and any(line.startswith("tiny: serving policy chosen") for line in lines)
    assert manifest["precision_choices"]["tiny"]["precision"] == "fp32"  # ServedModel's default, not measured


def test_idle_instances_share_a_query_in_pieces_of_at_least_min_piece(server):
    """A query the free instances can take at once is spread over them (lower latency at
    low load), never in pieces smaller than min_piece."""
    measured = server.models["tiny"].min_piece
    assert measured >= 1  # resolved at start from the instances' batch times
    try:
        server.configure("tiny", max_batch=64, max_delay_ms=0.0, min_piece=10)
        server.submit(Query(0, "tiny", 40, 0))
        (spread,) = _drain(server)
        server.configure("tiny", min_piece=1000)
        server.submit(Query(1, "tiny", 40, 0))
        (whole,) = _drain(server)
    finally:
        server.configure("tiny", max_batch=64, max_delay_ms=2.0, min_piece=0)
    assert spread["status"] == "ok" and spread["pieces"] == 2 and spread["batch_samples"] == 20
    assert whole["status"] == "ok" and whole["pieces"] == 1 and whole["batch_samples"] == 40
    assert server.models["tiny"].min_piece == measured  # 0 restores the measured break-even


def test_a_traced_point_is_chrome_trace_json_with_the_labs_spans_on_the_servers_clock(server, tmp_path):
    """--trace: every instance's torch.profiler operators and the lab's queries and batches in one
    trace.json that Perfetto and chrome://tracing open; the instances' profiles are moved onto the
    server's clock by the batch marks they carry."""
    import json

    from dlrm_lab.infer import load_point
    from dlrm_lab.infer.load import QuerySizes, Stream
    from dlrm_lab.metrics.columns import schema_of
    from dlrm_lab.metrics.run import Run

    cfg = load_point.InferConfig(duration_s=0.5, sla_ms=50, warmup_s=0.1)
    with Run.create(tmp_path, "infer", {}) as run:
        load_point.measure(server, load_point.Point(0, [Stream("tiny", 200.0, QuerySizes.parse("fixed:8"))]), cfg,
                           run.table("queries", schema_of("queries")), run.dir, trace=True)  # fmt: skip
    trace = json.loads((run.dir / "trace.json").read_text())
    events = trace["traceEvents"]
    assert isinstance(events, list) and trace["otherData"]["instances_aligned"] == [0, 1]
    for e in events:  # the fields every Chrome trace event needs
        assert {"ph", "pid", "name"} <= set(e) and (e["ph"] == "M" or isinstance(e["ts"], float | int))
    begins = [e for e in events if e["ph"] == "b" and e["cat"] == "query" and e["name"].startswith("query ")]
    assert begins and all({"latency_ms", "lat_queue_ms", "lat_roof_ms"} <= set(e["args"]) for e in begins)
    ends = [e for e in events if e["ph"] == "e" and e["cat"] == "query" and e["name"].startswith("query ")]
    assert len(ends) == len(begins)
    names = {e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert {"queries (dlrm-lab)", "instance 0 (tiny)", "instance 1 (tiny)"} <= names
    assert any(e.get("cat") == "cpu_op" for e in events)  # the profiler's operators
    marks = {e["name"]: e["ts"] for e in events if e.get("cat") == "user_annotation"}
    ours = {e["name"]: e["ts"] for e in events if e.get("cat") == "batch"}
    common = sorted(set(marks) & set(ours))
    assert common and sorted(abs(marks[n] - ours[n]) for n in common)[len(common) // 2] < 1000  # within 1 ms
    assert not (run.dir / "trace-instances").exists()  # merged into trace.json


def test_an_instance_stopped_inside_a_point_is_a_stall_the_point_names(server):
    import signal

    from dlrm_lab.infer.completions import STALL_MS
    from dlrm_lab.infer.load_point import point_line, stall_columns

    server.take_stalls()
    pid = server.instance_info[0]["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        for i in range(8):  # full batches: both instances get one at once; instance 0's waits in its pipe
            server.submit(Query(900_000 + i, "tiny", 64, offset=64 * i))
        time.sleep(1.2 * STALL_MS / 1e3)
    finally:
        os.kill(pid, signal.SIGCONT)
    _drain(server)
    stalls = server.take_stalls()
    assert stalls and {s["instance"] for s in stalls} == {0} and all(s["took_ms"] >= STALL_MS for s in stalls)
    cols = stall_columns(stalls)
    assert cols["instance_stalls"] == len(stalls) and cols["stalled_instances"] == "0"
    row = {"model": "tiny", "mode": "together", "target_qps": 1.0, "queries_per_s": 1.0, "samples_per_s": 4.0,
           "dropped_queries": 0, "late_queries": 0, "sla_met": True, **cols}  # fmt: skip
    assert f"instance 0 stalled: {len(stalls)} batch(es) held up to" in point_line(row)
    assert stall_columns([]) == {"instance_stalls": 0, "longest_stall_s": None, "stalled_instances": None}


def test_an_oversized_query_takes_turns_an_expired_one_is_not_computed_and_a_huge_one_is_refused(server):
    """An oversized query (more than a piece per instance) goes behind the others after each piece, so a small
    query sent after it is not starved; a query whose deadline passed before it began is never computed; a
    query above --max-query-samples is rejected at once, naming the bound."""
    server.take_records()
    big, small = Query(910_000, "tiny", 2000, offset=0), Query(910_001, "tiny", 4, offset=0)
    server.submit(big)
    server.submit(small)
    expired = Query(910_002, "tiny", 8, offset=0, deadline_ns=time.monotonic_ns() - 1)
    server.submit(expired)
    huge = Query(910_003, "tiny", 70_000, offset=0)
    server.submit(huge)
    rows = {r["query_id"]: r for r in _drain(server)}
    assert rows[910_000]["status"] == "ok" and rows[910_000]["pieces"] > 2 * 2  # split over turns
    assert rows[910_001]["status"] == "ok" and rows[910_001]["end_ms"] < rows[910_000]["end_ms"]
    # from its own issue it waited a few pieces, not behind all ~31 of them (measured from when it was issued: on a
    # loaded machine this thread may submit it several pieces after the big one, and each piece's fixed cost is most
    # of it where the kernels are fast: 0.51 of the span once, on AMX, with the suite's other worker beside it)
    big_span = rows[910_000]["end_ms"] - rows[910_000]["start_ms"]
    assert rows[910_001]["queue_ms"] < 0.75 * big_span, (rows[910_001]["queue_ms"], big_span)
    assert rows[910_002]["status"] == "expired" and rows[910_002]["start_ms"] is None
    assert rows[910_002]["error"] == "its deadline passed with 8 of 8 samples not begun"
    assert rows[910_003]["status"] == "rejected" and rows[910_003]["error"] == (
        "70000 samples: at most 65536 a query (--max-query-samples)"
    )

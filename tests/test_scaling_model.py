"""The scaling model (issue 18): the gap breakdown's arithmetic, predictions and projections
on fake profiles with answers worked by hand, and the probe's multi-process ceiling."""

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import dlrm_lab
from dlrm_lab.metrics.ceiling import ceiling_efficiency
from dlrm_lab.model.cost import step_communication_bytes
from dlrm_lab.train.fabrics import FABRICS, Fabric, project
from dlrm_lab.train.scaling_model import (
    Collective,
    StepTimes,
    fit_collectives,
    gap_breakdown,
    per_rank_work,
    predict,
    roof,
)

PHASES_ONE = {
    "data_wait": 1.0,
    "input_dist": 2.0,
    "embedding_lookup": 10.0,
    "embedding_all_to_all": 1.0,
    "dense_forward": 30.0,
    "backward": 50.0,
    "optimizer": 4.0,
}  # 98 ms in phases
ONE = StepTimes(step_ms=100.0, phases=PHASES_ONE, batch_size_per_rank=64, world_size=1)
MANY = StepTimes(
    step_ms=180.0,
    phases={
        "data_wait": 1.5,
        "input_dist": 8.0,
        "embedding_lookup": 14.0,
        "embedding_all_to_all": 6.0,
        "dense_forward": 45.0,
        "backward": 95.0,
        "optimizer": 6.0,
    },  # 175.5 ms in phases
    batch_size_per_rank=64,
    world_size=2,
)
# 1 ms a collective plus 1 GB/s: 1e6 bytes -> 1 ms + 1 ms
FITS = {"all_to_all": Collective(1e-3, 1e9), "all_reduce": Collective(1e-3, 1e9)}
COMM = {"input_dist": 1e6, "pooled_all_to_all": 2e6, "gradient_all_reduce": 3e6}


def test_the_gap_is_named_to_the_millisecond():
    gap = gap_breakdown(ONE, MANY, COMM, FITS, ceiling=0.8)
    items = gap["items_ms"]
    assert gap["gap_ms"] == pytest.approx(80.0)
    assert sum(items.values()) == pytest.approx(80.0) and gap["named_ms"] == pytest.approx(80.0)
    # compute phases (data wait, lookup, forward, optimizer, backward: 95 ms) / 0.8 - 95
    assert items["compute at the machine's ceiling"] == pytest.approx(95 / 0.8 - 95)
    assert items["dense_forward: beyond the ceiling"] == pytest.approx(45 - 30 / 0.8)
    # input distribution: 3 collectives x 1 ms + 1e6 B at 1 GB/s = 4 ms of the 6 ms it grew
    assert items["input_dist: at the measured bandwidth"] == pytest.approx(4.0)
    assert items["input_dist: beyond the bandwidth and the wait"] == pytest.approx(2.0)
    assert items["input_dist: waiting for the slowest rank (one rank's step-to-step jitter)"] == 0.0  # no jitter
    # pooled all-to-all forward half: 1 ms + 1e6 B = 2 ms of 5
    assert items["embedding_all_to_all: at the measured bandwidth"] == pytest.approx(2.0)
    # backward: pooled half (2 ms) + all-reduce (1 ms + 3 ms) = 6 ms; 95 - 50 / 0.8 - 6 beyond
    assert items["backward: collectives at the measured bandwidth"] == pytest.approx(6.0)
    assert items["backward: beyond the ceiling, the bandwidth and the wait"] == pytest.approx(95 - 62.5 - 6)
    assert items["untimed (between phases)"] == pytest.approx(4.5 - 2.0)
    assert gap["assumptions"] == []


def test_collectives_wait_for_the_slowest_rank_by_the_order_statistics_of_one_rank():
    # lookup times 1 or 3 ms: the slower of 2 ranks averages 1 x 1/4 + 3 x 3/4 = 2.5, 0.5 over the mean
    jittery = StepTimes(step_ms=100.0, phases=PHASES_ONE, batch_size_per_rank=64, world_size=1,
                        per_step={"embedding_lookup": (1.0, 3.0), "dense_forward": (30.0, 30.0)})  # fmt: skip
    assert jittery.slowest_of("embedding_lookup", 2) == pytest.approx(0.5)
    assert jittery.slowest_of("embedding_lookup", 1) == 0.0 and jittery.slowest_of("dense_forward", 8) == 0.0
    assert jittery.slowest_of("embedding_lookup", 64) == pytest.approx(1.0, abs=1e-6)  # nearly always the 3
    gap = gap_breakdown(jittery, MANY, COMM, FITS, ceiling=0.8)
    wait = gap["items_ms"]["embedding_all_to_all: waiting for the slowest rank (one rank's step-to-step jitter)"]
    assert wait == pytest.approx(0.5) and sum(gap["items_ms"].values()) == pytest.approx(80.0)
    assert gap["items_ms"]["embedding_all_to_all: beyond the bandwidth and the wait"] == pytest.approx(5 - 2 - 0.5)
    assert predict(jittery, 64, 2, COMM, FITS, 0.5)["wait_ms"] == pytest.approx(0.5)


def test_the_wait_for_the_slowest_rank_is_measured_in_the_n_rank_run(tmp_path):
    """A collective phase ends when the last rank arrives: a rank's time in it beyond the fastest
    rank's at that step is its wait. Both ranks slower at the same step (the source's block) is no wait."""
    phases = {p: 1.0 for p in PHASES_ONE}
    rows = []
    for step, (in0, in1, bw0, bw1) in enumerate(
        [(2.0, 5.0, 10.0, 10.0), (9.0, 9.0, 14.0, 10.0), (4.0, 2.0, 10.0, 12.0)]
    ):
        for rank, (inp, bw) in enumerate(((in0, bw0), (in1, bw1))):
            row = {f"{p}_ms": v for p, v in phases.items()} | {"input_dist_ms": inp, "backward_ms": bw}
            rows.append({"step": step, "rank": rank, "warmup": False, "batch_size": 64, "step_time_ms": 20.0, **row})
    rows.append({**rows[0], "step": 3, "input_dist_ms": 50.0})  # a step only rank 0 recorded: left out
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "steps.parquet")
    many = StepTimes.from_run(tmp_path)
    # input dist: per step the excess over the fastest rank, 3 + 0 + 2, over 3 steps x 2 ranks
    assert many.late_ms["input_dist"] == pytest.approx(5 / 6)
    assert many.late_ms["backward"] == pytest.approx(6 / 6) and many.late_ms["embedding_all_to_all"] == 0.0
    gap = gap_breakdown(ONE, many, COMM, FITS, ceiling=1.0)
    items = gap["items_ms"]
    assert items["input_dist: waiting for the slowest rank (measured)"] == pytest.approx(5 / 6)
    assert items["backward: waiting for the slowest rank (measured)"] == pytest.approx(1.0)
    assert sum(items.values()) == pytest.approx(gap["gap_ms"])
    assert not any("jitter" in item for item in items)


def test_the_pooled_all_to_all_backward_timed_apart_is_its_own_item(tmp_path):
    """Runs that time the pooled all-to-all's backward apart (tensor hooks) name it beside the
    forward half: its probed time, its measured wait, and what is beyond; backward keeps the
    all-reduce. Older runs (no such column) keep it inside backward as before."""
    split = StepTimes(step_ms=180.0, phases={**MANY.phases, "backward": 87.0, "embedding_all_to_all_backward": 8.0},
                      batch_size_per_rank=64, world_size=2)  # fmt: skip
    items = gap_breakdown(ONE, split, COMM, FITS, ceiling=0.8)["items_ms"]
    assert sum(items.values()) == pytest.approx(80.0)
    # the backward half of 2e6 pooled bytes: 1 ms + 1e6 B at 1 GB/s = 2 ms of its 8
    assert items["embedding_all_to_all_backward: at the measured bandwidth"] == pytest.approx(2.0)
    assert items["embedding_all_to_all_backward: beyond the bandwidth and the wait"] == pytest.approx(6.0)
    # backward: the all-reduce (1 ms + 3 ms) and what is beyond the ceiling share 50 / 0.8
    assert items["backward: the gradient all-reduce at the measured bandwidth"] == pytest.approx(4.0)
    assert items["backward: beyond the ceiling and the bandwidth"] == pytest.approx(87 - 62.5 - 4)
    assert not any(item.startswith("backward: waiting") for item in items)

    # measured in the N-rank run: rank 0 reached the backward all-to-all 3 ms before rank 1 at step 0
    rows = []
    for step, (a0, a1) in enumerate([(5.0, 2.0), (2.0, 2.0)]):
        for rank, a2a in enumerate((a0, a1)):
            row = {f"{p}_ms": v for p, v in split.phases.items()} | {"embedding_all_to_all_backward_ms": a2a}
            rows.append({"step": step, "rank": rank, "warmup": False, "batch_size": 64, "step_time_ms": 180.0, **row})
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "steps.parquet")
    many = StepTimes.from_run(tmp_path)
    assert many.late_ms["embedding_all_to_all_backward"] == pytest.approx(3 / 4)
    measured = gap_breakdown(ONE, many, COMM, FITS, ceiling=0.8)["items_ms"]
    assert measured["embedding_all_to_all_backward: waiting for the slowest rank (measured)"] == pytest.approx(0.75)
    assert sum(measured.values()) == pytest.approx(many.step_ms - 100.0)


def test_torchrec_distribution_where_probed_replaces_the_raw_collectives():
    """The probe times TorchRec's input distribution and pooled all-to-all as a step runs them
    (permutes, awaitables and copies around the collectives): the model takes those where present."""
    raw = [{"collective": c, "bytes": b, "time_ms": 1.0, "busbw_bytes_per_s": b / 1e-3}
           for c in ("all_to_all", "all_reduce") for b in (1e3, 1e7)]  # fmt: skip
    lib = [{"collective": name, "bytes": b, "time_ms": ms, "busbw_bytes_per_s": b / (ms / 1e3)}
           for name, b, ms in (("torchrec_input_dist", 1e6, 3.0), ("torchrec_pooled", 2e6, 8.0))]  # fmt: skip
    plain, with_lib = (
        fit_collectives({"comms": {"mpi/2": raw}}, "mpi/2"),
        fit_collectives({"comms": {"mpi/2": raw + lib}}, "mpi/2"),
    )
    assert "torchrec_pooled" not in plain and with_lib["torchrec_input_dist"].seconds(1e6) == pytest.approx(3e-3)
    # COMM: 1e6 B of ids -> 3 ms; 2e6 B of pooled rows forward and backward -> 8 ms, 4 each; the all-reduce as raw
    a = predict(ONE, 64, 2, COMM, plain, 1.0)["comm_ms"]
    b = predict(ONE, 64, 2, COMM, with_lib, 1.0)["comm_ms"]
    assert b - a == pytest.approx(
        (3.0 + 8.0) - (3 * 1.0 + 2 * 1.0)
    )  # raw: 3 ids calls at 1 ms, 2 pooled halves at 1 ms
    items = gap_breakdown(ONE, MANY, COMM, with_lib, ceiling=0.8)["items_ms"]
    assert items["input_dist: through TorchRec at its probed speed"] == pytest.approx(3.0)
    assert items["embedding_all_to_all: through TorchRec at its probed speed"] == pytest.approx(4.0)
    assert sum(items.values()) == pytest.approx(80.0)
    # data-parallel tables: no pooled all-to-all, backward's collective is the raw all-reduce
    replicated = gap_breakdown(ONE, MANY, {**COMM, "pooled_all_to_all": 0.0}, with_lib, ceiling=0.8)["items_ms"]
    assert replicated["backward: collectives at the measured bandwidth"] == pytest.approx(1.0)  # raw rows: 1 ms
    # the probe's forward share splits the pooled path's time: a quarter forward, the rest backward
    shared = fit_collectives({"comms": {"mpi/2": raw + [{**lib[1], "forward_share": 0.25}]}}, "mpi/2")
    split = StepTimes(step_ms=180.0, phases={**MANY.phases, "backward": 87.0, "embedding_all_to_all_backward": 8.0},
                      batch_size_per_rank=64, world_size=2)  # fmt: skip
    items = gap_breakdown(ONE, split, COMM, shared, ceiling=0.8)["items_ms"]
    assert items["embedding_all_to_all: through TorchRec at its probed speed"] == pytest.approx(2.0)
    assert items["embedding_all_to_all_backward: through TorchRec at its probed speed"] == pytest.approx(6.0)
    assert predict(ONE, 64, 2, COMM, shared, 1.0)["comm_ms"] == pytest.approx(b - 3.0 + 3 * 1.0)  # raw ids, same total


def test_row_wise_outputs_are_timed_as_reduce_scatters():
    # 2e6 bus bytes of reduce-scatter: forward half 1e6 = half of a 2e6-bus-byte all-reduce (1 ms + 2 ms) / 2
    comm = {**COMM, "pooled_all_to_all": 0.0, "pooled_reduce_scatter": 2e6}
    with_rs = predict(ONE, 64, 2, comm, FITS, ceiling=0.5)
    without = predict(ONE, 64, 2, {**comm, "pooled_reduce_scatter": 0.0}, FITS, ceiling=0.5)
    assert with_rs["comm_ms"] - without["comm_ms"] == pytest.approx(2 * 1.5)


def test_the_gap_without_a_probe_says_what_it_assumed():
    gap = gap_breakdown(ONE, MANY, COMM, None, ceiling=None)
    assert sum(gap["items_ms"].values()) == pytest.approx(80.0)
    assert gap["items_ms"]["compute at the machine's ceiling"] == 0.0
    assert gap["items_ms"]["input_dist: communication"] == pytest.approx(6.0)
    assert len(gap["assumptions"]) == 2 and "ceiling" in gap["assumptions"][0]


def test_strong_scaling_compares_against_half_the_work():
    # half of every phase but the dense optimizer (4 ms: it steps every parameter whatever the batch)
    half = StepTimes(step_ms=60.0, phases={k: v / 2 for k, v in PHASES_ONE.items()} | {"optimizer": 4.0},
                     batch_size_per_rank=32, world_size=2)  # fmt: skip
    gap = gap_breakdown(ONE, half, COMM, FITS, ceiling=1.0)
    assert gap["one_rank_step_ms"] == pytest.approx(52.0) and gap["gap_ms"] == pytest.approx(8.0)
    assert sum(gap["items_ms"].values()) == pytest.approx(8.0)
    assert gap["items_ms"]["optimizer: beyond the ceiling"] == pytest.approx(0.0)


def test_strong_sweeps_calibrate_on_one_rank_at_the_smallest_batch(tmp_path):
    """A step has costs per step as well as per sample: a strong sweep runs one rank again at the
    smallest per-rank batch (not a row of the table), and the model draws each phase's line through both."""
    from dlrm_lab.scaling import scaling_spec, table_points

    strong = scaling_spec([1, 2, 4], "strong", 256, {"preset": "tiny"}, tmp_path)
    assert [(p["ranks"], p["batch-size"]) for p in strong.points] == [(1, 256), (2, 128), (4, 64), (1, 64)]
    assert table_points(strong) == strong.points[:3]
    weak = scaling_spec([1, 2], "weak", 64, {"preset": "tiny"}, tmp_path)
    assert table_points(weak) == weak.points and len(weak.points) == 2
    no_one = scaling_spec([2, 4], "strong", 256, {"preset": "tiny"}, tmp_path)
    assert len(no_one.points) == 2  # no one-rank point to calibrate against

    def run(b):  # one rank at b samples: every phase 10 ms + 1/8 ms a sample but the optimizer's 4 ms; 1 ms untimed
        phases = {p: (4.0 if p == "optimizer" else 10.0 + b / 8) for p in PHASES_ONE}
        return StepTimes(step_ms=sum(phases.values()) + 1.0, phases=phases, batch_size_per_rank=b, world_size=1)

    big, small = run(64), run(32)
    work, untimed = per_rank_work(big, 16, small)  # extrapolated down the line
    line = {p: (4.0 if p == "optimizer" else 12.0) for p in PHASES_ONE}
    assert {p: work[p] for p in PHASES_ONE} == pytest.approx(line)
    assert work["embedding_all_to_all_backward"] == 0.0  # a phase these runs did not record: no time
    assert untimed == pytest.approx(1.0)
    proportional, _ = per_rank_work(big, 16)  # without the second run: in proportion, the optimizer whole
    assert proportional["dense_forward"] == pytest.approx(18.0 / 4) and proportional["optimizer"] == 4.0
    assert predict(big, 32, 1, COMM, FITS, None, small)["step_ms"] == pytest.approx(small.step_ms)


def test_the_roof_is_the_prediction_without_waits_at_the_raw_collectives():
    """What the machine allows: compute at the ceiling, the bytes at the raw collectives' probed
    speed, no waits; and the same through TorchRec's probed path (what the library allows)."""
    assert roof(ONE, 64, 2, COMM, FITS, 0.5) == pytest.approx({"machine_ms": 207.0, "library_ms": 207.0})
    jittery = StepTimes(step_ms=100.0, phases=PHASES_ONE, batch_size_per_rank=64, world_size=1,
                        per_step={"embedding_lookup": (1.0, 3.0)})  # fmt: skip
    assert predict(jittery, 64, 2, COMM, FITS, 0.5)["step_ms"] == pytest.approx(207.5)  # 0.5 ms of expected wait
    assert roof(jittery, 64, 2, COMM, FITS, 0.5)["machine_ms"] == pytest.approx(207.0)  # the roof has none
    raw = [{"collective": c, "bytes": b, "time_ms": 1.0, "busbw_bytes_per_s": b / 1e-3}
           for c in ("all_to_all", "all_reduce") for b in (1e3, 1e7)]  # fmt: skip
    lib = [{"collective": name, "bytes": b, "time_ms": ms, "busbw_bytes_per_s": b / (ms / 1e3)}
           for name, b, ms in (("torchrec_input_dist", 1e6, 3.0), ("torchrec_pooled", 2e6, 8.0))]  # fmt: skip
    both = roof(ONE, 64, 2, COMM, fit_collectives({"comms": {"mpi/2": raw + lib}}, "mpi/2"), 1.0)
    assert both["library_ms"] - both["machine_ms"] == pytest.approx((3.0 + 8.0) - (3 * 1.0 + 2 * 1.0))
    assert roof(ONE, 64, 1, COMM, FITS, 0.5) is None and roof(ONE, 64, 2, COMM, None, 0.5) is None
    assert roof(ONE, 64, 2, COMM, FITS, None) is None


def test_prediction_on_a_fake_profile():
    # compute (95 ms) / 0.5 + local comm phases and untimed (2 + 1 + 2) + collectives (4 + 2 + 2 + 4)
    got = predict(ONE, 64, 2, COMM, FITS, ceiling=0.5)
    assert got["step_ms"] == pytest.approx(190 + 5 + 12)
    assert got["comm_ms"] == pytest.approx(12)
    strong = predict(ONE, 32, 2, COMM, FITS, ceiling=1.0)  # half of all but the optimizer's 4 ms
    assert strong["step_ms"] == pytest.approx((95 - 4) / 2 + 4 + 2.5 + 12)
    assert predict(ONE, 64, 1, COMM, FITS, None)["step_ms"] == 100.0
    assert "ceiling" in predict(ONE, 64, 2, COMM, FITS, ceiling=None)
    assert "collectives" in predict(ONE, 64, 2, COMM, None, ceiling=0.9)


def test_collectives_are_taken_from_the_probe_rows_as_measured():
    # bus bytes = busbw x time: 500 B in 0.5 ms, 1e6 B in 2 ms (all-to-all); 1e3 B in 0.1 ms, 1e6 B in 1 ms
    rows = [
        {"collective": "all_to_all", "bytes": 1024, "time_ms": 0.5, "busbw_bytes_per_s": 1e6},
        {"collective": "all_to_all", "bytes": 1 << 21, "time_ms": 2.0, "busbw_bytes_per_s": 5e8},
        {"collective": "all_reduce", "bytes": 1024, "time_ms": 0.1, "busbw_bytes_per_s": 1e7},
        {"collective": "all_reduce", "bytes": 1 << 20, "time_ms": 1.0, "busbw_bytes_per_s": 1e9},
    ]
    fits = fit_collectives({"comms": {"mpi/2": rows}}, "mpi/2")
    a2a, ar = fits["all_to_all"], fits["all_reduce"]
    assert a2a.seconds(100) == pytest.approx(0.5e-3)  # below the smallest: its time
    assert a2a.seconds(500 + (1e6 - 500) / 2) == pytest.approx(1.25e-3)  # halfway: halfway
    # beyond the largest: the last segment's time per byte (1.5 ms more for 999,500 B more), not its mean
    assert a2a.seconds(2e6) == pytest.approx(2e-3 + 1e6 * 1.5e-3 / 999_500)
    one_size = fit_collectives({"comms": {"mpi/2": [rows[1], rows[3]]}}, "mpi/2")["all_to_all"]
    assert one_size.seconds(2e6) == pytest.approx(4e-3)  # one probed size: at its bandwidth
    flat = fit_collectives({"comms": {"mpi/2": [rows[0], {**rows[1], "time_ms": 0.5, "busbw_bytes_per_s": 2e9},
                                                  *rows[2:]]}}, "mpi/2")["all_to_all"]  # fmt: skip
    assert flat.seconds(2e6) == pytest.approx(1e-3)  # a last segment that does not rise: at the largest's bandwidth
    assert a2a.seconds(1e6, count=3) == pytest.approx(2e-3 + 2 * 0.5e-3)  # other collectives at latency
    assert ar.seconds(1e6) == pytest.approx(1e-3) and ar.seconds(0) == 0.0
    assert fit_collectives({"comms": {"mpi/2": rows}}, "gloo/2") is None
    assert fit_collectives(None, "gloo/2") is None


def test_projection_on_a_fabric_with_round_numbers():
    fabric = Fabric("round", "test", ranks_per_node=4, intra_bytes_per_s=100e9, inter_bytes_per_s=10e9,
                    latency_s=0.0, peer_s=1e-5, step_floor_s=1e-4, flops_per_s=1e12, memory_bytes_per_s=1e12,
                    memory_bytes=1e9,
                    source="made up")  # fmt: skip
    work = {"flops": 1e9, "gather_bytes": 1e8, "stream_bytes": 0.0}  # 1 ms of compute at the roof
    bytes_at = lambda global_batch, n: {  # noqa: E731
        "input_dist": 0.0,
        "pooled_all_to_all": 2e7 * (n - 1) / n,
        "gradient_all_reduce": 0.0,
    }
    rows, assumptions = project(work, 0.5, bytes_at, [1, 4, 8, 64], fabric, 64, "weak")
    one, four, eight, many = rows
    assert one["compute_ms"] == pytest.approx(2.0) and one["step_ms"] == pytest.approx(2.0)
    assert one["efficiency"] == pytest.approx(1.0)
    # 4 ranks, one node: 2 x 1e7 x 3/4 bytes over 100 GB/s = 0.15 ms, + 2 x 3 peers x 10 us
    assert four["pooled_all_to_all_ms"] == pytest.approx(0.15 + 0.06)
    # 8 ranks over 2 nodes: 4 of 7 peers remote; 2 x 1e7 x 7/8 x 4/7 B over 10 GB/s = 1 ms, + 2 x 7 x 10 us
    assert eight["pooled_all_to_all_ms"] == pytest.approx(1.0 + 0.14)
    assert not eight["all_to_all_dominates"]
    assert many["pooled_all_to_all_ms"] > many["compute_ms"] and many["all_to_all_dominates"]
    assert many["efficiency"] < eight["efficiency"] < 1
    assert any("0.50" in a for a in assumptions)


def test_published_fabrics_project_a_preset():
    spec = dlrm_lab.load_preset("dcnv2")
    work = {"flops": 2048 * 3e7, "gather_bytes": 2048 * 1e5, "stream_bytes": 1e8}
    rows, _ = project(work, 0.4, lambda b, n: step_communication_bytes(spec, b, n), [8, 64, 512, 4096],
                      FABRICS["h100-nvlink-ndr"], 2048, "weak")  # fmt: skip
    assert [r["ranks"] for r in rows] == [8, 64, 512, 4096]
    assert all(r["step_ms"] > r["compute_ms"] > 0 for r in rows)
    assert rows[-1]["efficiency"] < rows[0]["efficiency"]  # all-to-all grows with ranks


def test_the_ceiling_is_read_from_the_profile():
    profile = {"devices": {"cpu": {"ceiling": {"2": {"gemm": {"efficiency": 0.87}, "copy": {"efficiency": 0.6}}}}}}
    assert ceiling_efficiency(profile, 2) == 0.87 and ceiling_efficiency(profile, 2, "copy") == 0.6
    assert ceiling_efficiency(profile, 1) == 1.0 and ceiling_efficiency(profile, 4) is None
    assert ceiling_efficiency(None, 2) is None  # the probe itself: tests/test_roofline.py


def test_step_times_come_from_the_measured_steps(tmp_path):
    rows = []
    for rank in (0, 1):
        for step in range(4):
            rows.append({"rank": rank, "step": step, "warmup": step == 0, "batch_size": 64,
                         "step_time_ms": 1000.0 if step == 0 else 100.0 + 10 * rank,
                         **{f"{p}_ms": v for p, v in PHASES_ONE.items()}})  # fmt: skip
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "steps.parquet")
    times = StepTimes.from_run(tmp_path)
    assert times.step_ms == pytest.approx(105.0) and times.world_size == 2  # warm-up left out
    assert times.phases == pytest.approx({**PHASES_ONE, "embedding_all_to_all_backward": 0.0})  # not recorded: 0
    assert times.untimed_ms == pytest.approx(7.0)


def test_scaling_takes_each_efficiency_from_its_repeats_adjacent_pair_and_leaves_out_a_drifted_one():
    """Issue 60: a repeat's 1-rank and N-rank runs ran one after the other; each pair gives one efficiency, so a host
    twice as fast in one repeat moves neither; a pair whose canaries disagree by over 20% is left out."""
    from dlrm_lab.scaling import paired_efficiencies

    first = {r: (1, {"samples_per_s": rate, "canary_ratio": 0.9}) for r, rate in enumerate((1000.0, 2000.0, 1000.0))}
    two = {0: {"samples_per_s": 1800.0, "canary_ratio": 0.9}, 1: {"samples_per_s": 3600.0, "canary_ratio": 0.9},
           2: {"samples_per_s": 1000.0, "canary_ratio": 0.5}}  # fmt: skip
    paired = paired_efficiencies(first, two, ranks=2)
    assert paired["efficiency"] == pytest.approx(0.9) and paired["efficiency_spread"] == pytest.approx(0.0)
    assert paired["efficiency_pairs"] == 2 and paired["efficiency_pairs_left_out"] == 1
    assert paired_efficiencies(first, {}, ranks=2) == {
        "efficiency_pairs": 0, "efficiency_pairs_left_out": 0, "efficiency_spread": None}  # fmt: skip

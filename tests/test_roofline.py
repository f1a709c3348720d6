"""Machine profiles and the roofline: peaks measured, stored per machine, and runs placed against them."""

import json
import os
import time
from dataclasses import replace
from typing import Any

import pytest
import torch

import dlrm_lab
from dlrm_lab.errors import UserError
from dlrm_lab.metrics.columns import PHASES
from dlrm_lab.metrics.device_peaks import (
    CACHED_TABLE_BYTES,
    ProbeSizes,
    copy_bytes_per_s,
    gather_bytes_per_s,
    gemm_flops_per_s,
)
from dlrm_lab.metrics.hardware import hardware_fingerprint
from dlrm_lab.metrics.roofline import Peaks, Work, load_profile, peaks_for, place, save_profile
from dlrm_lab.model.cost import dense_step_bytes, lookup_bytes_per_sample, sample_cost

CPU = torch.device("cpu")


def fingerprint_of(path) -> str:
    return path.stem


def fake_profile(fingerprint: str = "f00d", comms: dict | None = None) -> dict:
    one = {"gemm_flops_per_s": {"fp32": 50e9, "bf16": 100e9}, "memory_bytes_per_s": 20e9, "gather_bytes_per_s": 5e9}
    two = {"gemm_flops_per_s": {"fp32": 90e9, "bf16": 180e9}, "memory_bytes_per_s": 30e9, "gather_bytes_per_s": 6e9}
    four = {"gemm_flops_per_s": {"fp32": 150e9, "bf16": 300e9}, "memory_bytes_per_s": 40e9, "gather_bytes_per_s": 8e9}
    return {
        "fingerprint_id": fingerprint,
        "probed_at": "2026-11-22T00:00:00+00:00",
        "quick": True,
        "devices": {"cpu": {"threads": {"1": one, "2": two, "4": four}}},
        "comms": comms or {},
    }


def test_bound_is_the_slowest_resource_and_fraction_is_bound_over_measured():
    peaks = Peaks(flops_per_s=1e11, memory_bytes_per_s=1e10, gather_bytes_per_s=5e9, comm_bytes_per_s=None, basis="x")
    # compute 1e9/1e11 = 10 ms; memory 5e7/5e9 + 1e8/1e10 = 10 + 10 = 20 ms
    out = place(Work(flops=1e9, gather_bytes=5e7, stream_bytes=1e8), 0.040, peaks)
    assert out["roofline_compute_ms"] == pytest.approx(10.0)
    assert out["roofline_memory_ms"] == pytest.approx(20.0)
    assert out["roofline_bound_by"] == "memory" and out["roofline_bound_ms"] == pytest.approx(20.0)
    assert out["roofline_fraction"] == pytest.approx(0.5)
    assert out["roofline_comm_ms"] is None and out["roofline_note"] is None


def test_communication_bounds_a_step_only_when_its_bandwidth_was_probed():
    work = Work(flops=1e9, gather_bytes=0, stream_bytes=0, comm_bytes=3e8)
    with_comm = Peaks(1e11, 1e10, 5e9, comm_bytes_per_s=1e10, basis="x")
    out = place(work, 0.1, with_comm)
    assert out["roofline_comm_ms"] == pytest.approx(30.0) and out["roofline_bound_by"] == "communication"
    out = place(work, 0.1, Peaks(1e11, 1e10, 5e9, comm_bytes_per_s=None, basis="x"))
    assert out["roofline_bound_by"] == "compute" and "collective bandwidth" in out["roofline_note"]


def test_without_a_profile_the_columns_are_null_with_the_reason():
    reason = peaks_for(None, "cpu", "fp32")
    out = place(Work(1e9, 1e6, 0), 0.01, reason)
    assert out["roofline_bound_ms"] is None and out["roofline_fraction"] is None
    assert "dlrm-lab machine probe" in out["roofline_note"]
    assert "fp16" in peaks_for(fake_profile(), "cpu", "fp16")  # a precision never probed
    assert "cuda:0" in peaks_for(fake_profile(), "cuda", "fp32")


def test_cpu_peaks_follow_the_thread_count():
    profile = fake_profile()
    assert peaks_for(profile, "cpu", "fp32", threads=2).flops_per_s == 90e9  # probed: as measured
    three = peaks_for(profile, "cpu", "bf16", threads=3)  # not probed: 3 x one thread, capped at all cores
    assert three.flops_per_s == 300e9 and three.gather_bytes_per_s == 8e9
    assert peaks_for(profile, "cpu", "fp32", threads=8).flops_per_s == 150e9  # beyond the cores: all-core peak
    assert "cpu 2 threads bf16" in peaks_for(profile, "cpu", "bf16", threads=2).basis


def test_collective_peak_is_the_best_all_to_all_bus_bandwidth_of_the_same_launch():
    rows = [
        {"collective": "all_to_all", "busbw_bytes_per_s": 1e9},
        {"collective": "all_to_all", "busbw_bytes_per_s": 3e9},
        {"collective": "all_reduce", "busbw_bytes_per_s": 9e9},
    ]
    profile = fake_profile(comms={"gloo/2": rows})
    assert peaks_for(profile, "cpu", "fp32", 1, world_size=2, backend="gloo").comm_bytes_per_s == 3e9
    assert peaks_for(profile, "cpu", "fp32", 1, world_size=4, backend="gloo").comm_bytes_per_s is None


def test_profiles_are_stored_per_fingerprint_and_merged(tmp_path, monkeypatch):
    monkeypatch.setenv("DLRM_LAB_MACHINE_DIR", str(tmp_path))
    assert load_profile("f00d") is None
    save_profile(fake_profile())
    comms_only = {**fake_profile(comms={"gloo/2": [{"collective": "all_reduce"}]}), "devices": {}}
    comms_only["probed_at"] = "2026-11-23T00:00:00+00:00"
    save_profile(comms_only)
    merged = load_profile("f00d")
    assert "cpu" in merged["devices"] and "gloo/2" in merged["comms"]
    assert merged["probed_at"] == "2026-11-22T00:00:00+00:00"  # the device peaks' date
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(UserError, match="bad.json"):
        load_profile("bad")


GOOD_BUILDS = {"batch_ms": {"eager": {"1": 0.7, "256": 3.1, "-2": 0.0}, "fused": {"1": 0.4, "256": 2.0, "-1": 0.3}},
               "measured_at": "2026-11-27T00:00:00+00:00"}  # fmt: skip


@pytest.mark.parametrize(
    ("section", "damage", "field"),
    [
        ("build_rates", ["not", "a", "table"], "build_rates = ['not', 'a', 'table']: must be a table of measured"),
        ("build_rates", {"k": "fast"}, "build_rates.k = 'fast': must be a table"),
        (
            "build_rates",
            {"k": {**GOOD_BUILDS, "batch_ms": {"fused": {"1": "0.4"}}}},
            "build_rates.k.batch_ms.fused.1 = '0.4': must be a number > 0",
        ),
        ("build_rates", {"k": {"batch_ms": GOOD_BUILDS["batch_ms"]}}, "build_rates.k.measured_at = None: must be the"),
        ("build_rates", {"k": {"measured_at": "2026-11-27"}}, "build_rates.k.batch_ms = None: must be a table"),
        (
            "build_rates",
            {"k": {**GOOD_BUILDS, "batch_ms": {"fused": {"1": -10.0}}}},
            "build_rates.k.batch_ms.fused.1 = -10.0: must be a number > 0",
        ),
        (
            "build_rates",
            {"k": {**GOOD_BUILDS, "batch_ms": {"fused": {"1": float("nan")}}}},
            "build_rates.k.batch_ms.fused.1 = nan: must be a number > 0",
        ),
        (
            "build_rates",
            {"k": {**GOOD_BUILDS, "batch_ms": {"fused": {"one": 1.0}}}},
            "build_rates.k.batch_ms.fused.one: must be a batch size",
        ),
        (
            "precision_rates",
            {"k": {"flops_per_s": {"bf16": 0}, "measured_at": "x"}},
            "precision_rates.k.flops_per_s.bf16 = 0: must be a number > 0",
        ),
        (
            "sharding_trials",
            {"k": {"step_ms": {"table_wise": 3.0}, "measured_at": "x"}},
            "sharding_trials.k.skipped = None: must be a table",
        ),
    ],
)
def test_a_damaged_cached_choice_is_discarded_with_one_line_and_replaced(tmp_path, monkeypatch, section, damage,
                                                                         field):  # fmt: skip
    from dlrm_lab.metrics.measured import cached_choice, store_measured

    monkeypatch.setenv("DLRM_LAB_MACHINE_DIR", str(tmp_path))
    save_profile({**fake_profile(), section: damage})
    profile = load_profile("f00d")
    lines: list[str] = []
    assert cached_choice(profile, section, "k", lines.append) is None
    (line,) = lines
    assert line.startswith(f"warning: {tmp_path / 'f00d.json'}: {field}")
    assert line.endswith("; discarded, measuring again")
    good = {
        "build_rates": GOOD_BUILDS,
        "precision_rates": {"flops_per_s": {"bf16": 1e12}, "measured_at": "x"},
        "sharding_trials": {"step_ms": {"table_wise": 3.0}, "skipped": {}, "measured_at": "x"},
    }[section]
    store_measured(profile, section, "k", good)  # the new measurement replaces the bad one
    assert cached_choice(load_profile("f00d"), section, "k", lines.append) == good and len(lines) == 1


def test_a_measured_choice_is_read_where_complete_measured_where_not_and_stored_unless_its_entry_says_why_not(
    tmp_path, monkeypatch
):
    """One sequence for every measured choice (builds, precisions, allocators): read the profile's entry where it
    holds all it needs, else measure, then store it with its date or say why it was not stored."""
    from dlrm_lab.metrics.measured import measured_choice

    monkeypatch.setenv("DLRM_LAB_MACHINE_DIR", str(tmp_path))
    save_profile(fake_profile())
    measured: list[str] = []

    def choose(wanted: str, noisy: bool = False) -> tuple[dict[str, float], str]:
        def read(entry: dict) -> dict[str, float] | None:
            return dict(entry["flops_per_s"]) if wanted in entry["flops_per_s"] else None

        def measure() -> dict[str, float]:
            measured.append(wanted)
            return {wanted: 2e12}

        def entry(rates: dict[str, float], found: dict | None) -> dict | str:
            earlier = found["flops_per_s"] if found else {}
            return "the machine was noisy" if noisy else {"flops_per_s": {**earlier, **rates}}

        return measured_choice(load_profile("f00d"), "precision_rates", "k", read=read, measure=measure, entry=entry)

    rates, source = choose("bf16")
    assert rates == {"bf16": 2e12} and measured == ["bf16"]
    assert source.startswith("measured now (") and source.endswith(
        f"on this machine, stored in {tmp_path / 'f00d.json'}"
    )
    stored = load_profile("f00d")["precision_rates"]["k"]
    assert stored["flops_per_s"] == {"bf16": 2e12} and isinstance(stored["measured_at"], str)
    rates, source = choose("bf16")  # complete: read, not measured
    assert rates == {"bf16": 2e12} and measured == ["bf16"]
    assert source == f"cached in {tmp_path / 'f00d.json'} (measured {stored['measured_at']})"
    rates, source = choose("fp16", noisy=True)  # incomplete: measured; its entry says why it is not stored
    assert rates == {"fp16": 2e12} and measured == ["bf16", "fp16"]
    assert source.endswith("on this machine, not stored: the machine was noisy")
    assert load_profile("f00d")["precision_rates"]["k"] == stored
    rates, _ = choose("fp16")  # stored now, beside what the entry found
    assert load_profile("f00d")["precision_rates"]["k"]["flops_per_s"] == {"bf16": 2e12, "fp16": 2e12}


def test_probe_kernels_measure_positive_rates_at_small_sizes():
    gemm = gemm_flops_per_s(CPU, torch.float32, (64, 128), repeats=2, min_flops=1e7)
    assert gemm["flops_per_s"] > 1e8 and gemm["size"] in (64, 128)
    assert copy_bytes_per_s(CPU, 8 << 20, repeats=2) > 1e8
    sizes = ProbeSizes((64,), 1 << 20, 2, 20_000, 16, 256, 4, (1024,), 2, 1e7)
    gather = gather_bytes_per_s(CPU, sizes, repeats=2)
    assert gather["bytes_per_s"] > 1e7 and gather["table_bytes"] == 2 * 20_000 * 16 * 4


def test_gemm_climb_is_not_cut_by_a_launch_bound_pilot(monkeypatch):
    """A GPU-like product: 100 us to launch, then 500 TFLOP/s. The pilot (n=256) predicts ~0.3
    TFLOP/s, under which n=8192 would take 3.3 s; the climb must still reach it (the rates timed at
    the smaller sizes predict it), while a slow kernel (20 GFLOP/s) stops after the smallest size."""
    from dlrm_lab.metrics import device_peaks

    def fake(launch_s: float, rate: float) -> list[int]:
        now = [0.0]
        seen: list[int] = []

        def mm(a, b, *args, **kwargs):
            seen.append(a.shape[0])
            now[0] += launch_s + 2 * a.shape[0] ** 3 / rate
            return a

        monkeypatch.setattr(device_peaks.torch, "mm", mm)
        monkeypatch.setattr(device_peaks.torch, "randn", lambda n, m, **kw: torch.empty(n, 1))
        monkeypatch.setattr(device_peaks.time, "perf_counter", lambda: now[0])
        return seen

    seen = fake(100e-6, 500e12)
    gpu_like = device_peaks._gemm_peak(CPU, torch.float32, (2048, 8192), repeats=2, min_flops=2e10)  # one library
    assert gpu_like["size"] == 8192 and 8192 in seen and gpu_like["flops_per_s"] > 0.95 * 500e12
    seen = fake(0.0, 20e9)
    slow = device_peaks._gemm_peak(CPU, torch.float32, (1024, 2048, 4096), repeats=2, min_flops=2e8)
    assert slow["size"] == 1024 and max(seen) == 1024  # 2048 would take 0.86 s a product


def test_inference_row_bytes_follow_the_table_precision():
    tiny = dlrm_lab.load_preset("tiny")  # 7 rows of dim 8 looked up per sample
    assert lookup_bytes_per_sample(tiny, "fp32") == 7 * 8 * 4
    assert lookup_bytes_per_sample(tiny, "fp16") == 7 * 8 * 2
    assert lookup_bytes_per_sample(tiny, "int8") == 7 * (8 + 4)  # fp16 scale and bias per row
    assert lookup_bytes_per_sample(tiny, "int4") == 7 * (4 + 4)
    # adagrad: forward, backward read, gradient write; optimizer grad read, param r+w, state r+w
    assert dense_step_bytes(tiny, "adagrad") == 4 * 8 * tiny.dense_parameters
    assert dense_step_bytes(tiny, "sgd") == 4 * 6 * tiny.dense_parameters


def test_machine_show_prints_a_stored_profile_and_errors_without_one(tmp_path, monkeypatch):
    from conftest import run_cli_in_process

    env_dir = tmp_path / "machines"
    env_dir.mkdir()
    fid = hardware_fingerprint()["fingerprint_id"]
    profile = fake_profile(fid)
    profile["devices"]["cpu"]["threads"]["2"].update(
        gather_pages={"base_bytes_per_s": 3.28e9, "huge_bytes_per_s": 6.11e9, "huge_error": None, "thp": "madvise"},
        gather_rows_per_s=7.6e7,
    )
    (env_dir / f"{fid}.json").write_text(json.dumps(profile))
    monkeypatch.setenv("DLRM_LAB_MACHINE_DIR", str(env_dir))
    code, shown, err = run_cli_in_process("machine", "show")
    assert code == 0, err
    assert "cpu x2 threads" in shown and "90.00" in shown
    assert "gather cpu x2 threads: 3.28 GB/s on 4 KiB pages, 6.11 on 2 MiB; 76.0 M rows/s of 64 bytes" in shown
    code, _, err = run_cli_in_process("machine", "show", "nosuchmachine")
    assert code == 2 and "dlrm-lab machine probe" in err
    assert len(err.strip().splitlines()) == 1


def test_a_training_run_is_placed_on_the_roofline_with_its_energy(tmp_path, monkeypatch):
    from conftest import ConstantPower, store_profile

    from dlrm_lab.config import TrainConfig
    from dlrm_lab.train import loop, preflight, train

    monkeypatch.setenv("DLRM_LAB_MACHINE_DIR", str(tmp_path / "machines"))
    store_profile(tmp_path / "machines", gflops=100.0, gather_gb=1.0)
    monkeypatch.setattr(loop, "open_power_sources", lambda *a, **k: ([ConstantPower(40.0)], {}))
    spec = dlrm_lab.load_preset("tiny")
    cfg = TrainConfig(steps=12, batch_size=128, target_auc=0.99)  # tiny cannot reach 0.99
    s = train(preflight(spec, cfg), metrics_dir=tmp_path / "runs").summary
    assert s["flops_per_sample"] == 4048 and s["bytes_per_sample"] == 7 * 8 * 4 * 2 + 2 * 4 * 7
    assert s["achieved_flops_per_s"] == pytest.approx(s["samples_per_s"] * 4048)
    compute_ms = 128 * 4048 / 100e9 * 1e3
    assert s["roofline_compute_ms"] == pytest.approx(compute_ms)
    # the rows a batch gathers are its distinct ones (measured on the run's first batch; a repeat is a cache hit)
    run_dir = next((tmp_path / "runs").iterdir())
    distinct = json.loads((run_dir / "manifest.json").read_text())["config"]["distinct_rows"]
    share = distinct["share"]
    assert 0 < share < 1 and share == distinct["rows"] / distinct["ids"] and distinct["ids"] >= 128 * 7
    memory_ms = (128 * share * s["bytes_per_sample"] / 1e9 + dense_step_bytes(spec, "adagrad") / 20e9) * 1e3
    assert s["roofline_memory_ms"] == pytest.approx(memory_ms)
    assert s["roofline_bound_by"] == "memory" and s["roofline_bound_ms"] == pytest.approx(memory_ms)
    assert s["roofline_fraction"] == pytest.approx(memory_ms / s["step_time_ms_mean"])
    assert "cpu" in s["roofline_basis"] and s["roofline_note"] is None
    # phase by phase: the lookup reads the rows (7 x 8 fp32 values), the backward runs its FLOPs or rereads the rows
    # with their state and writes both, whichever is longer; one rank sends nothing; the floors add up
    cost = sample_cost(spec)
    weights_ms = 4 * spec.dense_parameters / 20e9 * 1e3
    assert s["embedding_lookup_floor_ms"] == pytest.approx(128 * share * 7 * 8 * 4 / 1e9 * 1e3)
    assert s["dense_forward_floor_ms"] == pytest.approx(max(128 * cost.forward_flops / 100e9 * 1e3, weights_ms))
    update_ms = 128 * share * s["bytes_per_sample"] / 1e9 * 1e3 + 2 * weights_ms
    assert s["table_update_floor_ms"] == pytest.approx(128 * share * s["bytes_per_sample"] / 1e9 * 1e3)
    assert s["backward_floor_ms"] == pytest.approx(max(128 * cost.backward_flops / 100e9 * 1e3, update_ms))
    assert s["optimizer_floor_ms"] == pytest.approx(weights_ms * (3 + 2))  # adagrad: one state
    assert s["input_dist_floor_ms"] == s["embedding_all_to_all_floor_ms"] == s["data_wait_floor_ms"] == 0.0
    floors = [s[f"{p}_floor_ms"] for p in PHASES]
    assert s["phase_floor_ms"] == pytest.approx(sum(floors)) and s["phase_floor_ms"] > s["roofline_bound_ms"]
    assert s["phase_floor_fraction"] == pytest.approx(s["phase_floor_ms"] / s["step_time_ms_mean"])
    assert s["target_reached"] is False and s["valid_flops_per_s"] == 0.0  # no credit without quality
    # 40 W for the whole measured window: J/sample = W / (samples/s)
    assert s["power_w_mean"] == pytest.approx(40.0) and s["energy_scope"] == "fake:dev0"
    assert s["energy_per_sample_j"] == pytest.approx(40.0 / s["samples_per_s"])
    assert s["energy_j"] > 0 and s["energy_unavailable"] is None
    assert s["cpu_utilization_mean"] is not None and s["process_rss_max_mb"] > 0
    import pyarrow.parquet as pq

    telemetry = pq.read_table(run_dir / "telemetry.parquet").to_pylist()
    assert {r["quantity"] for r in telemetry} >= {"power_w", "cpu_percent", "rss_bytes"}
    assert {r["rank"] for r in telemetry} == {0}  # several ranks' samples stay apart


def test_without_sensors_energy_is_null_with_a_reason_never_zero(tmp_path, monkeypatch):
    from dlrm_lab.config import TrainConfig
    from dlrm_lab.train import preflight, train

    monkeypatch.setenv("DLRM_LAB_MACHINE_DIR", str(tmp_path / "never-probed"))

    s = train(
        preflight(dlrm_lab.load_preset("tiny"), TrainConfig(steps=6, batch_size=64)), metrics_dir=tmp_path
    ).summary
    assert s["energy_j"] is None and s["energy_per_sample_j"] is None and s["samples_per_s_per_w"] is None
    assert s["energy_unavailable"]  # e.g. "RAPL not readable: ..." on this machine
    assert s["roofline_fraction"] is None and "machine probe" in s["roofline_note"]  # no profile stored
    assert s["valid_flops_per_s"] is None  # no --target-auc: no quality rule to apply


@pytest.mark.multiprocess
def test_probe_stores_peaks_then_a_two_rank_probe_adds_collectives(tmp_path, monkeypatch):
    from conftest import run_cli, run_cli_in_process

    monkeypatch.setenv("DLRM_LAB_MACHINE_DIR", str(tmp_path))
    code, _, err = run_cli_in_process("machine", "probe", "--quick")  # its 2-process ceiling: processes of its own
    assert code == 0, err[-2000:]
    (path,) = tmp_path.glob("*.json")
    profile = json.loads(path.read_text())
    assert path.stem == profile["fingerprint_id"] == hardware_fingerprint()["fingerprint_id"]
    cpu = profile["devices"]["cpu"]["threads"]
    assert "1" in cpu
    for peaks in cpu.values():
        assert peaks["gemm_flops_per_s"]["fp32"] > 1e8 and peaks["gemm_flops_per_s"]["bf16"] > 0
        assert peaks["memory_bytes_per_s"] > 1e8 and peaks["gather_bytes_per_s"] > 1e7
        # the gather again from tables that stay in cache: smaller than the probe's, a ceiling of its own
        assert peaks["gather_cached_table_bytes"] <= CACHED_TABLE_BYTES < peaks["gather_table_bytes"]
        assert peaks["gather_cached_bytes_per_s"] > 1e7
    if len(os.sched_getaffinity(0)) > 1:  # N pinned processes at once against one alone (issue 18)
        ceiling = profile["devices"]["cpu"]["ceiling"]["2"]
        assert ceiling["processes"] == 2 and len(ceiling["gemm"]["each_flops_per_s"]) == 2
        assert 0 < ceiling["gemm"]["efficiency"] and 0 < ceiling["copy"]["efficiency"]
        assert ceiling["gemm"]["efficiency"] == pytest.approx(
            ceiling["gemm"]["all_flops_per_s"] / (2 * ceiling["gemm"]["one_flops_per_s"])
        )
    # started by mpiexec: gloo's collectives and MPI's own, side by side
    out = run_cli("launch", "--nproc", "2", "--launcher", "mpi", "--", "machine", "probe", "--quick", "--comms-only")
    assert out.returncode == 0, out.stderr[-2000:]
    merged = json.loads(path.read_text())
    assert merged["devices"] == profile["devices"]  # kept from the first probe
    assert merged["wake"] == profile["wake"] and merged["cold_gather"] == profile["cold_gather"]  # the floor's too
    for transport in ("gloo/2", "mpi/2"):  # the raw collectives, and TorchRec's distribution over each
        rows = merged["comms"][transport]
        assert {r["collective"] for r in rows} == {"all_to_all", "all_reduce", "torchrec_input_dist", "torchrec_pooled"}
        ids = {r["samples_per_rank"]: r for r in rows if r["collective"] == "torchrec_input_dist"}
        assert sorted(ids) == [512, 2048] and ids[2048]["bytes"] == 2048 * 12 * 26 // 2  # ids + lengths, half remote
        assert all(0 < r["forward_share"] < 1 for r in rows if r["collective"] == "torchrec_pooled")
        for r in rows:  # bus bandwidth: x (n-1)/n = 1/2 for all-to-all, x 2(n-1)/n = 1 for all-reduce at 2 ranks
            factor = 0.5 if r["collective"] == "all_to_all" else 1.0  # TorchRec's rows are in bus bytes already
            assert r["busbw_bytes_per_s"] == pytest.approx(r["algbw_bytes_per_s"] * factor)
            assert r["algbw_bytes_per_s"] == pytest.approx(r["bytes"] / (r["time_ms"] / 1e3))
    code, shown, _ = run_cli_in_process("machine", "show", fingerprint_of(path))
    assert code == 0 and "collectives gloo/2" in shown and "all_to_all" in shown
    code, _, err = run_cli_in_process("machine", "probe", "--comms-only")
    assert code == 2 and "several ranks" in err


def test_run_probe_rules_without_measuring(tmp_path, monkeypatch):
    """The orchestration lives in the library: bad device, --comms-only alone, --if-missing."""
    from conftest import store_profile

    from dlrm_lab.errors import UserError
    from dlrm_lab.metrics.probe import run_probe

    monkeypatch.setenv("DLRM_LAB_MACHINE_DIR", str(tmp_path))
    with pytest.raises(UserError, match="^device 'tpu': allowed: auto, cpu, cuda"):
        run_probe(device="tpu")
    with pytest.raises(UserError, match="^comms_only: needs a launch with several ranks"):
        run_probe(comms_only=True)
    stored = store_profile(tmp_path)
    outcome = run_probe(quick=True, if_missing=True)  # a stored profile: nothing measured, nothing written
    assert outcome.written is None and outcome.fingerprint_id == stored["fingerprint_id"]
    assert "not probing again (--if-missing)" in outcome.kept


def test_the_phase_sum_floor_bounds_each_phase_by_its_own_resource():
    """A step of known phases: a compute-bound one, a gather-bound one, one bound by its collective and one that
    mixes rows and dense bytes. The whole-step roof takes the largest resource as if all overlapped; the phases run
    in sequence, so their floors add, and a collective never probed leaves its phase (and the sum) unbounded."""
    from dlrm_lab.metrics.roofline import phase_floors

    peaks = Peaks(flops_per_s=1e12, memory_bytes_per_s=1e10, gather_bytes_per_s=5e9, comm_bytes_per_s=2e9, basis="x")
    phases = {
        "dense_forward": Work(flops=4e9, gather_bytes=0.0, stream_bytes=1e7),  # 4 ms of FLOPs, 1 ms of weights
        "embedding_lookup": Work(flops=0.0, gather_bytes=1e7, stream_bytes=0.0),  # 2 ms of rows
        "embedding_all_to_all": Work(0.0, 0.0, 0.0, comm_bytes=4e6),  # 2 ms on the wire
        "backward": Work(flops=1e9, gather_bytes=1e7, stream_bytes=2e7, comm_bytes=2e6),  # 1, 2 + 2, 1 ms: 4
    }
    floors = phase_floors(phases, peaks)
    assert floors == pytest.approx({"dense_forward": 4.0, "embedding_lookup": 2.0, "embedding_all_to_all": 2.0,
                                    "backward": 4.0})  # fmt: skip
    whole = place(Work(flops=5e9, gather_bytes=2e7, stream_bytes=3e7, comm_bytes=6e6), None, peaks)
    assert whole["roofline_bound_ms"] == pytest.approx(7.0) and sum(floors.values()) == pytest.approx(12.0)
    unprobed = phase_floors(phases, Peaks(1e12, 1e10, 5e9, comm_bytes_per_s=None, basis="x"))
    assert unprobed["embedding_all_to_all"] is None and unprobed["backward"] is None
    assert unprobed["dense_forward"] == pytest.approx(4.0)


def test_a_steps_phases_hold_the_whole_steps_work():
    """`step_phase_work` splits the step the whole-step roof counts: the same FLOPs and collective bytes, the rows
    read twice (the lookup, then the update rereads them with their state) and the dense bytes of each phase."""
    from dlrm_lab.model.cost import step_communication_bytes, step_phase_work

    spec = dlrm_lab.load_preset("kaggle")
    phases = step_phase_work(spec, 2048, 2)
    assert list(phases) == list(PHASES)
    cost = sample_cost(spec)
    assert sum(w.flops for w in phases.values()) == 2048 * cost.training_flops
    assert sum(w.comm_bytes for w in phases.values()) == pytest.approx(
        sum(step_communication_bytes(spec, 4096, 2).values())
    )
    rows = cost.embedding_bytes_read + cost.embedding_bytes_written + cost.optimizer_state_bytes
    assert sum(w.gather_bytes for w in phases.values()) == pytest.approx(2048 * (cost.embedding_bytes_read + rows))
    assert phases["optimizer"].stream_bytes == 4 * spec.dense_parameters * 5  # adagrad: grad, param r/w, state r/w


def test_rows_of_one_line_are_bound_by_their_count_not_their_bytes():
    """The gather's two ceilings: bytes at the bandwidth probed on wide rows, and row accesses at the rate rows of
    one cache line are gathered. Narrow rows meet the second; wide rows the first; a profile without the row rate
    keeps the byte ceiling alone."""
    from dlrm_lab.metrics.roofline import phase_floors

    peaks = Peaks(flops_per_s=1e12, memory_bytes_per_s=1e10, gather_bytes_per_s=8e9, comm_bytes_per_s=None,
                  basis="x", gather_rows_per_s=2e7)  # fmt: skip
    narrow = Work(0.0, gather_bytes=53_248 * 64.0, stream_bytes=0.0, gather_rows=53_248)  # kaggle's lookup
    wide = Work(0.0, gather_bytes=10_000 * 1024.0, stream_bytes=0.0, gather_rows=10_000)
    floors = phase_floors({"narrow": narrow, "wide": wide}, peaks)
    assert floors["narrow"] == pytest.approx(53_248 / 2e7 * 1e3)  # 2.66 ms of rows, not 0.43 of bytes
    assert floors["wide"] == pytest.approx(10_000 * 1024 / 8e9 * 1e3)  # 1.28 ms of bytes over 0.5 of rows
    no_rate = Peaks(1e12, 1e10, 8e9, comm_bytes_per_s=None, basis="x")
    assert phase_floors({"narrow": narrow}, no_rate)["narrow"] == pytest.approx(53_248 * 64 / 8e9 * 1e3)
    # the phases count kaggle's rows: the lookup's, then the update's again with their row-wise state
    from dlrm_lab.model.cost import step_phase_work, table_update_work

    spec = dlrm_lab.load_preset("kaggle")
    phases, ids = step_phase_work(spec, 2048, 1), 2048 * 26
    assert phases["embedding_lookup"].gather_rows == ids and table_update_work(spec, 2048).gather_rows == 2 * ids
    assert phases["backward"].gather_rows == 2 * ids
    assert table_update_work(spec, 2048, embedding_optimizer="sgd").gather_rows == ids  # no state of its own


def test_tables_smaller_than_the_probes_are_bound_by_the_cache_resident_gather():
    """A gather is faster the smaller its tables: the DRAM probe's rate bounds tables at least as large as its own,
    and smaller ones (rm2 at 0.5% of its rows: 20 MB) meet the cache-resident probe's rate, where a row costs no page
    walk (no row ceiling). A profile without that probe, or work whose tables are unknown, keeps the DRAM bound."""
    from dlrm_lab.infer.records import batch_roof
    from dlrm_lab.metrics.roofline import phase_floors

    dram = Peaks(flops_per_s=1e15, memory_bytes_per_s=1e12, gather_bytes_per_s=8e9, comm_bytes_per_s=None,
                 basis="x", gather_rows_per_s=2e7, gather_table_bytes=128e6)  # fmt: skip
    cached = replace(dram, gather_cached_bytes_per_s=32e9)
    rows = dict(gather_bytes=10_000 * 256.0, stream_bytes=0.0, gather_rows=10_000)
    small, large, unknown = (Work(0.0, **rows, table_bytes=b) for b in (20e6, 1e9, 0.0))
    floors = phase_floors({"small": small, "large": large, "unknown": unknown}, cached)
    assert floors["small"] == pytest.approx(10_000 * 256 / 32e9 * 1e3)  # from cache: bytes alone, at its rate
    assert floors["large"] == floors["unknown"] == pytest.approx(10_000 / 2e7 * 1e3)  # DRAM: the row ceiling
    assert phase_floors({"small": small}, dram)["small"] == floors["large"]  # not probed: the DRAM bound
    # a served batch of rm2 at 0.5% of its rows is bounded by the cached rate, at the full size by DRAM's
    rm2, full = dlrm_lab.load_preset("rm2", table_scale=0.005), dlrm_lab.load_preset("rm2")
    assert batch_roof(rm2, "fp32", cached)(256) < batch_roof(rm2, "fp32", dram)(256)
    assert batch_roof(full, "fp32", cached)(256) == batch_roof(full, "fp32", dram)(256)


def test_the_fp32_gemm_peak_is_the_better_of_mkls_and_onednns(monkeypatch):
    """torch's fp32 `mm` runs Intel's MKL, which on AMD EPYCs takes a half-width path (Zen 5: 98-102 GFLOP/s where
    oneDNN's fp32 runs 219-226, and OpenVINO's f32 DLRMv2 ran at 2.0 of the MKL-probed roof): the CPU's fp32 peak is
    probed through both libraries and the better kept; oneDNN's product is the same one (a x b^T)."""
    import torch

    from dlrm_lab.metrics import device_peaks

    cpu = torch.device("cpu")
    asked = []

    def peak(device, dtype, sizes, repeats, min_flops, onednn_fp32=False):
        asked.append((dtype, onednn_fp32))
        return {"flops_per_s": 2.2e11 if onednn_fp32 else 1e11, "size": 512, "spread": 1.0}

    with monkeypatch.context() as m:
        m.setattr(device_peaks, "_gemm_peak", peak)
        assert device_peaks.gemm_flops_per_s(cpu, torch.float32, (64,), 1)["flops_per_s"] == 2.2e11
        assert device_peaks.gemm_flops_per_s(cpu, torch.bfloat16, (64,), 1)["flops_per_s"] == 1e11  # one library
    assert asked == [(torch.float32, True), (torch.float32, False), (torch.bfloat16, False)]
    real = device_peaks._gemm_peak(cpu, torch.float32, (64,), 1, 1e6, onednn_fp32=True)  # runs, on its own layout
    assert real["size"] == 64 and real["flops_per_s"] > 0
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    torch.testing.assert_close(torch._C._nn.mkldnn_linear(a.to_mkldnn(), b.to_mkldnn(), None).to_dense(), a @ b.T)


def test_a_gather_of_another_probe_method_is_never_kept_over_a_new_one():
    """Re-probing keeps the better of each peak, but an earlier gather read tables never written (the kernel's one
    zero page, several times faster than rows): a figure of another method, replaced by the new one."""
    from dlrm_lab.metrics.roofline import GATHER_PROBE, _keep_better

    old = {"cpu": {"threads": {"1": {"gemm_flops_per_s": {"fp32": 2e11}, "memory_bytes_per_s": 1.3e10,
                                     "gather_bytes_per_s": 9.3e9}}}}  # fmt: skip
    new = {"cpu": {"threads": {"1": {"gemm_flops_per_s": {"fp32": 1.4e11}, "memory_bytes_per_s": 8e9,
                                     "gather_bytes_per_s": 5.4e9, "gather_rows_per_s": 4e7,
                                     "gather_probe": GATHER_PROBE}}}}  # fmt: skip
    kept = _keep_better(old, new)
    peaks = new["cpu"]["threads"]["1"]
    assert peaks["gather_bytes_per_s"] == 5.4e9 and peaks["gather_rows_per_s"] == 4e7  # the new method's
    assert peaks["gemm_flops_per_s"]["fp32"] == 2e11 and peaks["memory_bytes_per_s"] == 1.3e10  # the better kept
    assert sorted(kept) == ["cpu.threads.1.gemm_flops_per_s.fp32", "cpu.threads.1.memory_bytes_per_s"]
    # two probes of the same method: the better gather is kept as any peak
    again = {"cpu": {"threads": {"1": {**peaks, "gather_bytes_per_s": 4e9, "gather_rows_per_s": 5e7}}}}
    assert _keep_better(new, again) == ["cpu.threads.1.gather_bytes_per_s"]
    assert again["cpu"]["threads"]["1"]["gather_rows_per_s"] == 5e7


def test_a_later_probe_keeps_the_wake_and_cold_gather_figures_it_did_not_measure(tmp_path, monkeypatch):
    """A collectives-only probe, a GPU-only one or a probe of fewer idle times measures no wake or cold gather of its
    own: the earlier figures stay, so a later run never loses a term of its low-load floor."""
    monkeypatch.setenv("DLRM_LAB_MACHINE_DIR", str(tmp_path))
    fid = hardware_fingerprint()["fingerprint_id"]
    cpu = {"threads": {"1": {"gemm_flops_per_s": {"fp32": 1e11}, "memory_bytes_per_s": 1e10}}}
    first = {
        "fingerprint_id": fid,
        "probed_at": "2026-11-28T00:00:00+00:00",
        "devices": {"cpu": cpu},
        "comms": {},
        "wake": {"1": {"p50_us": 20.0}, "100": {"p50_us": 90.0}},
        "cold_gather": {"1": 1.03, "100": 5.18},
    }
    save_profile(first)
    save_profile(
        {
            "fingerprint_id": fid,
            "probed_at": "2026-11-28T01:00:00+00:00",
            "devices": {},
            "comms": {"gloo/2": [{"collective": "all_reduce"}]},
        }
    )  # collectives only
    save_profile(
        {
            "fingerprint_id": fid,
            "probed_at": "2026-11-28T02:00:00+00:00",
            "comms": {},
            "devices": {"cuda:0": {"gemm_flops_per_s": {"fp32": 5e13}}},
        }
    )  # a GPU only
    save_profile(
        {
            "fingerprint_id": fid,
            "probed_at": "2026-11-28T03:00:00+00:00",
            "devices": {"cpu": cpu},
            "comms": {},
            "wake": {"1": {"p50_us": 25.0}},
            "cold_gather": {"1": 1.10},
        },
        keep_better=True,
    )
    stored = load_profile(fid)
    assert stored["wake"] == {"1": {"p50_us": 25.0}, "100": {"p50_us": 90.0}}  # the new figure, the old kept
    assert stored["cold_gather"] == {"1": 1.10, "100": 5.18}
    assert set(stored["devices"]) == {"cpu", "cuda:0"} and "gloo/2" in stored["comms"]


def test_a_gpus_copy_and_gather_are_sized_past_its_cache_and_within_its_memory():
    """A GPU is probed on its own sizes (a 64 MiB copy and a 10 MB gather read 0.65 and 0.01 of an H200's rates):
    4 tables of up to 10M rows, at most a quarter of the free memory."""
    from dlrm_lab.metrics.device_peaks import ProbeSizes

    full = ProbeSizes.preset(False).for_gpu(140 << 30)
    assert (full.gather_tables, full.gather_rows, full.gather_dim, full.copy_bytes) == (4, 10_000_000, 128, 4 << 30)
    small = ProbeSizes.preset(True).for_gpu(8 << 30)
    assert small.gather_rows * small.gather_tables * small.gather_dim * 4 <= 2 << 30 and small.gather_rows > 0
    assert ProbeSizes.preset(True).gather_rows == 250_000  # the CPU's own sizes unchanged


def test_an_int8_build_is_placed_against_the_int8_products_peak_where_the_probe_measured_it():
    """An int8 build's GEMMs are integer products (VNNI, AMX int8): against the bf16 peak its samples beat their
    roof (kaggle's `aoti_int8` at 1.09 of it on Zen 4). The probe times `torch._int_mm`; a profile probed before it
    keeps the served precision's peak."""
    import copy

    from dlrm_lab.infer.builds import computes_in
    from dlrm_lab.infer.load_point import _peaks
    from dlrm_lab.infer.sut import ModelDescription
    from dlrm_lab.metrics.device_peaks import gemm_flops_per_s

    int8 = gemm_flops_per_s(torch.device("cpu"), torch.int8, (64, 128), repeats=2, min_flops=1e6)
    assert int8["flops_per_s"] > 0 and int8["size"] in (64, 128)
    assert computes_in("aoti_int8", "bf16") == computes_in("openvino_int8", "fp32") == "int8"
    assert computes_in("aoti", "bf16") == computes_in("not-a-build", "bf16") == computes_in(None, "bf16") == "bf16"
    spec = dlrm_lab.load_preset("tiny")
    served = ModelDescription("tiny", spec, threads=1, precision="bf16", build="aoti_int8")
    older = fake_profile()
    probed = copy.deepcopy(older)
    probed["devices"]["cpu"]["threads"]["1"]["gemm_flops_per_s"]["int8"] = 400e9
    assert _peaks(probed, "cpu", served).flops_per_s == 400e9
    assert _peaks(older, "cpu", served).flops_per_s == 100e9  # not probed: the bf16 peak it is served beside
    bf16 = ModelDescription("tiny", spec, threads=1, precision="bf16", build="aoti")
    assert _peaks(probed, "cpu", bf16).flops_per_s == 100e9


def test_the_int8_peak_is_the_better_of_the_int8_products_a_build_can_run(monkeypatch):
    """The int8 peak is the better of torch's `_int_mm` and oneDNN's quantised linear (the product the int8 builds
    run): without VNNI the first takes a reference path 100x slower (Zen 3: 1.0 against 150 GOP/s), and an int8 build's
    latency floor read it ("p99 26.5 ms, floor 210 ms"). A way this torch cannot run is passed over."""
    from dlrm_lab.metrics import device_peaks

    cpu = torch.device("cpu")
    ways = device_peaks.int8_cpu_products()
    assert set(ways) == {"int_mm", "onednn"}
    for way in ways.values():  # each runs here, on the probe's square operands
        way(64)()

    def timed_as(seconds: float) -> device_peaks.SquareProduct:
        return lambda n: lambda: time.sleep(seconds)

    def missing(n: int) -> Any:
        raise NotImplementedError("no such op on this torch")

    monkeypatch.setattr(device_peaks, "int8_cpu_products", lambda: {"slow": timed_as(0.02), "fast": timed_as(0.0005),
                                                                   "absent": missing})  # fmt: skip
    peak = device_peaks.gemm_flops_per_s(cpu, torch.int8, (64,), repeats=3, min_flops=1.0)
    assert 2 * 64**3 / 0.02 < peak["flops_per_s"] <= 2 * 64**3 / 0.0005  # the fast way's: a sleep never runs short

"""Energy telemetry: integration maths, sensor degradation and the sampler's lifecycle.

Sampling is driven synchronously with a fake clock (start(thread=False) + sample_now()) so the numbers are
exact; only the lifecycle and host tests use the real thread, for a fraction of a second.
"""

from __future__ import annotations

import builtins
import os
import re
import sys
import time
import types
from collections import namedtuple
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pyarrow as pa
import pytest
import torch

from dlrm_lab.infer.records import energy_columns as point_energy
from dlrm_lab.metrics import cpu, energy, sensors
from dlrm_lab.metrics.energy import TELEMETRY_SCHEMA, EnergySampler, combine_summaries
from dlrm_lab.metrics.sensors import NvmlSource, RaplSource, Reading, SensorUnavailable, open_power_sources
from dlrm_lab.train.records import energy_columns as run_energy


@dataclass
class FakeClock:
    t: float = 0.0

    def __call__(self) -> float:
        return self.t


@dataclass
class FakeSource:
    """Reads value(now) from a function of the fake clock; fails while `failing` is set."""

    clock: FakeClock
    value: object  # Callable[[float], float]
    quantity: str = "power_w"
    name: str = "fake"
    failing: bool = False
    closed: bool = False
    reads: int = 0
    channel_names: list[str] = field(default_factory=lambda: ["dev0"])

    def channels(self) -> list[str]:
        return list(self.channel_names)

    def read(self) -> dict[str, Reading]:
        self.reads += 1
        if self.failing:
            raise OSError("sensor gone")
        return {c: Reading(self.quantity, self.value(self.clock.t)) for c in self.channel_names}

    def close(self) -> None:
        self.closed = True


def drive(sampler: EnergySampler, clock: FakeClock, times: list[float]) -> None:
    """Start at times[0], sample at each later time, stop at the last."""
    clock.t = times[0]
    sampler.start(thread=False)
    for t in times[1:-1]:
        clock.t = t
        sampler.sample_now()
    clock.t = times[-1]
    sampler.stop()


def test_constant_power_integrates_to_joules_over_any_window():
    clock = FakeClock()
    sampler = EnergySampler([FakeSource(clock, lambda t: 10.0)], host=False, clock=clock)
    drive(sampler, clock, [0.0, 0.5, 1.0, 1.5, 2.0])

    assert sampler.energy_j() == pytest.approx({"fake:dev0": 20.0})
    assert sampler.energy_j(0.5, 1.0)["fake:dev0"] == pytest.approx(5.0)
    assert sampler.energy_j(0.25, 0.35)["fake:dev0"] == pytest.approx(1.0)  # between two samples
    summary = sampler.summary()
    assert summary["energy_j"] == pytest.approx(20.0)
    assert summary["power_w_mean"] == pytest.approx(10.0)
    assert summary["energy_scope"] == "fake:dev0"
    assert summary["energy_unavailable"] is None


def test_power_ramp_window_edges_are_interpolated():
    # p(t) = 10 t: the trapezoid rule is exact for a linear ramp, so any error comes from the edges.
    clock = FakeClock()
    sampler = EnergySampler([FakeSource(clock, lambda t: 10.0 * t)], host=False, clock=clock)
    drive(sampler, clock, [0.0, 1.0, 2.0, 3.0])

    def exact(a: float, b: float) -> float:
        return 5.0 * (b * b - a * a)

    for a, b in [(0.0, 3.0), (0.5, 1.5), (0.25, 0.75), (1.2, 2.9), (2.0, 2.0)]:
        assert sampler.energy_j(a, b)["fake:dev0"] == pytest.approx(exact(a, b)), (a, b)
    # A window wider than the sampled span only counts what was measured.
    assert sampler.energy_j(-5.0, 10.0)["fake:dev0"] == pytest.approx(exact(0.0, 3.0))
    # A window outside the samples has no energy rather than 0 J.
    assert sampler.energy_j(5.0, 6.0) == {}


def test_energy_counter_is_differenced_and_interpolated_inside_a_window():
    clock = FakeClock()
    # A cumulative counter starting at 1000 J growing at 50 W (as NVML's total-energy counter would).
    source = FakeSource(clock, lambda t: 1000.0 + 50.0 * t, quantity="energy_j", name="nvml", channel_names=["gpu0"])
    sampler = EnergySampler([source], host=False, clock=clock)
    drive(sampler, clock, [0.0, 1.0, 2.0, 4.0])

    assert sampler.energy_j()["nvml:gpu0"] == pytest.approx(200.0)
    assert sampler.energy_j(1.5, 3.0)["nvml:gpu0"] == pytest.approx(75.0)
    assert sampler.summary(1.5, 3.0)["power_w_mean"] == pytest.approx(50.0)


def test_summary_sums_channels_and_names_a_source_that_always_fails():
    clock = FakeClock()
    gpus = FakeSource(clock, lambda t: 100.0, name="nvml", channel_names=["gpu0", "gpu1"])
    dead = FakeSource(clock, lambda t: 1.0, name="rapl", failing=True)
    sampler = EnergySampler([gpus, dead], host=False, clock=clock, unavailable={"cpu": "RAPL not readable: x"})
    drive(sampler, clock, [0.0, 1.0, 2.0])

    summary = sampler.summary()
    assert summary["energy_j"] == pytest.approx(400.0)
    assert summary["energy_scope"] == "nvml:gpu0+nvml:gpu1"
    assert "RAPL not readable: x" in summary["energy_unavailable"]
    assert "rapl: every read failed (sensor gone)" in summary["energy_unavailable"]
    assert dead.closed and gpus.closed


def test_a_source_failing_for_one_tick_loses_only_that_tick():
    clock = FakeClock()
    source = FakeSource(clock, lambda t: 10.0)
    sampler = EnergySampler([source], host=False, clock=clock)
    clock.t = 0.0
    sampler.start(thread=False)
    clock.t, source.failing = 1.0, True
    sampler.sample_now()
    clock.t, source.failing = 2.0, False
    sampler.stop()

    assert sampler.energy_j()["fake:dev0"] == pytest.approx(20.0)
    assert sampler.summary()["energy_unavailable"] is None


def write_zone(root: Path, zone_dir: str, name: str, energy_uj: int, max_uj: int = 1_000_000) -> Path:
    zone = root / zone_dir
    zone.mkdir(parents=True)
    (zone / "name").write_text(f"{name}\n")
    (zone / "energy_uj").write_text(f"{energy_uj}\n")
    (zone / "max_energy_range_uj").write_text(f"{max_uj}\n")
    return zone


def test_rapl_reads_packages_and_survives_counter_wrap(tmp_path):
    pkg0 = write_zone(tmp_path, "intel-rapl:0", "package-0", 900_000)
    write_zone(tmp_path, "intel-rapl:1", "package-1", 10_000)
    write_zone(tmp_path, "intel-rapl:0:0", "core", 5)  # sub-zone: inside the package, must not add up twice
    write_zone(tmp_path, "intel-rapl:2", "psys", 0)  # platform zone overlaps the packages

    source = RaplSource(tmp_path)
    assert source.channels() == ["package-0", "package-1"]
    (pkg0 / "energy_uj").write_text("950000\n")
    first = source.read()
    assert first["package-0"] == Reading("energy_j", pytest.approx(0.05))
    assert first["package-1"].value == pytest.approx(0.0)

    (pkg0 / "energy_uj").write_text("30000\n")  # wrapped at 1_000_000 uJ: +50_000 then +30_000
    assert source.read()["package-0"].value == pytest.approx(0.05 + 0.08)


def server_powercap(root: Path, max_uj: int = 1_000_000) -> dict[str, Path]:
    """Two sockets, each with core, uncore and dram sub-zones, and the platform's psys zone."""
    zones = {}
    for socket in (0, 1):
        zones[f"package-{socket}"] = write_zone(root, f"intel-rapl:{socket}", f"package-{socket}", 0, max_uj)
        zones[f"core{socket}"] = write_zone(root, f"intel-rapl:{socket}:0", "core", 0, max_uj)
        zones[f"uncore{socket}"] = write_zone(root, f"intel-rapl:{socket}:1", "uncore", 0, max_uj)
        zones[f"dram{socket}"] = write_zone(root, f"intel-rapl:{socket}:2", "dram", 0, max_uj)
    zones["psys"] = write_zone(root, "intel-rapl:2", "psys", 0, max_uj)
    zones["mmio"] = write_zone(root, "intel-rapl-mmio:0", "package-0", 0, max_uj)  # the same package, over MMIO
    return zones


def test_rapl_reads_dram_as_its_own_channel_beside_each_package_and_never_core_uncore_or_psys(tmp_path):
    zones = server_powercap(tmp_path)
    source = RaplSource(tmp_path)
    assert source.channels() == ["package-0", "dram", "package-1", "dram@intel-rapl:1:2"]

    for name, uj in {"package-0": 400_000, "dram0": 100_000, "package-1": 300_000, "dram1": 50_000,
                     "core0": 200_000, "uncore0": 90_000, "psys": 990_000, "mmio": 400_000}.items():  # fmt: skip
        (zones[name] / "energy_uj").write_text(f"{uj}\n")
    read = source.read()
    assert {c: r.value for c, r in read.items()} == pytest.approx(
        {"package-0": 0.4, "dram": 0.1, "package-1": 0.3, "dram@intel-rapl:1:2": 0.05}
    )
    assert {r.quantity for r in read.values()} == {"energy_j"}

    (zones["dram0"] / "energy_uj").write_text("20000\n")  # wrapped at 1_000_000 uJ: +900_000 then +20_000
    assert source.read()["dram"].value == pytest.approx(0.1 + 0.92)


def test_rapl_dram_of_a_zone_that_is_not_a_package_is_not_read(tmp_path):
    write_zone(tmp_path, "intel-rapl:0", "package-0", 0)
    write_zone(tmp_path, "intel-rapl:1", "psys", 0)
    write_zone(tmp_path, "intel-rapl:1:0", "dram", 0)  # psys already covers it
    assert RaplSource(tmp_path).channels() == ["package-0"]


def test_energy_of_packages_and_dram_counts_each_once(tmp_path):
    """Package 0 at 60 W, its DRAM at 15 W, package 1 at 40 W, its DRAM at 5 W, for 2 s: 240 J, while core,
    uncore and psys counters move too (adding any of them would count some of those joules twice)."""
    zones = server_powercap(tmp_path, max_uj=100_000_000)  # package-0's counter wraps once, at 100 J
    watts = {"package-0": 60.0, "dram0": 15.0, "package-1": 40.0, "dram1": 5.0, "core0": 30.0, "uncore0": 10.0,
             "core1": 20.0, "uncore1": 10.0, "psys": 150.0, "mmio": 60.0}  # fmt: skip
    clock = FakeClock()
    sampler = EnergySampler([RaplSource(tmp_path)], host=False, clock=clock)
    sampler.start(thread=False)
    for t in (0.5, 1.0, 1.5, 2.0):
        clock.t = t
        for name, w in watts.items():
            (zones[name] / "energy_uj").write_text(f"{round(w * t * 1e6) % 100_000_000}\n")
        if t < 2.0:
            sampler.sample_now()
    sampler.stop()

    summary = sampler.summary()
    assert summary["energy_j"] == pytest.approx(2.0 * (60 + 15 + 40 + 5))
    assert summary["power_w_mean"] == pytest.approx(120.0)
    assert summary["energy_scope"] == "rapl:package-0+rapl:dram+rapl:package-1+rapl:dram@intel-rapl:1:2"
    assert sampler.energy_j()["rapl:dram"] == pytest.approx(30.0)


def test_rapl_absent_root_names_the_path(tmp_path):
    missing = tmp_path / "powercap"
    with pytest.raises(SensorUnavailable, match="RAPL not readable") as info:
        RaplSource(missing)
    assert str(missing) in str(info.value)


def test_rapl_permission_denied_is_reported_as_such(tmp_path, monkeypatch):
    write_zone(tmp_path, "intel-rapl:0", "package-0", 1)
    real_open = builtins.open

    def root_only(path, *args, **kwargs):
        if str(path).endswith("energy_uj"):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", root_only)
    with pytest.raises(SensorUnavailable, match="permission denied"):
        RaplSource(tmp_path)


def test_nvml_absent_here_degrades_to_a_reason(tmp_path, monkeypatch):
    if not torch.cuda.is_available():
        with pytest.raises(SensorUnavailable, match="NVML unavailable"):
            NvmlSource()

    monkeypatch.setattr(sensors, "POWERCAP_ROOT", tmp_path / "no-powercap")
    sources, missing = open_power_sources("cpu")
    assert sources == []
    assert set(missing) == {"cpu"}
    assert "RAPL not readable" in missing["cpu"] and "no-powercap" in missing["cpu"]

    sampler = EnergySampler(sources, unavailable=missing, host=False, interval_s=0.01)
    with sampler:
        pass
    summary = sampler.summary()
    assert summary["energy_j"] is None and summary["power_w_mean"] is None and summary["energy_scope"] is None
    assert summary["energy_unavailable"] == missing["cpu"]
    efficiency = run_energy(summary, {"samples_per_s": 1000.0})
    assert efficiency["energy_per_sample_j"] is None and efficiency["samples_per_s_per_w"] is None


def test_no_source_and_no_reason_still_says_why():
    sampler = EnergySampler([], host=False)
    with sampler:
        pass
    assert sampler.summary()["energy_unavailable"] == "no power source"


class FakeNvmlError(Exception):
    pass


def fake_pynvml(energy_supported: list[bool]) -> types.ModuleType:
    """Two-device NVML where device i supports the energy counter iff energy_supported[i]."""
    mod = types.ModuleType("pynvml")
    mod.NVMLError = FakeNvmlError
    mod.shutdowns = 0

    def total_energy(handle: int) -> int:
        if not energy_supported[handle]:
            raise FakeNvmlError("Not Supported")
        return 123_000  # mJ

    def shutdown() -> None:
        mod.shutdowns += 1

    mod.nvmlInit = lambda: None
    mod.nvmlShutdown = shutdown
    mod.nvmlDeviceGetCount = lambda: len(energy_supported)
    mod.nvmlDeviceGetHandleByIndex = lambda i: i
    mod.nvmlDeviceGetTotalEnergyConsumption = total_energy
    mod.nvmlDeviceGetPowerUsage = lambda handle: 250_000  # mW
    return mod


def test_nvml_prefers_energy_counter_and_falls_back_to_power(monkeypatch):
    nvml = fake_pynvml([True, False])
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    source = NvmlSource()
    assert source.channels() == ["gpu0", "gpu1"]
    assert source.read() == {"gpu0": Reading("energy_j", 123.0), "gpu1": Reading("power_w", 250.0)}
    only_second = NvmlSource(devices=[1])
    assert only_second.channels() == ["gpu1"]
    only_second.close()
    source.close()
    source.close()
    assert nvml.shutdowns == 2  # NVML is reference counted: one shutdown per source, not per close() call

    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml([]))
    with pytest.raises(SensorUnavailable, match="no GPU"):
        NvmlSource()


def test_real_thread_samples_until_stop_then_closes_sources():
    clock = FakeClock()
    source = FakeSource(clock, lambda t: 10.0)
    sampler = EnergySampler([source], interval_s=0.01, host=False).start()
    time.sleep(0.15)
    assert sampler.running
    sampler.stop()

    rows = sampler.rows()
    assert len(rows) >= 5
    assert sampler._thread is not None and not sampler._thread.is_alive()
    assert source.closed
    sampler.stop()  # idempotent
    sampler.sample_now()  # no effect once stopped
    time.sleep(0.03)
    assert len(sampler.rows()) == len(rows) and source.reads == len(rows)
    # unix timestamps (~1.7e9 s) carry ~0.1 us of float rounding, hence the tolerance
    span_s = rows[-1]["time_unix_s"] - rows[0]["time_unix_s"]
    assert sampler.summary()["energy_j"] == pytest.approx(10.0 * span_s, rel=1e-4)


def test_host_sampling_records_every_core_and_process_tree_memory():
    child_pids = [psutil.Process().pid, 2**22 + 12345]  # itself (not counted twice) and a pid that does not exist
    sampler = EnergySampler([], interval_s=0.01, pids=lambda: child_pids)
    with sampler:
        deadline = time.monotonic() + 0.12
        while time.monotonic() < deadline:  # keep one core busy so utilisation is not trivially 0
            sum(range(1000))

    rows = sampler.rows()
    cores = {r["channel"] for r in rows if r["quantity"] == "cpu_percent"}
    assert cores == {f"cpu{i}" for i in range(len(psutil.cpu_times(percpu=True)))}
    assert all(0.0 <= r["value"] <= 100.0 for r in rows if r["quantity"] == "cpu_percent")
    rss = [r["value"] for r in rows if r["quantity"] == "rss_bytes"]
    own = psutil.Process().memory_info().rss
    assert rss and all(0 < v < 1.5 * own for v in rss)
    assert {r["source"] for r in rows} == {"psutil"}

    summary = sampler.summary()
    assert summary["process_rss_max_mb"] > 0
    assert 0.0 < summary["cpu_utilization_mean"] <= 1.0
    table = pa.Table.from_pylist(rows, schema=TELEMETRY_SCHEMA)
    assert table.num_rows == len(rows)
    assert abs(rows[-1]["time_unix_s"] - time.time()) < 5.0


def test_rows_use_unix_time_and_match_the_schema():
    clock = FakeClock(t=100.0)
    sampler = EnergySampler([FakeSource(clock, lambda t: 10.0)], host=False, clock=clock)
    before = time.time()
    drive(sampler, clock, [100.0, 101.0])
    rows = sampler.rows()
    assert [r["quantity"] for r in rows] == ["power_w", "power_w"]
    assert rows[1]["time_unix_s"] - rows[0]["time_unix_s"] == pytest.approx(1.0)
    assert rows[0]["time_unix_s"] == pytest.approx(before, abs=1.0)
    assert pa.Table.from_pylist(rows, schema=TELEMETRY_SCHEMA).schema == TELEMETRY_SCHEMA


def test_energy_per_sample_query_and_watt():
    energy = {"energy_j": 100.0, "power_w_mean": 10.0}
    train = run_energy(energy, {"samples_per_s": 100.0, "valid_flops_per_s": 2e9})
    assert train["energy_per_sample_j"] == pytest.approx(0.1) and train["samples_per_s_per_w"] == pytest.approx(10.0)
    assert train["valid_flops_per_s_per_w"] == pytest.approx(2e8)
    # a co-located point: the power is shared by every model's queries
    rows = [{"queries_per_s": 30.0, "samples_per_s": 300.0}, {"queries_per_s": 20.0, "samples_per_s": 100.0}]
    point = point_energy(energy, rows)
    assert point["energy_per_query_j"] == pytest.approx(10.0 / 50) and point["energy_per_sample_j"] == pytest.approx(
        10.0 / 400
    )
    assert point_energy({"energy_j": None, "power_w_mean": None}, rows).get("energy_per_query_j") is None


def test_ranks_combine_into_one_summary():
    gpu0 = {"energy_j": 50.0, "power_w_mean": 100.0, "energy_scope": "nvml:gpu0", "energy_unavailable": None,
            "cpu_utilization_mean": 0.5, "process_rss_max_mb": 100.0}  # fmt: skip
    gpu1 = {**gpu0, "energy_scope": "nvml:gpu1", "cpu_utilization_mean": 0.7}
    both = combine_summaries([gpu0, gpu1])
    assert both["energy_j"] == 100.0 and both["power_w_mean"] == 200.0
    assert both["energy_scope"] == "nvml:gpu0+nvml:gpu1" and both["process_rss_max_mb"] == 200.0
    assert both["cpu_utilization_mean"] == pytest.approx(0.6)
    none = {"energy_j": None, "power_w_mean": None, "energy_scope": None, "energy_unavailable": "RAPL not readable"}
    assert combine_summaries([none, none]) == {**dict.fromkeys(gpu0), "energy_unavailable": "RAPL not readable"}


@pytest.mark.parametrize("interval", [0, 0.001, 5, float("nan")])
def test_interval_out_of_range_is_rejected(interval):
    with pytest.raises(ValueError, match="interval_s"):
        EnergySampler([], interval_s=interval)


# ------------------------------------------------------------------------------------ CPU meter

# psutil's Linux field layouts; guest time is also inside user time, as the kernel reports it
CoreTimes = namedtuple("CoreTimes", "user nice system idle iowait irq softirq steal guest guest_nice")
ProcTimes = namedtuple("ProcTimes", "user system children_user children_system")


@dataclass
class FakeCpu:
    """Cumulative kernel counters the test advances: per core {field: seconds}, per pid (user, system)."""

    cores: list[dict[str, float]]
    procs: dict[int, tuple[float, float]] = field(default_factory=dict)

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        def cpu_times(percpu: bool = False) -> list[CoreTimes]:
            assert percpu
            return [CoreTimes(**{f: c.get(f, 0.0) for f in CoreTimes._fields}) for c in self.cores]

        def process_cpu_times(proc: psutil.Process) -> ProcTimes:
            if proc.pid not in self.procs:
                raise psutil.NoSuchProcess(proc.pid)
            return ProcTimes(*self.procs[proc.pid], 0.0, 0.0)

        monkeypatch.setattr(psutil, "cpu_times", cpu_times)
        monkeypatch.setattr(psutil.Process, "cpu_times", process_cpu_times)

    def add(self, core: int, **seconds: float) -> None:
        for name, value in seconds.items():
            self.cores[core][name] = self.cores[core].get(name, 0.0) + value


def test_cpu_meter_gives_the_documented_numbers_from_kernel_counters(monkeypatch):
    me, other = os.getpid(), os.getppid()
    fake = FakeCpu([{"user": 10.0, "idle": 90.0}, {"user": 5.0, "idle": 95.0}], {other: (1.0, 1.0), me: (2.0, 0.0)})
    fake.install(monkeypatch)
    clock = FakeClock()
    procs = {"instance": [(other, 1)], "server": [(me, 1)]}
    both = cpu.CpuMeter(None, procs, clock=clock).start()
    first = cpu.CpuMeter([0], clock=clock).start()
    second = cpu.CpuMeter([1], clock=clock).start()

    # 1 s: core 0 fully busy (0.25 s of it guest, which the kernel already counts in user), core 1 idle
    # or waiting on I/O (not busy either); the instance used 0.2 s user + 0.1 s system, the server 0.05 s
    clock.t = 1.0
    fake.add(0, user=1.0, guest=0.25)
    fake.add(1, idle=0.8, iowait=0.2)
    fake.procs = {other: (1.2, 1.1), me: (2.05, 0.0)}
    use = both.stop()

    assert use["wall_s"] == pytest.approx(1.0)
    assert use["cpu_busy_s"] == pytest.approx(1.0) and use["cpu_total_s"] == pytest.approx(2.0)
    assert use["cpu_utilization"] == pytest.approx(0.5)  # guest added twice would give 1.25 / 2.25
    assert use["core_utilization"] == pytest.approx({0: 1.0, 1: 0.0})
    assert first.stop()["cpu_utilization"] == pytest.approx(1.0)
    assert second.stop()["cpu_utilization"] == pytest.approx(0.0)
    assert use["instance_cpu_s"] == pytest.approx(0.3) and use["instance_cpu_utilization"] == pytest.approx(0.3)
    assert use["server_cpu_s"] == pytest.approx(0.05)


def test_cpu_meter_hot_plug_and_vanished_process_give_none_not_a_wrong_number(monkeypatch):
    me = os.getpid()
    fake = FakeCpu([{"user": 1.0, "idle": 1.0}] * 2, {me: (1.0, 0.0)})
    fake.install(monkeypatch)
    clock = FakeClock()
    meter = cpu.CpuMeter(processes={"server": [(me, 2)]}, clock=clock).start()

    clock.t = 1.0
    fake.cores = [{"user": 1.5, "idle": 1.5}] * 3  # a core came online: indices no longer line up
    fake.procs[me] = (1.5, 0.5)
    lap = meter.lap()
    assert lap["cpu_utilization"] is None and lap["cpu_busy_s"] is None and lap["core_utilization"] == {}
    assert lap["server_cpu_s"] == pytest.approx(1.0) and lap["server_cpu_utilization"] == pytest.approx(0.5)

    clock.t = 2.0  # the next window starts from the new layout
    fake.cores = [{"user": 2.5, "idle": 1.5}] * 3
    del fake.procs[me]
    lap = meter.stop()
    assert lap["cpu_utilization"] == pytest.approx(1.0)
    assert lap["server_cpu_s"] is None and lap["server_cpu_utilization"] is None
    with pytest.raises(RuntimeError, match="before start"):
        meter.stop()


def test_energy_sampler_cpu_utilisation_goes_through_the_cpu_meter(monkeypatch):
    laps: list[dict] = []

    class SpyMeter(cpu.CpuMeter):
        def lap(self) -> dict:
            laps.append(super().lap())
            return laps[-1]

    monkeypatch.setattr(energy, "CpuMeter", SpyMeter)
    fake = FakeCpu([{"user": 10.0, "idle": 90.0}, {"user": 5.0, "idle": 95.0}])
    fake.install(monkeypatch)
    clock = FakeClock()
    sampler = EnergySampler([], clock=clock)
    clock.t = 0.0
    sampler.start(thread=False)
    clock.t = 1.0  # core 0 busy, core 1 idle: 0.5 of both cores
    fake.add(0, user=1.0)
    fake.add(1, idle=1.0)
    sampler.sample_now()
    clock.t = 2.0  # both idle
    fake.add(0, idle=1.0)
    fake.add(1, idle=1.0)
    sampler.stop()

    assert [lap["cpu_utilization"] for lap in laps] == pytest.approx([0.5, 0.0])
    assert sampler.summary()["cpu_utilization_mean"] == pytest.approx(0.25)  # 1 busy of 4 core-seconds
    assert sampler.summary(0.5, 1.0)["cpu_utilization_mean"] == pytest.approx(0.5)
    percent = [(r["time_unix_s"], r["channel"], r["value"]) for r in sampler.rows() if r["quantity"] == "cpu_percent"]
    assert [(c, v) for _, c, v in percent] == [("cpu0", 100.0), ("cpu1", 0.0), ("cpu0", 0.0), ("cpu1", 0.0)]


def test_one_cpu_meter_in_the_package():
    import dlrm_lab
    from dlrm_lab.infer import load_point

    root = Path(dlrm_lab.__file__).parent
    sources = {p.relative_to(root).as_posix(): p.read_text() for p in root.rglob("*.py")}
    assert {name for name, text in sources.items() if "cpu_times(" in text} == {"metrics/cpu.py"}
    meters = {name for name, text in sources.items() if re.search(r"^class \w*Cpu\w*Meter\b", text, re.M)}
    assert meters == {"metrics/cpu.py"}
    assert not hasattr(load_point, "_CpuMeter")
    assert energy.CpuMeter is cpu.CpuMeter and load_point.CpuMeter is cpu.CpuMeter

"""Energy and host telemetry sampled in the background during a run.

GPU power/energy comes from NVML, CPU package energy from RAPL (Linux powercap sysfs), CPU utilisation
from the CPU meter (dlrm_lab.metrics.cpu) and process-tree memory from psutil. A sensor that is absent
or unreadable is reported as unavailable (None plus a reason), never as zero: a zero would silently turn
into "free" samples in the summaries.
"""

from __future__ import annotations

import bisect
import logging
import os
import re
import threading
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import psutil
import pyarrow as pa

from dlrm_lab.metrics.cpu import CpuMeter, busy_share

log = logging.getLogger(__name__)

POWER_W = "power_w"
ENERGY_J = "energy_j"
QUANTITIES = (POWER_W, ENERGY_J)
POWERCAP_ROOT = Path("/sys/class/powercap")
MIN_INTERVAL_S = 0.01
MAX_INTERVAL_S = 1.0

TELEMETRY_SCHEMA = pa.schema(
    [
        ("time_unix_s", pa.float64()),
        ("source", pa.string()),
        ("channel", pa.string()),
        ("quantity", pa.string()),
        ("value", pa.float64()),
    ]
)


def telemetry_schema(key: str) -> pa.Schema:
    """TELEMETRY_SCHEMA led by the run's own int32 key: `rank` (training), `point` (inference)."""
    return pa.schema([pa.field(key, pa.int32()), *TELEMETRY_SCHEMA])


# Summary columns of an energy window (EnergySampler.summary); the per-sample/query ones are the caller's.
ENERGY_FIELDS = [
    pa.field("energy_j", pa.float64()),
    pa.field("power_w_mean", pa.float64()),
    pa.field("energy_scope", pa.string()),
    pa.field("energy_unavailable", pa.string()),
    pa.field("cpu_utilization_mean", pa.float64()),
    pa.field("process_rss_max_mb", pa.float64()),
]


class SensorUnavailable(Exception):
    """A power sensor cannot be used here; the message is the one-line reason shown to users."""


@dataclass(frozen=True)
class Reading:
    quantity: str  # "power_w" (instantaneous watts) or "energy_j" (monotonic cumulative joules counter)
    value: float


class PowerSource(Protocol):
    name: str

    def channels(self) -> list[str]: ...

    def read(self) -> dict[str, Reading]: ...

    def close(self) -> None: ...


# --------------------------------------------------------------------------------------------- NVML


class NvmlSource:
    """Per-GPU energy through NVML.

    The total-energy counter (mJ, Volta and newer) is preferred: it integrates inside the driver, so
    short spikes between our samples are not lost. Older GPUs fall back to instantaneous power (mW).
    """

    name = "nvml"

    def __init__(self, devices: list[int] | None = None):
        try:
            import pynvml
        except ImportError as e:
            raise SensorUnavailable(f"NVML unavailable: nvidia-ml-py not installed ({e})") from None
        self._nvml = pynvml
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as e:
            raise SensorUnavailable(f"NVML unavailable: {_one_line(e)}") from None
        self._closed = False
        try:
            count = pynvml.nvmlDeviceGetCount()
            if count == 0:
                raise SensorUnavailable("NVML unavailable: no GPU devices")
            indices = list(range(count)) if devices is None else list(devices)
            self._devices: list[tuple[str, Any, str]] = []  # (channel, handle, quantity)
            for index in indices:
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                self._devices.append((f"gpu{index}", handle, self._probe(handle, index)))
        except pynvml.NVMLError as e:
            self.close()
            raise SensorUnavailable(f"NVML unavailable: {_one_line(e)}") from None
        except SensorUnavailable:
            self.close()
            raise

    def _probe(self, handle: Any, index: int) -> str:
        nvml = self._nvml
        try:
            nvml.nvmlDeviceGetTotalEnergyConsumption(handle)
            return ENERGY_J
        except nvml.NVMLError:
            pass
        try:
            nvml.nvmlDeviceGetPowerUsage(handle)
            return POWER_W
        except nvml.NVMLError as e:
            reason = f"NVML unavailable: gpu{index} reports neither energy nor power ({_one_line(e)})"
            raise SensorUnavailable(reason) from None

    def channels(self) -> list[str]:
        return [channel for channel, _, _ in self._devices]

    def read(self) -> dict[str, Reading]:
        nvml = self._nvml
        out: dict[str, Reading] = {}
        for channel, handle, quantity in self._devices:
            if quantity == ENERGY_J:
                out[channel] = Reading(ENERGY_J, nvml.nvmlDeviceGetTotalEnergyConsumption(handle) / 1e3)
            else:
                out[channel] = Reading(POWER_W, nvml.nvmlDeviceGetPowerUsage(handle) / 1e3)
        return out

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._nvml.nvmlShutdown()
        except self._nvml.NVMLError:
            pass


# --------------------------------------------------------------------------------------------- RAPL

_PACKAGE_ZONE = re.compile(r"intel-rapl:(\d+)")


@dataclass
class _RaplZone:
    channel: str
    energy_path: Path
    max_range_uj: int | None
    last_raw_uj: int
    total_uj: int = 0


class RaplSource:
    """CPU package energy from `<root>/intel-rapl:N/energy_uj`.

    Only top-level package zones are read: sub-zones (core, uncore, dram) are contained in the package
    and psys overlaps it, so adding them would count energy twice. The raw counter wraps at
    max_energy_range_uj; the source keeps its own monotonic total so callers never see the wrap.
    """

    name = "rapl"

    def __init__(self, root: str | Path = POWERCAP_ROOT):
        root = Path(root)
        if not root.is_dir():
            raise SensorUnavailable(f"RAPL not readable: {root} absent")
        self._zones: list[_RaplZone] = []
        for zone_dir in sorted(root.iterdir(), key=lambda p: _zone_index(p.name)):
            if not _PACKAGE_ZONE.fullmatch(zone_dir.name):
                continue
            try:
                label = _read_text(zone_dir / "name")
            except OSError:
                continue
            if not label.startswith("package"):
                continue
            energy_path = zone_dir / "energy_uj"
            try:
                raw = _read_int(energy_path)
            except PermissionError:
                raise SensorUnavailable(
                    f"RAPL not readable: permission denied on {energy_path} (recent kernels make energy_uj root-only)"
                ) from None
            except (OSError, ValueError) as e:
                raise SensorUnavailable(f"RAPL not readable: {energy_path}: {_one_line(e)}") from None
            try:
                max_range: int | None = _read_int(zone_dir / "max_energy_range_uj")
            except (OSError, ValueError):
                max_range = None
            channel = label if label not in self.channels() else f"{label}@{zone_dir.name}"
            self._zones.append(_RaplZone(channel, energy_path, max_range, raw))
        if not self._zones:
            raise SensorUnavailable(f"RAPL not readable: no package zones under {root}")

    def channels(self) -> list[str]:
        return [zone.channel for zone in self._zones]

    def read(self) -> dict[str, Reading]:
        out: dict[str, Reading] = {}
        for zone in self._zones:
            raw = _read_int(zone.energy_path)
            delta = raw - zone.last_raw_uj
            if delta < 0:
                # Wrapped (at most once: at <= 1 s per read a wrap takes minutes even at full package power).
                # Without a known range only the part after the wrap can be counted.
                delta += zone.max_range_uj if zone.max_range_uj else zone.last_raw_uj
            zone.total_uj += delta
            zone.last_raw_uj = raw
            out[zone.channel] = Reading(ENERGY_J, zone.total_uj / 1e6)
        return out

    def close(self) -> None:
        pass


def _zone_index(name: str) -> tuple[int, str]:
    m = _PACKAGE_ZONE.fullmatch(name)
    return (int(m.group(1)) if m else 1 << 30, name)


def _read_text(path: Path) -> str:
    with open(path) as f:
        return f.read().strip()


def _read_int(path: Path) -> int:
    return int(_read_text(path))


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text or type(e).__name__


def open_power_sources(
    device: str, *, nvml_devices: list[int] | None = None, packages: bool = True
) -> tuple[list[PowerSource], dict[str, str]]:
    """The power sources that work for `device` ("cpu" or "cuda") and a reason for each missing one.

    For "cpu" only RAPL matters; for "cuda" NVML gives GPU energy and RAPL the host's. `nvml_devices`
    restricts NVML to those indices (default: every GPU NVML sees, which may include other jobs' GPUs).
    `packages=False` leaves RAPL out: several ranks of one node must read the packages only once.
    """
    kind = device.split(":", 1)[0]
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    sources: list[PowerSource] = []
    missing: dict[str, str] = {}
    if kind == "cuda":
        try:
            sources.append(NvmlSource(nvml_devices))
        except SensorUnavailable as e:
            missing["gpu"] = str(e)
    if not packages:
        return sources, missing
    try:
        sources.append(RaplSource(POWERCAP_ROOT))
    except SensorUnavailable as e:
        missing["cpu"] = str(e)
    return sources, missing


# ------------------------------------------------------------------------------------------ sampler


class _Series:
    """Samples of one channel: parallel arrays keep a long run's memory at 16 bytes per sample."""

    def __init__(self, source: str, channel: str, quantity: str):
        self.source = source
        self.channel = channel
        self.quantity = quantity
        self.t = array("d")
        self.v = array("d")

    @property
    def key(self) -> str:
        return f"{self.source}:{self.channel}"


@dataclass
class _SourceHealth:
    reads: int = 0
    failures: int = 0
    last_error: str = ""


@dataclass(frozen=True)
class _HostSample:
    t: float
    busy_s: float | None  # core-seconds busy since the previous host sample, all cores (None for the first)
    total_s: float | None  # core-seconds elapsed in the same interval
    cores: dict[int, float]  # busy share per core in that interval (cores without ticks left out)
    rss_bytes: int


class EnergySampler:
    """Samples every power source (and host CPU/memory) on a daemon thread between start() and stop().

    Readings are taken once at start() and once at stop() as well as every `interval_s`, so any window
    inside [start, stop] is covered at both edges. Tests drive `sample_now()` with a fake clock and
    `start(thread=False)` instead of sleeping.
    """

    def __init__(
        self,
        sources: Sequence[PowerSource],
        interval_s: float = 0.05,
        *,
        unavailable: dict[str, str] | None = None,
        host: bool = True,
        pids: Callable[[], list[int]] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        if not MIN_INTERVAL_S <= interval_s <= MAX_INTERVAL_S:
            raise ValueError(f"interval_s must be within [{MIN_INTERVAL_S}, {MAX_INTERVAL_S}] s, got {interval_s}")
        self.sources = list(sources)
        self.interval_s = float(interval_s)
        self.unavailable = dict(unavailable or {})
        self.host = host
        self._pids = pids
        self._clock = clock
        self._lock = threading.Lock()  # guards the recorded data
        self._sample_lock = threading.Lock()  # serialises sample_now (sources keep state between reads)
        self._stop_event = threading.Event()
        self._thread: threading.Thread | None = None
        self._state = "new"  # new -> running -> stopped
        self._unix_offset = 0.0
        self._t_start: float | None = None
        self._t_last: float | None = None
        self._series: dict[tuple[str, str], _Series] = {}
        self._health = {id(s): _SourceHealth() for s in self.sources}
        self._host_samples: list[_HostSample] = []
        self._cpu = CpuMeter(clock=clock)  # every core of the host, from one host sample to the next
        self._process = psutil.Process(os.getpid()) if host else None

    # lifecycle

    def start(self, *, thread: bool = True) -> EnergySampler:
        """Take the first sample and (unless `thread=False`) start the background thread."""
        if self._state != "new":
            raise RuntimeError("EnergySampler can only be started once")
        self._unix_offset = time.time() - self._clock()
        self._state = "running"
        self.sample_now()
        if thread:
            self._thread = threading.Thread(target=self._run, name="energy-sampler", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the thread, take the closing sample and close the sources (owned by the sampler). Idempotent."""
        if self._state == "stopped":
            return
        try:
            if self._state == "running":
                self._stop_event.set()
                if self._thread is not None:
                    self._thread.join()
                self.sample_now()
        finally:
            self._state = "stopped"
            for source in self.sources:
                try:
                    source.close()
                except Exception:  # closing must not mask the run's own outcome
                    log.debug("closing power source %s failed", source.name, exc_info=True)

    def __enter__(self) -> EnergySampler:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        return self._state == "running"

    def mark(self) -> float:
        """A window edge for energy_j()/summary(): a sample is taken now, so that a window
        ending (or starting) between two ticks is not cut short by the clipping to samples."""
        self.sample_now()
        return self._clock()

    def _run(self) -> None:
        while not self._stop_event.wait(self.interval_s):
            try:
                self.sample_now()
            except Exception:  # a sampler bug must not take the run down; losing telemetry is the lesser harm
                log.warning("energy sampling failed", exc_info=True)

    # sampling

    def sample_now(self) -> None:
        """Read every source (and the host) once and record the readings; no-op unless running."""
        with self._sample_lock:
            if self._state != "running":
                return
            begin = self._clock()
            for source in self.sources:
                self._sample_source(source)
            if self.host:
                try:
                    self._sample_host()
                except (psutil.Error, OSError):  # host telemetry is best effort, like a sensor tick
                    log.debug("host sampling failed", exc_info=True)
            end = self._clock()
            with self._lock:
                self._t_start = begin if self._t_start is None else self._t_start
                self._t_last = end

    def _sample_source(self, source: PowerSource) -> None:
        health = self._health[id(source)]
        before = self._clock()
        try:
            readings = source.read()
        except Exception as e:  # a failing sensor loses this tick only
            with self._lock:
                health.reads += 1
                health.failures += 1
                health.last_error = _one_line(e)
            return
        t = (before + self._clock()) / 2
        with self._lock:
            health.reads += 1
            for channel, reading in readings.items():
                key = (source.name, channel)
                series = self._series.get(key)
                if series is None:
                    series = self._series[key] = _Series(source.name, channel, reading.quantity)
                if reading.quantity != series.quantity:
                    continue  # a channel keeps one quantity; mixing watts and joules would be meaningless
                series.t.append(t)
                series.v.append(float(reading.value))

    def _sample_host(self) -> None:
        busy = total = None
        cores: dict[int, float] = {}
        if self._cpu.started:
            use = self._cpu.lap()
            busy, total, cores = use["cpu_busy_s"], use["cpu_total_s"], use["core_utilization"]
        else:
            self._cpu.start()
        sample = _HostSample(self._clock(), busy, total, cores, self._rss_bytes())
        with self._lock:
            self._host_samples.append(sample)

    def _rss_bytes(self) -> int:
        assert self._process is not None
        rss = self._process.memory_info().rss
        try:
            others = set(self._pids()) if self._pids else set()
        except Exception:
            others = set()
        others.discard(os.getpid())
        for pid in others:
            try:
                rss += psutil.Process(pid).memory_info().rss
            except psutil.Error:  # vanished, zombie or not ours
                pass
        return rss

    # results

    def _window(self, t0: float | None, t1: float | None) -> tuple[float, float] | None:
        with self._lock:
            start, last = self._t_start, self._t_last
        if start is None or last is None:
            return None
        return (start if t0 is None else t0, last if t1 is None else t1)

    def energy_j(self, t0: float | None = None, t1: float | None = None) -> dict[str, float]:
        """Joules per "source:channel" within [t0, t1] (default: the whole sampling span).

        Channels without two readings around the window are left out rather than reported as 0.
        """
        return self._energy(self._window(t0, t1))

    def _energy(self, window: tuple[float, float] | None) -> dict[str, float]:
        return {key: joules for key, (joules, _) in self._energy_spans(window).items()}

    def _energy_spans(self, window: tuple[float, float] | None) -> dict[str, tuple[float, float]]:
        """(joules, seconds covered by readings) per channel within the window."""
        if window is None:
            return {}
        a, b = window
        out: dict[str, tuple[float, float]] = {}
        with self._lock:
            series = [(s.key, s.quantity, list(s.t), list(s.v)) for s in self._series.values()]
        for key, quantity, ts, vs in series:
            joules = _integrate(ts, vs, a, b) if quantity == POWER_W else _counter_delta(ts, vs, a, b)
            span = _clip(ts, a, b)
            if joules is not None and span is not None:
                out[key] = (joules, span[1] - span[0])
        return out

    def _failed_sources(self) -> list[str]:
        with self._lock:
            return [
                f"{s.name}: every read failed ({h.last_error})"
                for s in self.sources
                if (h := self._health[id(s)]).reads and h.failures == h.reads
            ]

    def summary(self, t0: float | None = None, t1: float | None = None) -> dict[str, Any]:
        """Energy, mean power, CPU utilisation and peak memory over the window, as run summary columns."""
        window = self._window(t0, t1)
        per_channel = self._energy_spans(window)
        energy = sum(j for j, _ in per_channel.values()) if per_channel else None
        # each channel's mean power over the time its readings cover (a window edge between two
        # ticks is not counted as 0 W)
        power = sum(j / span for j, span in per_channel.values() if span > 0) if per_channel else None
        reasons = list(self.unavailable.values()) + self._failed_sources()
        if energy is None and not reasons:
            reasons.append("no power source" if not self.sources else "no power readings in the window")
        return {
            "energy_j": energy,
            "power_w_mean": power if energy is not None else None,
            "energy_scope": "+".join(per_channel) if per_channel else None,
            "energy_unavailable": "; ".join(reasons) if reasons else None,
            "cpu_utilization_mean": self._cpu_utilization(window),
            "process_rss_max_mb": self._rss_max_mb(window),
        }

    def _host_in(self, window: tuple[float, float] | None) -> list[_HostSample]:
        if window is None:
            return []
        with self._lock:
            return [h for h in self._host_samples if window[0] <= h.t <= window[1]]

    def _cpu_utilization(self, window: tuple[float, float] | None) -> float | None:
        # Time-weighted: equals the mean of per-sample cpu_percent/100 at a steady interval, and stays right
        # when ticks are irregular or too short for the kernel's 10 ms accounting granularity.
        busy = total = 0.0
        for h in self._host_in(window):
            if h.busy_s is not None and h.total_s is not None:
                busy += h.busy_s
                total += h.total_s
        return busy_share(busy, total)

    def _rss_max_mb(self, window: tuple[float, float] | None) -> float | None:
        samples = self._host_in(window)
        return max(h.rss_bytes for h in samples) / 1e6 if samples else None

    def rows(self) -> list[dict[str, Any]]:
        """Every sample in long form (TELEMETRY_SCHEMA), ordered by time."""
        off = self._unix_offset
        out: list[tuple[float, int, dict[str, Any]]] = []
        with self._lock:
            for s in self._series.values():
                for t, v in zip(s.t, s.v, strict=True):
                    out.append((t, len(out), _row(t + off, s.source, s.channel, s.quantity, v)))
            for h in self._host_samples:
                for core, share in h.cores.items():
                    out.append((h.t, len(out), _row(h.t + off, "psutil", f"cpu{core}", "cpu_percent", 100.0 * share)))
                out.append((h.t, len(out), _row(h.t + off, "psutil", "process_tree", "rss_bytes", h.rss_bytes)))
        out.sort(key=lambda r: (r[0], r[1]))
        return [r for _, _, r in out]


def _row(t: float, source: str, channel: str, quantity: str, value: float) -> dict[str, Any]:
    return {"time_unix_s": t, "source": source, "channel": channel, "quantity": quantity, "value": float(value)}


def _interp(ts: list[float], vs: list[float], t: float) -> float:
    """Linear interpolation of the samples at t, with ts[0] <= t <= ts[-1]."""
    i = bisect.bisect_right(ts, t)
    if i >= len(ts):
        return vs[-1]
    if i == 0:
        return vs[0]
    t_a, t_b = ts[i - 1], ts[i]
    if t_b == t_a:
        return vs[i]
    return vs[i - 1] + (vs[i] - vs[i - 1]) * (t - t_a) / (t_b - t_a)


def _clip(ts: list[float], a: float, b: float) -> tuple[float, float] | None:
    if len(ts) < 2:
        return None
    lo, hi = max(a, ts[0]), min(b, ts[-1])
    return (lo, hi) if lo <= hi else None


def _integrate(ts: list[float], vs: list[float], a: float, b: float) -> float | None:
    """Trapezoid integral of power samples over [a, b], clipped to the sampled span."""
    span = _clip(ts, a, b)
    if span is None:
        return None
    lo, hi = span
    first, last = bisect.bisect_right(ts, lo), bisect.bisect_left(ts, hi)
    points_t = [lo, *ts[first:last], hi]
    points_v = [_interp(ts, vs, lo), *vs[first:last], _interp(ts, vs, hi)]
    return sum((points_t[i + 1] - points_t[i]) * (points_v[i + 1] + points_v[i]) / 2 for i in range(len(points_t) - 1))


def _counter_delta(ts: list[float], vs: list[float], a: float, b: float) -> float | None:
    """Growth of a cumulative joules counter over [a, b], clipped to the sampled span."""
    span = _clip(ts, a, b)
    if span is None:
        return None
    return _interp(ts, vs, span[1]) - _interp(ts, vs, span[0])


def combine_summaries(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One summary from several ranks' samplers over the same window: energies add up (each
    sensor is read by one rank only), memory adds up, CPU utilisation is averaged; energy is
    unavailable only when no rank read any."""
    energies = [p["energy_j"] for p in parts if p.get("energy_j") is not None]
    powers = [p["power_w_mean"] for p in parts if p.get("power_w_mean") is not None]
    reasons = list(dict.fromkeys(p["energy_unavailable"] for p in parts if p.get("energy_unavailable")))
    if len(reasons) > 1 or energies:  # a rank that reads no sensor by design says only "no power source"
        reasons = [r for r in reasons if r != "no power source"]
    cpu = [p["cpu_utilization_mean"] for p in parts if p.get("cpu_utilization_mean") is not None]
    rss = [p["process_rss_max_mb"] for p in parts if p.get("process_rss_max_mb") is not None]
    return {
        "energy_j": sum(energies) if energies else None,
        "power_w_mean": sum(powers) if powers else None,
        "energy_scope": "+".join(p["energy_scope"] for p in parts if p.get("energy_scope")) or None,
        "energy_unavailable": "; ".join(reasons) if reasons else None,
        "cpu_utilization_mean": sum(cpu) / len(cpu) if cpu else None,
        "process_rss_max_mb": sum(rss) if rss else None,
    }

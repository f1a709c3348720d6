"""Energy and host telemetry sampled in the background during a run.

`EnergySampler` reads the power sensors (`metrics.sensors`: NVML, RAPL), CPU utilisation
from the CPU meter (`metrics.cpu`) and process-tree memory from psutil on a daemon thread,
keeps every reading as telemetry rows, and turns any window of them into summary columns
(joules by `metrics.integrate`). A sensor that is absent or unreadable is reported as
unavailable (None plus a reason), never as zero.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

import psutil
import pyarrow as pa

from dlrm_lab.metrics.columns import schema_of
from dlrm_lab.metrics.cpu import CpuMeter, busy_share
from dlrm_lab.metrics.integrate import clip_to_samples, counter_delta, integrate_power
from dlrm_lab.metrics.sensors import POWER_W, PowerSource, one_line

log = logging.getLogger(__name__)

MIN_INTERVAL_S = 0.01
MAX_INTERVAL_S = 1.0

TELEMETRY_SCHEMA = schema_of("telemetry")  # the sampler's rows (`metrics.columns`)
_TELEMETRY_TABLES = {"rank": "train telemetry", "point": "infer telemetry"}


def telemetry_schema(key: str) -> pa.Schema:
    """TELEMETRY_SCHEMA led by the run's own int32 key: `rank` (training), `point` (inference)."""
    return schema_of(_TELEMETRY_TABLES[key])


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
                health.last_error = one_line(e)
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
        busy: float | None = None
        total: float | None = None
        cores: dict[int, float] = {}
        if self._cpu.started:
            use = self._cpu.lap()  # its values by key: these two seconds (or None), the per-core shares
            busy, total = cast("float | None", use["cpu_busy_s"]), cast("float | None", use["cpu_total_s"])
            cores = cast("dict[int, float]", use["core_utilization"])
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
            joules = integrate_power(ts, vs, a, b) if quantity == POWER_W else counter_delta(ts, vs, a, b)
            span = clip_to_samples(ts, a, b)
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

    def summary(self, t0: float | None = None, t1: float | None = None) -> dict[str, float | str | None]:
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

    def rows(self) -> list[dict[str, float | str]]:
        """Every sample in long form (TELEMETRY_SCHEMA), ordered by time."""
        off = self._unix_offset
        out: list[tuple[float, int, dict[str, float | str]]] = []
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


def _row(t: float, source: str, channel: str, quantity: str, value: float) -> dict[str, float | str]:
    return {"time_unix_s": t, "source": source, "channel": channel, "quantity": quantity, "value": float(value)}


def _numbers(parts: list[dict[str, float | str | None]], key: str) -> list[float]:
    """The ranks' values of one of a summary's number columns, where they have one."""
    return [cast(float, p[key]) for p in parts if p.get(key) is not None]


def combine_summaries(parts: list[dict[str, float | str | None]]) -> dict[str, float | str | None]:
    """One summary from several ranks' samplers over the same window: energies add up (each
    sensor is read by one rank only), memory adds up, CPU utilisation is averaged; energy is
    unavailable only when no rank read any."""
    energies = _numbers(parts, "energy_j")
    powers = _numbers(parts, "power_w_mean")
    reasons = list(dict.fromkeys(cast(str, p["energy_unavailable"]) for p in parts if p.get("energy_unavailable")))
    if len(reasons) > 1 or energies:  # a rank that reads no sensor by design says only "no power source"
        reasons = [r for r in reasons if r != "no power source"]
    cpu = _numbers(parts, "cpu_utilization_mean")
    rss = _numbers(parts, "process_rss_max_mb")
    return {
        "energy_j": sum(energies) if energies else None,
        "power_w_mean": sum(powers) if powers else None,
        "energy_scope": "+".join(cast(str, p["energy_scope"]) for p in parts if p.get("energy_scope")) or None,
        "energy_unavailable": "; ".join(reasons) if reasons else None,
        "cpu_utilization_mean": sum(cpu) / len(cpu) if cpu else None,
        "process_rss_max_mb": sum(rss) if rss else None,
    }

"""Power sensors: GPU energy through NVML, CPU package and DRAM energy through RAPL (Linux powercap sysfs).

Every source reads its channels as `Reading`s (instantaneous watts or a monotonic joules
counter); `metrics.energy` samples them over time. A sensor that is absent or unreadable
raises `SensorUnavailable` with a one-line reason, never reads as zero: a zero would
silently turn into "free" samples in the summaries.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

POWER_W = "power_w"
ENERGY_J = "energy_j"
QUANTITIES = (POWER_W, ENERGY_J)
POWERCAP_ROOT = Path("/sys/class/powercap")


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
            raise SensorUnavailable(f"NVML unavailable: {one_line(e)}") from None
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
            raise SensorUnavailable(f"NVML unavailable: {one_line(e)}") from None
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
            reason = f"NVML unavailable: gpu{index} reports neither energy nor power ({one_line(e)})"
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

_ZONE = re.compile(r"intel-rapl:(\d+)(?::(\d+))?")  # a package-level zone, or one of its sub-zones


@dataclass
class _RaplZone:
    channel: str
    energy_path: Path
    max_range_uj: int | None
    last_raw_uj: int
    total_uj: int = 0


class RaplSource:
    """CPU package and DRAM energy from `<root>/intel-rapl:N/energy_uj` and `<root>/intel-rapl:N:M/energy_uj`.

    Read: every top-level zone named `package-*`, and every sub-zone of a package named `dram`. Intel
    documents DRAM as a RAPL domain of its own, outside the package counter, so it adds to the package.
    Never read: the core and uncore sub-zones (inside the package counter: they would count twice) and
    psys (the whole platform, packages and DRAM included). Channels are named after the zone (`package-0`,
    `dram`); a name seen before gets the zone's directory (`dram@intel-rapl:1:0`). The raw counter wraps
    at max_energy_range_uj; the source keeps its own monotonic total so callers never see the wrap.
    """

    name = "rapl"

    def __init__(self, root: str | Path = POWERCAP_ROOT):
        root = Path(root)
        if not root.is_dir():
            raise SensorUnavailable(f"RAPL not readable: {root} absent")
        self._zones: list[_RaplZone] = []
        zones = {m.groups(): d for d in root.iterdir() if (m := _ZONE.fullmatch(d.name))}
        packages: set[str] = set()
        for (package, sub), zone_dir in sorted(zones.items(), key=lambda kv: _zone_index(*kv[0])):
            try:
                label = _read_text(zone_dir / "name")
            except OSError:
                continue
            wanted = package in packages and label == "dram" if sub is not None else label.startswith("package")
            if not wanted:
                continue
            if sub is None:
                packages.add(package)
            energy_path = zone_dir / "energy_uj"
            try:
                raw = _read_int(energy_path)
            except PermissionError:
                raise SensorUnavailable(
                    f"RAPL not readable: permission denied on {energy_path} (recent kernels make energy_uj root-only)"
                ) from None
            except (OSError, ValueError) as e:
                raise SensorUnavailable(f"RAPL not readable: {energy_path}: {one_line(e)}") from None
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


def _zone_index(package: str, sub: str | None) -> tuple[int, int]:
    """A package's zone first, then its sub-zones in order (a package is read before its dram)."""
    return (int(package), -1 if sub is None else int(sub))


def _read_text(path: Path) -> str:
    with open(path) as f:
        return f.read().strip()


def _read_int(path: Path) -> int:
    return int(_read_text(path))


def one_line(e: BaseException) -> str:
    """An exception as a one-line reason (its type when it has no message)."""
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

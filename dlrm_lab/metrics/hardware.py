"""Hardware fingerprint and software versions pinned in every run manifest, and the machine profile measured under
the fingerprint (`MachineProfile`)."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import socket
import subprocess
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

import psutil

from dlrm_lab.config.values import JsonObject

if TYPE_CHECKING:
    from dlrm_lab.metrics.collectives import CommRow
    from dlrm_lab.metrics.device_peaks import DeviceEntry

_PACKAGES = (
    "dlrm-lab",
    "torch",
    "torchrec",
    "fbgemm-gpu",
    "fbgemm-gpu-cpu",
    "numpy",
    "pyarrow",
    "typer",
    "rich",
    "torchmetrics",
    "nvidia-ml-py",
    "mpi4py",
    "mpich",
    "mlcommons-loadgen",
)


class MachineProfile(TypedDict, total=False):
    """A machine profile's sections, as `metrics.probe.probe_machine` writes them and `metrics.roofline` stores them
    under `fingerprint_id`. A profile read from disk is passed on as its JsonObject (`metrics.roofline.load_profile`
    checked its peaks); this is how its sections are read."""

    fingerprint_id: str
    hardware: JsonObject  # `hardware_fingerprint`
    probed_at: str
    quick: bool
    packages: dict[str, str]  # `package_versions`, those installed
    python: str
    devices: dict[str, DeviceEntry]  # "cpu", "cuda:<index>"
    comms: dict[str, list[CommRow]]  # by "<backend>/<ranks>"
    load: dict[str, float | bool | str]  # `metrics.trust.Load.to_dict`
    wake: dict[str, dict[str, float]]  # `metrics.wake.probe_wake`
    cold_gather: dict[str, float]  # `metrics.wake.probe_cold_gather`


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags() -> list[str]:
    """The vector/matrix ISA extensions that decide GEMM speed (AVX-512, AMX)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = line.split(":", 1)[1].split()
                return sorted(f for f in flags if f.startswith(("avx", "amx", "fma")))
    except OSError:
        pass
    return []


def gpus() -> JsonObject:
    """GPU names, memory and driver through NVML; an explanation where there is none."""
    try:
        import pynvml  # nvidia-ml-py
    except ImportError:
        return {"available": False, "reason": "nvidia-ml-py not installed", "devices": []}
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return {"available": False, "reason": f"NVML unavailable: {exc}", "devices": []}
    try:
        driver = pynvml.nvmlSystemGetDriverVersion()
        devices = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            devices.append(
                {
                    "index": i,
                    "name": pynvml.nvmlDeviceGetName(handle),
                    "memory_bytes": int(pynvml.nvmlDeviceGetMemoryInfo(handle).total),
                }
            )
        return {"available": bool(devices), "driver": driver, "devices": devices}
    finally:
        pynvml.nvmlShutdown()


IDLE_FILES = {  # how an idle core waits: what decides whether memory and caches go cold between queries
    "cpuidle_driver": "/sys/devices/system/cpu/cpuidle/current_driver",
    "cpuidle_governor": "/sys/devices/system/cpu/cpuidle/current_governor",
    "guest_halt_poll_ns": "/sys/module/haltpoll/parameters/guest_halt_poll_ns",
}


def idle_facts() -> dict[str, str | None]:
    """The machine's idle settings as read now (None: not there); not part of the fingerprint, since the lab's
    `--idle-hold halt-poll` changes one of them while it serves."""
    out: dict[str, str | None] = {}
    for name, path in IDLE_FILES.items():
        try:
            out[name] = Path(path).read_text().strip()
        except OSError:
            out[name] = None
    return out


def hardware_fingerprint() -> JsonObject:
    """What the machine is; `fingerprint_id` is stable across runs on the same machine."""
    info: JsonObject = {
        "hostname": socket.gethostname(),
        "cpu_model": cpu_model(),
        "cpu_flags": cpu_flags(),
        "logical_cores": psutil.cpu_count(logical=True),
        "physical_cores": psutil.cpu_count(logical=False),
        "cores_available": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "memory_bytes": psutil.virtual_memory().total,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "gpus": gpus(),
        "idle": idle_facts(),
    }
    stable = {k: info[k] for k in ("cpu_model", "cpu_flags", "logical_cores", "memory_bytes")}
    gpu = info["gpus"]  # `gpus` gives a table whose devices are a list, empty where there is no GPU
    devices = gpu.get("devices", []) if isinstance(gpu, dict) else []
    stable["gpus"] = [d["name"] for d in devices]
    info["fingerprint_id"] = hashlib.sha256(json.dumps(stable, sort_keys=True).encode()).hexdigest()[:16]
    return info


def package_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {}
    for name in _PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def git_state(path: Path | None = None) -> dict[str, str | bool | None]:
    """Commit and dirtiness of the source tree dlrm_lab runs from (null outside a checkout)."""
    where = path or Path(__file__).resolve().parents[2]
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True, timeout=5, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=where,
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}
    return {"commit": commit, "dirty": bool(dirty)}

"""Machine profiles and the roofline: where a measured step or batch sits against the peaks.

A machine profile (`dlrm-lab machine probe`) is stored as JSON under the hardware
fingerprint, in `$DLRM_LAB_MACHINE_DIR` (default `~/.cache/dlrm-lab/machines`), and every
later run on a machine with that fingerprint is placed against it.

The bound of a piece of work (a training step on one rank, an inference batch on one
instance) is the time it would take at the measured peaks:
- compute: FLOPs / GEMM peak at the run's precision and thread count;
- memory: embedding-row bytes / gather bandwidth + dense bytes / copy bandwidth;
- communication (several ranks): bytes one rank sends / the best bus bandwidth of the
  collective probed with the same backend and rank count.
The bound is the largest of them (that resource "bounds it"); the achieved fraction is
bound / measured time (1.0 = running at the roofline).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from dlrm_lab.config.values import JsonObject, section
from dlrm_lab.errors import UserError
from dlrm_lab.metrics.columns import ROOFLINE_PLACED
from dlrm_lab.metrics.hardware import MachineProfile, hardware_fingerprint
from dlrm_lab.resources import read_bounded

if TYPE_CHECKING:
    from dlrm_lab.metrics.device_peaks import DeviceEntry, DevicePeaks, PeakRate

MACHINE_DIR_ENV = "DLRM_LAB_MACHINE_DIR"


def machine_dir() -> Path:
    return Path(os.environ.get(MACHINE_DIR_ENV) or Path.home() / ".cache" / "dlrm-lab" / "machines")


def profile_path(fingerprint_id: str) -> Path:
    return machine_dir() / f"{fingerprint_id}.json"


def load_profile(fingerprint_id: str | None = None) -> JsonObject | None:
    """This machine's profile (or the one of `fingerprint_id`); None when never probed."""
    path = profile_path(fingerprint_id or str(hardware_fingerprint()["fingerprint_id"]))
    if not path.is_file():
        return None
    try:
        profile = json.loads(read_bounded(path, "machine profile"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(
            f"{path}: unreadable machine profile ({exc}); delete it and run 'dlrm-lab machine probe'"
        ) from None
    if not isinstance(profile, dict) or "devices" not in profile:
        raise UserError(f"{path}: not a machine profile (no 'devices'); delete it and run 'dlrm-lab machine probe'")
    if problem := profile_problem(profile):
        raise UserError(f"{path}: {problem}; run 'dlrm-lab machine probe --force' (or delete the file)")
    return profile


# What a run carries of the profile it was placed against (`Run.create`): enough for reports and comparisons made
# anywhere (peaks, ceilings, collectives, price); the caches of measured choices stay on the machine.
RUN_PROFILE_KEYS = (
    "fingerprint_id",
    "hardware",
    "probed_at",
    "quick",
    "devices",
    "comms",
    "load",
    "price",
    "instance_type",
    "wake",
    "cold_gather",
)


def profile_for_run(fingerprint_id: str | None = None) -> JsonObject | None:
    """This machine's profile as a run's manifest carries it (RUN_PROFILE_KEYS); None when there is none or it
    cannot be read (the run goes on; its roofline columns already say why)."""
    try:
        profile = load_profile(fingerprint_id)
    except UserError:
        return None
    return None if profile is None else {k: profile[k] for k in RUN_PROFILE_KEYS if k in profile}


def run_profile(manifest: JsonObject) -> JsonObject | None:
    """The machine profile a run was placed against: the one its manifest carries, else (runs made before runs
    carried it) the profile of its fingerprint on this machine, if any."""
    carried = manifest.get("machine")
    if isinstance(carried, dict) and "devices" in carried:
        return carried
    fingerprint = section(manifest, "hardware").get("fingerprint_id")
    if not fingerprint:
        return None
    try:
        return load_profile(str(fingerprint))  # as profile_path formats it
    except UserError:
        return None


_PEAK_FIELDS = ("memory_bytes_per_s", "gather_bytes_per_s")


def not_positive(where: str, value: Any) -> str | None:
    """`where = value: rule` unless `value` is a finite number > 0."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        return f"{where} = {value!r}: must be a number > 0"
    return None


def profile_problem(profile: JsonObject) -> str | None:
    """The first field of a profile's device peaks that is not a finite number > 0 (every floor,
    roof and precision choice divides by them), as `field = value: rule`; None when all are."""

    bad = not_positive
    devices = profile.get("devices")
    if not isinstance(devices, dict):
        return f"devices = {devices!r}: must be a table of devices"
    for name, device in devices.items():
        tables = device.get("threads") if isinstance(device, dict) and name == "cpu" else {"": device}
        if not isinstance(tables, dict):
            return f"devices.{name}.threads = {tables!r}: must be a table per thread count"
        for threads, peaks in tables.items():
            where = f"devices.{name}" + (f".threads.{threads}" if threads else "")
            if not isinstance(peaks, dict) or not isinstance(peaks.get("gemm_flops_per_s"), dict):
                return f"{where}.gemm_flops_per_s: missing or not a table per precision"
            for precision, value in peaks["gemm_flops_per_s"].items():
                if problem := bad(f"{where}.gemm_flops_per_s.{precision}", value):
                    return problem
            for key in _PEAK_FIELDS:
                if key in peaks and (problem := bad(f"{where}.{key}", peaks[key])):
                    return problem
    return None


# Profile sections of measurements the lab's choices are made from, each {key: entry}: GEMM rates of model shapes
# (metrics.precision), step times of sharding plans (train.sharding_trial), batch times of serving builds
# (infer.build), batch times of the dense layers under each C allocator (infer.allocator).
MEASURED_CHOICES = ("precision_rates", "sharding_trials", "build_rates", "allocator_rates", "gemm_widths")


def save_profile(profile: JsonObject | MachineProfile, keep_better: bool = False) -> Path:
    """Store a probe's result, keeping what an earlier probe measured and this one did not
    (a probe under a 2-rank launch adds its collectives to the single-process peaks). With
    `keep_better`, each peak keeps the higher of the stored and the new measurement (a peak is
    what the machine can do: a lower figure is a disturbed measurement, never a better one).
    A stored profile that is unreadable or impossible is replaced whole."""
    new = cast(MachineProfile, profile)
    path = profile_path(new["fingerprint_id"])
    merged: dict[str, Any] = dict(profile)
    try:
        old = cast("MachineProfile | None", load_profile(new["fingerprint_id"]) if path.is_file() else None)
    except UserError:
        old = None
    if old is not None:
        # every figure an earlier probe measured and this one did not stays (a collectives-only or GPU-only probe
        # measures no wake and no cold gather; the low-load floor must not lose them), and what the user gave (the
        # machine's price, its instance type: a probe has none of its own)
        merged = {**old, **profile}
        # choices measured on this machine (precision rates, sharding trials) stay valid across probes, and the
        # figures keyed by what was measured (ms idle) merge key by key
        for table in (*PER_FIGURE_SECTIONS, *MEASURED_CHOICES):
            merged[table] = {**section(old, table), **section(profile, table)}
        merged["devices"] = {**old.get("devices", {}), **new["devices"]}
        if keep_better:
            kept = _keep_better(old.get("devices", {}), merged["devices"])
            merged["kept_from_earlier_probe"] = kept
        merged["comms"] = {**old.get("comms", {}), **new["comms"]}
        if not new["devices"]:  # a collectives-only probe: the device peaks' date stays
            merged["probed_at"] = old.get("probed_at")
            merged["quick"] = old.get("quick")
            merged["comms_probed_at"] = new["probed_at"]
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(merged, indent=2) + "\n")
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise ProfileNotStored(
            f"cannot store the machine profile in {path.parent}: {exc.strerror or exc}; set {MACHINE_DIR_ENV} to a "
            "writable directory"
        ) from None
    return path


# sections of figures keyed by what was measured (ms idle): a probe that measured some keeps the others'
PER_FIGURE_SECTIONS = ("wake", "cold_gather")
# The gather probe as it is now (`metrics.device_peaks`): rows written before they are read, on both page sizes.
# An earlier probe's gather read tables never written (one zero page): a figure of another method, never kept.
GATHER_PROBE = 2
_GATHER_FIELDS = ("gather_bytes_per_s", "gather_rows_per_s", "gather_cached_bytes_per_s")
_BETTER_FIELDS = ("memory_bytes_per_s", *_GATHER_FIELDS, "h2d_bytes_per_s", "d2h_bytes_per_s")  # `PeakRate`'s


def _keep_better(old: dict[str, DeviceEntry], new: dict[str, DeviceEntry]) -> list[str]:
    """Raise every peak in `new` (devices, changed in place) to the stored one in `old` where that was higher;
    the fields kept from `old`."""
    kept = []

    def tables(devices: dict[str, DeviceEntry]) -> dict[str, DevicePeaks]:
        out: dict[str, DevicePeaks] = {}
        for name, dev in devices.items():
            if isinstance(dev, dict) and "threads" in dev:
                out.update({f"{name}.threads.{k}": v for k, v in dev["threads"].items()})
            elif isinstance(dev, dict):
                out[name] = dev
        return out

    before = tables(old)
    for where, peaks in tables(new).items():
        prior = before.get(where)
        if prior is None:
            continue
        for precision, value in (peaks.get("gemm_flops_per_s") or {}).items():
            earlier = (prior.get("gemm_flops_per_s") or {}).get(precision)
            if earlier and earlier > value:
                peaks["gemm_flops_per_s"][precision] = earlier
                kept.append(f"{where}.gemm_flops_per_s.{precision}")
        for key in cast("tuple[PeakRate, ...]", _BETTER_FIELDS):  # its names, as the TypedDict knows them
            if key in _GATHER_FIELDS and prior.get("gather_probe") != peaks.get("gather_probe"):
                continue
            if key in peaks and prior.get(key) and prior[key] > peaks[key]:
                peaks[key] = prior[key]
                kept.append(f"{where}.{key}")
    return kept


class ProfileNotStored(UserError):
    """The profile's directory cannot be written (a read-only HOME): one line, naming the remedy."""


@dataclass(frozen=True)
class Peaks:
    """The peaks a piece of work is bounded by; comm is None on one rank or when unprobed."""

    flops_per_s: float
    memory_bytes_per_s: float
    gather_bytes_per_s: float
    comm_bytes_per_s: float | None
    basis: str  # what was picked from the profile, for the summary
    # the wake of an idle thread by idle ms (`metrics.wake`: "1", "10", "100" -> p50_us, p99_us, ...); None: unprobed
    wake: dict[str, dict[str, float]] | None = None
    # an embedding gather's time after idling 1, 10, 100 ms over back to back (`metrics.wake`); None: unprobed
    cold: dict[str, float] | None = None
    # random rows of one cache line gathered per second (`metrics.device_peaks`); None: unprobed, no row ceiling
    gather_rows_per_s: float | None = None
    # the probe's tables (`gather_bytes_per_s` holds for tables at least this large), and the gather from tables that
    # stay in the last-level cache (`gather_cached_bytes_per_s`, probed on `gather_cached_table_bytes`); None: unprobed
    gather_table_bytes: float | None = None
    gather_cached_bytes_per_s: float | None = None


@dataclass(frozen=True)
class Work:
    """What one step (one rank) or one batch (one instance) does."""

    flops: float
    gather_bytes: float  # embedding rows, optimizer state: random row accesses
    stream_bytes: float  # dense parameters and their state: sequential
    comm_bytes: float = 0.0  # sent by one rank
    gather_rows: float = 0.0  # the random row accesses behind gather_bytes (their own ceiling: a row costs a line)
    table_bytes: float = 0.0  # the tables the rows are gathered from (0: unknown, as large as the probe's)


def _cpu_peaks(cpu: DeviceEntry, threads: int) -> DevicePeaks:
    """Peaks at `threads`: measured if probed at that count, otherwise the one-thread peaks
    scaled by the thread count and capped at the all-core peaks."""
    by = {int(k): v for k, v in cpu["threads"].items()}
    if threads in by:
        return by[threads]
    one, most = by[min(by)], by[max(by)]
    scale = threads / min(by)

    def pick(a: float, b: float) -> float:
        return min(a * scale, b) if threads < max(by) else b

    out: DevicePeaks = {
        "gemm_flops_per_s": {
            k: pick(v, most["gemm_flops_per_s"].get(k, v)) for k, v in one["gemm_flops_per_s"].items()
        },
        "memory_bytes_per_s": pick(one["memory_bytes_per_s"], most["memory_bytes_per_s"]),
        "gather_bytes_per_s": pick(one["gather_bytes_per_s"], most["gather_bytes_per_s"]),
    }
    if one.get("gather_rows_per_s") and most.get("gather_rows_per_s"):
        out["gather_rows_per_s"] = pick(one["gather_rows_per_s"], most["gather_rows_per_s"])
    if one.get("gather_cached_bytes_per_s") and most.get("gather_cached_bytes_per_s"):
        out["gather_cached_bytes_per_s"] = pick(one["gather_cached_bytes_per_s"], most["gather_cached_bytes_per_s"])
    if one.get("gather_table_bytes"):
        out["gather_table_bytes"] = one["gather_table_bytes"]
    return out


def gemm_precision(device_type: str, precision: str) -> str:
    """The GEMM peak that applies to a run's dense precision: fp32 matrix products on a GPU
    run as TF32 when torch allows it."""
    if device_type == "cuda" and precision == "fp32":
        import torch

        if torch.backends.cuda.matmul.allow_tf32:
            return "tf32"
    return precision


def peaks_for(
    profile: JsonObject | None,
    device: str,
    precision: str,
    threads: int = 1,
    world_size: int = 1,
    backend: str | None = None,
) -> Peaks | str:
    """The profile's peaks for this device, precision, thread count and collective; a reason
    (str) when the profile cannot place it."""
    if profile is None:
        return "no machine profile for this machine: run 'dlrm-lab machine probe'"
    known = cast(MachineProfile, profile)
    devices = known.get("devices", {})
    if device == "cpu":
        if "cpu" not in devices:
            return "the machine profile has no cpu peaks"
        peaks = _cpu_peaks(devices["cpu"], max(1, threads))
        basis = f"cpu {threads} thread{'s' if threads != 1 else ''}"
    else:
        key = device if ":" in device else "cuda:0"
        if key not in devices:
            return f"the machine profile has no {key} peaks"
        peaks, basis = devices[key], key
    flops = peaks["gemm_flops_per_s"].get(precision)
    if not flops:
        return f"the machine profile has no {precision} GEMM peak for {basis}"
    comm = None
    if world_size > 1:
        rows = known.get("comms", {}).get(f"{backend}/{world_size}", [])
        a2a = [r["busbw_bytes_per_s"] for r in rows if r["collective"] == "all_to_all"]
        comm = max(a2a) if a2a else None
    return Peaks(
        flops_per_s=flops,
        memory_bytes_per_s=peaks["memory_bytes_per_s"],
        gather_bytes_per_s=peaks["gather_bytes_per_s"],
        gather_rows_per_s=peaks.get("gather_rows_per_s"),
        gather_table_bytes=peaks.get("gather_table_bytes"),
        gather_cached_bytes_per_s=peaks.get("gather_cached_bytes_per_s"),
        comm_bytes_per_s=comm,
        basis=f"{basis} {precision}, profile {profile.get('fingerprint_id')} of {profile.get('probed_at')}",
        wake=known.get("wake") if device == "cpu" else None,
        cold=known.get("cold_gather") if device == "cpu" else None,
    )


# The summary columns `place` fills (`metrics.columns` defines them)
ROOFLINE_COLUMNS = ROOFLINE_PLACED


def _gather_seconds(work: Work, peaks: Peaks) -> float:
    """Random row accesses at the larger of two ceilings: their bytes at the gather bandwidth (probed on rows of
    several lines), and their count at the rate rows of one cache line are gathered (a row smaller than a line
    still costs a line and a page walk: at 64-byte rows the byte ceiling alone is several times too high).

    A gather is faster the smaller its tables: the probe's rate bounds tables at least as large as its own; smaller
    ones meet the cache-resident probe's rate (no row ceiling there), where it was probed."""
    cached, probed = peaks.gather_cached_bytes_per_s, peaks.gather_table_bytes
    if cached and probed and 0 < work.table_bytes < probed:
        return work.gather_bytes / max(cached, peaks.gather_bytes_per_s)
    seconds = work.gather_bytes / peaks.gather_bytes_per_s
    if work.gather_rows and peaks.gather_rows_per_s:
        seconds = max(seconds, work.gather_rows / peaks.gather_rows_per_s)
    return seconds


def _seconds(work: Work, peaks: Peaks) -> dict[str, float]:
    """`work`'s time on each resource at the peaks; communication only where it sends and its bandwidth was probed."""
    times = {
        "compute": work.flops / peaks.flops_per_s,
        "memory": _gather_seconds(work, peaks) + work.stream_bytes / peaks.memory_bytes_per_s,
    }
    if work.comm_bytes > 0 and peaks.comm_bytes_per_s:
        times["communication"] = work.comm_bytes / peaks.comm_bytes_per_s
    return times


def place(work: Work, measured_s: float | None, peaks: Peaks | str) -> dict[str, float | str | None]:
    """Roofline columns for `work` that took `measured_s`; nulls with a note when it cannot be placed."""
    out: dict[str, float | str | None] = dict.fromkeys(ROOFLINE_COLUMNS)
    if isinstance(peaks, str):
        out["roofline_note"] = peaks
        return out
    times = _seconds(work, peaks)
    if work.comm_bytes > 0 and "communication" not in times:
        out["roofline_note"] = (
            "no collective bandwidth in the profile for this backend and rank count: "
            "run 'dlrm-lab machine probe' under the same launcher; communication not bounded"
        )
    bound_by = max(times, key=lambda k: times[k])
    out.update(
        roofline_compute_ms=times["compute"] * 1e3,
        roofline_memory_ms=times["memory"] * 1e3,
        roofline_comm_ms=times["communication"] * 1e3 if "communication" in times else None,
        roofline_bound_ms=times[bound_by] * 1e3,
        roofline_bound_by=bound_by,
        roofline_basis=peaks.basis,
    )
    if measured_s and measured_s > 0:
        out["roofline_fraction"] = times[bound_by] / measured_s
    return out


def phase_floors(phases: Mapping[str, Work], peaks: Peaks) -> dict[str, float | None]:
    """Each phase of a step at its own bound (ms): the larger of its FLOPs at the GEMM peak, its bytes at the
    bandwidths they meet (rows and optimizer state at the gather bandwidth, dense weights and states at the copy
    bandwidth) and its collectives' bytes at the probed collective bandwidth. Phases run in sequence, so their sum
    is the step's floor (`place` takes the largest of the whole step's resources instead: it assumes every phase
    overlaps every other). A phase with collective bytes but no probed bandwidth is None (not bounded)."""
    out: dict[str, float | None] = {}
    for name, w in phases.items():
        times = _seconds(w, peaks)
        out[name] = None if w.comm_bytes > 0 and "communication" not in times else max(times.values()) * 1e3
    return out

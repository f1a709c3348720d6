"""Machine probe: the measured peaks a roofline is drawn from (HPC AI500's method).

What is measured, per device, and what each number counts:
- GEMM peak: `torch.mm` of square matrices at sizes that fill the device, 2 n^3 FLOPs per
  product, best size kept; fp32, bf16 and fp16 (tf32 too on GPU). On CPU at one thread and
  at every core this process may use, so a run can be placed against the threads it had.
- Memory bandwidth: a large tensor copy (well past the last-level cache), counting the bytes
  read plus the bytes written.
- Embedding gather bandwidth: fbgemm's table-batched embedding-bag forward (the kernel
  TorchRec trains and serves with) over tables larger than the caches, uniform ids, counting
  the bytes of the rows read.
- Host-device copy bandwidth (GPU): pinned host memory to the device and back.
- Under a launcher with several ranks: all-to-all and all-reduce over sizes, reported as
  algorithm bandwidth (bytes per rank / time) and bus bandwidth (algbw x (n-1)/n for
  all-to-all, x 2(n-1)/n for all-reduce), the conventions of PARAM and nccl-tests.

Each device's peaks are measured in `metrics.device_peaks` (timing: the median of repeats after
warm-up), the collectives in `metrics.collectives`; this module runs them (rank 0 alone measures
the devices), adds the wake and ceiling probes and the machine's load while probing, and stores
the profile (`run_probe`). Hand-written because no library measures these on both CPU and GPU
with the kernels DLRM actually uses.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import cast

import torch
import torch.distributed as dist

from dlrm_lab.config.values import Log
from dlrm_lab.errors import FieldError, first_line
from dlrm_lab.metrics.canary import quiet_canary
from dlrm_lab.metrics.ceiling import measure_ceiling
from dlrm_lab.metrics.collectives import comm_bandwidth, mpi_bandwidth, slowest_over, torchrec_distribution
from dlrm_lab.metrics.cpu import LoadWatch
from dlrm_lab.metrics.device_peaks import (
    CACHED_TABLE_BYTES,
    GEMM_DTYPES,
    DeviceEntry,
    DevicePeaks,
    ProbeSizes,
    copy_bytes_per_s,
    gather_bytes_per_s,
    gather_cached_bytes_per_s,
    gather_on_pages,
    gather_rows_per_s,
    gemm_flops_per_s,
    host_device_bytes_per_s,
)
from dlrm_lab.metrics.hardware import MachineProfile, hardware_fingerprint, package_versions
from dlrm_lab.metrics.roofline import GATHER_PROBE
from dlrm_lab.metrics.trust import judge
from dlrm_lab.metrics.wake import probe_cold_gather, probe_wake


def _cpu_threads() -> list[int]:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return sorted({1, cores})


def probe_device(device: torch.device, sizes: ProbeSizes, log: Log | None = None) -> DeviceEntry:
    """Peaks of one device. CPU peaks are keyed by thread count ("1", "<all cores>")."""
    say = log or (lambda _: None)
    dtypes = dict(GEMM_DTYPES)
    if device.type == "cuda":
        dtypes["tf32"] = torch.float32
        sizes = sizes.for_gpu(torch.cuda.mem_get_info(device)[0])

    def peaks() -> DevicePeaks:
        out: DevicePeaks = {"gemm_flops_per_s": {}, "gemm_size": {}, "gemm_spread": {}}
        for name, dtype in dtypes.items():
            if device.type == "cuda":
                torch.backends.cuda.matmul.allow_tf32 = name == "tf32"
            square = sizes.gpu_gemm_sizes if device.type == "cuda" else sizes.gemm_sizes
            try:
                gemm = gemm_flops_per_s(device, dtype, square, sizes.repeats, sizes.gemm_min_flops)
            except (RuntimeError, NotImplementedError) as exc:  # int8: a torch without this device's _int_mm
                if dtype != torch.int8:
                    raise
                say(f"  GEMM int8: not measured ({first_line(exc)})")
                continue
            out["gemm_flops_per_s"][name] = gemm["flops_per_s"]
            out["gemm_size"][name] = gemm["size"]
            out["gemm_spread"][name] = gemm["spread"]
            unit = "GOP/s" if dtype == torch.int8 else "GFLOP/s"
            say(f"  GEMM {name}: {gemm['flops_per_s'] / 1e9:,.1f} {unit} (n={gemm['size']})")
        if device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = False
        out["memory_bytes_per_s"] = copy_bytes_per_s(device, sizes.copy_bytes, sizes.repeats)
        say(f"  memory (copy, read+write): {out['memory_bytes_per_s'] / 1e9:,.2f} GB/s")
        if device.type == "cpu":  # on 4 KiB and on 2 MiB pages, in turn: the roof is the better, the tables follow
            pages = gather_on_pages(sizes, sizes.repeats)
            out["gather_pages"] = {k: v for k, v in pages.items() if k != "table_bytes"}
            out["gather_bytes_per_s"] = max(pages["base_bytes_per_s"], pages["huge_bytes_per_s"] or 0.0)
            out["gather_table_bytes"] = pages["table_bytes"]
            huge = pages["huge_bytes_per_s"]
            say(
                f"  embedding gather (fbgemm TBE forward): {pages['base_bytes_per_s'] / 1e9:,.2f} GB/s; on 2 MiB "
                + (f"pages {huge / 1e9:,.2f} GB/s" if huge else f"pages not measured ({pages['huge_error']})")
            )
            on_huge = bool(huge and huge > pages["base_bytes_per_s"])
        else:
            gather = gather_bytes_per_s(device, sizes, sizes.repeats)
            out["gather_bytes_per_s"], out["gather_table_bytes"] = gather["bytes_per_s"], gather["table_bytes"]
            say(f"  embedding gather (fbgemm TBE forward): {out['gather_bytes_per_s'] / 1e9:,.2f} GB/s")
            on_huge = False
        if device.type == "cpu":  # the speed canary's work measured quiet: every run's readings are over it
            out["canary"] = quiet_canary()
            say(
                f"  speed canary, quiet: GEMM {out['canary']['gemm_flops_per_s'] / 1e9:,.1f} GFLOP/s, gather "
                f"{out['canary']['gather_bytes_per_s'] / 1e9:,.2f} GB/s ({out['canary']['ms']:.2f} ms)"
            )
        out["gather_rows_per_s"] = gather_rows_per_s(device, sizes, sizes.repeats, huge_pages=on_huge)
        out["gather_probe"] = GATHER_PROBE
        say(
            f"  embedding gather of 64-byte rows: {out['gather_rows_per_s'] / 1e6:,.1f} M rows/s"
            + (" (2 MiB pages)" if on_huge else "")
        )
        if device.type == "cpu" and out["gather_table_bytes"] > CACHED_TABLE_BYTES:
            cached = gather_cached_bytes_per_s(device, sizes, sizes.repeats)
            out["gather_cached_bytes_per_s"], out["gather_cached_table_bytes"] = (
                cached["bytes_per_s"],
                cached["table_bytes"],
            )
            say(
                f"  embedding gather from {cached['table_bytes'] / 2**20:,.0f} MiB of tables (cache-resident): "
                f"{cached['bytes_per_s'] / 1e9:,.2f} GB/s"
            )
        return out

    if device.type == "cuda":
        say(f"{device} ({torch.cuda.get_device_name(device)}):")
        gpu: DeviceEntry = {"name": torch.cuda.get_device_name(device), **peaks()}
        gpu.update(host_device_bytes_per_s(device, sizes.copy_bytes // 4, sizes.repeats))
        say(
            f"  host->device {gpu['h2d_bytes_per_s'] / 1e9:,.2f} GB/s, device->host "
            f"{gpu['d2h_bytes_per_s'] / 1e9:,.2f} GB/s"
        )
        return gpu
    saved = torch.get_num_threads()
    by_threads: dict[str, DevicePeaks] = {}
    try:
        for threads in _cpu_threads():
            torch.set_num_threads(threads)
            say(f"cpu, {threads} thread{'s' if threads > 1 else ''}:")
            by_threads[str(threads)] = peaks()
    finally:
        torch.set_num_threads(saved)
    result: DeviceEntry = {"threads": by_threads}
    if (cores := max(_cpu_threads())) > 1:
        # what N ranks pinned one per core can do at best (dlrm_lab.metrics.ceiling)
        result["ceiling"] = {}
        for n in sorted({2, cores} | {1 << k for k in range(1, cores.bit_length()) if 1 << k <= cores}):
            quick = sizes.repeats < 5  # a first look: one round of 0.2 s each
            entry = measure_ceiling(n, repeats=1 if quick else 3, seconds=0.2 if quick else 1.0)
            result["ceiling"][str(n)] = entry
            say(
                f"cpu, {n} processes x 1 thread at once: GEMM {entry['gemm']['efficiency']:.0%} and copy "
                f"{entry['copy']['efficiency']:.0%} of {n} x one alone"
            )
    return result


def probe_machine(
    quick: bool = False, devices: list[str] | None = None, log: Log | None = None, comms: bool = True
) -> MachineProfile:
    """A machine profile: every device's peaks plus, under a multi-rank launch, collective
    bandwidths. Under a launcher only rank 0's device peaks are kept (ranks share a machine
    kind); every rank takes part in the collectives (`comms=False`: none are probed, for a
    probe that rank 0 alone runs while the others wait)."""
    sizes = ProbeSizes.preset(quick)
    wanted = devices if devices is not None else (["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"])
    profile: MachineProfile = {
        "hardware": hardware_fingerprint(),
        "probed_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "quick": quick,
        "packages": {k: v for k, v in package_versions().items() if v},
        "python": platform.python_version(),
        "devices": {},
        "comms": {},
    }
    profile["fingerprint_id"] = cast(str, profile["hardware"]["fingerprint_id"])  # a hex digest
    rank = dist.get_rank() if dist.is_initialized() else 0
    # ranks of one launch share the machine: peaks measured by all at once would be halved
    with LoadWatch() as watch:
        for name in wanted if rank == 0 else []:
            if name == "cuda":
                for index in range(torch.cuda.device_count()):
                    profile["devices"][f"cuda:{index}"] = probe_device(torch.device("cuda", index), sizes, log)
            else:
                profile["devices"]["cpu"] = probe_device(torch.device("cpu"), sizes, log)
                profile["wake"] = probe_wake(quick)  # the low-load latency floor's wake (metrics.wake)
                profile["cold_gather"] = probe_cold_gather(quick)  # ... and its memory gone cold
                if log:
                    log(
                        "wake of an idle thread: "
                        + "; ".join(
                            f"after {idle} ms idle p50 {w['p50_us']:.0f} us, p99 {w['p99_us']:.0f} us"
                            for idle, w in profile["wake"].items()
                        )
                    )
                    log(
                        "an embedding gather after idling, against back to back: "
                        + "; ".join(f"{idle} ms {f:.2f}x" for idle, f in profile["cold_gather"].items())
                    )
    if profile["devices"]:
        spread = max((s for p in _peak_tables(profile) for s in p.get("gemm_spread", {}).values()), default=1.0)
        profile["load"] = judge(watch.seconds, watch.other_cores, watch.steal_share, spread).to_dict()
        if log:
            log(f"while probing: {profile['load']['why']}")
    if comms and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
        backend = dist.get_backend()
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        world = dist.get_world_size()
        profile["comms"][f"{backend}/{world}"] = comm_bandwidth(device, sizes.comm_bytes, sizes.repeats)
        from dlrm_lab.distributed.context import detect_launch

        batches = sizes.torchrec_batches  # TorchRec's distribution, gloo's now and MPI's below
        if device.type == "cpu":  # as training runs it on CPU ranks
            profile["comms"][f"{backend}/{world}"] += torchrec_distribution(
                dist.group.WORLD, batches, slowest_over(dist.group.WORLD, sizes.repeats)
            )
        if detect_launch().launcher == "mpi":  # started by mpiexec: MPI's own collectives too
            from dlrm_lab.distributed.mpi import BACKEND, register

            register()
            over_mpi = dist.new_group(backend=BACKEND)  # the lab's process group on MPI (`--collectives mpi`)
            profile["comms"][f"mpi/{world}"] = [
                *mpi_bandwidth(sizes.comm_bytes, sizes.repeats),
                *torchrec_distribution(over_mpi, batches, slowest_over(over_mpi, sizes.repeats)),
            ]
        for key, rows in profile["comms"].items() if log and rank == 0 else ():
            assert log is not None  # the loop runs only with a log
            for r in rows:
                algbw, busbw = r["algbw_bytes_per_s"] / 1e9, r["busbw_bytes_per_s"] / 1e9
                log(
                    f"  {key.replace('/', ' x')} {r['collective']} {r['bytes']:>10,} B: "
                    f"algbw {algbw:.3f} GB/s, busbw {busbw:.3f} GB/s"
                )
    return profile


def _peak_tables(profile: MachineProfile) -> list[DevicePeaks]:
    """Every table of peaks in a profile: one per CPU thread count, one per GPU."""
    out: list[DevicePeaks] = []
    for dev in profile.get("devices", {}).values():
        out += list(dev["threads"].values()) if "threads" in dev else [dev]
    return out


PROBE_DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class ProbeOutcome:
    """What `run_probe` did: `written` is the profile's path (rank 0 after a probe);
    `kept` says why no probe ran (`if_missing` found a stored profile)."""

    fingerprint_id: str
    written: Path | None = None
    kept: str | None = None
    refused: str | None = None  # why a probe that could not be trusted was not stored (the old profile kept)
    warning: str | None = None  # stored although it could not be trusted (there was none to keep)


def run_probe(
    *,
    quick: bool = False,
    device: str = "auto",
    comms_only: bool = False,
    timeout_s: float = 600.0,
    if_missing: bool = False,
    force: bool = False,
    log: Log | None = None,
) -> ProbeOutcome:
    """`dlrm-lab machine probe`: measure this machine and store its profile.

    Under a multi-rank launch every rank calls it (the collectives need all); rank 0 alone
    measures the devices, logs and writes. `comms_only` keeps the stored device peaks and
    adds the collectives; `if_missing` probes only a machine with no stored profile. A probe the
    machine's load spoiled (`metrics.trust`) does not replace a stored profile unless `force`; a stored
    peak is replaced only by a better one unless `force`.
    """
    from dlrm_lab.distributed.context import detect_launch, init_distributed, shutdown_distributed
    from dlrm_lab.metrics.roofline import MACHINE_DIR_ENV, load_profile, machine_dir, profile_path, save_profile
    from dlrm_lab.metrics.run import check_writable

    if device not in PROBE_DEVICES:
        raise FieldError("device", f"{device!r}: allowed: {', '.join(PROBE_DEVICES)}")
    if if_missing:
        stored = cast("MachineProfile | None", load_profile())  # as probe_machine wrote it
        if stored is not None and stored.get("devices"):
            kind = "quick profile" if stored.get("quick") else "profile"
            where = profile_path(stored["fingerprint_id"])
            return ProbeOutcome(
                stored["fingerprint_id"],
                kept=f"machine {kind} of {stored.get('probed_at')} in {where}: not probing again (--if-missing)",
            )
    if device == "cuda" and not torch.cuda.is_available():
        raise FieldError("device", f"cuda: no CUDA device is visible to this torch build (torch {torch.__version__})")
    check_writable(machine_dir(), MACHINE_DIR_ENV, remedy=f"set {MACHINE_DIR_ENV} to a writable directory")
    launch = detect_launch()
    if comms_only and launch.world_size < 2:
        raise FieldError(
            "comms_only", ": needs a launch with several ranks (e.g. dlrm-lab launch --nproc 2 -- machine probe)"
        )
    devices = None if device == "auto" else [device]
    rank = 0
    if launch.world_size > 1:
        comm_device = "cuda" if torch.cuda.is_available() and device != "cpu" else "cpu"
        rank = init_distributed(comm_device, timeout_s).rank
    try:
        profile = probe_machine(quick=quick, devices=[] if comms_only else devices, log=log if rank == 0 else None)
    finally:
        shutdown_distributed()
    if rank != 0:
        return ProbeOutcome(profile["fingerprint_id"])
    load = profile.get("load")
    fid = profile["fingerprint_id"]
    if load and not load["trusted"] and not force:
        stored = cast("MachineProfile | None", load_profile(fid))
        if stored is not None and stored.get("devices"):
            return ProbeOutcome(
                fid,
                refused=f"the machine was busy while probing ({load['why']}): not stored; the "
                f"profile of {stored.get('probed_at')} is kept (probe again on an idle machine, or "
                "--force to store it)",
            )
        warning = (
            f"warning: the machine was busy while probing ({load['why']}); stored, as this machine had no "
            "profile: probe again on an idle machine"
        )
        return ProbeOutcome(fid, written=save_profile(profile), warning=warning)
    return ProbeOutcome(fid, written=save_profile(profile, keep_better=not force))

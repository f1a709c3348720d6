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

Timing is the median of repeats after warm-up; CUDA work is synchronised before the clock
is read. Hand-written because no library measures these on both CPU and GPU with the
kernels DLRM actually uses.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dlrm_lab.errors import FieldError
from dlrm_lab.metrics.ceiling import measure_ceiling
from dlrm_lab.metrics.cpu import LoadWatch
from dlrm_lab.metrics.hardware import hardware_fingerprint, package_versions
from dlrm_lab.metrics.trust import judge
from dlrm_lab.metrics.wake import probe_cold_gather, probe_wake

Log = Callable[[str], None]

GEMM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class ProbeSizes:
    """How big and how often; `quick` fits a test or a first look (seconds, not minutes)."""

    gemm_sizes: tuple[int, ...]
    copy_bytes: int
    gather_tables: int
    gather_rows: int
    gather_dim: int
    gather_batch: int
    gather_pooling: int
    comm_bytes: tuple[int, ...]
    repeats: int
    gemm_min_flops: float  # per timing: small products are repeated up to this much work
    # samples a rank at which TorchRec's distribution is timed (`torchrec_distribution`)
    torchrec_batches: tuple[int, ...] = (512, 2048)
    # a GPU reaches its peak only on larger products (an H200's bf16: 430 TFLOP/s at 2048, 667 at 8192)
    gpu_gemm_sizes: tuple[int, ...] = (2048, 8192)

    @classmethod
    def preset(cls, quick: bool) -> ProbeSizes:
        if quick:
            return cls((256, 1024), 64 << 20, 2, 250_000, 64, 1024, 20, (1 << 10, 1 << 16, 1 << 20), 3, 2e8)
        return cls(
            (1024, 2048, 4096), 1 << 30, 4, 1_000_000, 64, 4096, 20,
            tuple(1 << k for k in range(10, 27, 2)), 7, 2e9, (512, 2048, 8192), (2048, 4096, 8192, 16384),
        )  # fmt: skip


def _timed(fn: Callable[[], Any], repeats: int, device: torch.device, warmup: int = 2) -> float:
    """Median seconds of `fn()` after warm-up."""
    return statistics.median(_timed_all(fn, repeats, device, warmup))


def _timed_all(fn: Callable[[], Any], repeats: int, device: torch.device, warmup: int = 2) -> list[float]:
    """Seconds of each of `repeats` calls of `fn()` after warm-up."""
    for _ in range(warmup):
        fn()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *_: None)
    sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return times


def gemm_flops_per_s(
    device: torch.device, dtype: torch.dtype, sizes: tuple[int, ...], repeats: int, min_flops: float = 2e9
) -> dict[str, Any]:
    """Best FLOP/s of square matrix products over `sizes` (2 n^3 FLOPs each)."""
    best: dict[str, Any] = {"flops_per_s": 0.0, "size": None, "spread": 1.0}
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *_: None)
    # A slow kernel (bf16 without AVX-512 bf16/AMX, fp16 on most CPUs) would take seconds per
    # product at these sizes. A pilot product decides only whether the smallest size is
    # affordable (its size stands in when not); each larger size is predicted from the best
    # rate timed so far and the first predicted to take over 0.25 s ends the climb. The pilot
    # is a floor, not a forecast: on a GPU one small product is launch-bound (an H200's pilot
    # cut bf16 at n=2048: 430 of the 667 TFLOP/s it sustains at n=8192).
    pilot = min(256, *sizes)
    a = torch.randn(pilot, pilot, device=device).to(dtype)
    torch.mm(a, a)  # first call: kernel selection
    sync(device)
    t0 = time.perf_counter()
    torch.mm(a, a)
    sync(device)
    pilot_rate = 2 * pilot**3 / max(time.perf_counter() - t0, 1e-9)
    climb = sorted(sizes) if 2 * min(sizes) ** 3 / pilot_rate <= 0.25 else [pilot]
    for n in climb:
        if best["size"] is not None and 2 * n**3 / best["flops_per_s"] > 0.25:
            break
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        t0 = time.perf_counter()
        torch.mm(a, b)
        sync(device)
        single = time.perf_counter() - t0
        # repeat small products so that one timing holds enough work, but keep it under ~0.1 s
        inner = max(1, min(int(min_flops // (2 * n**3)), int(0.1 / max(single, 1e-6))))

        def step(a: torch.Tensor = a, b: torch.Tensor = b, inner: int = inner) -> None:
            for _ in range(inner):
                torch.mm(a, b)

        times = _timed_all(step, repeats, device)
        rate = inner * 2 * n**3 / statistics.median(times)
        if rate > best["flops_per_s"]:
            best = {"flops_per_s": rate, "size": n, "spread": max(times) / max(min(times), 1e-12)}
    return best


def copy_bytes_per_s(device: torch.device, nbytes: int, repeats: int) -> float:
    """Bytes read plus written per second by a large copy."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    seconds = _timed(lambda: dst.copy_(src), repeats, device)
    return 2 * src.numel() * 4 / seconds


def gather_bytes_per_s(device: torch.device, sizes: ProbeSizes, repeats: int) -> dict[str, Any]:
    """Bytes of embedding rows read per second by fbgemm's table-batched embedding-bag forward."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    t, r, d, b, pool = (
        sizes.gather_tables,
        sizes.gather_rows,
        sizes.gather_dim,
        sizes.gather_batch,
        sizes.gather_pooling,
    )
    if device.type == "cuda":
        location, compute = EmbeddingLocation.DEVICE, ComputeDevice.CUDA
    else:
        location, compute = EmbeddingLocation.HOST, ComputeDevice.CPU
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(r, d, location, compute)] * t, pooling_mode=PoolingMode.SUM, device=device
    )
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, r, (t * b * pool,), generator=generator, dtype=torch.int64).to(device)
    offsets = torch.arange(0, t * b * pool + 1, pool, dtype=torch.int64).to(device)
    with torch.no_grad():
        seconds = _timed(lambda: tbe(ids, offsets), repeats, device)
    table_bytes = t * r * d * 4
    return {"bytes_per_s": t * b * pool * d * 4 / seconds, "table_bytes": table_bytes}


def host_device_bytes_per_s(device: torch.device, nbytes: int, repeats: int) -> dict[str, float]:
    """Pinned host -> device and device -> host copy bandwidth."""
    host = torch.empty(nbytes // 4, dtype=torch.float32).pin_memory()
    dev = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    h2d = _timed(lambda: dev.copy_(host, non_blocking=True), repeats, device)
    d2h = _timed(lambda: host.copy_(dev, non_blocking=True), repeats, device)
    return {"h2d_bytes_per_s": nbytes / h2d, "d2h_bytes_per_s": nbytes / d2h}


CollectivesAt = Callable[[int], tuple[tuple[str, Callable[[], Any], float], ...]]


def _collective_rows(
    n: int, sizes: tuple[int, ...], collectives_at: CollectivesAt, slowest_seconds: Callable[[Callable[[], Any]], float]
) -> list[dict[str, Any]]:
    """One row per size and collective: `collectives_at(numel)` gives (name, call, bus-bytes
    factor) over buffers of numel floats; `slowest_seconds(call)` its time on the slowest rank."""
    rows = []
    for nbytes in sizes:
        numel = max(n, nbytes // 4 // n * n)  # all-to-all splits evenly over ranks
        for name, fn, factor in collectives_at(numel):
            seconds = slowest_seconds(fn)
            algbw = numel * 4 / seconds
            rows.append(
                {
                    "collective": name,
                    "bytes": numel * 4,
                    "time_ms": seconds * 1e3,
                    "algbw_bytes_per_s": algbw,
                    "busbw_bytes_per_s": algbw * factor,
                }
            )
    return rows


def _slowest_over(pg: Any, repeats: int, device: torch.device | None = None) -> Callable[[Callable[[], Any]], float]:
    """A call's median time on the slowest rank of `pg` (CPU by default): the slowest rank decides how long a
    collective takes."""
    on = device or torch.device("cpu")

    def slowest_seconds(fn: Callable[[], Any]) -> float:
        dist.barrier(group=pg)
        t = torch.tensor([_timed(fn, repeats, on)], dtype=torch.float64, device=on)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=pg)
        return float(t.item())

    return slowest_seconds


def comm_bandwidth(device: torch.device, sizes: tuple[int, ...], repeats: int) -> list[dict[str, Any]]:
    """All-to-all and all-reduce over the default process group at each size in bytes per rank."""
    n = dist.get_world_size()

    def collectives_at(numel: int) -> tuple[tuple[str, Callable[[], Any], float], ...]:
        buf = torch.ones(numel, dtype=torch.float32, device=device)
        out = torch.empty_like(buf)
        return (
            ("all_to_all", partial(dist.all_to_all_single, out, buf), (n - 1) / n),
            ("all_reduce", partial(dist.all_reduce, buf), 2 * (n - 1) / n),
        )

    return _collective_rows(n, sizes, collectives_at, _slowest_over(dist.group.WORLD, repeats, device))


def mpi_bandwidth(sizes: tuple[int, ...], repeats: int) -> list[dict[str, Any]]:
    """The same collectives through MPI (mpi4py on numpy buffers), for ranks started by
    mpiexec: PyPI torch has no MPI backend, so this is what a custom process group over
    MPI could reach (with MPICH's shared-memory transport between ranks of one host)."""
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    n = comm.Get_size()

    def collectives_at(numel: int) -> tuple[tuple[str, Callable[[], Any], float], ...]:
        buf = np.ones(numel, dtype=np.float32)
        out = np.empty_like(buf)
        return (
            ("all_to_all", lambda: comm.Alltoall(buf, out), (n - 1) / n),
            ("all_reduce", lambda: comm.Allreduce(buf, out, op=MPI.SUM), 2 * (n - 1) / n),
        )

    def slowest_seconds(fn: Callable[[], Any]) -> float:
        comm.Barrier()
        return comm.allreduce(_timed(fn, repeats, torch.device("cpu")), op=MPI.MAX)

    return _collective_rows(n, sizes, collectives_at, slowest_seconds)


# TorchRec's own distribution probed at a kaggle-like shape: 26 one-id features of dim 16 spread over the ranks
TORCHREC_FEATURES, TORCHREC_DIM = 26, 16


def torchrec_distribution(
    pg: Any, batches: tuple[int, ...], slowest_seconds: Callable[[Callable[[], Any]], float]
) -> list[dict[str, Any]]:
    """TorchRec's input distribution (`KJTAllToAll`: splits, lengths and ids) and pooled all-to-all
    (`PooledEmbeddingsAllToAll`, forward and backward) over `pg`, per samples a rank, as a step runs
    them: the collectives with the permutes, awaitables and concatenations around them, which the
    raw collectives above do not hold (3-3.5 ms of a 2-rank kaggle step over MPI, docs/benchmarks-history.md).
    Rows in the cost model's bus bytes (`model.cost.step_communication_bytes`: ids 8 B and a length
    4 B per sample and feature; pooled rows 4 B a dim, forward and backward; x (N-1)/N). The pooled
    row's `forward_share` is the forward's part of its time (mean over ranks of each rank's median):
    the halves differ (the backward regroups the gradient by rank before its collective)."""
    from torchrec.distributed.dist_data import KJTAllToAll, PooledEmbeddingsAllToAll
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    n = pg.size()
    per_rank = max(1, TORCHREC_FEATURES // n)
    features, remote = per_rank * n, (n - 1) / n
    ids_a2a = KJTAllToAll(pg, [per_rank] * n)
    pooled_a2a = PooledEmbeddingsAllToAll(pg, [per_rank * TORCHREC_DIM] * n)
    rows = []
    for b in batches:
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=[f"f{k}" for k in range(features)],
            values=torch.randint(0, 1 << 20, (features * b,)),
            lengths=torch.ones(features * b, dtype=torch.int32),
        )
        local = torch.randn(b * n, per_rank * TORCHREC_DIM, requires_grad=True)
        halves: list[tuple[float, float]] = []  # (forward, forward and backward) seconds of each call

        def pooled(local: torch.Tensor = local, halves: list = halves) -> None:
            t0 = time.perf_counter()
            out = pooled_a2a(local).wait()
            t1 = time.perf_counter()
            out.backward(torch.ones_like(out))
            local.grad = None
            halves.append((t1 - t0, time.perf_counter() - t0))

        def input_dist(kjt: KeyedJaggedTensor = kjt) -> None:
            ids_a2a(kjt).wait().wait()

        for name, fn, bus in (
            ("torchrec_input_dist", input_dist, b * 12 * features * remote),
            ("torchrec_pooled", pooled, b * 2 * 4 * TORCHREC_DIM * features * remote),
        ):
            seconds = slowest_seconds(fn)
            rate = bus / seconds
            rows.append({"collective": name, "bytes": int(bus), "time_ms": seconds * 1e3, "algbw_bytes_per_s": rate,
                         "busbw_bytes_per_s": rate, "samples_per_rank": b})  # fmt: skip
        share = torch.tensor([statistics.median(f for f, _ in halves) / statistics.median(t for _, t in halves)])
        dist.all_reduce(share, group=pg)
        rows[-1]["forward_share"] = share.item() / n
    return rows


def _cpu_threads() -> list[int]:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return sorted({1, cores})


def probe_device(device: torch.device, sizes: ProbeSizes, log: Log | None = None) -> dict[str, Any]:
    """Peaks of one device. CPU peaks are keyed by thread count ("1", "<all cores>")."""
    say = log or (lambda _: None)
    dtypes = dict(GEMM_DTYPES)
    if device.type == "cuda":
        dtypes["tf32"] = torch.float32

    def peaks() -> dict[str, Any]:
        out: dict[str, Any] = {"gemm_flops_per_s": {}, "gemm_size": {}, "gemm_spread": {}}
        for name, dtype in dtypes.items():
            if device.type == "cuda":
                torch.backends.cuda.matmul.allow_tf32 = name == "tf32"
            square = sizes.gpu_gemm_sizes if device.type == "cuda" else sizes.gemm_sizes
            gemm = gemm_flops_per_s(device, dtype, square, sizes.repeats, sizes.gemm_min_flops)
            out["gemm_flops_per_s"][name] = gemm["flops_per_s"]
            out["gemm_size"][name] = gemm["size"]
            out["gemm_spread"][name] = gemm["spread"]
            say(f"  GEMM {name}: {gemm['flops_per_s'] / 1e9:,.1f} GFLOP/s (n={gemm['size']})")
        if device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = False
        out["memory_bytes_per_s"] = copy_bytes_per_s(device, sizes.copy_bytes, sizes.repeats)
        say(f"  memory (copy, read+write): {out['memory_bytes_per_s'] / 1e9:,.2f} GB/s")
        gather = gather_bytes_per_s(device, sizes, sizes.repeats)
        out["gather_bytes_per_s"] = gather["bytes_per_s"]
        out["gather_table_bytes"] = gather["table_bytes"]
        say(f"  embedding gather (fbgemm TBE forward): {out['gather_bytes_per_s'] / 1e9:,.2f} GB/s")
        return out

    if device.type == "cuda":
        say(f"{device} ({torch.cuda.get_device_name(device)}):")
        result = {"name": torch.cuda.get_device_name(device), **peaks()}
        result.update(host_device_bytes_per_s(device, sizes.copy_bytes // 4, sizes.repeats))
        say(f"  host->device {result['h2d_bytes_per_s'] / 1e9:,.2f} GB/s, device->host "
            f"{result['d2h_bytes_per_s'] / 1e9:,.2f} GB/s")  # fmt: skip
        return result
    saved = torch.get_num_threads()
    by_threads: dict[str, Any] = {}
    try:
        for threads in _cpu_threads():
            torch.set_num_threads(threads)
            say(f"cpu, {threads} thread{'s' if threads > 1 else ''}:")
            by_threads[str(threads)] = peaks()
    finally:
        torch.set_num_threads(saved)
    result: dict[str, Any] = {"threads": by_threads}
    if (cores := max(_cpu_threads())) > 1:
        # what N ranks pinned one per core can do at best (dlrm_lab.metrics.ceiling)
        result["ceiling"] = {}
        for n in sorted({2, cores} | {1 << k for k in range(1, cores.bit_length()) if 1 << k <= cores}):
            quick = sizes.repeats < 5  # a first look: one round of 0.2 s each
            entry = measure_ceiling(n, repeats=1 if quick else 3, seconds=0.2 if quick else 1.0)
            result["ceiling"][str(n)] = entry
            say(f"cpu, {n} processes x 1 thread at once: GEMM {entry['gemm']['efficiency']:.0%} and copy "
                f"{entry['copy']['efficiency']:.0%} of {n} x one alone")  # fmt: skip
    return result


def probe_machine(
    quick: bool = False, devices: list[str] | None = None, log: Log | None = None, comms: bool = True
) -> dict[str, Any]:
    """A machine profile: every device's peaks plus, under a multi-rank launch, collective
    bandwidths. Under a launcher only rank 0's device peaks are kept (ranks share a machine
    kind); every rank takes part in the collectives (`comms=False`: none are probed, for a
    probe that rank 0 alone runs while the others wait)."""
    sizes = ProbeSizes.preset(quick)
    wanted = devices if devices is not None else (["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"])
    profile: dict[str, Any] = {
        "hardware": hardware_fingerprint(),
        "probed_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "quick": quick,
        "packages": {k: v for k, v in package_versions().items() if v},
        "python": platform.python_version(),
        "devices": {},
        "comms": {},
    }
    profile["fingerprint_id"] = profile["hardware"]["fingerprint_id"]
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
                    log("wake of an idle thread: " + "; ".join(
                        f"after {idle} ms idle p50 {w['p50_us']:.0f} us, p99 {w['p99_us']:.0f} us"
                        for idle, w in profile["wake"].items()))  # fmt: skip
                    log("an embedding gather after idling, against back to back: " + "; ".join(
                        f"{idle} ms {f:.2f}x" for idle, f in profile["cold_gather"].items()))  # fmt: skip
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
                dist.group.WORLD, batches, _slowest_over(dist.group.WORLD, sizes.repeats)
            )
        if detect_launch().launcher == "mpi":  # started by mpiexec: MPI's own collectives too
            from dlrm_lab.distributed.mpi import BACKEND, register

            register()
            over_mpi = dist.new_group(backend=BACKEND)  # the lab's process group on MPI (`--collectives mpi`)
            profile["comms"][f"mpi/{world}"] = [
                *mpi_bandwidth(sizes.comm_bytes, sizes.repeats),
                *torchrec_distribution(over_mpi, batches, _slowest_over(over_mpi, sizes.repeats)),
            ]
        for key, rows in profile["comms"].items() if log and rank == 0 else ():
            for r in rows:
                algbw, busbw = r["algbw_bytes_per_s"] / 1e9, r["busbw_bytes_per_s"] / 1e9
                log(f"  {key.replace('/', ' x')} {r['collective']} {r['bytes']:>10,} B: "
                    f"algbw {algbw:.3f} GB/s, busbw {busbw:.3f} GB/s")  # fmt: skip
    return profile


def _peak_tables(profile: dict[str, Any]) -> list[dict[str, Any]]:
    """Every table of peaks in a profile: one per CPU thread count, one per GPU."""
    out = []
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
        stored = load_profile()
        if stored is not None and stored.get("devices"):
            kind = "quick profile" if stored.get("quick") else "profile"
            where = profile_path(stored["fingerprint_id"])
            return ProbeOutcome(stored["fingerprint_id"], kept=f"machine {kind} of {stored.get('probed_at')} in "
                                f"{where}: not probing again (--if-missing)")  # fmt: skip
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
        stored = load_profile(fid)
        if stored is not None and stored.get("devices"):
            return ProbeOutcome(fid, refused=f"the machine was busy while probing ({load['why']}): not stored; the "
                                f"profile of {stored.get('probed_at')} is kept (probe again on an idle machine, or "
                                "--force to store it)")  # fmt: skip
        warning = (f"warning: the machine was busy while probing ({load['why']}); stored, as this machine had no "
                   "profile: probe again on an idle machine")  # fmt: skip
        return ProbeOutcome(fid, written=save_profile(profile), warning=warning)
    return ProbeOutcome(fid, written=save_profile(profile, keep_better=not force))

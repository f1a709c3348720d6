"""One device's peak measurements, each a function the machine probe (`metrics.probe`) calls: GEMM FLOP/s, copy
(memory) bandwidth, fbgemm's embedding gather bandwidth and host-device copy bandwidth; with how big and how often the
probe measures (`ProbeSizes`) and its clock (`timed`): the median of repeats after warm-up, CUDA work synchronised
before the clock is read.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal, TypedDict

import torch

from dlrm_lab.metrics.huge_pages import back_with_huge_pages, thp_mode
from dlrm_lab.metrics.interleaved import interleaved_medians

if TYPE_CHECKING:
    from dlrm_lab.metrics.ceiling import CeilingEntry

GEMM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "int8": torch.int8}


class GemmPeak(TypedDict):
    """`gemm_flops_per_s`: the best rate, the size it was timed at (None: none was), the spread of its timings."""

    flops_per_s: float
    size: int | None
    spread: float


class GatherWork(TypedDict, total=False):
    """What one batch of `_gather_bench` gathers; `huge_*` where its tables were put on 2 MiB pages."""

    bytes: int
    rows: int
    table_bytes: int
    huge_bytes: int
    huge_error: str | None


class GatherRate(TypedDict, total=False):
    """`gather_bytes_per_s`: the rate, the tables' size, and (with `huge_pages`) what went on 2 MiB pages."""

    bytes_per_s: float
    table_bytes: int
    huge_bytes: int
    huge_error: str | None


class GatherPages(TypedDict):
    """`gather_on_pages`: the CPU gather on 4 KiB and on 2 MiB pages."""

    base_bytes_per_s: float
    huge_bytes_per_s: float | None
    huge_error: str | None
    thp: str | None
    table_bytes: int


class DevicePeaks(TypedDict, total=False):
    """One table of peaks in a machine profile (`metrics.probe.probe_device`): a GPU's, or the CPU's at one thread
    count."""

    name: str  # a GPU's
    gemm_flops_per_s: dict[str, float]  # by precision
    gemm_size: dict[str, int | None]
    gemm_spread: dict[str, float]
    memory_bytes_per_s: float
    gather_pages: dict[str, Any]  # the CPU's: `gather_on_pages` less its table_bytes
    gather_bytes_per_s: float
    gather_table_bytes: int
    canary: dict[str, Any]  # the CPU's: `metrics.canary.quiet_canary`
    gather_rows_per_s: float
    # the CPU's gather from tables small enough to stay in the last-level cache (`gather_cached_bytes_per_s`)
    gather_cached_bytes_per_s: float
    gather_cached_table_bytes: int
    gather_probe: int
    h2d_bytes_per_s: float  # a GPU's
    d2h_bytes_per_s: float


# the peaks of a table that are one rate each (`metrics.roofline` keeps a stored one higher than a new probe's)
PeakRate = Literal[
    "memory_bytes_per_s",
    "gather_bytes_per_s",
    "gather_rows_per_s",
    "gather_cached_bytes_per_s",
    "h2d_bytes_per_s",
    "d2h_bytes_per_s",
]


class DeviceEntry(DevicePeaks, total=False):
    """A device of a machine profile: a GPU's peaks, or the CPU's per thread count and its N-process ceilings."""

    threads: dict[str, DevicePeaks]
    ceiling: dict[str, CeilingEntry]  # by processes


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
    # and its memory only on work far past its L2 (an H200's: 60 MB) and its launch cost: the copy's bytes and the
    # gather's (tables, rows, dim, batch, pooling). 64 MiB copies and 10 MB gathers read 2.7 TB/s and 35 GB/s on an
    # H200 whose 4 GiB copy reads 4.3 TB/s and whose 4 x 10M-row gather 3.7 TB/s
    gpu_copy_bytes: int = 1 << 30
    gpu_gather: tuple[int, int, int, int, int] = (4, 2_500_000, 128, 16384, 20)

    def for_gpu(self, free_bytes: int) -> ProbeSizes:
        """These sizes with the GPU's copy and gather, the gather's tables at most a quarter of `free_bytes`."""
        tables, rows, dim, batch, pooling = self.gpu_gather
        rows = max(1, min(rows, free_bytes // 4 // (tables * dim * 4)))
        return replace(
            self,
            copy_bytes=self.gpu_copy_bytes,
            gather_tables=tables,
            gather_rows=rows,
            gather_dim=dim,
            gather_batch=batch,
            gather_pooling=pooling,
        )

    @classmethod
    def preset(cls, quick: bool) -> ProbeSizes:
        if quick:
            return cls((256, 1024), 64 << 20, 2, 250_000, 64, 1024, 20, (1 << 10, 1 << 16, 1 << 20), 3, 2e8)
        return cls(
            (1024, 2048, 4096),
            1 << 30,
            4,
            1_000_000,
            64,
            4096,
            20,
            tuple(1 << k for k in range(10, 27, 2)),
            7,
            2e9,
            (512, 2048, 8192),
            (2048, 4096, 8192, 16384),
            4 << 30,
            (4, 10_000_000, 128, 65536, 20),
        )


def timed(fn: Callable[[], Any], repeats: int, device: torch.device, warmup: int = 2) -> float:
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
) -> GemmPeak:
    """Best FLOP/s of square matrix products over `sizes` (2 n^3 FLOPs each). On a CPU, the better of each way the
    lab's builds compute in: in fp32 torch's `mm` (Intel's MKL) and oneDNN's fp32 product (on AMD EPYCs MKL takes a
    path of half the width: 2 Zen 5 cores, one thread, MKL 98-102 GFLOP/s, oneDNN 219-226; OpenVINO's f32, on oneDNN,
    ran at twice a peak probed with MKL alone); in int8 torch's `_int_mm` and oneDNN's quantised linear
    (`int8_cpu_products`)."""
    if device.type == "cpu" and dtype == torch.float32 and "onednn" in fp32_cpu_products():
        onednn = _gemm_peak(device, dtype, sizes, repeats, min_flops, onednn_fp32=True)
        mkl = _gemm_peak(device, dtype, sizes, repeats, min_flops)
        return onednn if onednn["flops_per_s"] > mkl["flops_per_s"] else mkl
    if device.type == "cpu" and dtype == torch.int8:
        best: GemmPeak | None = None
        for way in int8_cpu_products().values():
            try:
                peak = _gemm_peak(device, dtype, sizes, repeats, min_flops, product=way)
            except (RuntimeError, NotImplementedError):  # a torch without this way: the other stands
                continue
            best = peak if best is None or peak["flops_per_s"] > best["flops_per_s"] else best
        if best is None:  # neither way runs here: said as `_int_mm`'s own error (the probe prints it)
            return _gemm_peak(device, dtype, sizes, repeats, min_flops)
        return best
    return _gemm_peak(device, dtype, sizes, repeats, min_flops)


Product = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def fp32_cpu_products() -> dict[str, tuple[Product, Callable[[torch.Tensor], torch.Tensor]]]:
    """The fp32 products a CPU's fp32 peak is the better of, each with how an operand is made ready for it: torch's
    `mm` (Intel's MKL) and, where torch has oneDNN, oneDNN's fp32 linear on tensors in its own layout (a x b^T: the
    same FLOPs). Whatever compares a rate timed now with the profile's fp32 peak times it the same way."""
    ways: dict[str, tuple[Product, Callable[[torch.Tensor], torch.Tensor]]] = {"mkl": (torch.mm, lambda m: m)}
    if torch.backends.mkldnn.is_available():
        ways["onednn"] = (lambda a, b: torch._C._nn.mkldnn_linear(a, b, None), lambda m: m.to_mkldnn())
    return ways


# a way to compute an n x n x n product, given n: a call that computes one (its operands made ready once)
SquareProduct = Callable[[int], Callable[[], Any]]


def int8_cpu_products() -> dict[str, SquareProduct]:
    """The int8 products a CPU's int8 peak is the better of: torch's `_int_mm` (int32 sums), and oneDNN's quantised
    linear (u8 activations x s8 weights prepacked, fp32 out), the product the lab's int8 builds run (torchao's PT2E
    lowers to it). Without VNNI `_int_mm` takes a reference path: 2 Zen 3 cores, one thread, 1.0-1.6 GOP/s against
    oneDNN's 145-157, and an int8 build's floor read the first (`make run` served "p99 26.5 ms, floor 210 ms")."""

    def int_mm(n: int) -> Callable[[], Any]:
        a, b = (torch.randint(-128, 128, (n, n), dtype=torch.int8) for _ in range(2))
        return lambda: torch._int_mm(a, b)

    def onednn(n: int) -> Callable[[], Any]:
        x = torch.randint(0, 256, (n, n), dtype=torch.uint8)
        packed = torch.ops.onednn.qlinear_prepack(torch.randint(-128, 128, (n, n), dtype=torch.int8), x.shape)
        scales, zeros = torch.ones(n), torch.zeros(n, dtype=torch.int64)
        return lambda: torch.ops.onednn.qlinear_pointwise(
            x, 1.0, 0, packed, scales, zeros, None, 1.0, 0, torch.float32, "none", [], ""
        )

    return {"int_mm": int_mm, "onednn": onednn}


def _gemm_peak(
    device: torch.device,
    dtype: torch.dtype,
    sizes: tuple[int, ...],
    repeats: int,
    min_flops: float,
    onednn_fp32: bool = False,
    product: SquareProduct | None = None,
) -> GemmPeak:
    """`gemm_flops_per_s` through one library: torch's own product, (`onednn_fp32`) oneDNN's fp32 linear on
    tensors in its own layout (a x b^T: the same FLOPs), or `product` (its operands made for each size)."""
    best: GemmPeak = {"flops_per_s": 0.0, "size": None, "spread": 1.0}
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *_: None)
    # A slow kernel (bf16 without AVX-512 bf16/AMX, fp16 on most CPUs) would take seconds per
    # product at these sizes. A pilot product decides only whether the smallest size is
    # affordable (its size stands in when not); each larger size is predicted from the best
    # rate timed so far and the first predicted to take over 0.25 s ends the climb. The pilot
    # is a floor, not a forecast: on a GPU one small product is launch-bound (an H200's pilot
    # cut bf16 at n=2048: 430 of the 667 TFLOP/s it sustains at n=8192).
    # int8: the integer product int8 builds compute in (VNNI, AMX int8; int32 sums), counted as 2 n^3 operations
    mm: Product = torch._int_mm if dtype == torch.int8 else torch.mm
    ready: Callable[[torch.Tensor], torch.Tensor] = lambda m: m  # noqa: E731
    if onednn_fp32:
        mm, ready = fp32_cpu_products()["onednn"]

    def square(n: int) -> torch.Tensor:
        if dtype == torch.int8:
            return torch.randint(-128, 128, (n, n), device=device, dtype=dtype)
        return ready(torch.randn(n, n, device=device).to(dtype))

    def made(n: int) -> Callable[[], Any]:
        if product is not None:
            return product(n)
        a, b = square(n), square(n)
        return lambda: mm(a, b)

    pilot = min(256, *sizes)
    call = made(pilot)
    call()  # first call: kernel selection
    sync(device)
    t0 = time.perf_counter()
    call()
    sync(device)
    pilot_rate = 2 * pilot**3 / max(time.perf_counter() - t0, 1e-9)
    climb = sorted(sizes) if 2 * min(sizes) ** 3 / pilot_rate <= 0.25 else [pilot]
    for n in climb:
        if best["size"] is not None and 2 * n**3 / best["flops_per_s"] > 0.25:
            break
        call = made(n)
        t0 = time.perf_counter()
        call()
        sync(device)
        single = time.perf_counter() - t0
        # repeat small products so that one timing holds enough work, but keep it under ~0.1 s
        inner = max(1, min(int(min_flops // (2 * n**3)), int(0.1 / max(single, 1e-6))))

        def step(call: Callable[[], Any] = call, inner: int = inner) -> None:
            for _ in range(inner):
                call()

        times = _timed_all(step, repeats, device)
        rate = inner * 2 * n**3 / statistics.median(times)
        if rate > best["flops_per_s"]:
            best = {"flops_per_s": rate, "size": n, "spread": max(times) / max(min(times), 1e-12)}
    return best


def copy_bytes_per_s(device: torch.device, nbytes: int, repeats: int) -> float:
    """Bytes read plus written per second by a large copy."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    seconds = timed(lambda: dst.copy_(src), repeats, device)
    return 2 * src.numel() * 4 / seconds


def _gather_bench(device: torch.device, sizes: ProbeSizes, huge_pages: bool = False) -> tuple[Any, GatherWork]:
    """fbgemm's table-batched embedding-bag forward over the probe's tables (on 2 MiB pages with `huge_pages`:
    `metrics.huge_pages`), fed one batch of random ids: (a call that gathers it, what it gathers)."""
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
    # rows written, as a trained table's are: never-touched memory reads as the kernel's one zero page, faulted in
    # page by page on first touch, which is neither a table's cost nor its pages'
    with torch.no_grad():
        (tbe.weights_host if device.type == "cpu" else tbe.weights_dev).uniform_(-0.01, 0.01)
    pages = back_with_huge_pages([tbe.weights_host]) if huge_pages and device.type == "cpu" else None
    ids = torch.randint(0, r, (t * b * pool,), generator=generator, dtype=torch.int64).to(device)
    offsets = torch.arange(0, t * b * pool + 1, pool, dtype=torch.int64).to(device)
    what: GatherWork = {"bytes": t * b * pool * d * 4, "rows": t * b * pool, "table_bytes": t * r * d * 4}
    if pages is not None:
        what["huge_bytes"], what["huge_error"] = pages.huge_bytes, pages.error

    def gather() -> None:
        with torch.no_grad():
            tbe(ids, offsets)

    return gather, what


def gather_bytes_per_s(device: torch.device, sizes: ProbeSizes, repeats: int, huge_pages: bool = False) -> GatherRate:
    """Bytes of embedding rows read per second by fbgemm's table-batched embedding-bag forward; with
    `huge_pages`, its tables put on 2 MiB pages first (`metrics.huge_pages`; `huge_error` says why not)."""
    gather, what = _gather_bench(device, sizes, huge_pages)
    seconds = timed(gather, repeats, device)
    out: GatherRate = {"bytes_per_s": what["bytes"] / seconds, "table_bytes": what["table_bytes"]}
    if "huge_bytes" in what:
        out["huge_bytes"], out["huge_error"] = what["huge_bytes"], what["huge_error"]
    return out


def gather_on_pages(sizes: ProbeSizes, repeats: int) -> GatherPages:
    """The CPU gather on 4 KiB pages and on 2 MiB pages, the two tables built side by side and timed in turn
    (a noisy host drifts between two probes taken one after the other): `base_bytes_per_s`, `huge_bytes_per_s`
    (None where the kernel put nothing on huge pages, `huge_error` says why), `thp` (the kernel's mode)."""
    cpu = torch.device("cpu")
    base, base_what = _gather_bench(cpu, sizes)
    huge, huge_what = _gather_bench(cpu, sizes, huge_pages=True)
    benches = {"base": base, "huge": huge}
    med = interleaved_medians(  # a round: 3 calls of the table's gather, warm
        ("base", "huge"),
        lambda name: statistics.median(_timed_all(benches[name], 3, cpu, warmup=1)),
        repeats,
        warm_up=False,
    )
    on_huge = bool(huge_what.get("huge_bytes"))
    return {
        "base_bytes_per_s": base_what["bytes"] / med["base"],
        "huge_bytes_per_s": huge_what["bytes"] / med["huge"] if on_huge else None,
        "huge_error": huge_what.get("huge_error"),
        "thp": thp_mode(),
        "table_bytes": base_what["table_bytes"],
    }


LINE_DIM = 16  # fp32 values in a row of one 64-byte cache line
# Tables this large fit the last-level cache of every CPU class the lab has met (Zen 3/4: 32 MiB a CCD; the AMX
# guest: 504 MiB) and exceed its L2: a model whose tables are smaller gathers from cache, faster than the DRAM probe
CACHED_TABLE_BYTES = 16 << 20


def gather_cached_bytes_per_s(device: torch.device, sizes: ProbeSizes, repeats: int) -> GatherRate:
    """The gather of `gather_bytes_per_s` from tables of CACHED_TABLE_BYTES in all: the ceiling of a model whose
    tables are smaller than the DRAM probe's (its rate holds only for tables at least as large as its own)."""
    rows = max(1, CACHED_TABLE_BYTES // (sizes.gather_tables * sizes.gather_dim * 4))
    return gather_bytes_per_s(device, replace(sizes, gather_rows=rows), repeats)


def gather_rows_per_s(device: torch.device, sizes: ProbeSizes, repeats: int, huge_pages: bool = False) -> float:
    """Random rows of one cache line gathered per second: the same tables' bytes as `gather_bytes_per_s` cut
    into 64-byte rows. A row this small is bound by its count (a line fetched and a page walked each), not by its
    bytes: the gather's second ceiling (`metrics.roofline._gather_seconds`)."""
    narrow = replace(sizes, gather_dim=LINE_DIM, gather_rows=sizes.gather_rows * sizes.gather_dim // LINE_DIM)
    return gather_bytes_per_s(device, narrow, repeats, huge_pages)["bytes_per_s"] / (LINE_DIM * 4)


class HostDeviceRates(TypedDict):
    """`host_device_bytes_per_s`: pinned host memory to the device and back."""

    h2d_bytes_per_s: float
    d2h_bytes_per_s: float


def host_device_bytes_per_s(device: torch.device, nbytes: int, repeats: int) -> HostDeviceRates:
    """Pinned host -> device and device -> host copy bandwidth."""
    host = torch.empty(nbytes // 4, dtype=torch.float32).pin_memory()
    dev = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    h2d = timed(lambda: dev.copy_(host, non_blocking=True), repeats, device)
    d2h = timed(lambda: host.copy_(dev, non_blocking=True), repeats, device)
    return {"h2d_bytes_per_s": nbytes / h2d, "d2h_bytes_per_s": nbytes / d2h}

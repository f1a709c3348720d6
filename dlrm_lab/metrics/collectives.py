"""Collective bandwidths among the ranks of a launch, each a function the machine probe (`metrics.probe`) calls:
all-to-all and all-reduce over torch.distributed's process group or over MPI itself (mpi4py), and TorchRec's input
distribution and pooled all-to-all as a training step runs them, in rows of algorithm and bus bandwidth; each call is
timed on the slowest rank, which decides how long a collective takes.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any, TypedDict

import torch
import torch.distributed as dist

from dlrm_lab.metrics.device_peaks import timed

CollectivesAt = Callable[[int], tuple[tuple[str, Callable[[], Any], float], ...]]


class CommRow(TypedDict, total=False):
    """One measured collective at one size, as a machine profile's `comms` holds them (bytes per rank)."""

    collective: str
    bytes: int
    time_ms: float
    algbw_bytes_per_s: float
    busbw_bytes_per_s: float
    samples_per_rank: int  # TorchRec's rows
    forward_share: float  # TorchRec's pooled row: the forward's share of its time


def _collective_rows(
    n: int, sizes: tuple[int, ...], collectives_at: CollectivesAt, slowest_seconds: Callable[[Callable[[], Any]], float]
) -> list[CommRow]:
    """One row per size and collective: `collectives_at(numel)` gives (name, call, bus-bytes
    factor) over buffers of numel floats; `slowest_seconds(call)` its time on the slowest rank."""
    rows: list[CommRow] = []
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


def slowest_over(pg: Any, repeats: int, device: torch.device | None = None) -> Callable[[Callable[[], Any]], float]:
    """A call's median time on the slowest rank of `pg` (CPU by default): the slowest rank decides how long a
    collective takes."""
    on = device or torch.device("cpu")

    def slowest_seconds(fn: Callable[[], Any]) -> float:
        dist.barrier(group=pg)
        t = torch.tensor([timed(fn, repeats, on)], dtype=torch.float64, device=on)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=pg)
        return float(t.item())

    return slowest_seconds


def comm_bandwidth(device: torch.device, sizes: tuple[int, ...], repeats: int) -> list[CommRow]:
    """All-to-all and all-reduce over the default process group at each size in bytes per rank."""
    n = dist.get_world_size()

    def collectives_at(numel: int) -> tuple[tuple[str, Callable[[], Any], float], ...]:
        buf = torch.ones(numel, dtype=torch.float32, device=device)
        out = torch.empty_like(buf)
        return (
            ("all_to_all", partial(dist.all_to_all_single, out, buf), (n - 1) / n),
            ("all_reduce", partial(dist.all_reduce, buf), 2 * (n - 1) / n),
        )

    return _collective_rows(n, sizes, collectives_at, slowest_over(dist.group.WORLD, repeats, device))


def mpi_bandwidth(sizes: tuple[int, ...], repeats: int) -> list[CommRow]:
    """The same collectives through MPI (mpi4py on numpy buffers), for ranks started by
    mpiexec: PyPI torch has no MPI backend, so this is what a custom process group over
    MPI could reach (with MPICH's shared-memory transport between ranks of one host)."""
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    n = comm.Get_size()

    def collectives_at(numel: int) -> tuple[tuple[str, Callable[[], Any], float], ...]:
        buf: np.ndarray[Any, Any] = np.ones(numel, dtype=np.float32)
        out = np.empty_like(buf)
        return (
            ("all_to_all", lambda: comm.Alltoall(buf, out), (n - 1) / n),
            ("all_reduce", lambda: comm.Allreduce(buf, out, op=MPI.SUM), 2 * (n - 1) / n),
        )

    def slowest_seconds(fn: Callable[[], Any]) -> float:
        comm.Barrier()
        return comm.allreduce(timed(fn, repeats, torch.device("cpu")), op=MPI.MAX)

    return _collective_rows(n, sizes, collectives_at, slowest_seconds)


# TorchRec's own distribution probed at a kaggle-like shape: 26 one-id features of dim 16 spread over the ranks
TORCHREC_FEATURES, TORCHREC_DIM = 26, 16


def torchrec_distribution(
    pg: Any, batches: tuple[int, ...], slowest_seconds: Callable[[Callable[[], Any]], float]
) -> list[CommRow]:
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
    rows: list[CommRow] = []
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
            rows.append(
                {
                    "collective": name,
                    "bytes": int(bus),
                    "time_ms": seconds * 1e3,
                    "algbw_bytes_per_s": rate,
                    "busbw_bytes_per_s": rate,
                    "samples_per_rank": b,
                }
            )
        share = torch.tensor([statistics.median(f for f, _ in halves) / statistics.median(t for _, t in halves)])
        dist.all_reduce(share, group=pg)
        rows[-1]["forward_share"] = share.item() / n
    return rows

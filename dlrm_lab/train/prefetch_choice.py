"""Where a training rank makes its batches: inline, on a thread, or in worker processes (`choose_prefetch`)."""

from __future__ import annotations

import os
from typing import TypedDict

import torch

from dlrm_lab.config import TrainConfig
from dlrm_lab.distributed.context import DistContext

PREFETCH_DEPTH = 2  # batches a background thread keeps ready when there is a core for it


class PrefetchChoice(TypedDict):
    """Batches a background thread keeps ready (0: made inline), and why (the manifest's `prefetch_choice`)."""

    prefetch: int
    reason: str
    workers: int  # processes that make the batches (`data.prefetch.WorkerPrefetcher`), 0: the thread alone


MAX_DATA_WORKERS = 8  # a dcnv2 batch of 6,912 takes a host core ~70 ms: 8 workers feed a ~10 ms GPU step


def choose_prefetch(cfg: TrainConfig, ctx: DistContext) -> PrefetchChoice:
    """`_thread_depth`'s depth, and the processes that make the batches: on a GPU every host core but the
    step's thread and the pinning thread (at most MAX_DATA_WORKERS, shared by the node's ranks); on a CPU none."""
    depth, reason = _thread_depth(cfg, ctx)
    if cfg.data_workers != "auto":
        workers = int(cfg.data_workers)
        depth = max(depth, PREFETCH_DEPTH) if workers else depth
        return {"prefetch": depth, "reason": f"{reason}; --data-workers {workers}", "workers": workers}
    if ctx.device.type != "cuda" or not depth:
        return {"prefetch": depth, "reason": reason, "workers": 0}
    affinity = _host_cores()
    workers = min(MAX_DATA_WORKERS, max(0, affinity // max(1, ctx.local_world_size) - 2))
    if not workers:
        return {"prefetch": depth, "reason": f"{reason} ({affinity} host core(s): none for workers)", "workers": 0}
    why = f"{workers} worker processes make the batches while the GPU computes ({affinity} host cores)"
    return {"prefetch": depth, "reason": why, "workers": workers}


def _host_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _thread_depth(cfg: TrainConfig, ctx: DistContext) -> tuple[int, str]:
    """Where this rank makes its batches (the batches a background thread keeps ready, 0: inline, and why): on a
    thread only where a core of the rank's own is left free by its compute threads (or the compute runs on a GPU);
    else inline, at the start of each step. A data thread on the compute thread's core only time-slices it, and at
    several ranks each rank is interrupted at a different point of its step, so the others wait at the next
    collective. Measured (kaggle 100k rows, batch 2048 per rank, one pinned core per rank, MPI
    collectives, 3 alternated pairs): per-rank step 101.6-104.8 ms inline against 103.8-108.8 ms with
    the thread at 1 rank, 114.2-118.2 against 119.7-123.2 ms at 2 ranks (docs/benchmarks-history.md, issue 18)."""
    threads = torch.get_num_threads()
    if cfg.prefetch != "auto":
        depth = int(cfg.prefetch)
        return depth, f"--prefetch {depth}" + (" (inline)" if depth == 0 else " (a thread)")
    if ctx.device.type == "cuda":
        return PREFETCH_DEPTH, "a thread: the host prepares batches while the GPU computes"
    # pinned: the rank's own cores; else the cores it may use, shared with the other ranks of its node
    cores = _host_cores() if cfg.pin_cores else max(1, _host_cores() // max(1, ctx.local_world_size))
    if cores > threads:
        return PREFETCH_DEPTH, f"a thread: {cores} core(s) for this rank, {threads} compute thread(s)"
    return 0, (
        f"inline: this rank's {cores} core(s) all run its {threads} compute thread(s); "
        "a data thread would only time-slice them"
    )

"""The machine's multi-process compute ceiling: what N ranks on one host can do at best.

N processes, each pinned to a core of its own with one intra-op thread (as `dlrm-lab scale`
runs its ranks), run the same fp32 matrix product and a large copy at the same time; their
summed rate over N times one process alone is the ceiling of weak-scaling efficiency on this
host. Below 1 when the cores share something: a core's SMT sibling, the last-level cache,
memory bandwidth, a power or frequency budget, or a hypervisor's scheduling. The issue that
asked for it saw 2 processes reach 1.75x one on a 2-core EPYC VM.

Written by hand: no library measures concurrent per-core throughput; multiprocessing with
a barrier keeps the N timings overlapping.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import time
from collections.abc import Mapping
from typing import Any, Literal, TypedDict

import torch

from dlrm_lab.errors import end_with_parent, interrupt_blocked

KINDS: tuple[Literal["gemm"], Literal["copy"]] = ("gemm", "copy")


class CeilingEntry(TypedDict, total=False):
    """`measure_ceiling`'s result: how it measured, and per kind the rates of one process alone, of all at once and of
    each (`one_flops_per_s`, ...: flops for gemm, bytes for copy) and `efficiency`."""

    processes: int
    threads_per_process: int
    seconds: float
    size: int
    gemm: dict[str, Any]
    copy: dict[str, Any]


def _work(kind: str, size: int) -> tuple[Any, float]:
    """A callable unit of work and its FLOPs (gemm) or bytes read and written (copy)."""
    if kind == "gemm":
        a, b = torch.randn(size, size), torch.randn(size, size)
        return (lambda: torch.mm(a, b)), 2.0 * size**3
    src = torch.ones(size * size * 64)  # 64 n^2 floats (64 MiB at n=512): beyond any last-level cache
    dst = torch.empty_like(src)
    return (lambda: dst.copy_(src)), 2.0 * 4 * src.numel()


def _worker(core: int | None, size: int, inbox: Any, outbox: Any) -> None:
    """Runs rounds until told to stop: (kind, start at, seconds) -> the rate it measured."""
    end_with_parent()  # a probe killed by SIGKILL leaves no worker (and no resource tracker) behind
    if core is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, [core])
    torch.set_num_threads(1)
    work = {kind: _work(kind, size) for kind in KINDS}
    for fn, _ in work.values():
        fn()  # kernel selection, first touch
    outbox.put("ready")
    while (task := inbox.get()) is not None:
        kind, start_at, seconds = task
        fn, units = work[kind]
        while time.monotonic() < start_at:  # the round's processes start together
            pass
        done, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            fn()
            done += 1
        outbox.put(done * units / (time.perf_counter() - t0))


def measure_ceiling(processes: int, repeats: int = 3, seconds: float = 1.0, size: int = 512) -> CeilingEntry:
    """The N-process ceiling for matrix products and copies: medians of `repeats` rounds of
    (process 0 alone, then all N at once), alternated so that drift of a noisy host hits both.
    The N processes are started once (spawned: importing torch takes seconds) and kept."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    ctx = mp.get_context("spawn")  # no fork of a torch process with live threads
    inboxes = [ctx.Queue() for _ in range(processes)]
    outboxes = [ctx.Queue() for _ in range(processes)]
    procs = [
        ctx.Process(target=_worker, args=(cores[k] if k < len(cores) else None, size, inboxes[k], outboxes[k]))
        for k in range(processes)
    ]
    with interrupt_blocked():  # a Ctrl-C while they import is the probe's, not a traceback of each
        for p in procs:
            p.start()

    def round_of(kind: str, who: range) -> list[float]:
        start_at = time.monotonic() + 0.05
        for k in who:
            inboxes[k].put((kind, start_at, seconds))
        return [outboxes[k].get(timeout=60 + 2 * seconds) for k in who]

    out: CeilingEntry = {"processes": processes, "threads_per_process": 1, "seconds": seconds, "size": size}
    try:
        for box in outboxes:
            box.get(timeout=120)  # every process ready
        for kind in KINDS:
            solo, each = [], []
            for _ in range(repeats):
                solo.append(round_of(kind, range(1))[0])
                each.append(round_of(kind, range(processes)))
            alone, together = statistics.median(solo), statistics.median(sum(r) for r in each)
            unit = "flops" if kind == "gemm" else "bytes"
            out[kind] = {
                f"one_{unit}_per_s": alone,
                f"all_{unit}_per_s": together,
                f"each_{unit}_per_s": [statistics.median(r[k] for r in each) for k in range(processes)],
                "efficiency": together / (processes * alone),
            }
    finally:
        for box in inboxes:
            box.put(None)
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return out


def ceiling_efficiency(profile: Mapping[str, Any] | None, processes: int, kind: str = "gemm") -> float | None:
    """The stored N-process efficiency (1.0 for one process); None when it was not probed. `profile`: a machine
    profile as read from JSON (`metrics.hardware.MachineProfile`), a section missing or null reading as none."""
    if processes <= 1:
        return 1.0
    cpu = ((profile or {}).get("devices") or {}).get("cpu") or {}
    entry = (cpu.get("ceiling") or {}).get(str(processes))
    return None if entry is None else float(entry[kind]["efficiency"])

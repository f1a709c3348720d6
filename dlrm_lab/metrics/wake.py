"""What idling costs on this machine: a thread's wake, and a fresh batch's memory reads after a gap.

Two probes, both part of every low-load latency floor.

A served query at low load finds its instance asleep: blocked on its pipe, its core perhaps in a deep idle
state. The probe measures that wake as a server meets it: a thread blocked on a condition for 1, 10 and
100 ms is woken by another, and the time from the notify to the waiter running again is recorded (p50,
p99, max per idle time). A latency floor at low load adds the wake at the idle nearest the query gap
(`wake_ms_for_gap`), and the query's latency parts name it.

The second: the same embedding gather (fbgemm's TBE forward, random rows) timed back to back and after
sleeping 1, 10 and 100 ms. On these KVM guests a gather after 100 ms idle ran several times slower than back to
back (memory gone cold: the last-level cache is the host's, shared), and spinning instead of sleeping did not
keep it warm; a low-load floor that assumed warm memory was not a floor this machine has. The ratio
(`cold_factor_for_gap`) divides the floor's memory bandwidths at the gap an instance sits idle.

Hand-written: no library measures a thread's wake-up latency from Python (cyclictest measures a timer's, in C),
nor how fast memory goes cold between a server's batches.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np

_Entry = TypeVar("_Entry")  # what a probe's table holds per idle time: its wake statistics, or a cold factor

IDLE_MS = (1.0, 10.0, 100.0)  # how long the waiter sleeps before each wake


def measure_wake(
    idle_ms: float,
    repeats: int,
    clock: Callable[[], int] = time.perf_counter_ns,
    sleep: Callable[[float], Any] = time.sleep,
) -> list[float]:
    """`repeats` wakes of a thread blocked for `idle_ms` on a condition: microseconds from the notify to the
    waiter running. The notifier waits for each wake before the next round, so the clock's calls alternate
    (notify, wake, notify, wake, ...): a fake clock can script them."""
    cond = threading.Condition()
    state = {"round": 0, "woke": 0}
    notified: list[int] = []
    woke: list[int] = []

    def waiter() -> None:
        for k in range(1, repeats + 1):
            with cond:
                while state["round"] < k:
                    cond.wait()
            woke.append(clock())
            with cond:
                state["woke"] = k
                cond.notify_all()

    thread = threading.Thread(target=waiter, name="wake-probe", daemon=True)
    thread.start()
    try:
        for k in range(1, repeats + 1):
            sleep(idle_ms / 1e3)  # the waiter is blocked all this time
            with cond:
                notified.append(clock())
                state["round"] = k
                cond.notify_all()
                while state["woke"] < k:
                    cond.wait()
    finally:
        thread.join(timeout=5)
    return [(w - n) / 1e3 for n, w in zip(notified, woke, strict=True)]


def summarize_wakes(wakes_us: Sequence[float]) -> dict[str, float]:
    a = np.asarray(wakes_us, dtype=np.float64)
    return {
        "samples": int(a.size),
        "p50_us": float(np.percentile(a, 50)),
        "p99_us": float(np.percentile(a, 99)),
        "max_us": float(a.max()),
    }


def probe_wake(quick: bool = False, **how: Any) -> dict[str, dict[str, float]]:
    """The wake of an idle thread after each of IDLE_MS, keyed by the idle ms ("1", "10", "100")."""
    repeats = {1.0: 40, 10.0: 40, 100.0: 10} if quick else {1.0: 200, 10.0: 100, 100.0: 30}
    return {f"{idle:g}": summarize_wakes(measure_wake(idle, repeats[idle], **how)) for idle in IDLE_MS}


def wake_ms_for_gap(wake: dict[str, dict[str, float]] | None, gap_ms: float | None, stat: str = "p50_us") -> float:
    """The wake (ms) of an instance idle for `gap_ms` between its batches: the probe's at the nearest idle time
    at or below the gap (none below 1 ms of idle: a busy instance never sleeps long); 0 without a probe."""
    entry = _at_gap(wake, gap_ms)
    return entry[stat] / 1e3 if entry is not None else 0.0


def _at_gap(table: dict[str, _Entry] | None, gap_ms: float | None) -> _Entry | None:
    """A probe's entry at the longest idle time it measured at or below `gap_ms`; None below 1 ms or unprobed."""
    known = [i for i in IDLE_MS if gap_ms is not None and i <= gap_ms and f"{i:g}" in (table or {})]
    return table[f"{max(known):g}"] if table and known else None


def measure_cold(
    work: Callable[[], Any],
    idle_ms: float,
    repeats: int,
    sleep: Callable[[float], Any] = time.sleep,
    clock: Callable[[], float] = time.perf_counter,
) -> list[float]:
    """Milliseconds of `work` after sleeping `idle_ms` each time (0: back to back)."""
    out = []
    for _ in range(repeats):
        if idle_ms:
            sleep(idle_ms / 1e3)
        t = clock()
        work()
        out.append((clock() - t) * 1e3)
    return out


def cold_factors(work: Callable[[], Any], repeats: int, **how: Any) -> dict[str, float]:
    """`work`'s median time after each of IDLE_MS of idle over its median back to back (>= 1), keyed as the wake."""
    for _ in range(3):  # warm-up: allocation, first faults
        work()
    warm = float(np.median(measure_cold(work, 0.0, repeats * 2, **how)))
    return {
        f"{idle:g}": max(1.0, float(np.median(measure_cold(work, idle, repeats, **how))) / warm) for idle in IDLE_MS
    }


def probe_cold_gather(quick: bool = False) -> dict[str, float]:
    """`cold_factors` of an embedding gather the size of a served batch: fbgemm's TBE forward over 8 tables of
    250,000 rows x 64 (fp32, 512 MB), 256 samples a table, one id each (random)."""
    import torch
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    tables, rows, dim, batch = 8, 250_000, 64, 256
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(rows, dim, EmbeddingLocation.HOST, ComputeDevice.CPU)] * tables,
        pooling_mode=PoolingMode.SUM,
        device=torch.device("cpu"),
    )
    with torch.no_grad():  # rows written, as a served table's are (never-touched memory reads one zero page)
        tbe.weights_host.uniform_(-0.01, 0.01)
    generator = torch.Generator().manual_seed(0)
    offsets = torch.arange(0, tables * batch + 1, dtype=torch.int64)

    def work() -> None:  # other rows each time, as a server's next batch
        ids = torch.randint(0, rows, (tables * batch,), generator=generator, dtype=torch.int64)
        with torch.no_grad():
            tbe(ids, offsets)

    return cold_factors(work, 8 if quick else 30)


def cold_factor_for_gap(cold: dict[str, float] | None, gap_ms: float | None) -> float:
    """How many times slower memory reads a batch after `gap_ms` idle than back to back: the probe's at the nearest
    idle time at or below the gap; 1 below 1 ms or without a probe."""
    factor = _at_gap(cold, gap_ms)
    return factor if factor is not None else 1.0

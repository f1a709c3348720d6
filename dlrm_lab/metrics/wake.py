"""How long this machine takes to wake an idle thread: part of every low-load latency floor.

A served query at low load finds its instance asleep: blocked on its pipe, its core perhaps in a deep idle
state. The probe measures that wake as a server meets it: a thread blocked on a condition for 1, 10 and
100 ms is woken by another, and the time from the notify to the waiter running again is recorded (p50,
p99, max per idle time). A latency floor at low load adds the wake at the idle nearest the query gap
(`wake_ms_for_gap`), and the query's latency parts name it.

Hand-written: no library measures a thread's wake-up latency from Python (cyclictest measures a timer's, in C).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

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
    return {"samples": int(a.size), "p50_us": float(np.percentile(a, 50)), "p99_us": float(np.percentile(a, 99)),
            "max_us": float(a.max())}  # fmt: skip


def probe_wake(quick: bool = False, **how: Any) -> dict[str, dict[str, float]]:
    """The wake of an idle thread after each of IDLE_MS, keyed by the idle ms ("1", "10", "100")."""
    repeats = {1.0: 40, 10.0: 40, 100.0: 10} if quick else {1.0: 200, 10.0: 100, 100.0: 30}
    return {f"{idle:g}": summarize_wakes(measure_wake(idle, repeats[idle], **how)) for idle in IDLE_MS}


def wake_ms_for_gap(wake: dict[str, dict[str, float]] | None, gap_ms: float | None, stat: str = "p50_us") -> float:
    """The wake (ms) of an instance idle for `gap_ms` between its batches: the probe's at the nearest idle time
    at or below the gap (none below 1 ms of idle: a busy instance never sleeps long); 0 without a probe."""
    known = [i for i in IDLE_MS if gap_ms is not None and i <= gap_ms and f"{i:g}" in (wake or {})]
    return wake[f"{max(known):g}"][stat] / 1e3 if wake and known else 0.0

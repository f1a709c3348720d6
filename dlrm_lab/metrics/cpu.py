"""CPU use over a window, from the kernel's counters through psutil: the one meter behind every CPU column.

`CpuMeter` measures the busy share of a set of cores (the host sampler's per-core `cpu_percent`
telemetry and `cpu_utilization_mean`, inference's `cpu_utilization`) and the CPU seconds of groups of
processes (inference's `instance_cpu_utilization` and `server_cpu_s`).

The busy share is psutil's `cpu_percent` formula applied to counter deltas: busy = total - idle - iowait,
where total leaves guest time out (Linux already counts it in user time). Deltas of `psutil.cpu_times`
rather than `psutil.cpu_percent()`, whose baseline is process-global and reset by any other caller.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeAlias

import psutil

Proc: TypeAlias = int | psutil.Process  # a pid, or an open Process


def usable_cores() -> list[int] | None:
    """The cores this process may run on (its affinity); None where the OS does not say (then all count)."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None


def core_seconds(times: Any) -> tuple[float, float]:
    """(busy, total) cumulative seconds of one core's `psutil.cpu_times(percpu=True)` entry."""
    total = sum(times) - getattr(times, "guest", 0.0) - getattr(times, "guest_nice", 0.0)
    return total - times.idle - getattr(times, "iowait", 0.0), total


def busy_share(busy_s: float, total_s: float) -> float | None:
    """busy / total within [0, 1] (the counters are not perfectly consistent); None when no time elapsed."""
    return min(max(busy_s / total_s, 0.0), 1.0) if total_s > 0 else None


class CpuMeter:
    """CPU use between start() and stop() (or between successive lap() calls).

    `cores`: indices into `psutil.cpu_times(percpu=True)` whose busy share is measured (None: all).
    `processes`: named groups of (pid or Process, threads); each group's CPU seconds (user + system)
    are summed, and divided by wall x the group's threads for its utilisation. A process already gone
    at construction counts in neither; one that cannot be read later makes its group's numbers None.

    start() returns the meter; lap() and stop() return a dict:
      wall_s                          seconds of the window
      cpu_busy_s, cpu_total_s         busy and elapsed core-seconds summed over the counted cores
      cpu_utilization                 cpu_busy_s / cpu_total_s, in [0, 1]
      core_utilization                {core: busy share} of each counted core that had ticks
      <group>_cpu_s                   CPU seconds of the group's processes in the window
      <group>_cpu_utilization         <group>_cpu_s / (wall_s x the group's threads), not clamped
    The core fields are None (core_utilization empty) when the number of cores changed (CPU hot-plug).
    """

    def __init__(
        self,
        cores: Iterable[int] | None = None,
        processes: Mapping[str, Sequence[tuple[Proc, int]]] | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.cores = None if cores is None else frozenset(cores)
        self.groups: dict[str, list[tuple[psutil.Process, int]]] = {}
        for name, members in (processes or {}).items():
            group = self.groups[name] = []
            for proc, threads in members:
                try:
                    group.append((proc if isinstance(proc, psutil.Process) else psutil.Process(proc), max(1, threads)))
                except psutil.Error:
                    pass
        self._clock = clock
        self._last: tuple[float, list[tuple[float, float]], dict[str, float | None]] | None = None

    @property
    def started(self) -> bool:
        return self._last is not None

    def start(self) -> CpuMeter:
        self._last = self._read()
        return self

    def lap(self) -> dict[str, float | dict[int, float] | None]:
        """CPU use since start() or the previous lap(); the next window starts here."""
        if self._last is None:
            raise RuntimeError("CpuMeter: lap() or stop() before start()")
        now = self._read()
        (t0, cores0, procs0), (t1, cores1, procs1) = self._last, now
        self._last = now
        wall = t1 - t0
        out: dict[str, float | dict[int, float] | None] = {
            "wall_s": wall,
            "cpu_busy_s": None,
            "cpu_total_s": None,
            "cpu_utilization": None,
        }
        per_core: dict[int, float] = {}
        if len(cores0) == len(cores1):  # a CPU hot-plug shifts the indices: no comparable baseline
            busy = total = 0.0
            for k, ((b0, n0), (b1, n1)) in enumerate(zip(cores0, cores1, strict=True)):
                if self.cores is not None and k not in self.cores:
                    continue
                busy, total = busy + b1 - b0, total + n1 - n0
                share = busy_share(b1 - b0, n1 - n0)
                if share is not None:  # no tick elapsed on this core: no information, not 0 %
                    per_core[k] = share
            out.update(cpu_busy_s=busy, cpu_total_s=total, cpu_utilization=busy_share(busy, total))
        out["core_utilization"] = per_core
        for name, group in self.groups.items():
            before, after = procs0[name], procs1[name]
            cpu_s = after - before if before is not None and after is not None and group else None
            threads = sum(n for _, n in group)
            out[f"{name}_cpu_s"] = cpu_s
            out[f"{name}_cpu_utilization"] = cpu_s / (wall * threads) if cpu_s is not None and wall > 0 else None
        return out

    def stop(self) -> dict[str, float | dict[int, float] | None]:
        """CPU use since start() (or the last lap()); the meter can be started again."""
        out = self.lap()
        self._last = None
        return out

    def _read(self) -> tuple[float, list[tuple[float, float]], dict[str, float | None]]:
        t = self._clock()
        cores = [core_seconds(c) for c in psutil.cpu_times(percpu=True)]
        procs = {name: _cpu_seconds(p for p, _ in group) for name, group in self.groups.items()}
        return t, cores, procs


def _cpu_seconds(procs: Iterable[psutil.Process]) -> float | None:
    """Summed user + system seconds of the processes; None if one cannot be read (gone, not ours)."""
    total = 0.0
    for p in procs:
        try:
            times = p.cpu_times()
        except psutil.Error:
            return None
        total += times.user + times.system
    return total


class LoadWatch:
    """Around a piece of work (a probe, `metrics.trust`): the CPU time the rest of the machine used, in cores
    (`other_cores`), and the share of the cores' time the hypervisor stole (`steal_share`)."""

    def __init__(self) -> None:
        self._me = psutil.Process(os.getpid())

    def __enter__(self) -> LoadWatch:
        self.t0 = time.monotonic()
        self.cpu0 = psutil.cpu_times()
        self.mine0 = self._own()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.seconds = max(time.monotonic() - self.t0, 1e-9)
        cpu1 = psutil.cpu_times()
        busy = _busy(cpu1) - _busy(self.cpu0)
        self.other_cores = max(0.0, busy - (self._own() - self.mine0)) / self.seconds
        total = sum(cpu1) - sum(self.cpu0)
        self.steal_share = max(0.0, getattr(cpu1, "steal", 0.0) - getattr(self.cpu0, "steal", 0.0)) / max(total, 1e-9)

    def _own(self) -> float:
        """CPU seconds of this process and its children (a probe's ceiling runs pinned child processes)."""
        t = self._me.cpu_times()
        own = t.user + t.system + t.children_user + t.children_system
        for child in self._me.children(recursive=True):
            try:
                c = child.cpu_times()
                own += c.user + c.system
            except psutil.Error:
                continue
        return own


def _busy(t: Any) -> float:
    """Busy CPU seconds of a `psutil.cpu_times()` (steal and guest time are not this guest's work)."""
    idle = t.idle + getattr(t, "iowait", 0.0)
    return sum(t) - idle - getattr(t, "steal", 0.0) - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)

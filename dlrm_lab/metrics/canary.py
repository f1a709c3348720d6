"""A speed canary: a small fixed workload (a GEMM and a table gather, under a millisecond on one core) timed at
a fixed cadence beside a run, so that a figure measured while the host ran slow, or shared, says so.

Shared cloud hosts move under a run (the same training command at 20-40k samples/s within 15 minutes on one guest):
the canary is the instrument that measures the host beside the run, not an apology after it. A reading holds:
- its burst: the GEMM's FLOP/s and the gather's bytes/s over the same work measured quiet by `machine probe` (the
  profile's `canary` term, per thread count; without it, the run's own fastest reading, and the summary says so in
  `canary_basis`), the slower of the two being the reading's ratio: how fast this core runs now;
- the machine's foreign load since the last reading: the share of its CPU time that went to processes outside the
  run's session, and to the host (steal), from /proc/stat and each process's own times. A burst cannot see a hog on
  its cores (the scheduler runs a task that just woke first, for longer than the burst), but the run's queries and
  steps wait their turns beside it: that is what this share says.

Where it runs: between training steps (`train.loop`, outside the timed step) and in a serving instance's idle
moments, or between its batches where it has none (`infer.instance`). Its cost is its time over the run's
(`canary_share`): about 1 ms every 2 s a process, and the foreign load's read of /proc.

Hand-written: no library times a host's drift beside a workload.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Mapping, Sequence
from typing import Any

from dlrm_lab.config.values import JsonObject

CANARY_EVERY_S = 2.0  # the cadence: a reading at most this often (DLRM_LAB_CANARY_S: another; 0: off)
CANARY_ENV = "DLRM_LAB_CANARY_S"
SLOW_PHASE = 0.8  # a run whose canary's median is below this fraction of quiet was measured in a slow phase
GEMM_N = 256  # fp32 n x n x n: 33.5 MFLOP, ~0.2-0.35 ms on one core of these machines
# 4 x 8,192 64-byte rows from a 256 KiB table: in the core's own cache, so that the gather measures the core as the
# GEMM does (a table beyond the caches read 2x slower after a training step than back to back, host or no host)
GATHER_ROWS, TABLE_ROWS, ROW_FLOATS, GATHERS = 8_192, 4_096, 16, 4
QUIET_READINGS = 15  # the probe's quiet baseline: the median of this many readings, back to back


class CanaryWorkload:
    """The fixed work, its tensors made once (seeded: the same everywhere)."""

    def __init__(self) -> None:
        import torch  # here: the module's rules and readers are read where torch is not loaded (`metrics.roofline`)

        rng = torch.Generator().manual_seed(0)
        self.a = torch.rand(GEMM_N, GEMM_N, generator=rng)
        self.b = torch.rand(GEMM_N, GEMM_N, generator=rng)
        self.c = torch.empty(GEMM_N, GEMM_N)
        self.table = torch.rand(TABLE_ROWS, ROW_FLOATS, generator=rng)
        self.ids = torch.randint(0, TABLE_ROWS, (GATHER_ROWS,), generator=rng)
        self.rows = torch.empty(GATHER_ROWS, ROW_FLOATS)

    def time(self) -> tuple[float, float, float]:
        """One reading: (GEMM FLOP/s, gather bytes/s, its ms in all), the rates of the work's second run back to back:
        the first, after other work (a training step, a batch) or idle, pays for caches and sleeping threads, which
        the quiet baseline, back to back, does not."""
        first, second = self._once(), self._once()
        return second[0], second[1], first[2] + second[2]  # its cost: both runs

    def _once(self) -> tuple[float, float, float]:
        import torch

        with torch.inference_mode():
            t0 = time.perf_counter()
            torch.mm(self.a, self.b, out=self.c)
            t1 = time.perf_counter()
            for _ in range(GATHERS):
                torch.index_select(self.table, 0, self.ids, out=self.rows)
            t2 = time.perf_counter()
        flops, moved = 2 * GEMM_N**3, GATHERS * GATHER_ROWS * ROW_FLOATS * 4
        return flops / max(t1 - t0, 1e-9), moved / max(t2 - t1, 1e-9), (t2 - t0) * 1e3


def quiet_canary(repeats: int = QUIET_READINGS) -> JsonObject:
    """The canary measured quiet (`machine probe`, per thread count): its medians, the baseline of every run's
    readings on this machine."""
    work = CanaryWorkload()
    work.time()  # first call: kernel selection, pages faulted in
    readings = [work.time() for _ in range(repeats)]
    return {
        "gemm_flops_per_s": statistics.median(r[0] for r in readings),
        "gather_bytes_per_s": statistics.median(r[1] for r in readings),
        "ms": statistics.median(r[2] for r in readings),
    }


def canary_every_s() -> float:
    """The cadence: CANARY_EVERY_S, or the environment's DLRM_LAB_CANARY_S (0: no canary)."""
    from dlrm_lab.config.values import env_seconds

    return env_seconds(CANARY_ENV, CANARY_EVERY_S, maximum=3600.0)


def quiet_of(profile: Mapping[str, Any] | None, threads: int) -> JsonObject | None:
    """The profile's quiet canary at this many threads (None: probed before the canary existed)."""
    if not profile:
        return None
    by_threads = ((profile.get("devices") or {}).get("cpu") or {}).get("threads") or {}
    entry = by_threads.get(str(threads)) or {}
    quiet = entry.get("canary")
    return quiet if isinstance(quiet, dict) else None


def cpu_ticks() -> tuple[int, int, int] | None:
    """The machine's CPU time since boot, in clock ticks: (busy, stolen by the host, all), from /proc/stat's first
    line (None: not Linux)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    user, nice, system, idle, iowait, irq, softirq, steal = fields + [0] * (8 - len(fields))
    return user + nice + system + irq + softirq, steal, sum(fields)


RUN_ROOT_ENV = "DLRM_LAB_RUN_ROOT"  # the pid of the command that started the run, inherited by all it starts


def mark_run_root() -> None:
    """Make this process the root of the run's processes (the command line does, once): every process it starts,
    however launched (mpirun's daemons start sessions of their own), inherits the mark."""
    os.environ.setdefault(RUN_ROOT_ENV, str(os.getpid()))


def run_ticks() -> dict[int, int]:
    """CPU ticks used by each of the run's own processes (`run_processes`), by pid: what the machine's busy time
    holds that is the run's own. By process, so that one that ends between two readings takes away only its own
    time since the first (`foreign_load`), not its whole lifetime's."""
    procs: dict[int, tuple[int, int, int]] = {}  # pid -> (parent, session, ticks)
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rpartition(")")[2].split()  # after the command's name, which may hold spaces
        except OSError:
            continue  # ended meanwhile
        # from the state on: state (0) ppid (1) pgrp (2) session (3) ... utime (11) stime (12)
        procs[int(pid)] = (int(fields[1]), int(fields[3]), int(fields[11]) + int(fields[12]))
    roots = {os.getpid()} | ({int(root)} if (root := os.environ.get(RUN_ROOT_ENV)) else set())
    mine = run_processes({pid: (parent, session) for pid, (parent, session, _) in procs.items()}, os.getsid(0), roots)
    return {pid: procs[pid][2] for pid in mine}


def run_processes(procs: dict[int, tuple[int, int]], session: int, roots: set[int]) -> set[int]:
    """The run's processes among `procs` (pid -> (parent, session)): those of its session, and those descended
    from one of `roots` (the run's root, this process). Descent from a mere member of the session is not enough:
    in a container the session often holds PID 1, the parent of every orphan on the machine, another user's
    daemonised processes among them."""
    roots = roots - {0}  # the kernel's: every process descends from it
    below: dict[int, bool] = {}  # pid -> descended from a root

    def descended(pid: int) -> bool:
        chain = []
        while pid in procs and pid not in below and pid not in roots:
            chain.append(pid)
            pid = procs[pid][0]
        found = pid in roots or below.get(pid, False)
        for p in chain:
            below[p] = found
        return found

    return {pid for pid, (_, sid) in procs.items() if sid == session or descended(pid)}


LoadState = tuple[tuple[int, int, int], dict[int, int]]  # the machine's CPU ticks and the run's, at one moment


def foreign_load(before: LoadState | None) -> tuple[float | None, LoadState | None]:
    """(the share of the machine's CPU that went to other sessions and to the host since `before`, the state now)."""
    ticks = cpu_ticks()
    if ticks is None:
        return None, None
    now = (ticks, run_ticks())
    if before is None:
        return None, now
    (busy0, steal0, all0), own0 = before
    (busy1, steal1, all1), own1 = now
    if all1 <= all0:
        return None, before  # under a tick since: measured over a longer span at the next reading
    # a process that started since (a pid reused too) counts from zero; one that ended since shows its last moments
    # (under a reading's interval) as foreign
    own = sum(ticks - own0[pid] if ticks >= own0.get(pid, ticks + 1) else ticks for pid, ticks in own1.items())
    foreign = max(0, (busy1 - busy0) - own) + (steal1 - steal0)
    return min(1.0, foreign / (all1 - all0)), now


class Canary:
    """Readings of the canary at most every `every_s`, against `quiet` (`quiet_of`; None: the run's fastest)."""

    def __init__(self, quiet: JsonObject | None, source: str, every_s: float | None = None) -> None:
        every_s = canary_every_s() if every_s is None else every_s
        self.quiet, self.source, self.every_s = quiet, source, every_s
        self.work = CanaryWorkload() if every_s > 0 else None
        self.next_at = 0.0  # monotonic: the first reading at the first chance
        self.readings: list[JsonObject] = []
        self.load: LoadState | None = foreign_load(None)[1]

    def due(self) -> bool:
        return self.work is not None and time.monotonic() >= self.next_at

    def overdue(self) -> bool:
        """Due for a whole cadence more: a busy process reads it now rather than wait for an idle moment."""
        return self.work is not None and time.monotonic() >= self.next_at + self.every_s

    def read(self) -> JsonObject:
        """Take one reading now (also where it is not yet due) and keep it."""
        assert self.work is not None
        if not self.readings:
            self.work.time()  # its first call selects kernels and faults pages: neither a reading nor its cost
        gemm, gather, ms = self.work.time()
        self.next_at = time.monotonic() + self.every_s
        foreign, self.load = foreign_load(self.load)
        reading: JsonObject = {
            "time_unix_s": time.time(),
            "source": self.source,
            "canary_gemm_flops_per_s": gemm,
            "canary_gather_bytes_per_s": gather,
            "canary_ms": ms,
            "canary_foreign": foreign,
        }
        self.readings.append(reading)
        return reading

    def maybe_read(self) -> JsonObject | None:
        return self.read() if self.due() else None


def as_telemetry(reading: Mapping[str, Any]) -> list[JsonObject]:
    """A reading as telemetry rows (`metrics.energy`'s long form: channel `canary`), beside the power and the CPU."""
    return [
        {
            "time_unix_s": reading["time_unix_s"],
            "source": reading["source"],
            "channel": "canary",
            "quantity": quantity,
            "value": float(reading[key]),
        }
        for quantity, key in (
            ("gemm_flops_per_s", "canary_gemm_flops_per_s"),
            ("gather_bytes_per_s", "canary_gather_bytes_per_s"),
            ("ms", "canary_ms"),
            ("foreign", "canary_foreign"),
        )
        if reading.get(key) is not None
    ]


def ratios(readings: Sequence[Mapping[str, Any]], quiet: Mapping[str, Any] | None) -> tuple[list[float], str]:
    """Each reading's ratio (the slower of its GEMM and its gather, against quiet or, where the profile has no quiet
    canary, against its source's fastest reading in the run), and the basis said."""
    best: dict[str, tuple[float, float]] = {}
    for r in readings:
        old = best.get(r["source"], (0.0, 0.0))
        best[r["source"]] = (
            max(old[0], float(r["canary_gemm_flops_per_s"])),
            max(old[1], float(r["canary_gather_bytes_per_s"])),
        )
    out = []
    for r in readings:
        gemm, gather = (
            (float(quiet["gemm_flops_per_s"]), float(quiet["gather_bytes_per_s"])) if quiet else best[r["source"]]
        )
        out.append(min(float(r["canary_gemm_flops_per_s"]) / gemm, float(r["canary_gather_bytes_per_s"]) / gather))
    if quiet:
        return out, "the machine profile's quiet canary"
    return out, "the run's fastest reading (the machine profile has no quiet canary: run dlrm-lab machine probe)"


def change_point(values: Sequence[float]) -> tuple[int, float, float] | None:
    """Where a series fell for good: the split (at least two readings each side) whose later side's median is under
    SLOW_PHASE of the earlier side's and that puts at least 80% of the readings on the right side of that cut, the
    best such split, as (its index, the median before, the median after); None where it did not fall. A change
    point, so that one slow reading among fast ones is not a phase."""
    n, best = len(values), None
    for k in range(2, n - 1):
        before, after = values[:k], values[k:]
        level = statistics.median(before)
        cut = SLOW_PHASE * level
        if statistics.median(after) >= cut:
            continue
        score = sum(v >= cut for v in before) + sum(v < cut for v in after)
        if score >= 0.8 * n and (best is None or score > best[0]):
            best = (score, k, level, statistics.median(after))
    return None if best is None else best[1:]


def slow_phase_line(values: Sequence[float], times_s: Sequence[float]) -> str | None:
    """One line where the canary's ratio says the run met a slow phase, from some time on (`change_point`) or all
    along (its median under SLOW_PHASE of quiet); None where the host held its speed."""
    if not values:
        return None
    if (fell := change_point(values)) is not None:
        k, before, after = fell
        return (
            f"this machine slowed to {after:.2f} of its profiled speed (canary) from {times_s[k]:.1f} s into the run "
            f"(it ran at {before:.2f} before): figures after that are of a slower phase"
        )
    median = statistics.median(values)
    if median < SLOW_PHASE:
        return (
            f"measured while this machine ran at {median:.2f} of its profiled speed (canary); figures are of that phase"
        )
    return None


def shared_phase_line(foreign: Sequence[float], times_s: Sequence[float]) -> str | None:
    """One line where other processes or the host took a share of the machine's CPU beside the run: from some time
    on (the run's free share fell, `change_point`) or all along (over 1 - SLOW_PHASE of it); None otherwise."""
    if not foreign:
        return None
    if (fell := change_point([1.0 - f for f in foreign])) is not None:
        k, before, after = fell
        return (
            f"other processes took {1.0 - after:.2f} of this machine's CPU from {times_s[k]:.1f} s into the run "
            f"({1.0 - before:.2f} before; canary): figures after that shared the machine"
        )
    median = statistics.median(foreign)
    if median > 1.0 - SLOW_PHASE:
        return f"other processes took {median:.2f} of this machine's CPU during the run (canary): figures shared it"
    return None


def canary_columns(
    readings: Sequence[Mapping[str, Any]], quiet: Mapping[str, Any] | None, elapsed_s: float
) -> dict[str, Any]:
    """A summary's canary columns (`metrics.columns.groups.CANARY`) from a run's or a point's readings over
    `elapsed_s` (their cost: their time over it). Its line (`canary_phase`) joins what each source (a rank, an
    instance) said of its speed, naming the source where there are several, and what the machine's foreign load
    said (the same machine for every source: read from all their readings)."""
    if not readings:
        return dict.fromkeys(CANARY_NAMES)
    readings = sorted(readings, key=lambda r: float(r["time_unix_s"]))
    values, basis = ratios(readings, quiet)
    spent_s = sum(float(r["canary_ms"]) for r in readings) / 1e3
    q = statistics.quantiles(values, n=10) if len(values) > 1 else [values[0]] * 9
    first = float(readings[0]["time_unix_s"])
    sources = sorted({str(r["source"]) for r in readings})
    said: dict[str, str] = {}
    for source in sources:
        mine = [
            (float(r["time_unix_s"]) - first, v) for r, v in zip(readings, values, strict=True) if r["source"] == source
        ]
        line = slow_phase_line([v for _, v in mine], [t for t, _ in mine])
        if line is not None:
            said[source] = line
    # the machine slowed where every source saw it; one source alone saw its own core shared (the run's own work
    # there, or a neighbour on that core), and is said as such
    lines = [line if len(sources) == 1 else f"{source}: {line}" for source, line in said.items()]
    if 1 < len(sources) and len(said) < len(sources):
        lines = [
            f"{source} alone (not {', '.join(s for s in sources if s not in said)}): its core, not the machine: "
            + line.replace("this machine", "its core")
            for source, line in said.items()
        ]
    loads = [
        (float(r["time_unix_s"]) - first, float(r["canary_foreign"]))
        for r in readings
        if r.get("canary_foreign") is not None
    ]
    if (shared := shared_phase_line([f for _, f in loads], [t for t, _ in loads])) is not None:
        lines.append(shared)
    return {
        "canary_readings": len(values),
        "canary_ratio": statistics.median(values),
        "canary_ratio_p10": q[0],
        "canary_ratio_p90": q[-1],
        "canary_foreign": statistics.median(f for _, f in loads) if loads else None,
        "canary_ms": statistics.median(float(r["canary_ms"]) for r in readings),
        "canary_share": spent_s / elapsed_s if elapsed_s > 0 else None,
        "canary_basis": basis,
        "canary_phase": "; ".join(lines) or None,
    }


CANARY_NAMES = (
    "canary_readings",
    "canary_ratio",
    "canary_ratio_p10",
    "canary_ratio_p90",
    "canary_foreign",
    "canary_ms",
    "canary_share",
    "canary_basis",
    "canary_phase",
)


def canary_now(profile: JsonObject | None) -> float | None:
    """One speed-canary reading now against the profile's quiet canary (None without it): what a stored choice is
    checked against (`metrics.measured.cached_choice`)."""
    import torch

    quiet = quiet_of(profile, torch.get_num_threads())
    if quiet is None:
        return None
    return ratios([Canary(quiet, "choice", every_s=1.0).read()], quiet)[0][0]


def measured_slower(profile: JsonObject, entry: JsonObject) -> str | None:
    """Why a stored choice is not kept blindly: the machine ran at a different speed when it was measured than it
    does now (their canaries `apart`, or the stored one in a slow phase); None to keep it."""
    then = entry.get("canary_ratio")
    if not isinstance(then, float):
        return None  # measured before choices carried a canary: kept as it was
    now = canary_now(profile)
    if now is None:
        return None
    if then < SLOW_PHASE or apart(now, then):
        return f"measured while the machine ran at {then:.2f} of its quiet speed (canary), now {now:.2f}"
    return None


# Two canary readings further apart than this fraction of the higher were taken at different speeds of the host: a
# pair of runs (`compare`, `scale`) is left out, a stored choice measured again. A quiet host's runs differ by up to
# ~15%: at 10%, 1-3 pairs of 5 were left out of a self-comparison (`benchmarks/drift.py`).
CANARY_APART = 0.2


def apart(a: Any, b: Any) -> bool:
    """Whether two canary ratios (either may be missing: then not) were read at different speeds (CANARY_APART)."""
    return isinstance(a, float) and isinstance(b, float) and abs(a - b) > CANARY_APART * max(a, b)

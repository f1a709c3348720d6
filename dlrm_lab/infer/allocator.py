"""The C allocator an instance process runs (`--allocator`): glibc's malloc, or jemalloc or tcmalloc loaded first
(LD_PRELOAD) where the machine has them installed.

A served batch allocates as it runs: the activations (an AOTInductor package's buffers, eager's outputs) and
oneDNN's per-call descriptors. glibc's malloc was 30% of a 1-sample kaggle batch's samples on the AMX class
(`perf`, BENCHMARKS.md), and the same packages served under jemalloc or tcmalloc cost about 0.76x a batch there.
Which allocator is fastest differs by machine and by version, so `auto` measures: a trial process per installed
allocator times the model's dense layers at one row and at the max batch (its own layers, its precision and
threads), the allocators interleaved in rounds; glibc's is served unless another is faster by the builds' `MARGIN`
(`infer.builds.simplest_fast`). The figures are kept in the machine profile (`allocator_rates`), so a machine pays
the trial once per model shape.

An allocator can be chosen only as a process starts: instances are spawned with it first in LD_PRELOAD
(`preloaded`), and each reads its own mappings at start (`in_use`) and refuses to serve another one than its plan
names. Hand-written: no library chooses a process's allocator by measurement.
"""

from __future__ import annotations

import contextlib
import hashlib
import multiprocessing as mp
import os
import platform
import statistics
import sysconfig
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dlrm_lab.config.values import JsonObject, Log
from dlrm_lab.errors import FieldError, exit_description
from dlrm_lab.infer.builds import MARGIN, simplest_fast

AUTO, GLIBC = "auto", "glibc"
# Each allocator other than glibc's, by the names its library is installed under (Debian: libjemalloc2,
# libtcmalloc-minimal4 or libgoogle-perftools4), the first found served
LIBRARIES: dict[str, tuple[str, ...]] = {
    "jemalloc": ("libjemalloc.so.2", "libjemalloc.so.1", "libjemalloc.so"),
    "tcmalloc": ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4", "libtcmalloc_minimal.so", "libtcmalloc.so"),
}
ALLOCATORS = (AUTO, GLIBC, *LIBRARIES)
ORDER = (GLIBC, *LIBRARIES)  # simplest first: glibc's is kept unless another is MARGIN faster
# colon-separated directories searched instead of the system's (an allocator built by hand; tests: none found)
DIRS_ENV = "DLRM_LAB_ALLOCATOR_DIRS"
ROUNDS = 2  # trial processes per allocator, interleaved
REPEATS = 30  # timed calls per batch size in a trial process, after 5 untimed
_ENV_LOCK = threading.Lock()  # one process spawned at a time with its own LD_PRELOAD


def library_dirs() -> list[Path]:
    """Where allocator libraries are looked for: `DIRS_ENV`'s directories where it is set, else the system's."""
    if (given := os.environ.get(DIRS_ENV)) is not None:
        return [Path(d) for d in given.split(":") if d]
    arch = sysconfig.get_config_var("MULTIARCH") or f"{platform.machine()}-linux-gnu"
    return [Path(p) for p in (f"/usr/lib/{arch}", f"/lib/{arch}", "/usr/lib64", "/usr/local/lib", "/usr/lib")]


def installed(dirs: Sequence[Path] | None = None) -> dict[str, str]:
    """The allocators this machine has: name -> the library to preload ("" for glibc's, always there)."""
    found = {GLIBC: ""}
    for name, files in LIBRARIES.items():
        for directory in dirs if dirs is not None else library_dirs():
            hit = next((directory / f for f in files if (directory / f).is_file()), None)
            if hit is not None:
                found[name] = str(hit)
                break
    return found


def _stem(path: str) -> str:
    """A library's name without its directory and its `.so` version: libjemalloc.so.2 -> libjemalloc."""
    return Path(path).name.split(".so")[0]


STEMS = {_stem(f): name for name, files in LIBRARIES.items() for f in files}  # library stem -> allocator


def in_use(maps: str | None = None) -> str:
    """The allocator this process runs, from its mappings (`maps`: /proc/self/maps's text): a preloaded allocator's
    library is mapped; glibc's otherwise."""
    if maps is None:
        try:
            maps = Path("/proc/self/maps").read_text()
        except OSError:
            return GLIBC
    mapped = {_stem(line.split()[-1]) for line in maps.splitlines() if "/" in line}
    return next((name for stem, name in STEMS.items() if stem in mapped), GLIBC)


def check_running(planned: str, maps: str | None = None) -> None:
    """Refuse to serve under another C allocator than the plan's: one that LD_PRELOAD did not load (a library gone
    since the plan, an environment that strips it) would serve another figure than was chosen."""
    if (running := in_use(maps)) != planned:
        raise RuntimeError(
            f"runs {running}'s malloc where its plan says {planned} (LD_PRELOAD={os.environ.get('LD_PRELOAD', '')!r})"
        )


def _without_allocators(preload: str) -> list[str]:
    """LD_PRELOAD's entries (colon or space separated), less any allocator's library: the one chosen goes first."""
    return [e for e in preload.replace(" ", ":").split(":") if e and _stem(e) not in STEMS]


@contextlib.contextmanager
def preloaded(library: str) -> Iterator[None]:
    """Within: LD_PRELOAD names `library` first ("" : no allocator's library at all, glibc's malloc), for the
    processes started then (a spawned process takes the environment at its start); put back after."""
    with _ENV_LOCK:
        before = os.environ.get("LD_PRELOAD")
        entries = ([library] if library else []) + _without_allocators(before or "")
        if entries:
            os.environ["LD_PRELOAD"] = ":".join(entries)
        else:
            os.environ.pop("LD_PRELOAD", None)
        try:
            yield
        finally:
            if before is None:
                os.environ.pop("LD_PRELOAD", None)
            else:
                os.environ["LD_PRELOAD"] = before


def library_of(allocator: str, found: Mapping[str, str] | None = None) -> str:
    """The library to preload for `allocator` (not auto); a FieldError naming what is installed where it is not."""
    if allocator not in ORDER:
        raise FieldError("allocator", f"{allocator!r}: allowed: {', '.join(ALLOCATORS)}")
    found = installed() if found is None else found
    if allocator not in found:
        looked = ", ".join(LIBRARIES[allocator])
        dirs = ", ".join(str(d) for d in library_dirs()) or f"no directory ({DIRS_ENV} is empty)"
        raise FieldError(
            "allocator",
            f"{allocator!r}: not installed on this machine (looked for {looked} in {dirs}; set {DIRS_ENV} to "
            f"its directory); installed: {', '.join(found)}",
        )
    return found[allocator]


@dataclass(frozen=True)
class AllocatorChoice:
    """What a model's instances run, what was asked, and the trial's figures behind it (auto)."""

    requested: str
    allocator: str
    library: str  # what LD_PRELOAD names first ("" for glibc's)
    reason: str
    batch_ms: dict[str, dict[int, float]] = field(default_factory=dict)  # allocator -> rows -> median ms
    source: str = ""

    def to_dict(self) -> JsonObject:
        return {
            "requested": self.requested,
            "allocator": self.allocator,
            "library": self.library,
            "reason": self.reason,
            "batch_ms": {a: {str(n): v for n, v in per.items()} for a, per in self.batch_ms.items()},
            "source": self.source,
        }


Layers = Sequence[tuple[int, int]]  # (in, out) features of each dense layer, in order
Trial = Callable[[Mapping[str, str], Layers, str, int, Sequence[int]], dict[str, dict[int, float]]]


def choose(
    requested: str,
    layers: Layers,
    dtype: str,
    threads: int,
    rows: Sequence[int],
    *,
    only_glibc: str | None = None,
    found: Mapping[str, str] | None = None,
    trial: Trial | None = None,
    log: Log | None = None,
) -> AllocatorChoice:
    """The allocator a model's instances run. `requested` by name: checked to be installed. auto: glibc's where it
    is the only one installed (or `only_glibc` says why it must be), else the trial's choice (`rows` batch sizes
    of `layers` in `dtype` at `threads`, their ms summed), cached in this machine's profile."""
    found = installed() if found is None else found
    if requested != AUTO:
        return AllocatorChoice(requested, requested, library_of(requested, found), f"--allocator {requested}")
    if only_glibc:
        return AllocatorChoice(requested, GLIBC, "", f"auto: glibc's malloc: {only_glibc}")
    if len(found) == 1:
        looked = "; ".join(f"{n}: {', '.join(f)}" for n, f in LIBRARIES.items())
        reason = f"auto: glibc's malloc, the only one installed (looked for {looked})"
        return AllocatorChoice(requested, GLIBC, "", reason)
    try:
        ms, source = _rates(found, layers, dtype, threads, rows, trial or run_trials, log)
    except RuntimeError as exc:  # a trial process that failed: served on glibc's, saying why
        return AllocatorChoice(requested, GLIBC, "", f"auto: glibc's malloc: {exc}")
    total = {a: sum(per.values()) for a, per in ms.items()}
    best = simplest_fast(total, ORDER)
    said = ", ".join(f"{a} {total[a]:.3f}" for a in ORDER if a in total)
    verdict = "" if best != GLIBC else f" (none {MARGIN:g}x faster)"
    reason = f"auto: {best}{verdict}: {'+'.join(str(n) for n in rows)} rows of the dense layers took ms {said}"
    return AllocatorChoice(requested, best, found[best], reason, ms, source)


def _key(found: Mapping[str, str], layers: Layers, dtype: str, threads: int, rows: Sequence[int]) -> str:
    shapes = hashlib.sha1(repr((list(layers), list(rows))).encode()).hexdigest()[:12]
    libraries = "+".join(f"{a}={Path(p).name}" for a, p in sorted(found.items()) if p)
    return f"cpu/{threads}t/{dtype}/{shapes}/{libraries}"


def _rates(
    found: Mapping[str, str],
    layers: Layers,
    dtype: str,
    threads: int,
    rows: Sequence[int],
    trial: Trial,
    log: Log | None,
) -> tuple[dict[str, dict[int, float]], str]:
    from dlrm_lab.metrics.measured import batch_times, measured_choice, stored_batch_times
    from dlrm_lab.metrics.roofline import load_profile

    def measure() -> dict[str, dict[int, float]]:
        if log:
            log(f"timing the allocators {', '.join(found)} in trial processes (once per machine and model shape)")
        return trial(found, layers, dtype, threads, rows)

    return measured_choice(
        load_profile(),
        "allocator_rates",
        _key(found, layers, dtype, threads, rows),
        read=batch_times(list(found)),
        measure=measure,
        entry=lambda ms, _: {"batch_ms": stored_batch_times(ms)},
        log=log,
    )


def run_trials(
    found: Mapping[str, str], layers: Layers, dtype: str, threads: int, rows: Sequence[int], rounds: int = ROUNDS
) -> dict[str, dict[int, float]]:
    """Each allocator's median ms per batch size over `rounds` trial processes, the allocators interleaved."""
    ctx = mp.get_context("spawn")
    got: dict[str, list[dict[int, float]]] = {a: [] for a in found}
    for _ in range(rounds):
        for name, library in found.items():
            mine, theirs = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_trial_main, args=(list(layers), dtype, threads, list(rows), theirs), daemon=True)
            with preloaded(library):
                proc.start()
            theirs.close()
            running: str | None
            result: Any
            try:
                running, result = mine.recv() if mine.poll(120) else (None, "no answer in 120 s")
            except EOFError:
                proc.join(10)
                running, result = None, f"its process {exit_description(proc.exitcode)}"
            proc.join(10)
            if running != name:
                raise RuntimeError(f"allocator trial under {name} ({library or 'no preload'}): {running!r}, {result}")
            got[name].append(result)
    return {a: {n: statistics.median(r[n] for r in runs) for n in rows} for a, runs in got.items()}


def _trial_main(layers: list[tuple[int, int]], dtype: str, threads: int, rows: list[int], conn: Any) -> None:
    """A trial process: the dense layers (Linear + ReLU) called at each batch size in turn, median ms each."""
    try:
        import torch

        from dlrm_lab.metrics.precision import DTYPES

        torch.set_num_threads(threads)
        kind = DTYPES[dtype]
        torch.manual_seed(0)
        weights = [(torch.randn(o, i, dtype=kind) / i**0.5, torch.zeros(o, dtype=kind)) for i, o in layers]
        # a layer whose input is not the layer before's output (the top MLP after the interaction) starts afresh
        starts = {k: torch.randn(max(rows), i, dtype=kind) for k, (i, _) in enumerate(layers)}

        def call(n: int) -> Any:
            x = starts[0][:n]
            for k, (w, b) in enumerate(weights):
                x = x if x.shape[1] == w.shape[1] else starts[k][:n]
                x = torch.relu(torch.nn.functional.linear(x, w, b))
            return x

        times: dict[int, list[float]] = {n: [] for n in rows}
        with torch.inference_mode():
            for i in range(5 + REPEATS):
                for n in rows:
                    start = time.perf_counter()
                    call(n)
                    if i >= 5:
                        times[n].append((time.perf_counter() - start) * 1e3)
        conn.send((in_use(), {n: statistics.median(t) for n, t in times.items()}))
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which names it
        conn.send((None, f"{type(exc).__name__}: {exc}"))
    finally:
        conn.close()

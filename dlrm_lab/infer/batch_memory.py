"""Whether an instance's C allocator keeps a batch's freed buffers for the next batch or gives them back
(`--batch-memory`).

glibc's malloc maps each block over its mmap threshold (32 MiB at most) on its own and unmaps it when freed, and
trims the free top of its heap: a large batch's activations come back every batch as fresh pages that the kernel
faults in and zeroes. DLRMv2's 4,096-sample batch has several such blocks (16% of its time, BENCHMARKS.md); a
kaggle batch of 256 samples has none. `keep` tells malloc to keep what it frees (no trim, no block mapped on its
own): the memory of the largest batch stays with the instance, which `infer.memory` counts already. `auto`: each
instance times its warm-up batch (the largest it serves) both ways, in turn, and keeps memory only where that
batch is faster by `MARGIN` (`choose`): measured where it is served, beside the other instances.

The allocator is told through `mallopt`, glibc's: where there is none, `keep` fails the instance's start with the
reason and `auto` gives memory back, saying why.
"""

from __future__ import annotations

import ctypes
import statistics
import time
from collections.abc import Callable
from typing import TypedDict

from dlrm_lab.infer.allocator import GLIBC
from dlrm_lab.infer.builds import MARGIN  # the builds' rule: keep memory only for a batch this much faster

BATCH_MEMORY = ("auto", "release", "keep")
ROUNDS = 3  # timed pairs (release, keep) after one untimed batch each way

# glibc's malloc.h. Any of them turns off glibc's own rule that raises the mmap threshold (to 32 MiB at most) and the
# trim threshold (to twice it) as large blocks are freed: given back after a trial, memory follows where that rule
# ends for a large batch
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
RULE_TRIM_THRESHOLD, DEFAULT_MMAP_MAX = 64 << 20, 65536
KEEP_TRIM_THRESHOLD = 1 << 30


class BatchMemoryChoice(TypedDict):
    """What an instance chose (`--batch-memory`), why, and its warm-up batch's median ms each way (auto)."""

    batch_memory: str  # release or keep
    reason: str
    samples: int | None  # the batch timed (auto)
    ms: dict[str, float]  # release / keep -> median ms of that batch


def _mallopt() -> Callable[[int, int], int] | None:
    return getattr(ctypes.CDLL(None), "mallopt", None)


def keep_batch_memory() -> None:
    """Tell this process's malloc to keep what it frees. RuntimeError where the C library has no mallopt (not
    glibc)."""
    mallopt = _mallopt()
    if mallopt is None or not (mallopt(M_TRIM_THRESHOLD, KEEP_TRIM_THRESHOLD) and mallopt(M_MMAP_MAX, 0)):
        raise RuntimeError("this C library's malloc takes no mallopt (not glibc): it cannot be told to keep memory")


def choose(
    requested: str,
    batch: Callable[[], object],
    samples: int,
    *,
    device: str = "cpu",
    held: bool = False,
    allocator: str = GLIBC,
) -> BatchMemoryChoice:
    """Apply `requested` (`BATCH_MEMORY`) in this process (`release`: glibc's defaults, untouched); for auto, time
    `batch` (one batch of `samples`) `ROUNDS` times as glibc gives memory back, then as it keeps it (each after
    an untimed batch: what the way maps, mapped), and keep memory only where its median is faster by `MARGIN`.
    Not interleaved: the defaults cannot be put back once changed. On a GPU a batch's buffers are the device's:
    nothing is asked of malloc. `held`: `--idle-hold keep-memory` keeps memory already, and nothing gives it back.
    Under another `allocator` than glibc's (`infer.allocator`), that allocator's own rules stand."""
    if device != "cpu":
        return BatchMemoryChoice(
            batch_memory="release", reason=f"on {device}: a batch's buffers are the device's", samples=None, ms={}
        )
    if allocator != GLIBC:  # mallopt would tell glibc's malloc, which this process does not run
        return BatchMemoryChoice(
            batch_memory="release", reason=f"{allocator}'s own (mallopt is glibc's)", samples=None, ms={}
        )
    if held:
        return BatchMemoryChoice(batch_memory="keep", reason="kept by --idle-hold keep-memory", samples=None, ms={})
    if requested == "keep":
        keep_batch_memory()
    if requested != "auto":
        return BatchMemoryChoice(batch_memory=requested, reason=f"--batch-memory {requested}", samples=None, ms={})
    mallopt = _mallopt()
    if mallopt is None:
        return BatchMemoryChoice(
            batch_memory="release", reason="auto: no mallopt here (not glibc): memory given back", samples=None, ms={}
        )
    times: dict[str, list[float]] = {"release": [], "keep": []}
    for kind in times:
        if kind == "keep":
            keep_batch_memory()
        batch()
        for _ in range(ROUNDS):
            start = time.perf_counter()
            batch()
            times[kind].append((time.perf_counter() - start) * 1e3)
    ms = {k: statistics.median(v) for k, v in times.items()}
    kept = ms["release"] >= MARGIN * ms["keep"]
    if not kept:
        mallopt(M_MMAP_MAX, DEFAULT_MMAP_MAX), mallopt(M_TRIM_THRESHOLD, RULE_TRIM_THRESHOLD)
    verdict = "kept" if kept else f"given back (kept is not {MARGIN:g}x faster)"
    return BatchMemoryChoice(
        batch_memory="keep" if kept else "release",
        reason=(
            f"auto: memory {verdict}: a {samples:,}-sample batch {ms['keep']:.2f} ms kept vs "
            f"{ms['release']:.2f} ms given back"
        ),
        samples=samples,
        ms=ms,
    )

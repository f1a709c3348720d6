"""The build an instance serves, decided again in the instance between the serving process's finalists.

`--build auto` times the builds in the serving process (`infer.build`), but an instance is another process, and
some builds' speed is drawn per process: the same `aoti_frozen` package of DLRMv2, at one thread and 4,096 samples,
ran at 187-233 ms in some processes and 258-323 in others, while `aoti` held 187-241 in every one (BENCHMARKS.md,
2026-11-29). A choice timed in one process and served in others then served the slow draw. So the serving process
hands its instances the choice and every runner-up within `SPREAD` of it, or faster than it at one of the sizes
timed, that reads the same table bytes (the package builds: each a file an instance loads beside the tables it
maps), and each instance times them in turn at the batch sizes it serves (`sizes_to_time`) and serves the fastest
by the builds' own rule (`infer.builds.MARGIN`): measured where it is served.

The packages take the same inputs, so an instance may serve each batch size by another: `max_autotune`'s
templates (`aoti_tuned`) cost least at a few samples and oneDNN's prepacked kernels (`aoti_frozen`) at hundreds
(kaggle bf16, AMX, one thread: 0.33 against 0.53 ms at one sample; BENCHMARKS.md, 2026-11-30). Where the fastest
differs by size the runner calls, for each batch, the package chosen at the smallest size timed that holds it
(`by_size`): still one native call a batch.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TypedDict

import torch

from dlrm_lab.infer.builds import MARGIN, builds, simplest_fast

SPREAD = 1.25  # a runner-up this close to the choice (its batch times summed) is timed again in each instance
ROUNDS = 3  # timed rounds (each finalist once, in turn) after one untimed batch each


class FinalChoice(TypedDict):
    """What an instance serves of its finalists, why, and each one's median ms at its largest batch."""

    build: str  # served at the largest batch (and at every size `by_size` does not name)
    reason: str
    samples: int | None  # the largest batch timed; None where there was nothing to choose
    ms: dict[str, float]  # at the largest batch
    by_size: dict[int, str]  # batch sizes timed -> the build served up to that size, where not `build`


def sizes_to_time(largest: int) -> list[int]:
    """The batch sizes an instance times its finalists at: the powers of two below its largest batch, and it."""
    return sorted({1 << k for k in range(max(1, largest).bit_length()) if 1 << k < largest} | {max(1, largest)})


def finalists_of(
    best: str,
    total: Mapping[str, float],
    artefact: Callable[[str], str | None],
    per_size: Mapping[str, Mapping[int, float]] | None = None,
) -> dict[str, str]:
    """The runners-up of `best` an instance can switch to, and their artefacts: builds within `SPREAD` of its summed
    batch time (`total`: the builds timed and kept), or faster than it by `MARGIN` at one size timed (`per_size`:
    build -> size -> ms), served from one file (`artefact(build)`, asked only of those close enough: it may make the
    build; None where there is no such file), where `best` is served from one too."""
    if best not in total:
        return {}
    per_size = per_size or {}
    mine = per_size.get(best, {})

    def faster_somewhere(b: str) -> bool:
        return any(n in mine and ms * MARGIN <= mine[n] for n, ms in per_size.get(b, {}).items())

    close = [b for b in total if b != best and (total[b] <= SPREAD * total[best] or faster_somewhere(b))]
    if not close or artefact(best) is None:
        return {}
    found = {b: artefact(b) for b in close}
    return {b: path for b, path in found.items() if path is not None}


def same_tables(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two package builds read the same table bytes (`a`, `b`: their tables as one tensor each,
    `infer.table_lookup.table_weights`): one tensor (a build made from another shares its base's), or equal ones
    (`aoti_int8` makes its own fused tables at fp32: the same bytes at the same table precision, whatever the
    dense part's precision)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return a.data_ptr() == b.data_ptr() or torch.equal(a, b)


def unchosen(served: str) -> FinalChoice:
    return FinalChoice(
        build=served, reason="no finalist: served as the serving process chose", samples=None, ms={}, by_size={}
    )


def choose(
    served: str,
    batches: Mapping[str, Callable[[int], object]],
    sizes: Sequence[int],
    clock: Callable[[], float] | None = None,
) -> FinalChoice:
    """Time `batches` (build -> one batch of n samples in that build; `served` among them) at each of `sizes`, the
    builds in turn at each size, `ROUNDS` times after one untimed batch each, and keep at each size the simplest
    unless a later build is faster by `MARGIN`, as `infer.build.choose_build` does in the serving process. The
    build served is the one kept at the largest size; `by_size` names the sizes where another was kept."""
    if len(batches) < 2:
        return unchosen(served)
    clock = clock or time.perf_counter
    sizes = sorted(set(sizes))
    for n in sizes:
        for batch in batches.values():
            batch(n)
    times: dict[int, dict[str, list[float]]] = {n: {b: [] for b in batches} for n in sizes}
    for _ in range(ROUNDS):
        for n in sizes:
            for b, batch in batches.items():
                start = clock()
                batch(n)
                times[n][b].append((clock() - start) * 1e3)
    ms = {n: {b: statistics.median(v) for b, v in at.items()} for n, at in times.items()}
    kept = {n: simplest_fast(at) for n, at in ms.items()}
    largest = sizes[-1]
    best = kept[largest]
    by_size = {n: b for n, b in kept.items() if b != best}
    said = ", ".join(f"{b} {ms[largest][b]:.2f} ms" for b in builds() if b in ms[largest])
    verdict = "as the serving process chose" if best == served else f"not {served}, which the serving process chose"
    reason = (
        f"{best} in this process, {verdict} (a {largest:,}-sample batch: {said}; a later build kept only "
        f"where {MARGIN:g}x faster)"
    )
    if by_size:
        reason += "; up to " + ", ".join(
            f"{n:,} samples {b} ({ms[n][b]:.3f} against {ms[n][best]:.3f} ms)" for n, b in sorted(by_size.items())
        )
    return FinalChoice(build=best, reason=reason, samples=largest, ms=ms[largest], by_size=by_size)

"""The build an instance serves, decided again in the instance between the serving process's finalists.

`--build auto` times the builds in the serving process (`infer.build`), but an instance is another process, and
some builds' speed is drawn per process: the same `aoti_frozen` package of DLRMv2, at one thread and 4,096 samples,
ran at 187-233 ms in some processes and 258-323 in others, while `aoti` held 187-241 in every one (BENCHMARKS.md,
2026-11-29). A choice timed in one process and served in others then served the slow draw. So the serving process
hands its instances the choice and every runner-up within `SPREAD` of it that serves from the same tables (the
package builds: each a file an instance loads beside the tables it maps), and each instance times them at its
largest batch, in turn, and serves the fastest by the builds' own rule (`infer.builds.MARGIN`): measured where it
is served.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from typing import TypedDict

from dlrm_lab.infer.builds import MARGIN, builds, simplest_fast

SPREAD = 1.25  # a runner-up this close to the choice (its batch times summed) is timed again in each instance
ROUNDS = 3  # timed rounds (each finalist once, in turn) after one untimed batch each


class FinalChoice(TypedDict):
    """What an instance serves of its finalists, why, and each one's median ms at its largest batch."""

    build: str
    reason: str
    samples: int | None  # the batch timed; None where there was nothing to choose
    ms: dict[str, float]


def finalists_of(best: str, total: Mapping[str, float], artefact: Callable[[str], str | None]) -> dict[str, str]:
    """The runners-up of `best` an instance can switch to, and their artefacts: builds within `SPREAD` of its summed
    batch time (`total`: the builds timed and kept) served from one file (`artefact(build)`, asked only of those
    close enough: it may make the build; None where there is no such file), where `best` is served from one too."""
    if best not in total:
        return {}
    close = [b for b in total if b != best and total[b] <= SPREAD * total[best]]
    if not close or artefact(best) is None:
        return {}
    found = {b: artefact(b) for b in close}
    return {b: path for b, path in found.items() if path is not None}


def unchosen(served: str) -> FinalChoice:
    return FinalChoice(build=served, reason="no finalist: served as the serving process chose", samples=None, ms={})


def choose(
    served: str, batches: Mapping[str, Callable[[], object]], samples: int, clock: Callable[[], float] | None = None
) -> FinalChoice:
    """Time `batches` (build -> one batch of `samples` in that build; `served` among them) in turn, `ROUNDS` times
    after one untimed batch each, and keep the simplest unless a later build is faster by `MARGIN`, as
    `infer.build.choose_build` does in the serving process."""
    if len(batches) < 2:
        return unchosen(served)
    clock = clock or time.perf_counter
    for batch in batches.values():
        batch()
    times: dict[str, list[float]] = {b: [] for b in batches}
    for _ in range(ROUNDS):
        for b, batch in batches.items():
            start = clock()
            batch()
            times[b].append((clock() - start) * 1e3)
    ms = {b: statistics.median(v) for b, v in times.items()}
    best = simplest_fast(ms)
    said = ", ".join(f"{b} {ms[b]:.2f} ms" for b in builds() if b in ms)
    verdict = "as the serving process chose" if best == served else f"not {served}, which the serving process chose"
    return FinalChoice(
        build=best,
        reason=f"{best} in this process, {verdict} (a {samples:,}-sample batch: {said}; a later build kept only "
        f"where {MARGIN:g}x faster)",
        samples=samples,
        ms=ms,
    )

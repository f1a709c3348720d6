"""A training choice decided on the run's own steps, with every rank running them.

Timing a choice apart from the run (one rank, one phase, before the others start) measures conditions the run does
not have: two ranks on two cores slow each other's table update, dense compute and all-to-all differently from one
rank alone, and the way that wins alone can lose under contention (issue 46: the batched table update won alone and
cost 2 ranks 8% of their scaling efficiency). A `StepTrial` runs a window of the run's real steps with the ways
interleaved (ABBA), every rank switching at the same step, and decides from every rank's medians: the choice is
measured with the ranks, threads, phases and collectives the run has. The steps are the run's own (both ways update
the model alike), so the trial costs only the slower way's extra time on half its window.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

from dlrm_lab.config.values import JsonObject

TRIAL_WARMUP_STEPS = 2  # steps after the run's first before a trial starts (allocations, caches, the first batch)
TRIAL_REPEATS = 4  # steps of each way in a trial's window


@dataclass
class StepTrial:
    """Ways of running a step (`ways[0]` the one to prove, `ways[1]` the one kept unless `ways[0]` is `margin`
    faster), put in place by `apply(way)`; `gather` hands every rank's medians to every rank (`all_gather_object`;
    one rank: itself). The window is steps `first_step` to `first_step + 2 * repeats - 1`."""

    name: str  # the choice's key in its record (`table_update`, `gram_dtype`)
    manifest_key: str  # its record's key in the manifest's config (`table_update_choice`)
    ways: tuple[str, str]
    apply: Callable[[str], None]
    first_step: int
    gather: Callable[[dict[str, float]], list[dict[str, float]]]
    conditions: JsonObject  # ranks, threads per rank, ... (the manifest's record of what the timing had)
    repeats: int = TRIAL_REPEATS
    margin: float = 1.10
    times: dict[str, list[float]] = field(default_factory=dict)

    @property
    def last_step(self) -> int:
        return self.first_step + 2 * self.repeats - 1

    def way_at(self, step: int) -> str | None:
        """The way step `step` runs (ABBA: A B B A A B B A ...), None outside the window."""
        k = step - self.first_step
        if not 0 <= k <= 2 * self.repeats - 1:
            return None
        return self.ways[(k + 1) // 2 % 2]

    def before(self, step: int) -> None:
        if (way := self.way_at(step)) is not None:
            self.apply(way)

    def after(self, step: int, step_ms: float) -> JsonObject | None:
        """Record the step's time; at the window's last step, decide (every rank alike, from the same gathered
        medians), put the choice in place and return its record; else None."""
        way = self.way_at(step)
        if way is None:
            return None
        self.times.setdefault(way, []).append(step_ms)
        if step != self.last_step:
            return None
        mine = {w: statistics.median(self.times[w]) for w in self.ways}
        ranks = self.gather(mine)
        # the ranks' steps wait on each other in their collectives: the median over ranks of each way's median
        ms = {w: statistics.median(r[w] for r in ranks) for w in self.ways}
        proved, kept = self.ways
        chosen = proved if ms[kept] >= self.margin * ms[proved] else kept
        self.apply(chosen)
        verdict = (
            f"{proved} is faster" if chosen == proved else f"{proved} is not {self.margin:.2f}x faster: {kept} kept"
        )
        where = "on its one rank" if len(ranks) == 1 else f"on all {len(ranks)} ranks at once"
        of = f"of {self.repeats} steps each"
        medians = f"medians {of}" if len(ranks) == 1 else f"medians over ranks of each rank's medians {of}"
        return {
            self.name: chosen,
            "reason": f"the run's steps {self.first_step}-{self.last_step} {where}, the ways interleaved: "
            f"{ms[proved]:.2f} ms a step with {proved} against {ms[kept]:.2f} ms with {kept} ({medians}); {verdict}",
            "ms": {w: round(v, 3) for w, v in ms.items()},
            "ranks_ms": [{w: round(v, 3) for w, v in r.items()} for r in ranks],
            "steps": [self.first_step, self.last_step],
            "margin": self.margin,
            "conditions": self.conditions,
        }


def trial_window(start_step: int, steps: int, trials: int, repeats: int = TRIAL_REPEATS) -> list[int] | None:
    """The first steps of `trials` consecutive trial windows after the warm-up, or None where the run is too short
    for them and as many steps again measured after (a short run keeps the choice timed before it started)."""
    first = start_step + TRIAL_WARMUP_STEPS
    if steps - first < 2 * (2 * repeats * trials):
        return None
    return [first + 2 * repeats * k for k in range(trials)]

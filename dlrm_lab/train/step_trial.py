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

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

from dlrm_lab.config.values import JsonObject

TRIAL_WARMUP_STEPS = 2  # steps after the run's first before a trial starts (allocations, caches, the first batch)
TRIAL_REPEATS = 8  # steps of each way in a trial's window: 8 ABBA pairs a rank, enough for a sign test at 5%
TRIAL_SIGNIFICANCE = 0.05  # the sign test's one-sided level: the way to prove must win this surely


def sign_test(wins: int, pairs: int) -> float:
    """The one-sided p-value of `wins` of `pairs` under no difference: P(X >= wins), X ~ Binomial(pairs, 1/2)."""
    return sum(math.comb(pairs, k) for k in range(wins, pairs + 1)) / 2**pairs


@dataclass
class StepTrial:
    """Ways of running a step (`ways[0]` the one to prove, `ways[1]` the one kept unless `ways[0]` is surely faster),
    put in place by `apply(way)`; `gather` hands every rank's result to every rank (`all_gather_object`; one rank:
    itself). The window is steps `first_step` to `first_step + 2 * repeats - 1`, in adjacent pairs of one step of
    each way (ABBA); the way to prove is chosen where its step is faster in the median over ranks and in enough of
    the ranks' pairs that a sign test puts the difference beyond the host's noise (a fixed margin either keeps a
    real 5% or takes a noisy 7%: both were measured on one host, issue 46)."""

    name: str  # the choice's key in its record (`table_update`, `gram_dtype`)
    manifest_key: str  # its record's key in the manifest's config (`table_update_choice`)
    ways: tuple[str, str]
    apply: Callable[[str], None]
    first_step: int
    gather: Callable[[dict[str, float]], list[dict[str, float]]]
    conditions: JsonObject  # ranks, threads per rank, ... (the manifest's record of what the timing had)
    repeats: int = TRIAL_REPEATS
    significance: float = TRIAL_SIGNIFICANCE
    times: list[tuple[str, float]] = field(default_factory=list)  # the window's steps, in order

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
        results), put the choice in place and return its record; else None."""
        way = self.way_at(step)
        if way is None:
            return None
        self.times.append((way, step_ms))
        if step != self.last_step:
            return None
        proved, kept = self.ways
        pairs = [dict(self.times[k : k + 2]) for k in range(0, len(self.times), 2)]  # one step of each way
        mine = {w: statistics.median(t for v, t in self.times if v == w) for w in self.ways}
        mine |= {"wins": float(sum(pair[proved] < pair[kept] for pair in pairs)), "pairs": float(len(pairs))}
        ranks = self.gather(mine)
        # the ranks' steps wait on each other in their collectives: the median over ranks of each way's median
        ms = {w: statistics.median(r[w] for r in ranks) for w in self.ways}
        wins, total = int(sum(r["wins"] for r in ranks)), int(sum(r["pairs"] for r in ranks))
        p_value = sign_test(wins, total)
        chosen = proved if ms[proved] < ms[kept] and p_value <= self.significance else kept
        self.apply(chosen)
        verdict = f"{proved} is faster" if chosen == proved else f"{proved} is not surely faster: {kept} kept"
        where = "on its one rank" if len(ranks) == 1 else f"on all {len(ranks)} ranks at once"
        of = f"of {self.repeats} steps each"
        medians = f"medians {of}" if len(ranks) == 1 else f"medians over ranks of each rank's medians {of}"
        return {
            self.name: chosen,
            "reason": f"the run's steps {self.first_step}-{self.last_step} {where}, the ways interleaved: "
            f"{ms[proved]:.2f} ms a step with {proved} against {ms[kept]:.2f} ms with {kept} ({medians}); "
            f"{proved} faster in {wins} of {total} adjacent pairs (sign test p = {p_value:.3f}, "
            f"at most {self.significance:g} to change); {verdict}",
            "ms": {w: round(v, 3) for w, v in ms.items()},
            "ranks_ms": [{w: round(r[w], 3) for w in self.ways} for r in ranks],
            "wins": wins,
            "pairs": total,
            "p_value": round(p_value, 4),
            "steps": [self.first_step, self.last_step],
            "conditions": self.conditions,
        }


def trial_window(start_step: int, steps: int, trials: int, repeats: int = TRIAL_REPEATS) -> list[int] | None:
    """The first steps of `trials` consecutive trial windows after the warm-up, or None where the run is too short
    for them and as many steps again measured after (a short run keeps the choice timed before it started)."""
    first = start_step + TRIAL_WARMUP_STEPS
    if steps - first < 2 * (2 * repeats * trials):
        return None
    return [first + 2 * repeats * k for k in range(trials)]

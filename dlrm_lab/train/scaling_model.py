"""Where multi-rank step time goes, what it should be, and what it would be on a cluster.

Uses of one model of a training step (per rank, in ms):
- `gap_breakdown`: a measured N-rank step against the measured one-rank step, every
  millisecond of the difference named: the machine's N-process compute ceiling, compute
  slower beyond it (per phase), communication at the measured collective bandwidth, beyond
  it, and time no phase timer covers.
- `predict`: the N-rank step from the one-rank phases, the analytic bytes of the cost model
  (`model.cost.step_communication_bytes`), the probed collectives and ceiling of this
  machine, and the expected wait of every collective for the slowest rank (order statistics
  of one rank's per-step phase times); validated against `dlrm-lab scale`'s measurements.
- `roof`: the step the machine allows (the prediction with no waits and the raw collectives),
  and the same through TorchRec's probed distribution.
- `train.fabrics.project`: the same for 8 ... 4,096 ranks on a named fabric of published
  figures, with the TorchRec planner's sharding choice at that size.

Assumptions (printed with every projection): communication is not overlapped with compute;
ids and pooled embeddings are spread uniformly over ranks (`model.cost`; on this machine the
bytes follow the run's plan, in a projection the uniform rule); weak scaling keeps each
rank's work, strong scaling divides it by N (per phase a cost per step and one per sample
where a strong sweep ran one rank at both batches); a collective takes its probed time at that
size (a fabric's: latency + bytes / link bandwidth); ranks' step-to-step jitter is
independent (the wait for the slowest rank).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict, cast

import pyarrow.parquet as pq

from dlrm_lab.config.values import JsonObject
from dlrm_lab.metrics.columns import PHASES

COMPUTE_PHASES = ("data_wait", "embedding_lookup", "dense_forward", "optimizer")
PER_STEP_PHASES = ("optimizer",)  # the dense optimizer's work is per parameter, not per sample
# Collectives per step (a KJT all-to-all sends splits, lengths and values; the pooled
# all-to-all runs once forward and once backward; DDP all-reduces one bucket per 25 MB).
INPUT_DIST_COLLECTIVES = 3
DDP_BUCKET_BYTES = 25 * 2**20


@dataclass(frozen=True)
class StepTimes:
    """Mean per-rank step and phase times (ms) over a run's measured steps."""

    step_ms: float
    phases: dict[str, float]
    batch_size_per_rank: int
    world_size: int
    per_step: dict[str, tuple[float, ...]] = field(default_factory=dict)  # phase -> its measured steps' times
    # phase -> mean over steps and ranks of a rank's time in it beyond the fastest rank's at that step (N ranks)
    late_ms: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:  # a phase a run did not record (older runs) took no time
        object.__setattr__(self, "phases", {p: 0.0 for p in PHASES} | self.phases)

    def slowest_of(self, phase: str, ranks: int) -> float:
        """Expected excess of the slowest of `ranks` independent draws of the phase's per-step
        time over its mean: what a collective after the phase waits for the slowest rank.
        Order statistics of the measured steps: E[max] = sum x_(i) ((i/n)^N - ((i-1)/n)^N)."""
        xs = sorted(self.per_step.get(phase, ()))
        if ranks <= 1 or len(xs) < 2:
            return 0.0
        n = len(xs)
        expected_max = sum(x * ((i / n) ** ranks - ((i - 1) / n) ** ranks) for i, x in enumerate(xs, 1))
        return expected_max - sum(xs) / n

    @property
    def untimed_ms(self) -> float:
        return self.step_ms - sum(self.phases.values())

    @classmethod
    def from_run(cls, run_dir: str | Path) -> StepTimes:
        rows = [r for r in pq.read_table(Path(run_dir) / "steps.parquet").to_pylist() if not r.get("warmup")]
        if not rows:
            raise ValueError(f"{run_dir}: no measured steps")
        ranks = sorted({r["rank"] for r in rows})

        def mean(column: str) -> float:  # per rank over steps, then over ranks
            per = [[r.get(column) or 0.0 for r in rows if r["rank"] == k] for k in ranks]
            return sum(sum(p) / len(p) for p in per) / len(per)

        return cls(
            step_ms=mean("step_time_ms"),
            phases={p: mean(f"{p}_ms") for p in PHASES},
            batch_size_per_rank=int(rows[0]["batch_size"]),
            world_size=len(ranks),
            per_step={p: tuple(r.get(f"{p}_ms") or 0.0 for r in rows) for p in PHASES},
            late_ms=_late_ms(rows, len(ranks)),
        )


def _late_ms(rows: list[dict[str, Any]], ranks: int) -> dict[str, float]:
    """The wait in each collective phase, measured: each of these phases ends in a collective that
    every rank leaves together, so a rank's time in it beyond the fastest rank's at the same step
    is how much earlier it arrived, i.e. how long it waited for the last one (which did not wait).
    Mean over steps and ranks; steps some rank did not record are left out. Where a phase holds
    several collectives (backward: the pooled all-to-all's half, then the all-reduce) waits that
    cancel inside it are not seen: a lower bound there. Runs that time the pooled all-to-all's
    backward apart (`embedding_all_to_all_backward`) measure that wait exactly; their backward
    phase starts and ends unsynchronised, so its figure is jitter, not a wait (`gap_breakdown`
    leaves it out)."""
    by_step: dict[int, list[dict[str, Any]]] = {}  # steps.parquet's rows, read back (`to_pylist`)
    for r in rows:
        by_step.setdefault(r["step"], []).append(r)
    steps = [s for s in by_step.values() if len(s) == ranks]
    if ranks < 2 or not steps:
        return {}
    out = {}
    for phase in (*WAITED_IN, "backward"):
        times = [[r.get(f"{phase}_ms") or 0.0 for r in s] for s in steps]
        out[phase] = sum(sum(t) - len(t) * min(t) for t in times) / (len(times) * ranks)
    return out


@dataclass(frozen=True)
class Collective:
    """time(bytes) = latency + bytes / bandwidth, bytes being the bus bytes one rank moves."""

    latency_s: float
    bytes_per_s: float

    def seconds(self, nbytes: float, count: int = 1) -> float:
        return count * self.latency_s + nbytes / self.bytes_per_s if nbytes > 0 else 0.0


@dataclass(frozen=True)
class MeasuredCollective:
    """A probed collective: its time at each probed size, interpolated linearly in between,
    the smallest message's time below, and above the largest the last segment's time per byte
    (what one more byte costs there: a per-call cost is not charged again by the byte, which
    took rm2's 8 MB of ids at 24 ms over gloo where 18 were measured). Sizes are bus bytes
    (what one rank moves: x (N-1)/N for all-to-all, x 2 (N-1)/N for all-reduce), the unit of
    the cost model's communication bytes."""

    points: tuple[tuple[float, float], ...]  # (bus bytes, seconds), by size
    forward_share: float = 0.5  # of a forward-and-backward path (TorchRec's pooled all-to-all): the forward's part

    def seconds(self, nbytes: float, count: int = 1) -> float:
        if nbytes <= 0:
            return 0.0
        return (count - 1) * self.points[0][1] + self._one(nbytes)  # the bytes in one, the rest latency

    def _one(self, nbytes: float) -> float:
        pts = self.points
        if nbytes <= pts[0][0]:
            return pts[0][1]
        for (b0, t0), (b1, t1) in zip(pts, pts[1:], strict=False):
            if nbytes <= b1:
                return t0 + (t1 - t0) * (nbytes - b0) / (b1 - b0)
        b1, t1 = pts[-1]
        per_byte = (t1 - pts[-2][1]) / (b1 - pts[-2][0]) if len(pts) > 1 and t1 > pts[-2][1] else t1 / b1
        return t1 + (nbytes - b1) * per_byte


# TorchRec's distribution as a step runs it (`metrics.collectives.torchrec_distribution`), where probed
TORCHREC_PATH = ("torchrec_input_dist", "torchrec_pooled")


def fit_collectives(profile: JsonObject | None, key: str) -> dict[str, MeasuredCollective] | None:
    """All-to-all and all-reduce of a probed transport (`gloo/2`, `mpi/2`), as probed, and TorchRec's
    input distribution and pooled all-to-all over it where the probe timed them."""
    comms = cast("dict[str, Any]", (profile or {}).get("comms") or {})  # a profile's probes, by transport
    rows = comms.get(key)
    if not rows:
        return None
    out = {}
    for name in ("all_to_all", "all_reduce", *TORCHREC_PATH):
        mine = sorted((r for r in rows if r["collective"] == name), key=lambda r: r["bytes"])
        if mine:
            shares = [r["forward_share"] for r in mine if r.get("forward_share")]  # probed since 2026-11-24
            out[name] = MeasuredCollective(
                tuple((r["busbw_bytes_per_s"] * r["time_ms"] / 1e3, r["time_ms"] / 1e3) for r in mine),
                forward_share=sum(shares) / len(shares) if shares else 0.5,
            )
    return out if "all_to_all" in out and "all_reduce" in out else None


# The collective that waits for the slowest rank after each compute phase: the next step's
# input distribution after the optimizer (and the data wait), the pooled all-to-all after the
# lookup, its backward after the dense forward and the top of backward.
POOLED_BACKWARD = "embedding_all_to_all_backward"
WAITED_IN = {
    "input_dist": ("data_wait", "optimizer"),
    "embedding_all_to_all": ("embedding_lookup",),
    POOLED_BACKWARD: ("dense_forward", "backward"),
}


def per_rank_work(one: StepTimes, batch: int, small: StepTimes | None = None) -> tuple[dict[str, float], float]:
    """One rank's phase times and untimed ms at a per-rank `batch`.

    From one run: each phase in proportion to the batch but the dense optimizer's, which steps
    every parameter whatever the batch (scaling it too put ~1.2 ms of kaggle's strong-scaling step
    at 2 ranks as 'beyond'). With `small`, one rank again at another batch (a strong sweep's
    calibration point), each phase is the line through both runs (a cost per step plus one per
    sample): kaggle's one-rank step at 2,048 samples is 35 ms, not half of 63 at 4,096."""
    if small is not None and small.batch_size_per_rank != one.batch_size_per_rank:
        b0, b1 = one.batch_size_per_rank, small.batch_size_per_rank

        def line(at0: float, at1: float) -> float:
            return max(0.0, at0 + (at1 - at0) * (batch - b0) / (b1 - b0))

        return {p: line(one.phases[p], small.phases[p]) for p in PHASES}, line(one.untimed_ms, small.untimed_ms)
    ratio = batch / one.batch_size_per_rank
    return {p: one.phases[p] * (1.0 if p in PER_STEP_PHASES else ratio) for p in PHASES}, one.untimed_ms * ratio


def _waits_ms(one: StepTimes, ranks: int, ratio: float) -> dict[str, float]:
    """Per communication phase, the expected wait for the slowest rank (scaled to the work)."""
    return {c: ratio * sum(one.slowest_of(p, ranks) for p in after) for c, after in WAITED_IN.items()}


def communication_seconds(profile: JsonObject | None, transport: str, comm_bytes: dict[str, float]) -> float | None:
    """Seconds of one step's communication (`model.cost.step_communication_bytes`) at a probed
    transport's speed (`gloo/2`, `mpi/2`); None when it was not probed."""
    fits = fit_collectives(profile, transport)
    return None if fits is None else sum(_comm_seconds(comm_bytes, fits).values())


def _comm_seconds(comm_bytes: dict[str, float], fits: dict[str, MeasuredCollective]) -> dict[str, float]:
    """Seconds of each communication of one step: input distribution, the pooled all-to-all's
    forward and backward halves, the dense-gradient all-reduce."""
    a2a, ar = fits["all_to_all"], fits["all_reduce"]
    grad = comm_bytes["gradient_all_reduce"]
    # a reduce-scatter (or all-gather) is half a ring all-reduce of the same buffer, whose bus bytes are twice its own
    half = comm_bytes.get("pooled_reduce_scatter", 0.0) / 2
    scatter = ar.seconds(2 * half) / 2 if half else 0.0
    ids, rows = fits.get("torchrec_input_dist"), fits.get("torchrec_pooled")  # TorchRec's own path, where probed
    if rows:  # forward and backward probed together, with the forward's share of the time
        both = rows.seconds(comm_bytes["pooled_all_to_all"])
        forward, backward = both * rows.forward_share, both * (1 - rows.forward_share)
    else:
        forward = backward = a2a.seconds(comm_bytes["pooled_all_to_all"] / 2)
    return {
        "input_dist": ids.seconds(comm_bytes["input_dist"])
        if ids
        else a2a.seconds(comm_bytes["input_dist"], INPUT_DIST_COLLECTIVES),
        "pooled_forward": forward + scatter,
        "pooled_backward": backward + scatter,
        "gradient_all_reduce": ar.seconds(grad, max(1, math.ceil(grad / 2 / DDP_BUCKET_BYTES))),
    }


class GapBreakdown(TypedDict):
    """`gap_breakdown`'s account of an N-rank step against one rank's (ms per step per rank)."""

    one_rank_step_ms: float  # one rank's step, scaled to the N-rank run's per-rank work
    step_ms: float  # the N-rank run's per-rank step
    gap_ms: float  # the difference
    ceiling: float  # the N-process compute ceiling used (1 where none was probed)
    items_ms: dict[str, float]  # the gap item by item
    named_ms: float  # their sum
    assumptions: list[str]


def gap_breakdown(
    one: StepTimes,
    many: StepTimes,
    comm_bytes: dict[str, float],
    fits: dict[str, MeasuredCollective] | None,
    ceiling: float | None,
    small: StepTimes | None = None,
) -> GapBreakdown:
    """Every ms of `many`'s per-rank step beyond `one`'s (scaled to the same per-rank work).

    Items (ms per step per rank) sum to `gap_ms`. Without probed collectives the
    communication phases are one item each; without a probed ceiling, 1 is assumed (said in
    `assumptions`). The pooled all-to-all's backward is its own phase where the run timed it
    (`embedding_all_to_all_backward`; older runs and plans without one hold it in backward). The
    backward phase holds compute and the gradient all-reduce (overlapped by DDP): what is beyond
    its ceiling share and the all-reduce at bandwidth is named as such, not split further (the
    all-reduce's wait for the slowest rank among it). The waits for the slowest rank
    are measured in the N-rank run (`StepTimes.late_ms`) where it holds every rank's steps, else
    expected from one rank's jitter as `predict` does (which takes every rank's jitter as
    independent: a phase all ranks slow down together, as the source's block every few steps,
    it counts as a wait that does not happen).
    """
    ratio = many.batch_size_per_rank / one.batch_size_per_rank  # per-rank work, N ranks vs 1
    assumptions = []
    if ceiling is None:
        ceiling = 1.0
        assumptions.append("no probed multi-process ceiling: 1 assumed (run 'dlrm-lab machine probe')")
    comm = _comm_seconds(comm_bytes, fits) if fits else None
    if comm is None:
        assumptions.append("no probed collectives for this backend and rank count: communication not split")
    items: dict[str, float] = {}
    expected, untimed = per_rank_work(one, many.batch_size_per_rank, small)
    baseline = sum(expected.values()) + untimed
    items["compute at the machine's ceiling"] = sum(
        expected[p] * (1 / ceiling - 1) for p in (*COMPUTE_PHASES, "backward")
    )
    for p in COMPUTE_PHASES:
        items[f"{p}: beyond the ceiling"] = many.phases[p] - expected[p] / ceiling
    waiting = "waiting for the slowest rank"
    if many.late_ms:  # measured in the N-rank run
        waits, waiting = dict(many.late_ms), f"{waiting} (measured)"
    else:  # expected from one rank's jitter
        waits, waiting = _waits_ms(one, many.world_size, ratio), f"{waiting} (one rank's step-to-step jitter)"
    split = many.phases.get(POOLED_BACKWARD, 0.0) > 0  # the pooled all-to-all's backward timed apart
    collective_phases = [("input_dist", "input_dist"), ("embedding_all_to_all", "pooled_forward")]
    if split:
        collective_phases.append((POOLED_BACKWARD, "pooled_backward"))

    def labels(part: str) -> tuple[str, str]:  # the raw collectives' probed speed, or TorchRec's path's where probed
        path = {
            "input_dist": "torchrec_input_dist",
            "pooled_forward": "torchrec_pooled",
            "pooled_backward": "torchrec_pooled",
        }
        if part in path and (fits or {}).get(path[part]):
            return "through TorchRec at its probed speed", "beyond TorchRec's probed speed and the wait"
        return "at the measured bandwidth", "beyond the bandwidth and the wait"

    for p, part in collective_phases:
        at, beyond = labels(part)
        delta = many.phases[p] - expected[p]
        items[f"{p}: {waiting}"] = waits[p]
        if comm is None:
            items[f"{p}: communication"] = delta - waits[p]
            continue
        items[f"{p}: {at}"] = comm[part] * 1e3
        items[f"{p}: {beyond}"] = delta - comm[part] * 1e3 - waits[p]
    backward = many.phases["backward"] - expected["backward"] / ceiling
    if split:  # what is left in backward: compute and the all-reduce (its wait cannot be told apart there)
        wait_bw, beyond_bw, without = 0.0, "beyond the ceiling and the bandwidth", "beyond the ceiling"
        at_bw = comm["gradient_all_reduce"] * 1e3 if comm else 0.0
        at_bw_is = "the gradient all-reduce at the measured bandwidth"  # a raw collective
        backward_is = "(compute, the all-reduce and its wait)"
    else:  # the pooled all-to-all's backward inside backward, and its wait
        backward += many.phases[POOLED_BACKWARD] - expected[POOLED_BACKWARD]
        wait_bw = waits.get("backward", 0.0) if many.late_ms else waits[POOLED_BACKWARD]
        items[f"backward: {waiting}"] = wait_bw
        beyond_bw, without = "beyond the ceiling, the bandwidth and the wait", "beyond the ceiling and the wait"
        at_bw = (comm["gradient_all_reduce"] + comm["pooled_backward"]) * 1e3 if comm else 0.0
        pooled = comm is not None and comm["pooled_backward"] > 0  # else only the all-reduce: a raw collective
        at_bw_is = f"collectives {labels('pooled_backward')[0] if pooled else 'at the measured bandwidth'}"
        backward_is = "(compute and collectives)"
    if comm is None:
        items[f"backward: {without} {backward_is}"] = backward - wait_bw
    else:
        items[f"backward: {at_bw_is}"] = at_bw
        items[f"backward: {beyond_bw}"] = backward - at_bw - wait_bw
    items["untimed (between phases)"] = many.untimed_ms - untimed
    gap = many.step_ms - baseline
    return {
        "one_rank_step_ms": baseline,
        "step_ms": many.step_ms,
        "gap_ms": gap,
        "ceiling": ceiling,
        "items_ms": items,
        "named_ms": sum(items.values()),
        "assumptions": assumptions,
    }


def predict(
    one: StepTimes,
    batch_size_per_rank: int,
    world_size: int,
    comm_bytes: dict[str, float],
    fits: dict[str, MeasuredCollective] | None,
    ceiling: float | None,
    small: StepTimes | None = None,
) -> dict[str, float] | str:
    """The per-rank step at `world_size` ranks on this machine: one rank's phases scaled to
    the per-rank batch and slowed by the N-process ceiling, plus every collective at the
    probed latency and bandwidth. A reason (str) when the profile lacks what it needs."""
    ratio = batch_size_per_rank / one.batch_size_per_rank
    work, untimed = per_rank_work(one, batch_size_per_rank, small)
    if world_size == 1:
        alone = sum(work.values()) + untimed
        return {"step_ms": alone, "compute_ms": alone, "comm_ms": 0.0}
    if ceiling is None:
        return f"no probed {world_size}-process ceiling (run 'dlrm-lab machine probe')"
    if fits is None:
        return f"no probed collectives at {world_size} ranks (dlrm-lab launch --nproc {world_size} -- machine probe)"
    comm = _comm_seconds(comm_bytes, fits)
    compute = sum(work[p] for p in (*COMPUTE_PHASES, "backward")) / ceiling
    local = work["input_dist"] + work["embedding_all_to_all"] + work[POOLED_BACKWARD] + untimed
    comm_ms = sum(comm.values()) * 1e3
    wait_ms = sum(_waits_ms(one, world_size, ratio).values())
    return {
        "step_ms": compute + local + comm_ms + wait_ms,
        "compute_ms": compute + local,
        "comm_ms": comm_ms,
        "wait_ms": wait_ms,
    }


def roof(
    one: StepTimes,
    batch_size_per_rank: int,
    world_size: int,
    comm_bytes: dict[str, float],
    fits: dict[str, MeasuredCollective] | None,
    ceiling: float | None,
    small: StepTimes | None = None,
) -> dict[str, float] | None:
    """The per-rank step this machine allows at `world_size` ranks: one rank's work with its compute
    at the N-process ceiling and the step's bytes at the raw collectives' probed speed, no waits and
    nothing around the collectives (`machine_ms`); and the same with TorchRec's distribution at its
    probed speed where the probe timed it (`library_ms`: what the library lets a step reach here).
    None without a probed ceiling and collectives: the prediction says why."""
    if world_size < 2 or ceiling is None or not fits:
        return None
    raw = {name: fit for name, fit in fits.items() if name not in TORCHREC_PATH}
    out = {}
    for key, through in (("machine_ms", raw), ("library_ms", fits)):
        best = predict(one, batch_size_per_rank, world_size, comm_bytes, through, ceiling, small)
        if isinstance(best, str):
            return None
        out[key] = best["step_ms"] - best["wait_ms"]
    return out

"""The serving policy chosen by measurement: max batch, batching delay, spin and keep-warm (`infer run ... auto`).

A batch runs slower in service than warm: a core that slept between batches wakes slowly and
its caches are cold, and on a VM a halted vCPU waits for the host. The remedies trade against
each other and against the load, so none is right on every machine:

- the batching delay (`--max-delay-ms`): waiting fills batches (fewer fixed costs under load)
  but every query at low load pays it whole;
- spin (`--spin-ms`): an idle instance polls for its next batch before it sleeps, keeping its
  core awake, but the polling takes the core from the serving process and other instances;
- the max batch (`--max-batch`): large batches amortise the per-batch cost, long ones hold the
  queries behind them;
- keep-warm (`--keep-warm-ms`): an idle instance runs a 1-sample batch every few ms, its tables and weights kept in
  cache, at the cost of that core time.

`infer run` with `auto` for any of them chooses on the running server, once the bound is known:
- the max batch from the batch cost every instance measured at start (`auto_max_batch`);
- the delay, then the spin, by short open-loop probes at the point's own rate and query sizes
  (with `--qps auto`, at half of capacity, before the rate's bisection: `infer.calibrate`),
  interleaved and repeated, keeping the lowest median latency percentile (`choose_policy`).
  A spin and a keep-warm must beat none by `MARGIN`, since both cost cores.
Threads per instance are fixed when instances start: `infer search` compares layouts.

Hand-written: no serving framework tunes its own batching against the host's wake-up costs.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, TypedDict, cast

import numpy as np

from dlrm_lab.config.values import JsonObject, Log
from dlrm_lab.errors import UserError
from dlrm_lab.infer.batching import BatchCost
from dlrm_lab.infer.calibrate import drive_records
from dlrm_lab.infer.drivers import make_driver
from dlrm_lab.infer.load import LoadSettings, Stream
from dlrm_lab.infer.records import summarize
from dlrm_lab.infer.sut import SystemUnderTest

KNOBS = ("max_batch", "max_delay_ms", "spin_ms", "keep_warm_ms")  # what `auto` may be given for
# chosen by probes of one model's open-loop load (max_batch: by its batch cost)
PROBED = ("max_delay_ms", "spin_ms", "keep_warm_ms")
KEEP_WARM_PROBE_MS = 10.0  # the keep-warm interval probed against none (a 1-sample batch: ~0.5 ms of 10, 5%)
DELAYS_MS = (0.0, 0.5, 1.0, 2.0)  # batching delays probed (those above a quarter of the bound are not)
MARGIN = 1.05  # a spin must lower the percentile by this factor to be kept (it costs cores)
FIXED_SHARE = 0.1  # auto max batch: large enough that the per-batch cost is at most this share of a batch
# ... where the whole load is queued at once (Offline): no bound waits on a batch, and each percent of fixed cost
# left in a batch is a percent of throughput
QUEUED_FIXED_SHARE = 0.03
BATCH_SHARE_OF_BOUND = 0.25  # ... and short enough that a full batch takes at most this share of the bound
MAX_AUTO_BATCH = 4096  # a cap on the rule: a model this cheap per sample needs no larger batch to amortise
MAX_SPIN_MS = 10.0
MIN_QUERIES = 200  # a probe runs until about this many queries arrived (a percentile of a few is noise)


def parse_knob(name: str, value: Any) -> float | None:
    """A knob's value from the command line: a number, or None for `auto` (chosen by measurement)."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return None
    flag = "--" + name.replace("_", "-")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise UserError(f"{flag} {value}: must be a number or auto") from None
    if not math.isfinite(number):
        raise UserError(f"{flag} {value}: must be a finite number or auto")
    if name == "max_batch" and number != int(number):
        raise UserError(f"{flag} {value}: must be a whole number or auto")
    return number


def auto_max_batch(
    cost: BatchCost, largest_piece: int, sla_ms: float | None, fixed_share: float = FIXED_SHARE
) -> tuple[int, str]:
    """The max batch from the measured batch cost: the smallest batch whose fixed cost is at most
    `fixed_share` of it, but a full batch at most BATCH_SHARE_OF_BOUND of the bound, and never below
    `largest_piece` (one instance's share of the largest query: such a query then runs as parallel
    pieces, one per instance); in multiples of 64."""
    if cost.per_sample_ms <= 0:
        amortised = MAX_AUTO_BATCH
    else:
        amortised = math.ceil(cost.fixed_ms * (1 - fixed_share) / (fixed_share * cost.per_sample_ms))
    n, why = amortised, f"the per-batch cost ({cost.fixed_ms:.2f} ms) is {fixed_share:.0%} of a batch of {amortised}"
    if n > MAX_AUTO_BATCH:
        n, why = MAX_AUTO_BATCH, f"the cap (the per-batch cost would be {fixed_share:.0%} of a batch of {amortised})"
    if sla_ms is not None and cost.per_sample_ms > 0:
        bounded = int((BATCH_SHARE_OF_BOUND * sla_ms - cost.fixed_ms) / cost.per_sample_ms)
        if bounded < n:
            n = bounded
            why = f"a full batch takes {BATCH_SHARE_OF_BOUND:.0%} of the {sla_ms:g} ms bound at {bounded}"
    if largest_piece > n:
        n, why = largest_piece, f"one instance's share of the largest query ({largest_piece} samples)"
    n = max(64, -(-n // 64) * 64)
    return n, f"max batch {n}: {why} (batch {cost.fixed_ms:.2f} ms + {cost.per_sample_ms * 1e3:.1f} us per sample)"


def spin_candidates(qps: float, instances: int) -> list[float]:
    """Spins worth probing: none, 1 ms, and the mean gap between one instance's queries (capped)."""
    gap = 1e3 * max(1, instances) / qps if qps > 0 else MAX_SPIN_MS
    return sorted({0.0, 1.0, round(min(max(gap, 1.0), MAX_SPIN_MS), 2)})


_Probed = Literal["max_delay_ms", "spin_ms", "keep_warm_ms"]  # a knob of PROBED


class _Setting(TypedDict, total=False):
    """The knob a candidate sets, by name (one of them)."""

    max_delay_ms: float
    spin_ms: float
    keep_warm_ms: float


class _ProbeRun(TypedDict):
    """How `_compare` probes each candidate (`choose_policy`'s, the same for every knob)."""

    repeats: int
    seconds: float
    percentile: float
    sla_ms: float
    seed: int
    drain_s: float


class PolicyProbe(_Setting):
    """One candidate setting of a knob, probed `repeats` times (`_compare`): its latency percentiles (None: none
    completed), their median, and the share of a query's latency that was in-service slowdown."""

    knob: str
    latency_ms: list[float | None]
    slowdown_share: list[float]
    median_ms: float | None


@dataclass
class PolicyChoice:
    """The serving policy chosen, and the probes that chose it."""

    model: str
    qps: float
    percentile: float
    max_batch: int | None  # None: as the server's own (a transport that cannot say)
    max_delay_ms: float | None
    spin_ms: float | None
    tuned: list[str]  # the knobs chosen here (the others as given)
    keep_warm_ms: float = 0.0
    probes: list[PolicyProbe] = field(default_factory=list)  # each candidate: its percentiles, median
    reasons: list[str] = field(default_factory=list)

    @property
    def line(self) -> str:
        return f"{self.model}: serving policy chosen by measurement at {self.qps:.1f} queries/s: " + "; ".join(
            self.reasons
        )

    def to_dict(self) -> JsonObject:
        return {**asdict(self), "margin": MARGIN, "delays_ms": list(DELAYS_MS)}


def _probe(
    server: SystemUnderTest, stream: Stream, seconds: float, percentile: float, sla_ms: float, seed: int, drain_s: float
) -> tuple[float, float]:
    """Open-loop load at the stream's rate: its latency percentile (dropped = inf) and the median
    share of a query's latency that was in-service slowdown."""
    settings = LoadSettings("open-loop", duration_s=seconds, seed=seed, max_issue_lag_ms=None)
    records, _ = drive_records(server, make_driver(server, [stream], settings), drain_s)
    if not records:
        return math.inf, 0.0
    row = summarize(records, duration_s=seconds, sla_ms=sla_ms, sla_percentile=percentile)
    value = row.get("sla_latency_ms")
    shares = [
        r["lat_slowdown_ms"] / r["latency_ms"]
        for r in records
        if r.get("lat_slowdown_ms") is not None and r.get("latency_ms")
    ]
    return (math.inf if value is None else float(value)), float(np.median(shares)) if shares else 0.0


def _compare(
    server: SystemUnderTest,
    stream: Stream,
    model: str,
    candidates: list[_Setting],
    *,
    repeats: int,
    seconds: float,
    percentile: float,
    sla_ms: float,
    seed: int,
    drain_s: float,
    knob: _Probed,
) -> list[PolicyProbe]:
    """Each candidate setting probed `repeats` times, interleaved (a noisy host's drift falls on all)."""
    results: list[PolicyProbe] = [
        {**c, "knob": knob, "latency_ms": [], "slowdown_share": [], "median_ms": None} for c in candidates
    ]
    for r in range(repeats):
        for k, c in enumerate(candidates):
            server.configure(model, **c)
            p, share = _probe(server, stream, seconds, percentile, sla_ms, seed + 101 * r + k, drain_s)
            results[k]["latency_ms"].append(p)
            results[k]["slowdown_share"].append(share)
    for res in results:
        latencies = cast(list[float], res["latency_ms"])  # every probe's percentile until here (inf: none completed)
        median = statistics.median(latencies)
        res["latency_ms"] = [None if math.isinf(v) else v for v in latencies]
        res["median_ms"] = None if math.isinf(median) else median
    return results


def _median(res: PolicyProbe) -> float:
    return math.inf if res["median_ms"] is None else res["median_ms"]


def choose_max_batch(
    server: SystemUnderTest, stream: Stream, sla_ms: float, *, whole_load_queued: bool = False
) -> tuple[int | None, str]:
    """The auto max batch of `stream`'s model under `sla_ms` (`auto_max_batch` on the batch cost its instances
    measured), configured on `server`; the max batch and why. Where no cost was measured, the server's own."""
    model = stream.model
    sut = server.describe()
    served, cost = sut.models[model], sut.batch_costs.get(model)
    if cost is None:
        return served.max_batch, f"max batch {served.max_batch} as given (no batch cost was measured)"
    assert served.instances is not None  # its instances measured the cost: they are this server's own
    largest = max(served.largest_query, int(stream.sizes.quantile(0.999)))
    # a scenario that queues its whole load (Offline) has no latency bound for a batch to fit in
    bound, share = (None, QUEUED_FIXED_SHARE) if whole_load_queued else (sla_ms, FIXED_SHARE)
    max_batch, why = auto_max_batch(cost, -(-largest // max(1, served.instances)), bound, share)
    server.configure(model, max_batch=max_batch)
    return max_batch, why


def choose_policy(
    server: SystemUnderTest,
    stream: Stream,
    tune: Sequence[str],
    *,
    sla_ms: float,
    percentile: float = 99.0,
    whole_load_queued: bool = False,
    probe_s: float = 1.0,
    repeats: int = 2,
    seed: int = 0,
    drain_s: float = 30.0,
    log: Log | None = None,
) -> PolicyChoice:
    """Choose the knobs named in `tune` on the running `server` for `stream`'s load (module docstring);
    the others keep the server's settings. The chosen settings are left configured."""
    unknown = sorted(set(tune) - set(KNOBS))
    if unknown:
        raise UserError(f"auto is not allowed for {unknown[0]}; allowed: {', '.join(KNOBS)}")
    model = stream.model
    sut = server.describe()
    served = sut.models[model]
    choice = PolicyChoice(
        model=model,
        qps=stream.qps,
        percentile=percentile,
        max_batch=served.max_batch,
        max_delay_ms=served.max_delay_ms,
        spin_ms=served.spin_ms,
        tuned=list(tune),
        keep_warm_ms=served.keep_warm_ms or 0.0,
    )
    if "max_batch" in tune:
        choice.max_batch, why = choose_max_batch(server, stream, sla_ms, whole_load_queued=whole_load_queued)
        choice.reasons.append(why)
    seconds = min(max(probe_s, MIN_QUERIES / stream.qps if stream.qps > 0 else probe_s), 4 * probe_s)
    common = _ProbeRun(
        repeats=repeats, seconds=seconds, percentile=percentile, sla_ms=sla_ms, seed=seed, drain_s=drain_s
    )
    if "max_delay_ms" in tune:
        delays = [d for d in DELAYS_MS if d <= BATCH_SHARE_OF_BOUND * sla_ms] or [0.0]
        results = _compare(server, stream, model, [{"max_delay_ms": d} for d in delays], knob="max_delay_ms", **common)
        best = min(results, key=_median)
        choice.max_delay_ms = best["max_delay_ms"]
        choice.probes += results
        choice.reasons.append(f"delay {best['max_delay_ms']:g} ms ({_versus(results, 'max_delay_ms', percentile)})")
        server.configure(model, max_delay_ms=choice.max_delay_ms)
    # the idle-tail routes: each costs core time, so it must beat none (0) by MARGIN to be kept
    routes: dict[_Probed, tuple[str, list[float]]] = {
        # a target whose policy auto may set describes its instances (`InferConfig` refuses auto for the others)
        "spin_ms": ("spin", spin_candidates(stream.qps, served.instances or 1)),
        "keep_warm_ms": ("keep-warm", [0.0, KEEP_WARM_PROBE_MS]),
    }
    for knob, (label, values) in routes.items():
        if knob not in tune:
            continue
        settings = [cast(_Setting, {knob: v}) for v in values]  # `knob` is a key of _Setting (a literal of _Probed)
        results = _compare(server, stream, model, settings, knob=knob, **common)
        none = next(r for r in results if r[knob] == 0)
        best = min(results, key=_median)
        if best is not none and not _median(best) * MARGIN <= _median(none):
            best = none
        setattr(choice, knob, best[knob])
        choice.probes += results
        choice.reasons.append(f"{label} {best[knob]:g} ms ({_versus(results, knob, percentile)})")
        server.configure(model, **{knob: best[knob]})
    if log:
        log(choice.line)
    return choice


def _versus(results: list[PolicyProbe], knob: _Probed, percentile: float) -> str:
    """The candidates' median percentiles, in one clause."""

    def fmt(res: PolicyProbe) -> str:
        m = res["median_ms"]
        return f"{res[knob]:g} ms: {'none completed' if m is None else f'{m:.2f} ms'}"

    return f"p{percentile:g} medians " + ", ".join(fmt(r) for r in results)

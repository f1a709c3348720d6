"""Latency-bounded search: the highest rate each serving configuration sustains under a bound.

One run directory (kind `infer-search`): every probe is a load point of `infer.load_point.measure`
(`queries.parquet`, `summary.parquet`), and `frontier.parquet` holds the best rate of every
configuration that meets the latency bound.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, cast

import numpy as np

from dlrm_lab.config.values import JsonObject, Log
from dlrm_lab.errors import FieldError
from dlrm_lab.infer.calibrate import capacity_qps
from dlrm_lab.infer.certify import certify
from dlrm_lab.infer.drivers import scenario
from dlrm_lab.infer.frontier import frontier_row, judge, label_of, pruned_row
from dlrm_lab.infer.instance import PRECISIONS
from dlrm_lab.infer.lab import faults_name_the_run, stream_config
from dlrm_lab.infer.load import Stream
from dlrm_lab.infer.load_point import OnProgress, Point, measure
from dlrm_lab.infer.options import InferConfig
from dlrm_lab.infer.records import held_latency
from dlrm_lab.infer.search_options import SearchGrid, SearchOptions
from dlrm_lab.infer.served import ServedModel
from dlrm_lab.infer.sut import ModelDescription
from dlrm_lab.infer.targets import check_served_by, open_target, parse_target
from dlrm_lab.metrics.columns import FrontierRow, QueryRow, SearchSummaryRow, schema_of
from dlrm_lab.metrics.cost import price_of, serving_cost_columns
from dlrm_lab.metrics.energy import telemetry_schema
from dlrm_lab.metrics.precision import AUTO, choose_precision, contenders
from dlrm_lab.metrics.roofline import load_profile
from dlrm_lab.metrics.run import Run
from dlrm_lab.metrics.stats import nearest_rank
from dlrm_lab.metrics.trust import check_stored_profile

# Repeats of one probed rate whose percentiles all lie this far on one side of the bound
# settle it (tiny, 2 s probes on 2 cores: repeats of one rate differed by up to ~20%).
SETTLE_MARGIN = 0.25


def late_budget(qps: float, seconds: float, percentile: float) -> int:
    """How many of a probe's queries may be late (or dropped) and its nearest-rank
    percentile still meet the bound: n less the percentile's rank, of the n = qps x seconds planned."""
    n = max(1, round(qps * seconds))
    return n - nearest_rank(percentile, n)


def fails_already(model: str, sla_ms: float, budget: int) -> Callable[[list[QueryRow]], bool]:
    """A probe's `decided` test: more queries already late, dropped or failed than its budget
    (more queries cannot undo that: the percentile is already beyond the bound). The records
    only grow during a point, so each call counts just the ones added since the last: the
    test runs in the serving process while the load is measured."""
    seen = late = 0

    def decided(records: list[QueryRow]) -> bool:
        nonlocal seen, late
        for r in records[seen:]:
            if r["model"] == model and r["status"] != "rejected" and (r["status"] != "ok" or r["latency_ms"] > sla_ms):
                late += 1
        seen = len(records)
        return late > budget

    return decided


def verdict_settled(latencies: list[float], repeats: int, sla_ms: float, margin: float = 0.0) -> bool | None:
    """The probe's verdict (median latency at the percentile within the bound) once the
    repeats still to run cannot change it, else None: the remaining ones are filled in as
    best (0) and as worst (inf) cases. With `margin` > 0, repeats that all lie clearly on
    one side (within bound / (1 + margin), or beyond bound x (1 + margin)) settle it too:
    the rest would need a swing larger than repeats of one rate show."""
    if margin > 0 and latencies:
        if all(x <= sla_ms / (1 + margin) for x in latencies):
            return True
        if all(x >= sla_ms * (1 + margin) for x in latencies):
            return False
    left = repeats - len(latencies)
    best = np.median([*latencies, *[0.0] * left]) <= sla_ms
    worst = np.median([*latencies, *[math.inf] * left]) <= sla_ms
    return bool(best) if best == worst else None


def search(
    base: ServedModel,
    stream: Stream,
    grid: SearchGrid,
    cfg: InferConfig,
    options: SearchOptions,
    *,
    metrics_dir: str | Path = "runs",
    argv: list[str] | None = None,
    log: Log | None = None,
    on_progress: OnProgress | None = None,
    serve: Callable[[ServedModel], AbstractContextManager[Any]] | None = None,
) -> Path:
    """For each configuration, the highest rate whose latency percentile meets the bound.

    Per configuration: a closed-loop saturation run measures capacity C; then bisection on
    the rate in (0, 1.05 C]: each probed rate is run up to `repeats` times (open loop) and
    passes when the median `sla_latency_ms` (dropped queries infinitely late) is within the
    bound. The answer is the highest passing rate, reported with half the final bracket as
    its uncertainty. Instances are started once per (instances, threads) layout, whose
    configurations are bisected in order of capacity, most capable first.

    What keeps it fast without changing the answer: a configuration whose capacity (with
    `prune_margin` for noise) is below the best rate already found under the bound is not
    bisected (`outcome` says so), nor one that misses the bound at that best rate / (1 +
    `prune_margin`), its first probe (the winner's rate is still found by bisection); a
    probe's load ends as soon as more queries were late than its percentile allows
    (`late_budget`, LoadGen-style early stopping of a lost cause); and repeats stop once the
    rest cannot change the median's verdict, or all lie clearly on one side of the bound
    (`verdict_settled`, `SETTLE_MARGIN`).

    The load of each probe is our open-loop generator or MLPerf LoadGen's Server scenario
    (`cfg.scenario`); either way the verdict is computed from our own query records.
    `on_progress` hears how far each probe's load is (points numbered over the whole search).
    `serve(served model)` starts the system under test of a layout (default: an
    `InferenceServer` on this host); it has `configure(model, max_batch=, max_delay_ms=)`.
    """
    if not scenario(cfg.scenario).probes_rate:
        raise FieldError("scenario", f"{cfg.scenario}: a search probes rates with open-loop or LoadGen server load")
    target = parse_target(cfg.target)
    widest = max(grid.layouts, key=lambda layout: layout[0])[0]
    base = replace(base, largest_query=max(base.largest_query, stream.sizes.quantile(0.999)))
    # the widest layout's memory, and a build this machine cannot make, refused before the run directory exists
    check_served_by(target, [replace(base, instances=widest, max_batch=max(grid.max_batch))], device=cfg.device)
    config: JsonObject = {
        "infer": cfg.to_dict(),
        "model": base.describe(),
        "stream": stream_config(stream),
        "grid": asdict(grid),
        "search": asdict(options),
    }
    if serve is None:

        def serve(m: ServedModel) -> AbstractContextManager[Any]:
            return open_target(target, [m], cfg.connection(), device=cfg.device, seed=cfg.seed, pin_cores=cfg.pin_cores)

    check_stored_profile(log)
    run = Run.create(metrics_dir, "infer-search", config, argv=argv)
    frontier: list[FrontierRow] = []
    with faults_name_the_run(run), run:
        queries = run.table("queries", schema_of("queries"))
        summary = run.table("summary", schema_of("search summary"))
        telemetry = run.table("telemetry", telemetry_schema("point"))
        point_index = 0
        choices: dict[str, JsonObject] = {}
        layouts = [(layout, list(group)) for layout, group in itertools.groupby(grid.configs(), key=lambda c: c[:2])]
        runs = (
            [
                (layout, precision, group)
                for layout, group in layouts
                for precision in _search_precisions(base, layout[1], max(grid.max_batch), cfg, log, choices)
            ]
            if target.sets_policy
            else [((None, None), None, [(None, None, None, None)])]
        )
        # A remote server is searched as it serves: the rate alone (neither protocol sets its layout or batching;
        # its `configure` takes the group's Nones and sets nothing)
        run.update_manifest(precision_choices=choices)
        best_sps = 0.0  # the best rate found under the bound so far, samples/s
        mean_size = stream.sizes.mean
        for (instances, threads), precision, group in runs:
            # with a precision, a layout of the grid (a remote server's one run has neither): whole numbers
            first = (
                replace(base, instances=cast(int, instances), threads=cast(int, threads), precision=precision)
                if precision
                else base
            )
            with serve(first) as server:
                measured = []  # capacities first: the most capable configuration is searched first
                for _, _, max_batch, delay in group:
                    server.configure(base.name, max_batch=max_batch, max_delay_ms=delay)
                    capacity = capacity_qps(server, stream, options.capacity_s, cfg.seed, cfg.drain_timeout_s)
                    measured.append((capacity, max_batch, delay))
                    if log:
                        label = label_of(server.describe().models[base.name])
                        log(f"{label}: capacity {capacity:.1f} queries/s (closed loop)")
                for capacity, max_batch, delay in sorted(measured, key=lambda m: -m[0]):
                    server.configure(base.name, max_batch=max_batch, max_delay_ms=delay)
                    served = server.describe().models[base.name]
                    if options.prune_margin >= 0 and capacity * mean_size * (1 + options.prune_margin) < best_sps:
                        frontier.append(pruned_row(served, capacity, capacity * mean_size, best_sps, cfg, log))
                        continue
                    probe = _Probing(
                        server,
                        base,
                        stream,
                        cfg,
                        options,
                        queries,
                        summary,
                        telemetry,
                        run.dir,
                        log,
                        on_progress,
                        point_index,
                    )
                    row = probe.bisect(served, capacity, best_sps)
                    point_index = probe.point_index
                    frontier.append(row)
                    best_sps = max(best_sps, row["best_samples_per_s"] or 0.0)
        winner = judge(frontier)
        if winner is not None and options.certify_s > 0:
            point_index = certify(
                winner,
                base,
                stream,
                cfg,
                options,
                serve,
                queries,
                summary,
                telemetry,
                run.dir,
                point_index,
                log,
                on_progress,
            )
        price = price_of(load_profile() if target.on_this_host else None, cfg.price_per_hour, cfg.currency)
        for r in frontier:
            r.update(serving_cost_columns(r, price))
        # a list of rows (list is invariant: `Run.write_summary` would take a Sequence of them)
        run.write_summary(
            cast(list[dict[str, str | float | bool | None]], frontier), schema_of("frontier"), name="frontier"
        )
        run.update_manifest(best=winner)
    return run.dir


@dataclass
class _Probing:
    """The bisection of one configuration's rate under the bound (`search`), its probes written as it goes."""

    server: Any
    base: ServedModel
    stream: Stream
    cfg: InferConfig
    options: SearchOptions
    queries: Any
    summary: Any
    telemetry: Any
    run_dir: Path
    log: Log | None
    on_progress: OnProgress | None
    point_index: int  # the next point's number (the search's points are numbered over every probe)

    def bisect(self, served: ModelDescription, capacity: float, best_sps: float) -> FrontierRow:
        """The highest rate of `served` in (0, 1.05 x capacity] whose latency percentile meets the bound (search's
        docstring): its frontier row. `best_sps`: the best rate found under the bound so far (samples/s)."""
        server, base, stream, cfg, options = self.server, self.base, self.stream, self.cfg, self.options
        queries, summary, telemetry, log = self.queries, self.summary, self.telemetry, self.log
        mean_size = stream.sizes.mean
        point_index = self.point_index
        lo, hi = 0.0, capacity * 1.05
        best_rows: list[SearchSummaryRow] = []
        probes = points = 0
        # With a rate found under the bound already, the first probe asks whether this
        # configuration can come near it: failing there, it cannot win (one probe spent).
        challenge = best_sps / mean_size / (1 + options.prune_margin) if options.prune_margin >= 0 else 0.0
        lost = None
        while probes < options.steps and (hi - lo) / hi > options.tolerance:
            challenged = probes == 0 and 0 < challenge < hi
            if challenged:
                qps = challenge
            else:
                # a wide bracket (a bounded rate far below capacity) is halved in ratio, not in width
                mid = math.sqrt(lo * hi) if hi > 2 * lo > 0 else (lo + hi) / 2
                qps = mid if lo > 0 else hi * 0.8 if probes == 0 else hi / 2
            seconds = min(max(cfg.duration_s, options.min_queries / qps), options.max_duration_s)
            # LoadGen cannot be interrupted: ending its probe early would start the
            # next test while it still runs (it aborts the process)
            decided = (
                fails_already(base.name, cfg.sla_ms, late_budget(qps, seconds, cfg.sla_percentile))
                if options.early_stop and scenario(cfg.scenario).stops_early
                else None
            )
            rows: list[SearchSummaryRow] = []
            lat: list[float] = []
            passed: bool | None = None
            for rep in range(options.repeats):
                point = Point(point_index, [replace(stream, qps=qps)], "together", cfg.scenario, duration_s=seconds)
                point_index += 1
                (measured,) = measure(
                    server,
                    point,
                    cfg,
                    queries,
                    self.run_dir,
                    telemetry=telemetry,
                    on_progress=self.on_progress,
                    decided=decided,
                )
                row = SearchSummaryRow(measured, repeat=rep, probe=probes)
                rows.append(row)
                held = held_latency(row)
                lat.append(math.inf if held is None else held)
                passed = verdict_settled(lat, options.repeats, cfg.sla_ms, SETTLE_MARGIN if options.early_stop else 0.0)
                if passed is not None:
                    break  # the repeats left cannot change the verdict
            points += len(rows)
            for r in rows:
                r["passed"] = passed
            summary.extend(rows)
            summary.flush()
            if log:
                early = " (decided early)" if len(rows) < options.repeats or rows[-1]["load_stopped_early"] else ""
                log(
                    f"{label_of(served)}: {qps:.1f} queries/s -> p{cfg.sla_percentile:g} "
                    f"{np.median(lat):.2f} ms, {'pass' if passed else 'fail'}{early}"
                )
            probes += 1
            if passed:
                lo, best_rows = qps, rows
            elif challenged:
                hi = qps
                lost = f"lower: the bound missed at {qps:,.1f} queries/s, the best rate found / (1 + prune margin)"
                if log:
                    log(f"{label_of(served)}: {lost}")
                break
            else:
                hi = qps
        self.point_index = point_index
        result = frontier_row(served, capacity, lo, hi, best_rows, probes, cfg)
        result["probe_points"] = points
        result["outcome"] = lost
        return result


def _search_precisions(
    base: ServedModel, threads: int, rows: int, cfg: InferConfig, log: Log | None, choices: dict[str, JsonObject]
) -> list[str]:
    """The precisions a layout is searched in: the one asked for, or with `auto` every
    precision whose measured GEMM rate is close enough to the fastest to win (a clear loser
    is left out of the grid, and so costs no search time)."""
    if base.precision != AUTO:
        return [base.precision]
    choice = choose_precision(
        AUTO, base.spec, allowed=PRECISIONS, device=cfg.device, threads=threads, rows=rows, log=log
    )
    kept = contenders(choice)
    choices[f"{threads} threads"] = {**choice.to_dict(), "searched": kept}
    if log:
        log(f"{threads} thread{'s' if threads != 1 else ''}: searching precision {', '.join(kept)} ({choice.reason})")
    return kept

"""Certifying a search's best configuration under MLPerf LoadGen's Server scenario: its claimed rate run again for
LoadGen's own verdict (early stopping included) and the lab's percentile within the bound, backing off and then
bisecting until a rate holds (`certify`); where LoadGen holds well below the open-loop probes, the runs' own latency
parts say which clock was the slower.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import replace
from typing import Any

from dlrm_lab.config.values import Log
from dlrm_lab.infer.frontier import label_of
from dlrm_lab.infer.load import Stream
from dlrm_lab.infer.load_point import OnProgress, Point, measure
from dlrm_lab.infer.loadgen import loadgen_duration, queries_needed
from dlrm_lab.infer.options import InferConfig
from dlrm_lab.infer.records import held_latency
from dlrm_lab.infer.search_options import SearchOptions
from dlrm_lab.infer.served import ServedModel
from dlrm_lab.infer.targets import parse_target
from dlrm_lab.metrics.columns import FrontierRow, SearchSummaryRow

CERTIFY_BACKOFF = 0.85  # each try after a failed certification, until one holds, runs at most this share of the last
CERTIFY_BACKOFF_MAX = 0.5  # ... and at least this share: far beyond the bound, by the bound over LoadGen's p99
CERTIFY_TOLERANCE = 0.05  # then bisected until the lowest failing rate is within this of the highest holding one
# A run whose only failing is LoadGen's early-stopping estimate (its p99 near the bound) is run again at the same rate
# for as many more queries as LoadGen asked for (again, while it asks), where that takes at most this long
CERTIFY_MAX_S = 60.0


def certify(
    winner: FrontierRow,
    base: ServedModel,
    stream: Stream,
    cfg: InferConfig,
    options: SearchOptions,
    serve: Callable[[ServedModel], AbstractContextManager[Any]],
    queries: Any,
    summary: Any,
    telemetry: Any,
    run_dir: Any,
    point_index: int,
    log: Log | None,
    on_progress: OnProgress | None,
) -> int:
    """Run the best configuration under LoadGen's Server scenario (its verdict, with early stopping, and the
    lab's percentile within the bound) at the rate the lab's own open loop held as long (`_held_rate`; the claimed
    rate where none held); where that does not hold, back off by
    CERTIFY_BACKOFF until a rate holds, then bisect between the highest that held and the lowest that
    failed until they are within CERTIFY_TOLERANCE: the answer is within 5% of the rate LoadGen certifies,
    and a rate that did not hold is never the answer. Each run lasts `options.certify_s`, or longer where
    LoadGen's early-stopping estimate needs more queries at that rate; at most `options.certify_tries` runs.
    Fills in `winner`'s certified columns; returns the next point index."""
    served = (
        base
        if not parse_target(cfg.target).sets_policy
        else replace(
            base,
            instances=winner["instances"],
            threads=winner["threads_per_instance"],
            precision=winner["precision"],
            max_batch=winner["max_batch"],
            max_delay_ms=winner["max_delay_ms"],
        )
    )
    certify_cfg = replace(cfg, scenario="server", duration_s=options.certify_s)
    claimed = float(winner["best_qps"])
    held: SearchSummaryRow | None = None
    failed: SearchSummaryRow | None = None  # the lowest rate that did not hold
    last: SearchSummaryRow | None = None
    qps, longer = claimed, 0.0
    with serve(served) as server:
        label = label_of(server.describe().models[base.name])  # as it serves (remote: as its server says)

        def run(rate: float, seconds: float, point_cfg: InferConfig) -> Any:
            """One load point of the stream at `rate` for `seconds`, under `point_cfg`'s scenario."""
            nonlocal point_index
            point = Point(point_index, [replace(stream, qps=rate)], "together", point_cfg.scenario, duration_s=seconds)
            point_index += 1
            (measured,) = measure(
                server, point, point_cfg, queries, run_dir, telemetry=telemetry, on_progress=on_progress
            )
            return measured

        qps = _held_rate(winner, run, cfg, options, summary, log, label)
        if not qps:
            qps = claimed  # not even the lab's own load held a rate: LoadGen is asked the claim, for its verdict
        for attempt in range(options.certify_tries):
            # long enough for a verdict, or as long as LoadGen's early stopping asked for at this rate
            seconds = max(loadgen_duration(qps, options.certify_s, cfg.sla_percentile), longer)
            measured = run(qps, seconds, certify_cfg)
            ok = measured["loadgen_result"] == "VALID" and bool(measured["sla_met"])
            row = SearchSummaryRow(measured, repeat=0, probe=-1 - attempt, passed=ok)
            summary.extend([row])
            summary.flush()
            last = row
            if log:
                log(_certify_line(label, qps, seconds, row, cfg, ok))
            more = queries_needed(row.get("loadgen_reason"))
            lg_p99 = row.get("loadgen_p99_ms")
            if not ok and more and lg_p99 is not None and lg_p99 <= cfg.sla_ms and row["sla_met"]:
                # only the estimate's confidence failed: the same rate, longer, for as long as LoadGen asks for more
                # (near the knee a longer run's answer is often "a few more" again) and the run stays within the cap
                longer = seconds + math.ceil(1.1 * more / qps)  # at least 1 s more: `more` >= 1
                if longer <= CERTIFY_MAX_S:
                    continue
            longer = 0.0
            if ok:
                held = row if held is None or qps > held["target_qps"] else held
            else:
                failed = row if failed is None or qps < failed["target_qps"] else failed
            if held is not None and (
                failed is None or failed["target_qps"] <= held["target_qps"] * (1 + CERTIFY_TOLERANCE)
            ):
                break  # the claim held, or the bracket is narrow enough
            qps = (
                math.sqrt(held["target_qps"] * failed["target_qps"])
                if held is not None and failed is not None
                else qps * _backoff(row, cfg.sla_ms)
            )
    winner["certify_s"] = options.certify_s
    if held is not None:
        winner.update(
            certified_qps=held["target_qps"],
            certified_samples_per_s=held["samples_per_s"],
            certified_result=held["loadgen_result"],
            certified_sla_latency_ms=held["sla_latency_ms"],
        )
        if held["target_qps"] < claimed:
            winner["outcome"] = f"best; certified at {held['target_qps']:,.1f} queries/s (claimed {claimed:,.1f})"
            if held["target_qps"] < 0.9 * (winner.get("held_qps") or claimed) and log:
                log(_disagreement(winner, held, failed))
    else:
        winner.update(
            certified_qps=0.0,
            certified_samples_per_s=0.0,
            certified_result=last["loadgen_result"] if last else None,
            certified_sla_latency_ms=last["sla_latency_ms"] if last else None,
        )
        tries = f"{options.certify_tries} LoadGen Server run(s) of {options.certify_s:g} s or more"
        winner["outcome"] = f"best probed, not certified: no rate from {claimed:,.1f} queries/s down held {tries}"
    return point_index


def _held_rate(
    winner: FrontierRow,
    run: Callable[[float, float, InferConfig], Any],
    cfg: InferConfig,
    options: SearchOptions,
    summary: Any,
    log: Log | None,
    label: str,
) -> float:
    """The best rate as the lab's own open loop holds it over a certification's length, before LoadGen is asked: a
    probe's few seconds claim rates near the knee that a longer run does not hold (a queue that grows slowly: tiny
    at 8,867 queries/s held p99 10.9 ms over 2 s and 21.5 over 5 s), so LoadGen judged a rate nothing had held that
    long. Backs off as `certify` does until a rate holds; fills `held_qps` (0: none did) and its latency, and returns
    the rate held (0.0: none). `run(rate, seconds, cfg)`: one load point's measured row."""
    qps, held = float(winner["best_qps"]), 0.0
    latency: float | None = None
    for attempt in range(options.certify_tries):
        seconds = loadgen_duration(qps, options.certify_s, cfg.sla_percentile)  # as long as LoadGen's run will be
        row = SearchSummaryRow(run(qps, seconds, cfg), repeat=0, probe=-1 - attempt)
        latency = held_latency(row)
        ok = latency is not None and latency <= cfg.sla_ms
        row["passed"] = ok
        summary.extend([row])
        summary.flush()
        if log:
            p = "-" if latency is None else f"{latency:.2f}"
            log(
                f"hold {label} at {qps:,.1f} queries/s for {seconds:g} s (the lab's open loop, as long as "
                f"LoadGen's run): p{cfg.sla_percentile:g} {p} ms: {'holds' if ok else 'does not hold'}"
            )
        if ok:
            held = qps
            break
        qps *= _backoff(row, cfg.sla_ms)
    winner["held_qps"] = held
    winner["held_sla_latency_ms"] = latency if held else None
    return held


def _backoff(row: SearchSummaryRow, sla_ms: float) -> float:
    """The share of a failed rate the next certification tries, before any rate held: CERTIFY_BACKOFF near the
    bound, down to CERTIFY_BACKOFF_MAX where LoadGen's p99 (or the lab's) lies far beyond it (latency grows
    steeply past the knee: a rate at bound / p99 of the failed one lands near it)."""
    p99 = max(row.get("loadgen_p99_ms") or 0.0, row.get("sla_latency_ms") or 0.0)
    if p99 <= sla_ms:
        return CERTIFY_BACKOFF
    return min(CERTIFY_BACKOFF, max(CERTIFY_BACKOFF_MAX, sla_ms / p99))


def _certify_line(label: str, qps: float, seconds: float, row: SearchSummaryRow, cfg: InferConfig, ok: bool) -> str:
    """One certification run in a line, with LoadGen's own reason where it said INVALID."""
    p = "-" if row["sla_latency_ms"] is None else f"{row['sla_latency_ms']:.2f}"
    verdict = row["loadgen_result"]
    if verdict != "VALID" and row.get("loadgen_reason"):
        verdict = f"{verdict} ({row['loadgen_reason']})"
    lg = row.get("loadgen_p99_ms")
    lg_p = "" if lg is None else f"LoadGen's p99 {lg:.2f} ms, "
    return (
        f"certify {label} at {qps:,.1f} queries/s for {seconds:g} s under LoadGen Server: {verdict}, "
        f"{lg_p}the lab's p{cfg.sla_percentile:g} {p} ms: {'holds' if ok else 'does not hold'}"
    )


def _disagreement(winner: FrontierRow, held: SearchSummaryRow, failed: SearchSummaryRow | None) -> str:
    """Why LoadGen certified more than 10% below the open-loop probes: which side was slower, from the runs'
    own latency parts (the issuer's lag, the queue) and LoadGen's reason."""
    claimed, certified = float(winner.get("held_qps") or winner["best_qps"]), float(held["target_qps"])
    line = (
        f"LoadGen certified {certified:,.1f} queries/s, {1 - certified / claimed:.0%} below the "
        + ("rate the lab's open loop held as long" if winner.get("held_qps") else "open-loop probes'")
        + f" {claimed:,.1f}"
    )
    if failed is None:
        return line
    parts = [f"at {failed['target_qps']:,.1f} queries/s LoadGen said {failed['loadgen_result']}"]
    if failed.get("loadgen_reason"):
        parts.append(f"({failed['loadgen_reason']})")
    lg_p99, ours = failed.get("loadgen_p99_ms"), failed.get("sla_latency_ms")
    if lg_p99 is not None and ours is not None:
        if abs(lg_p99 - ours) <= 0.1 * ours:
            side = (
                "both clocks agree: the server itself held less under LoadGen's load, whose issue and completion "
                "callbacks run in the serving process (Python, the GIL), than under the open loop's"
            )
        elif lg_p99 > ours:
            side = (
                "LoadGen's clock is the slower: it counts from its schedule to its completion callback, so its "
                "issue and completion callbacks per query in the serving process (Python, the GIL) are in its "
                "figure and not in the lab's"
            )
        else:
            side = "the lab's clock is the slower"
        parts.append(f"with LoadGen's p99 {lg_p99:.2f} ms against the lab's {ours:.2f} ms for the same queries: {side}")
    return f"{line}: {' '.join(parts)}"

"""Inference experiments: load points (`infer.load_point`), several models together (the search is `infer.search`).

Each experiment is one run directory: `queries.parquet` (one row per query), `summary.parquet`
(one row per model and load point), and for a search `frontier.parquet` (the best rate of
every configuration that meets the latency bound).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, replace
from functools import partial
from pathlib import Path
from typing import cast

from dlrm_lab.config.values import JsonObject, Log
from dlrm_lab.errors import FieldError, RemoteFailure, ServingFault, UserError
from dlrm_lab.infer.calibrate import choose_load
from dlrm_lab.infer.drivers import check_scenario, scenario
from dlrm_lab.infer.load import Stream, check_planned
from dlrm_lab.infer.load_point import OnProgress, Point, measure
from dlrm_lab.infer.loadgen import check_loadgen_duration, loadgen_duration
from dlrm_lab.infer.options import InferConfig
from dlrm_lab.infer.served import ServedModel
from dlrm_lab.infer.sut import SystemUnderTest
from dlrm_lab.infer.targets import check_served_by, parse_target, reach
from dlrm_lab.infer.tune import MAX_AUTO_BATCH, PROBED, choose_max_batch, choose_policy
from dlrm_lab.metrics.columns import schema_of
from dlrm_lab.metrics.cost import price_of
from dlrm_lab.metrics.energy import telemetry_schema
from dlrm_lab.metrics.roofline import load_profile
from dlrm_lab.metrics.run import Run, check_writable
from dlrm_lab.metrics.trust import check_stored_profile


@contextmanager
def queue_room(server: SystemUnderTest, point: Point, duration_s: float) -> Iterator[None]:
    """While a LoadGen offline point runs, each model's queue holds every query it issues at
    once (with room to spare); the bounds are restored afterwards. A server that does not say its
    bound (a remote one: its queue is its own) is left as it is."""
    restore = {}
    if scenario(point.scenario).queues_whole_load:
        models = server.describe().models
        for s in point.streams:
            need = int(s.qps * duration_s * 1.5) + 64
            if (bound := models[s.model].max_queue) is not None and bound < need:
                restore[s.model] = bound
                server.configure(s.model, max_queue=need)
    try:
        yield
    finally:
        for model, bound in restore.items():
            server.configure(model, max_queue=bound)


def run_inference(
    models: list[ServedModel],
    streams: list[Stream],
    cfg: InferConfig,
    *,
    metrics_dir: str | Path = "runs",
    argv: list[str] | None = None,
    log: Log | None = None,
    on_progress: OnProgress | None = None,
) -> Path:
    """Serve `models` under `streams` (one per model) at one load point and record it.

    With several models they are first served together, then (with `compare_alone`) each
    alone under the same load: the difference is their interference. `on_progress` hears
    how far each point's load is (points 0, 1, ... of `cfg.duration_s` each).
    """
    if len(streams) != len(models):
        raise UserError(f"{len(models)} models but {len(streams)} load streams")
    load = check_scenario(cfg.scenario, len(models), cfg.qps_auto)
    if cfg.sla_auto and not cfg.qps_auto:
        raise FieldError("sla_ms", "auto: needs {qps} auto (the bound is chosen with the load)", "qps")
    if len(models) > 1 and (probed := [k for k in PROBED if k in cfg.tune]):
        raise FieldError(probed[0], "auto: one {model} (its probes run one model's load)", "model")
    check_writable(metrics_dir, "metrics_dir")
    target = parse_target(cfg.target)
    if not cfg.qps_auto and load.rate:  # auto: a probed rate, below capacity
        check_planned(sum(s.qps for s in streams), cfg.duration_s)
        if load.sized_by_early_stopping:
            check_loadgen_duration(streams[0].qps, cfg.duration_s, cfg.sla_percentile)
    auto_batch_queued = load.queues_whole_load and "max_batch" in cfg.tune
    models = [for_load(m, s, auto_batch_queued) for m, s in zip(models, streams, strict=True)]
    check_served_by(target, models, device=cfg.device)  # before its run directory exists
    check_stored_profile(log)
    # a damaged stored price is refused now, not after the load (the server's only where it runs here)
    price_of(load_profile() if target.on_this_host else None, cfg.price_per_hour, cfg.currency)
    config: JsonObject = {
        "infer": cfg.to_dict(),
        "models": [m.describe() for m in models],
        "streams": [{**stream_config(s), **({"qps": "auto"} if cfg.qps_auto else {})} for s in streams],
    }
    reached = reach(
        target, models, cfg.connection(), device=cfg.device, pin_cores=cfg.pin_cores, seed=cfg.seed, log=log
    )
    with reached as serving:
        run = Run.create(metrics_dir, "infer", config, argv=argv)
        with faults_name_the_run(run), run:
            queries = run.table("queries", schema_of("queries"))
            summary = run.table("summary", schema_of("infer summary"))
            telemetry = run.table("telemetry", telemetry_schema("point"))
            with serving() as server:
                said = server.describe()
                if log and said.about:
                    log(said.about)
                run.update_manifest(**said.record)
                policies: dict[str, JsonObject] = {}

                def tune(s: Stream, bound: float) -> None:
                    policies[s.model] = choose_policy(
                        server,
                        s,
                        cfg.tune,
                        sla_ms=bound,
                        percentile=cfg.sla_percentile,
                        whole_load_queued=load.queues_whole_load,
                        probe_s=cfg.calibrate_s / 2,
                        seed=cfg.seed,
                        drain_s=cfg.drain_timeout_s,
                        log=log,
                    ).to_dict()

                if cfg.qps_auto:
                    (stream,) = streams
                    if log:
                        log("choosing the load: an idle server's latency, closed-loop capacity, then a short bisection")
                    # what of the policy is auto is chosen inside: the bound's max batch before capacity, the rest at
                    # half of it, so that capacity and the probes measure the policy then served
                    choice = choose_load(
                        server,
                        stream,
                        sla_ms=None if cfg.sla_auto else (stream.sla_ms or cfg.sla_ms),
                        percentile=cfg.sla_percentile,
                        probe_s=cfg.calibrate_s,
                        seed=cfg.seed,
                        drain_s=cfg.drain_timeout_s,
                        settle=(
                            partial(choose_max_batch, server, stream, whole_load_queued=load.queues_whole_load)
                            if "max_batch" in cfg.tune
                            else None
                        ),
                        tune_at=(lambda qps, bound: tune(replace(stream, qps=qps), bound)) if cfg.tune else None,
                    )
                    streams = [replace(stream, qps=choice.qps, sla_ms=choice.sla_ms)]
                    cfg = replace(cfg, sla_ms=choice.sla_ms)
                    if load.sized_by_early_stopping:
                        seconds = loadgen_duration(choice.qps, cfg.duration_s, cfg.sla_percentile)
                        if seconds > cfg.duration_s and log:
                            log(
                                f"--duration {cfg.duration_s:g} s sized up to {seconds:g} s: at {choice.qps:.1f} "
                                "queries/s LoadGen's early-stopping estimate needs that many queries"
                            )
                        cfg = replace(cfg, duration_s=seconds)
                    run.update_manifest(load_choice=choice.to_dict())
                    if log:
                        log(choice.reason)
                        log(choice.roof_reason)
                elif cfg.tune:
                    for s in streams:
                        tune(s, s.sla_ms or cfg.sla_ms)
                if policies:
                    run.update_manifest(policy_choices=policies)
                points = [Point(0, streams, "together", cfg.scenario)]
                if len(streams) > 1 and cfg.compare_alone:
                    points += [Point(k + 1, [s], "alone", cfg.scenario) for k, s in enumerate(streams)]
                for point in points:
                    with queue_room(server, point, cfg.duration_s):
                        rows = measure(
                            server,
                            point,
                            cfg,
                            queries,
                            run.dir,
                            log,
                            telemetry,
                            on_progress,
                            trace=cfg.trace and point.index == 0,
                        )
                    summary.extend(cast(list[dict[str, str | float | bool | None]], rows))  # rows (list: invariant)
                    if stopped := next((r["issue_stopped"] for r in rows if r.get("issue_stopped")), None):
                        run.fails_at_end(f"point {point.index}: {stopped}")
                    if failed := next((r["error"] for r in rows if r.get("error")), None):
                        summary.flush()
                        raise RemoteFailure(f"point {point.index}: {failed}; rows kept in {run.dir}")
                    if cfg.trace and point.index == 0 and (run.dir / "trace.json").exists():
                        run.update_manifest(trace="trace.json")
                    summary.flush()
    return run.dir


@contextmanager
def faults_name_the_run(run: Run) -> Iterator[None]:
    """A serving fault's one line says where what was measured before it is (the run marks itself failed)."""
    try:
        yield
    except ServingFault as exc:
        raise ServingFault(f"{exc}; run {run.dir} marked failed, the queries before it kept") from None


def for_load(served: ServedModel, stream: Stream, auto_batch_queued: bool = False) -> ServedModel:
    """`served` knowing the queries it will get: the largest (its 99.9th percentile, what a piece may
    be cut from) and the batch sizes its build is timed at: the median query and the largest batch, which is
    the auto max batch's cap where the whole load is queued and the max batch is yet to be chosen (Offline's
    batches run to thousands, and a build that wins at 256 samples may lose there: `aoti_frozen` on DLRMv2 at
    fp16, 11.8 against `aoti`'s 14.2 ms at 256, 89 against 72 at 2,048, AMX)."""
    served = replace(served, largest_query=max(served.largest_query, stream.sizes.quantile(0.999)))
    if served.build_batches:
        return served
    median = min(stream.sizes.quantile(0.5), served.max_batch)
    largest = MAX_AUTO_BATCH if auto_batch_queued else served.max_batch
    return replace(served, build_batches=(median, largest))


def stream_config(s: Stream) -> JsonObject:
    return {
        "model": s.model,
        "qps": s.qps,
        "query_sizes": str(s.sizes),
        "arrival": asdict(s.arrivals),
        "sla_ms": s.sla_ms,
    }

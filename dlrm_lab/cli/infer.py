"""`dlrm-lab infer run|search`: latency-bounded inference throughput."""

from __future__ import annotations

import sys
from typing import Annotated, Any, Optional

import pyarrow.parquet as pq
import typer
from rich.table import Table

from dlrm_lab.cli.format import console, say_interrupted
from dlrm_lab.cli.format import progress as progress_display
from dlrm_lab.cli.options import MaxRows, MetricsDir, TableScale
from dlrm_lab.errors import UserError, raise_on_sigterm
from dlrm_lab.metrics import columns

app = typer.Typer(help="Inference lab: dynamic batching, co-location, MLPerf LoadGen, latency-bounded search.")

Models = Annotated[
    Optional[list[str]],
    typer.Option("--model", "-m", "--preset", "-p", help="Model preset to serve; repeat to co-locate several."),
]
Qps = Annotated[
    Optional[list[str]],
    typer.Option(
        "--qps",
        help="Target queries/s (one, or one per --model), or auto: the lab measures capacity and picks a rate "
        "meeting the bound (one model).",
    ),
]
QuerySize = Annotated[
    Optional[list[str]],
    typer.Option(
        "--query-size",
        help="Samples per query: fixed:N, normal:MEAN,STD, lognormal:MEDIAN,SIGMA, uniform:LO,HI or mlperf "
        "(100-700). One, or one per --model. Default: fixed:1.",
    ),
]
Arrival = Annotated[
    str,
    typer.Option(help="Open-loop arrivals: poisson, constant, or bursty[:FACTOR,SHARE,LENGTH_MS] (bursts at FACTOR "
                      "x the mean rate for SHARE of the time, LENGTH_MS long on average; default 4,0.1,50)."),
]  # fmt: skip
Duration = Annotated[float, typer.Option("--duration", help="Seconds of load per point.")]
Warmup = Annotated[
    float,
    typer.Option(
        "--warmup",
        help="Seconds of untimed load before each point (its own rate and sizes; at most a quarter of the point).",
    ),
]
SlaMs = Annotated[
    Optional[list[str]],
    typer.Option(
        "--sla-ms",
        help="Latency bound in ms (one, or one per model), or auto with --qps auto: 2.5x the latency of one "
        "query at a time.",
    ),
]
Percentile = Annotated[float, typer.Option(help="Latency percentile the bound applies to.")]
Instances = Annotated[int, typer.Option(help="Co-located instances (worker processes) per model.")]
Threads = Annotated[int, typer.Option(help="Intra-op threads per instance.")]
MaxQueue = Annotated[int, typer.Option(help="Waiting queries per model before new ones are dropped.")]
MaxBatch = Annotated[int, typer.Option(help="Largest batch in samples (larger queries are split across instances).")]
MaxDelayMs = Annotated[float, typer.Option(help="Longest a query waits for its batch to fill.")]
MinPiece = Annotated[
    int,
    typer.Option(
        help="Smallest piece a query is split into over idle instances (0: measured at start, where a batch's "
        "fixed cost equals its samples' cost)."
    ),
]
SpinMs = Annotated[
    float,
    typer.Option(
        help="An idle instance polls for its next batch this long before it sleeps: a core that just slept runs "
        "the next batch slower (0: sleep at once)."
    ),
]
MaxIssueLagMs = Annotated[
    float,
    typer.Option(
        help="Open loop: stop the load (rows kept, exit 1) once a query is this many ms past its arrival time "
        "before it could be issued: the issuer, not the server, has fallen behind."
    ),
]
Precision = Annotated[
    str,
    typer.Option(
        help="Dense compute: auto (measured: a lower precision only where its GEMMs are faster), fp32, "
        "bf16 (autocast) or fp16."
    ),
]
TablePrecision = Annotated[
    str, typer.Option(help="Embedding tables: fp32, fp16, int8 or int4 (row-wise quantised, fbgemm).")
]
Build = Annotated[
    str,
    typer.Option(
        help="Inference form served: auto (timed at start: the fastest whose scores pass the accuracy check), "
        "eager (the training module), fused (one fused fbgemm table lookup, weights stored in the served "
        "precision) or compiled (fused, dense part compiled by Inductor with freezing)."
    ),
]
Device = Annotated[str, typer.Option(help="cpu or cuda.")]
PinCores = Annotated[bool, typer.Option(help="Pin each instance to its own cores.")]
Seed = Annotated[int, typer.Option(help="Seed of the load, the samples and the weights.")]
DataSpec = Annotated[Optional[str], typer.Option(help="Synthetic data spec of the samples (default: the preset's).")]
Order = Annotated[
    str, typer.Option(help="Which samples queries take: random, or time (the library's order; HSTU requests by time).")
]
HistoryCacheMb = Annotated[
    float,
    typer.Option(help="HSTU presets: MB per instance of users' encoded histories, reused by their next request."),
]
Attention = Annotated[str, typer.Option(help="HSTU presets: padded, jagged, or auto (timed at start).")]
HistoryAffinity = Annotated[
    bool, typer.Option(help="HSTU with history reuse: send a user's requests to the instance holding their history.")
]
SetData = Annotated[
    Optional[list[str]], typer.Option("--set", help="HSTU presets: KEY=VALUE on the preset's [data] (its requests).")
]
Target = Annotated[
    str,
    typer.Option(
        help="The system under test: in-process (the lab's server, here), grpc://HOST:PORT (a dlrm-lab serve), or "
        "kserve://HOST:PORT[/MODEL] (any Open Inference Protocol v2 gRPC server: Triton, KServe, ours). Remote "
        "targets serve with their own settings: --instances, --threads, --precision ... apply in process only."
    ),
]
Rpc = Annotated[
    Optional[str],
    typer.Option(help="grpc:// targets: stream (one InferStream per connection, the default) or unary (an Infer "
                      "call per query); kserve:// targets: oip (a ModelInfer call per query)."),
]  # fmt: skip
Concurrency = Annotated[
    int,
    typer.Option(help="Remote targets: client connections, each beyond one in a process of its own; a closed loop "
                      "(--scenario closed-loop) keeps this many queries outstanding."),
]  # fmt: skip
Timeout = Annotated[float, typer.Option("--timeout", help="Remote targets: seconds a query may take (its deadline).")]
ConnectTimeout = Annotated[float, typer.Option(help="Remote targets: seconds to wait for the server at start.")]
UnavailableS = Annotated[
    float,
    typer.Option("--unavailable-s", help="Remote targets: the server is lost after only UNAVAILABLE this long."),
]
PricePerHour = Annotated[
    Optional[float],
    typer.Option(help="The machine's price per hour for the cost columns (default: the price stored with "
                      "`dlrm-lab machine price`, if any; a remote server's machine: give it here)."),
]  # fmt: skip
Currency = Annotated[Optional[str], typer.Option(help="Currency of --price-per-hour (default: USD).")]
ShowProgress = Annotated[bool, typer.Option(help="Show progress (a bar on a terminal, else a line every few s).")]
# a terminal bar redraws in the serving process: seldom, to stay out of the measured latency
_REFRESH_PER_S = 1.0


@app.command("run")
def run_command(
    model: Models = None,
    scenario: Annotated[
        str,
        typer.Option(
            help="open-loop (our generator), closed-loop (--concurrency queries outstanding) or MLPerf "
            "LoadGen: server, offline, single-stream, multi-stream."
        ),
    ] = "open-loop",  # fmt: skip
    target: Target = "in-process",
    rpc: Rpc = None,
    concurrency: Concurrency = 1,
    timeout: Timeout = 30.0,
    connect_timeout: ConnectTimeout = 10.0,
    unavailable_s: UnavailableS = 3.0,
    price_per_hour: PricePerHour = None,
    currency: Currency = None,
    qps: Qps = None,
    query_size: QuerySize = None,
    arrival: Arrival = "poisson",
    duration: Duration = 5.0,
    warmup: Warmup = 0.5,
    sla_ms: SlaMs = None,
    percentile: Percentile = 99.0,
    instances: Instances = 1,
    threads: Threads = 1,
    max_batch: Annotated[
        str,
        typer.Option(
            help="Largest batch in samples, or auto: from the batch cost the instances measure, large enough that "
            "the per-batch cost is at most 10% of a batch, a full batch at most a quarter of the bound."
        ),
    ] = "auto",
    max_delay_ms: Annotated[
        str,
        typer.Option(
            help="Longest a query waits for its batch to fill, or auto: the delay of 0-2 ms with the lowest latency "
            "percentile in short probes at the point's own load."
        ),
    ] = "1",
    max_queue: MaxQueue = 4096,
    min_piece: MinPiece = 0,
    spin_ms: Annotated[
        str,
        typer.Option(
            help="An idle instance polls for its next batch this long before it sleeps (a core that slept runs the "
            "next batch slower), or auto: chosen like --max-delay-ms, kept only where it beats no spin by 5%."
        ),
    ] = "0",
    max_issue_lag_ms: MaxIssueLagMs = 1000.0,
    precision: Precision = "auto",
    table_precision: TablePrecision = "fp32",
    build: Build = "auto",
    device: Device = "cpu",
    pin_cores: PinCores = True,
    alone: Annotated[bool, typer.Option(help="With several models, also serve each alone (interference).")] = True,
    data_spec: DataSpec = None,
    order: Order = "random",
    history_cache_mb: HistoryCacheMb = 0.0,
    history_affinity: HistoryAffinity = True,
    attention: Attention = "auto",
    set_: SetData = None,
    table_scale: TableScale = None,
    max_rows: MaxRows = None,
    seed: Seed = 0,
    trace: Annotated[
        bool,
        typer.Option(
            help="Write trace.json: a Chrome/Perfetto trace of the (first) point, torch.profiler's operators in "
            "every instance with the lab's queries and batches (open it in ui.perfetto.dev)."
        ),
    ] = False,
    metrics_dir: MetricsDir = "runs",
    progress: ShowProgress = True,
) -> None:
    """Serve one load point (or several models together) and record every query."""
    options = dict(locals())  # the parameters alone, before any other name is bound
    from dlrm_lab.commands import infer_setup
    from dlrm_lab.infer.lab import PointProgress, run_inference

    served, load, cfg = infer_setup(options)  # the one construction (sweeps check their points with it too)
    streams, n = load.streams, len(served)
    raise_on_sigterm()
    out = console(stderr=True)
    points = 1 + (n if n > 1 and alone else 0)
    bar = progress_display("point {task.fields[point]}", "{task.fields[queries]:,} queries", unit="s of load",
                           rate=False, to=out, enabled=progress, refresh_per_second=_REFRESH_PER_S)  # fmt: skip
    task = bar.add_task("infer", total=points * duration, point=f"1/{points}", queries=0)

    def on_progress(p: PointProgress) -> None:
        done = p.duration_s if p.finished else min(p.elapsed_s, p.duration_s)
        bar.update(task, completed=p.point * p.duration_s + done, point=f"{p.point + 1}/{points}", queries=p.queries)

    with say_interrupted(out), bar:
        run_dir = run_inference(
            served, streams, cfg, metrics_dir=metrics_dir, argv=["dlrm-lab", *sys.argv[1:]],
            log=lambda msg: out.print(msg, highlight=False), on_progress=on_progress,
        )  # fmt: skip
    invalid, stopped = _print_points(run_dir)
    console().print(f"run directory: {run_dir}")
    if stopped:  # the load was not what was asked: the numbers must not pass for it
        out.print(f"error: {stopped}; rows kept in {run_dir}", highlight=False, soft_wrap=True)
        raise typer.Exit(1)
    if invalid:  # a failed verdict fails the command, as a regression fails `compare`: scripts gate on it
        reasons = "; ".join(f"{model}: {why}" if why else model for model, why in invalid)
        out.print(f"error: MLPerf LoadGen's verdict is INVALID for {reasons} (LoadGen's summary: "
                  f"{run_dir}/loadgen/point-*/mlperf_log_summary.txt)", highlight=False, soft_wrap=True)  # fmt: skip
        raise typer.Exit(1)


def _print_points(run_dir: Any) -> tuple[list[tuple[str, str | None]], str | None]:
    """Print the points' table; return the models whose LoadGen verdict was INVALID (with LoadGen's reason), and why
    the first load stopped issuing early (None: none did)."""
    rows = pq.read_table(run_dir / "summary.parquet").to_pylist()
    table = Table(title=f"inference ({rows[0]['scenario']})")
    for name in columns.INFER_PRINTED:
        table.add_column(columns.column(name).narrow, justify="right")
    for r in rows:
        table.add_row(*(columns.fmt(name, r.get(name)) for name in columns.INFER_PRINTED))
    console().print(table)
    remote = [r for r in rows if r.get("rpc") is not None]
    if remote:  # what crossing the network cost, beside the latency it is part of
        table = Table(title=f"over the network ({remote[0]['target']})")
        for name in columns.TRANSFER_PRINTED:
            table.add_column(columns.column(name).narrow, justify="right")
        for r in remote:
            table.add_row(*(columns.fmt(name, r.get(name)) for name in columns.TRANSFER_PRINTED))
        console().print(table)
    for r in rows:
        if r.get("server_lost"):
            console().print(f"{r['model']}: {r['error']}")
        if r["loadgen_result"]:
            console().print(
                f"MLPerf LoadGen ({r['model']}): {r['loadgen_result']}, {r['loadgen_queries_per_s']:.1f} queries/s, "
                f"p99 {r['loadgen_p99_ms']:.2f} ms (LoadGen's own accounting; logs in {run_dir}/loadgen)"
            )
    stopped = next((f"point {r['point']}: {r['issue_stopped']}" for r in rows if r.get("issue_stopped")), None)
    invalid = [(r["model"], r.get("loadgen_reason")) for r in rows if r["loadgen_result"] == "INVALID"]
    return invalid, stopped


@app.command("search")
def search_command(
    model: Models = None,
    scenario: Annotated[
        str, typer.Option(help="Load of each probe: open-loop (our generator) or server (MLPerf LoadGen).")
    ] = "open-loop",
    target: Annotated[
        str,
        typer.Option(
            help="The system under test (see `infer run --help`); a remote server is searched as it "
            "serves: its rate alone, --layouts, --max-batch and --max-delay-ms apply in process."
        ),
    ] = "in-process",  # fmt: skip
    rpc: Rpc = None,
    concurrency: Concurrency = 1,
    timeout: Timeout = 30.0,
    connect_timeout: ConnectTimeout = 10.0,
    unavailable_s: UnavailableS = 3.0,
    price_per_hour: PricePerHour = None,
    currency: Currency = None,
    query_size: Annotated[str, typer.Option(help="Samples per query (see `infer run --help`).")] = "fixed:1",
    arrival: Arrival = "poisson",
    sla_ms: Annotated[float, typer.Option(help="Latency bound in ms.")] = 10.0,
    percentile: Percentile = 99.0,
    max_batch: Annotated[str, typer.Option(help="Largest batches to try, in samples.")] = "64,256,1024",
    max_delay_ms: Annotated[str, typer.Option(help="Batching delays to try, in ms.")] = "0.5,2",
    layouts: Annotated[
        Optional[str],
        typer.Option(help="instances x threads to try, e.g. 1x1,2x1 (default: all with instances x threads <= cores)."),
    ] = None,
    duration: Duration = 1.0,
    warmup: Warmup = 0.5,
    repeats: Annotated[int, typer.Option(help="Load points per probed rate (the median decides).")] = 2,
    steps: Annotated[int, typer.Option(help="Bisection probes per configuration at most.")] = 6,
    tolerance: Annotated[float, typer.Option(help="Stop when the bracket is this narrow (relative).")] = 0.05,
    capacity_duration: Annotated[float, typer.Option(help="Seconds of the closed-loop capacity run.")] = 1.0,
    min_queries: Annotated[
        int, typer.Option(help="A probe lasts until this many queries arrived (for a stable percentile)...")
    ] = 500,
    max_probe_duration: Annotated[float, typer.Option(help="... but at most this many seconds.")] = 20.0,
    prune_margin: Annotated[
        float,
        typer.Option(help="Skip a configuration whose capacity x (1 + this) is below the best rate found (< 0: off)."),
    ] = 0.10,
    early_stop: Annotated[
        bool,
        typer.Option(
            help="End a probe once decided: its load when more queries were late than its percentile allows, its "
            "repeats when all lie 25% or more on one side of the bound."
        ),
    ] = True,
    certify_duration: Annotated[
        float,
        typer.Option(
            help="Seconds of the MLPerf LoadGen Server run that certifies the best rate (backed off until it "
            "holds); 0: not certified."
        ),
    ] = 60.0,
    certify_tries: Annotated[int, typer.Option(help="Certification runs at most, each at 0.9x the rate before.")] = 3,
    max_queue: MaxQueue = 4096,
    min_piece: MinPiece = 0,
    spin_ms: SpinMs = 0.0,
    precision: Precision = "auto",
    table_precision: TablePrecision = "fp32",
    build: Build = "auto",
    device: Device = "cpu",
    pin_cores: PinCores = True,
    data_spec: DataSpec = None,
    order: Order = "random",
    history_cache_mb: HistoryCacheMb = 0.0,
    history_affinity: HistoryAffinity = True,
    attention: Attention = "auto",
    set_: SetData = None,
    table_scale: TableScale = None,
    max_rows: MaxRows = None,
    seed: Seed = 0,
    metrics_dir: MetricsDir = "runs",
    progress: ShowProgress = True,
) -> None:
    """Find, per configuration, the highest queries/s whose latency percentile meets the bound."""
    from dlrm_lab.infer.lab import InferConfig, PointProgress
    from dlrm_lab.infer.options import ServingOptions, number_list, parse_layouts, plan_load
    from dlrm_lab.infer.search import SearchGrid, SearchOptions, search

    if len(model or []) > 1:
        raise UserError("infer search: one --model at a time")
    grid = SearchGrid(parse_layouts(layouts), number_list(max_batch, int, "--max-batch"),
                      number_list(max_delay_ms, float, "--max-delay-ms"))  # fmt: skip
    if any(b < 1 for b in grid.max_batch) or any(d < 0 for d in grid.max_delay_ms):
        raise UserError("--max-batch values must be >= 1 and --max-delay-ms values >= 0")
    cfg = InferConfig(scenario=scenario, duration_s=duration, sla_ms=sla_ms, sla_percentile=percentile, seed=seed,
                      device=device, pin_cores=pin_cores, warmup_s=warmup, target=target, rpc=rpc,
                      concurrency=concurrency, timeout_s=timeout, connect_timeout_s=connect_timeout,
                      unavailable_s=unavailable_s, price_per_hour=price_per_hour, currency=currency)  # fmt: skip
    options = SearchOptions(repeats=repeats, steps=steps, tolerance=tolerance, capacity_s=capacity_duration,
                            min_queries=min_queries, max_duration_s=max_probe_duration, prune_margin=prune_margin,
                            early_stop=early_stop, certify_s=certify_duration,
                            certify_tries=certify_tries)  # fmt: skip
    (base,) = ServingOptions(max_queue=max_queue, min_piece=min_piece, spin_ms=spin_ms, precision=precision,
                             table_precision=table_precision, build=build, data_spec=data_spec, table_scale=table_scale,
                             max_rows=max_rows, history_cache_mb=history_cache_mb, attention=attention,
                             history_affinity=history_affinity,
                             data_overrides=tuple(set_ or ())).served(model)  # fmt: skip
    (stream,) = plan_load([base], ["1"], [query_size], [str(sla_ms)], arrival, order).streams
    raise_on_sigterm()
    out = console(stderr=True)
    bar = progress_display("{task.fields[probe]}", unit="probe points", rate=False, to=out, enabled=progress,
                           refresh_per_second=_REFRESH_PER_S)  # fmt: skip
    task = bar.add_task("search", total=None, probe="")

    def on_progress(p: PointProgress) -> None:
        shown = p.duration_s if p.finished else min(p.elapsed_s, p.duration_s)
        probe = f"point {p.point}: {shown:.1f}/{p.duration_s:.1f} s of load, {p.queries:,} queries"
        bar.update(task, completed=p.point + p.finished, probe=probe)

    with say_interrupted(out), bar:
        run_dir = search(base, stream, grid, cfg, options, metrics_dir=metrics_dir, argv=["dlrm-lab", *sys.argv[1:]],
                         log=lambda msg: out.print(msg, highlight=False), on_progress=on_progress)  # fmt: skip
    rows = pq.read_table(run_dir / "frontier.parquet").to_pylist()
    table = Table(title=f"highest queries/s with p{percentile:g} <= {sla_ms:g} ms ({base.name}, {query_size})")
    for name in columns.FRONTIER_PRINTED:
        heading = f"p{percentile:g} ms" if name == "best_sla_latency_ms" else columns.column(name).narrow
        table.add_column(heading, justify="right")
    for r in rows:
        table.add_row(*(columns.fmt(name, r.get(name)) for name in columns.FRONTIER_PRINTED))
    console().print(table)
    console().print(_answer(rows, percentile, sla_ms))
    console().print(f"run directory: {run_dir}")


def _answer(frontier: list[dict[str, Any]], percentile: float, sla_ms: float) -> str:
    """The search's answer: the rate a LoadGen Server run certified, never a rate that did not hold."""
    best = next((r for r in frontier if r["best"]), None)
    bound = f"p{percentile:g} <= {sla_ms:g} ms"
    if best is None:
        return f"answer: no configuration met {bound}"
    claimed = f"the search's probes claimed {best['best_qps']:,.1f}"
    if best.get("certified_qps") is None:
        return f"answer: {best['best_qps']:,.1f} queries/s under {bound}, not certified (--certify-duration 0)"
    if not best["certified_qps"]:
        return f"answer: no certified rate under {bound} ({claimed}; {best['outcome']})"
    return (f"answer: {best['certified_qps']:,.1f} queries/s ({best['certified_samples_per_s']:,.0f} samples/s) "
            f"under {bound}, certified by a {best['certify_s']:g} s MLPerf LoadGen Server run "
            f"({best['certified_result']}; {claimed})")  # fmt: skip

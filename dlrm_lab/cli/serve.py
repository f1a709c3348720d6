"""`dlrm-lab serve` and `dlrm-lab client`: inference over gRPC (docs/serving.md)."""

from __future__ import annotations

import sys
from typing import Annotated, Any, Optional

import typer
from rich.table import Table

from dlrm_lab.cli.format import console
from dlrm_lab.cli.infer import (
    Arrival,
    Build,
    DataSpec,
    Device,
    Duration,
    Instances,
    MaxBatch,
    MaxDelayMs,
    MaxIssueLagMs,
    MaxQueue,
    MinPiece,
    Models,
    PinCores,
    Precision,
    SpinMs,
    TablePrecision,
    Threads,
)
from dlrm_lab.cli.options import MaxRows, MetricsDir, TableScale
from dlrm_lab.errors import UserError, raise_on_sigterm
from dlrm_lab.infer.served import DEFAULT_MAX_QUERY_SAMPLES
from dlrm_lab.metrics import columns


def serve_command(
    model: Models = None,
    host: Annotated[str, typer.Option(help="Address to listen on (0.0.0.0: every IPv4 interface).")] = "0.0.0.0",
    port: Annotated[int, typer.Option(help="TCP port (0: any free port; the start line names it).")] = 50051,
    instances: Instances = 1,
    threads: Threads = 1,
    max_batch: MaxBatch = 256,
    max_delay_ms: MaxDelayMs = 1.0,
    max_queue: MaxQueue = 4096,
    max_query_samples: Annotated[
        int,
        typer.Option(
            help="The largest query accepted, in samples (larger: INVALID_ARGUMENT naming the bound); a query "
            "larger than one piece per instance takes its turns behind the others."
        ),
    ] = DEFAULT_MAX_QUERY_SAMPLES,
    min_piece: MinPiece = 0,
    spin_ms: SpinMs = 0.0,
    precision: Precision = "auto",
    table_precision: TablePrecision = "fp32",
    build: Build = "auto",
    device: Device = "cpu",
    pin_cores: PinCores = True,
    data_spec: DataSpec = None,
    table_scale: TableScale = None,
    max_rows: MaxRows = None,
    seed: Annotated[int, typer.Option(help="Seed of the weights and of the sample library Describe announces.")] = 0,
    grace: Annotated[
        float, typer.Option(help="On SIGTERM/Ctrl-C, seconds queries in flight may take to finish.")
    ] = 10.0,
    metrics_dir: MetricsDir = "runs",
) -> None:
    """Serve models over gRPC until SIGTERM or Ctrl-C (every query recorded in a `serve` run)."""
    from dlrm_lab.infer.options import ServingOptions
    from dlrm_lab.serve.server import serve

    served = ServingOptions(
        instances=instances, threads=threads, max_batch=max_batch, max_delay_ms=max_delay_ms, max_queue=max_queue,
        min_piece=min_piece, spin_ms=spin_ms, precision=precision, table_precision=table_precision, data_spec=data_spec,
        table_scale=table_scale, build=build, max_rows=max_rows, max_query_samples=max_query_samples,
    ).served(model)  # fmt: skip
    raise_on_sigterm()  # during start-up; serving installs its own graceful handler
    out = console(stderr=True)

    def log(msg: str) -> None:
        out.print(msg, highlight=False, soft_wrap=True)

    run_dir = serve(
        served, host=host, port=port, device=device, pin_cores=pin_cores, seed=seed, grace_s=grace,
        metrics_dir=metrics_dir, argv=["dlrm-lab", *sys.argv[1:]], log=log,
    )  # fmt: skip
    console().print(f"run directory: {run_dir}")


def client_command(
    target: Annotated[str, typer.Option(help="The server, HOST:PORT.")],
    concurrency: Annotated[int, typer.Option(help="Client worker processes, each with its own channel.")] = 1,
    qps: Annotated[
        Optional[float], typer.Option(help="Open loop: total target queries/s, split evenly over the workers.")
    ] = None,
    closed_loop: Annotated[
        bool, typer.Option("--closed-loop", help="Closed loop: each worker keeps one query outstanding.")
    ] = False,
    query_size: Annotated[
        str,
        typer.Option(
            help="Samples per query: fixed:N, normal:MEAN,STD, lognormal:MEDIAN,SIGMA, uniform:LO,HI, mlperf."
        ),
    ] = "fixed:1",
    arrival: Arrival = "poisson",
    duration: Duration = 10.0,
    model: Annotated[Optional[str], typer.Option(help="Served model to query (default: the first served).")] = None,
    seed: Annotated[int, typer.Option(help="Seed of the load (worker k uses seed + k).")] = 0,
    timeout: Annotated[float, typer.Option(help="Seconds a query may take before DEADLINE_EXCEEDED.")] = 30.0,
    unavailable_s: Annotated[
        float, typer.Option(help="Give up when the server has been UNAVAILABLE this many seconds.")
    ] = 3.0,
    connect_timeout: Annotated[float, typer.Option(help="Seconds to wait for the server at start.")] = 10.0,
    scenario: Annotated[
        str,
        typer.Option(
            help="open-loop, or an MLPerf LoadGen scenario (server, offline, single-stream, multi-stream) "
            "whose system under test forwards every query over gRPC (--concurrency 1, --qps)."
        ),
    ] = "open-loop",  # fmt: skip
    sla_ms: Annotated[float, typer.Option("--sla-ms", help="LoadGen's latency bound in ms.")] = 10.0,
    percentile: Annotated[float, typer.Option(help="LoadGen's latency percentile.")] = 99.0,
    max_issue_lag_ms: MaxIssueLagMs = 1000.0,
    rpc: Annotated[
        str,
        typer.Option(
            help="stream: one bidirectional InferStream per worker; unary: one Infer call per query; oip: one "
            "ModelInfer call per query, the Open Inference Protocol (KServe v2)."
        ),
    ] = "stream",
    metrics_dir: MetricsDir = "runs",
) -> None:
    """Drive a remote `dlrm-lab serve` with concurrent clients; record every query's stages."""
    from dlrm_lab.serve.client import ClientOptions, run_client
    from dlrm_lab.serve.remote import ServerLost

    if (qps is None) == (not closed_loop):
        raise UserError("give either --qps Q (open loop) or --closed-loop")
    options = ClientOptions(
        target=target, concurrency=concurrency, qps=qps, query_sizes=query_size, arrival=arrival,
        duration_s=duration, model=model, seed=seed, timeout_s=timeout, unavailable_s=unavailable_s,
        connect_timeout_s=connect_timeout, scenario=scenario, sla_ms=sla_ms, sla_percentile=percentile,
        max_issue_lag_ms=max_issue_lag_ms, rpc=rpc,
    )  # fmt: skip
    raise_on_sigterm()
    out = console(stderr=True)
    try:
        run_dir, summary = run_client(
            options, metrics_dir=metrics_dir, argv=["dlrm-lab", *sys.argv[1:]],
            log=lambda msg: out.print(msg, highlight=False, soft_wrap=True),
        )  # fmt: skip
    except ServerLost as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    _print_summary(summary)
    console().print(f"run directory: {run_dir}")
    if summary["issue_stopped"]:  # the load was not what was asked: the numbers must not pass for it
        typer.echo(f"error: {summary['issue_stopped']}; rows kept in {run_dir}", err=True)
        raise typer.Exit(1)


def _print_summary(r: dict[str, Any]) -> None:
    def f(v: Any, spec: str) -> str:
        return "-" if v is None else format(v, spec)

    how = f"{r['mode']}, {r['rpc']} RPC, {r['concurrency']} workers"
    table = Table(title=f"client: {r['model']} at {r['target']} ({how})")
    for name in columns.CLIENT_PRINTED:
        table.add_column(columns.column(name).narrow, justify="right")
    table.add_row(*(columns.fmt(name, r.get(name)) for name in columns.CLIENT_PRINTED))
    console().print(table)
    from dlrm_lab.serve.records import STAGES

    shares = ", ".join(f"{s} {f(r[f'{s}_share'], '.0%')}" for s in STAGES)
    console().print(f"share of mean latency: {shares}")
    if r.get("loadgen_result"):
        console().print(f"MLPerf LoadGen: {r['loadgen_result']}, {f(r['loadgen_queries_per_s'], '.1f')} queries/s, "
                        f"p99 {f(r['loadgen_p99_ms'], '.2f')} ms (its own accounting)")  # fmt: skip
    if r["errors_by_code"]:
        console().print("errors: " + ", ".join(f"{code} {n}" for code, n in r["errors_by_code"]))

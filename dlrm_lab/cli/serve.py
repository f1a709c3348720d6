"""`dlrm-lab serve`, and `dlrm-lab client` (an alias of `infer run --target`): inference over gRPC (docs/serving.md)."""

from __future__ import annotations

import sys
from typing import Annotated, Optional

import typer

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
    concurrency: Annotated[int, typer.Option(help="Client connections, each beyond one a process of its own.")] = 1,
    qps: Annotated[Optional[float], typer.Option(help="Open loop: total target queries/s.")] = None,
    closed_loop: Annotated[
        bool, typer.Option("--closed-loop", help="Closed loop: each connection keeps one query outstanding.")
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
    seed: Annotated[int, typer.Option(help="Seed of the load.")] = 0,
    timeout: Annotated[float, typer.Option(help="Seconds a query may take before DEADLINE_EXCEEDED.")] = 30.0,
    unavailable_s: Annotated[
        float, typer.Option(help="Give up when the server has been UNAVAILABLE this many seconds.")
    ] = 3.0,
    connect_timeout: Annotated[float, typer.Option(help="Seconds to wait for the server at start.")] = 10.0,
    scenario: Annotated[
        str, typer.Option(help="open-loop, or an MLPerf LoadGen scenario: server, offline, single- or multi-stream.")
    ] = "open-loop",
    sla_ms: Annotated[float, typer.Option("--sla-ms", help="Latency bound in ms.")] = 10.0,
    percentile: Annotated[float, typer.Option(help="Latency percentile the bound applies to.")] = 99.0,
    max_issue_lag_ms: MaxIssueLagMs = 1000.0,
    rpc: Annotated[
        str,
        typer.Option(
            help="stream: one bidirectional InferStream per connection; unary: one Infer call per query; oip: one "
            "ModelInfer call per query, the Open Inference Protocol (KServe v2)."
        ),
    ] = "stream",
    metrics_dir: MetricsDir = "runs",
) -> None:
    """`infer run --target grpc://HOST:PORT` (kserve:// with --rpc oip) under its former name: drive a remote
    `dlrm-lab serve` and record every query's stages."""
    from dlrm_lab.cli.infer import run_command
    from dlrm_lab.infer.lab import InferConfig
    from dlrm_lab.infer.targets import parse_target
    from dlrm_lab.serve.remote import describe_server

    if (qps is None) == (not closed_loop):
        raise UserError("give either --qps Q (open loop) or --closed-loop")
    if rpc not in ("stream", "unary", "oip"):
        raise UserError(f"--rpc {rpc!r}: allowed: stream, unary, oip")
    url = f"{'kserve' if rpc == 'oip' else 'grpc'}://{target}"
    InferConfig(
        scenario="closed-loop" if closed_loop else scenario,
        duration_s=duration,
        sla_ms=sla_ms,
        sla_percentile=percentile,
        max_issue_lag_ms=max_issue_lag_ms,
        target=url,
        rpc=None if rpc == "oip" else rpc,
        concurrency=concurrency,
        timeout_s=timeout,
        connect_timeout_s=connect_timeout,
        unavailable_s=unavailable_s,
    )  # the rules, before the server is asked
    served = describe_server(parse_target(f"grpc://{target}"), connect_timeout)
    names = [m.name for m in served]
    if model is not None and model not in names:
        raise UserError(f"--model {model!r}: not served at {target}; served: {', '.join(names)}")
    info = served[names.index(model)] if model else served[0]
    if rpc == "oip":
        url += f"/{info.name}"
    run_command(
        model=[info.preset], max_rows=info.max_rows or None, table_scale=info.table_scale or None, target=url,
        scenario="closed-loop" if closed_loop else scenario,
        rpc=None if rpc == "oip" else rpc, concurrency=concurrency, timeout=timeout, connect_timeout=connect_timeout,
        unavailable_s=unavailable_s, qps=None if qps is None else [str(qps)], query_size=[query_size],
        arrival=arrival, duration=duration, sla_ms=[str(sla_ms)], percentile=percentile,
        max_issue_lag_ms=max_issue_lag_ms, seed=seed, metrics_dir=metrics_dir, progress=False,
    )  # fmt: skip

"""`dlrm-lab serve`: the lab's gRPC service (`serve.service`) in front of an `infer.server.InferenceServer`, with the
Open Inference Protocol on the same port, its HTTP/REST binding and /metrics where asked: ports claimed before
anything starts, each protocol its share of the descriptors (`serve.connections`), records pumped to the run.

Bad requests are refused (INVALID_ARGUMENT) before the batcher, so the instances never see them: fields of the wrong
size in the handler, bad values by the InferenceServer's one check at submit; a full queue is RESOURCE_EXHAUSTED at
once (the InferenceServer drops the query at submit); an instance failure is INTERNAL. SIGTERM, SIGHUP or Ctrl-C: stop
accepting, let queries in flight finish (up to the grace period), then stop the instances. Every query (also refused
ones) is a row of the server's own run directory (kind `serve`).
"""

from __future__ import annotations

import asyncio
import signal
from dataclasses import asdict
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from dlrm_lab.config.family import family_of
from dlrm_lab.config.values import JsonObject, Log
from dlrm_lab.errors import FieldError, ServingFault, UserError
from dlrm_lab.infer.build import check_build_request
from dlrm_lab.infer.memory import check_fits
from dlrm_lab.infer.plan import plan_serving
from dlrm_lab.infer.served import ServedModel
from dlrm_lab.infer.server import InferenceServer
from dlrm_lab.metrics.columns import schema_of
from dlrm_lab.metrics.run import Run, check_writable
from dlrm_lab.metrics.tables import TableWriter
from dlrm_lab.metrics.trust import check_stored_profile
from dlrm_lab.serve.connections import connection_budget
from dlrm_lab.serve.open_inference import SERVICE as OPEN_INFERENCE
from dlrm_lab.serve.open_inference import OpenInferenceService
from dlrm_lab.serve.options import check_ports
from dlrm_lab.serve.ports import claim_port, release_to
from dlrm_lab.serve.protocol import (
    CHANNEL_OPTIONS,
    SERVICE,
)
from dlrm_lab.serve.service import FLUSH_S, InferenceService

PUMP_S = 0.5  # records move to the queries table this often (on disk within service.FLUSH_S)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)  # a closed terminal or ssh session stops it too
# Calls gRPC's core holds before the server has taken them. Its default (1,000) ended 4-7% of 2,000 streams opened at
# once with INTERNAL, unrecorded (benchmarks/serve_abuse.py); taken, a query beyond the server's own queue bound is
# answered RESOURCE_EXHAUSTED and recorded as dropped
PENDING_CALLS = 20_000


def serve(
    models: list[ServedModel],
    *,
    host: str = "0.0.0.0",
    port: int = 50051,
    device: str = "cpu",
    pin_cores: bool = True,
    seed: int = 0,
    grace_s: float = 10.0,
    http_port: int | None = None,
    metrics_port: int | None = None,
    metrics_dir: str | Path = "runs",
    argv: list[str] | None = None,
    log: Log | None = None,
) -> Path:
    """Serve `models` until SIGTERM, SIGHUP or Ctrl-C; returns the server's run directory."""
    log = log or (lambda _msg: None)
    if not grace_s >= 0:
        raise FieldError("grace_s", f"{grace_s!r}: must be >= 0 seconds")
    check_ports(port, http_port, metrics_port)
    for m in models:
        if not (family := family_of(m.spec)).wire_samples:  # the wire format carries DLRM samples
            raise FieldError(
                "model",
                f"{m.spec.name}: {family.label} presets are served in process only (`infer run`, "
                "`infer search`); gRPC carries DLRM samples",
            )
    if metrics_port is not None:  # /metrics (serve.prometheus): checked here, served once the instances are up
        from dlrm_lab.serve.prometheus import check_metrics_port

        check_metrics_port(host, metrics_port, port, http_port)
    # Every port is claimed now, before the instances take their time to start, and held: the HTTP and metrics ones
    # until their servers serve on those very sockets, gRPC's until it binds its own (`ports.release_to`)
    claimed: dict[str, Any] = {}
    try:
        claimed["grpc"] = claim_port(host, port, "port")
        if http_port is not None:
            claimed["http"] = claim_port(host, http_port, "http_port")
        if metrics_port is not None:
            claimed["metrics"] = claim_port(host, metrics_port, "metrics_port")
        return _serve_run(
            models,
            host,
            port,
            device,
            pin_cores,
            seed,
            grace_s,
            http_port,
            claimed,
            metrics_port,
            metrics_dir,
            argv,
            log,
        )
    finally:
        for sock in claimed.values():
            sock.close()


def _serve_run(
    models: list[ServedModel],
    host: str,
    port: int,
    device: str,
    pin_cores: bool,
    seed: int,
    grace_s: float,
    http_port: int | None,
    claimed: dict[str, Any],
    metrics_port: int | None,
    metrics_dir: str | Path,
    argv: list[str] | None,
    log: Log,
) -> Path:
    if metrics_port is not None:
        from dlrm_lab.serve.prometheus import start_metrics
    check_writable(metrics_dir, "metrics_dir")
    check_stored_profile(log)
    check_fits(models, device=device)  # a model too big is refused before its run directory exists
    for m in models:  # and a build this machine cannot make
        check_build_request(m.build, m.spec)
    config: JsonObject = {
        "serve": {
            "host": host,
            "port": port,
            "device": device,
            "pin_cores": pin_cores,
            "seed": seed,
            "grace_s": grace_s,
            "http_port": http_port,
        },
        "models": [m.describe() for m in models],
    }
    run = Run.create(metrics_dir, "serve", config, argv=argv)
    with run:
        queries = run.table("queries", schema_of("queries"), flush_seconds=FLUSH_S)
        service = None
        try:
            plan = plan_serving(models, device=device, seed=seed, log=log)  # every choice made before it serves
            with InferenceServer(plan, pin_cores=pin_cores, log=log, route_around_dead=True) as inference:
                run.update_manifest(instances=inference.instance_info, precision_choices=inference.precision_choices)
                service = InferenceService(inference)
                if metrics_port is not None:
                    service.metrics = start_metrics(inference, host, metrics_port, run, log, claimed["metrics"])
                asyncio.run(
                    _serve(
                        service, queries, host, port, grace_s, log, run, http_port, claimed.get("http"), claimed["grpc"]
                    )
                )
                if service.failure is not None:  # served on (INTERNAL) until stopped; the run failed
                    raise ServingFault(
                        f"an instance failed while serving: {service.failure}; run {run.dir} marked failed"
                    )
        finally:
            if service is not None:  # after stop(): queries it found unfinished are recorded too
                if service.metrics is not None:  # nothing scrapes a stopped server
                    service.metrics.close()
                service.pump(queries)
                if service.stalls:
                    run.update_manifest(instance_stalls=service.stalls, longest_stall_ms=service.longest_stall_ms)
    return run.dir


async def _serve(
    service: InferenceService,
    queries: TableWriter,
    host: str,
    port: int,
    grace_s: float,
    log: Log,
    run: Run,
    http_port: int | None = None,
    http_socket: Any = None,
    grpc_claim: Any = None,
) -> None:
    budget = connection_budget(protocols=2 if http_port is not None else 1)  # each its share of the descriptors
    # Without so_reuseport=0 a second server on a busy port would bind it too and share its traffic.
    server = grpc.aio.server(
        options=[
            *CHANNEL_OPTIONS,
            ("grpc.so_reuseport", 0),
            ("grpc.server.max_pending_requests", PENDING_CALLS),
            ("grpc.server.max_pending_requests_hard_limit", 2 * PENDING_CALLS),
            ("grpc.max_allowed_incoming_connections", budget.per_protocol),
        ]
    )
    open_inference = OpenInferenceService(service)  # the Open Inference Protocol (KServe v2) on the same port
    server.add_generic_rpc_handlers((service.handler(), open_inference.handler()))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([SERVICE, OPEN_INFERENCE, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    if grpc_claim is not None:  # held since before the instances started, given up now for gRPC to bind
        port = release_to(grpc_claim)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        bound = server.add_insecure_port(address)
    except RuntimeError as exc:
        raise UserError(f"cannot listen on {address}: {exc}") from None
    if not bound:
        raise UserError(f"cannot listen on {address} (in use, or not an address of this host)")
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()

    def on_signal(signum: int) -> None:
        if stopping.is_set():  # a second signal: do not wait for the grace period
            log(f"{signal.Signals(signum).name} again: cancelling queries in flight")
            asyncio.ensure_future(server.stop(None))
        stopping.set()

    # Taken before the server starts: a stop signal sent as soon as the start line is out (a supervisor's) stops it as
    # any other does, where it used to end the event loop under the started server, whose threads then never ended.
    for signum in STOP_SIGNALS:
        loop.add_signal_handler(signum, on_signal, signum)
    rest, losses = None, 0
    try:
        await server.start()
        for name in ("", SERVICE):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        address = address.rsplit(":", 1)[0] + f":{bound}"
        run.update_manifest(address=address, connection_budget=asdict(budget))
        if http_port is not None:  # the Open Inference Protocol over HTTP/REST, the same service behind it
            from dlrm_lab.serve.rest import RestFront

            rest = RestFront(open_inference, max_connections=budget.per_protocol)
            http_address = address.rsplit(":", 1)[0] + f":{await rest.start(host, http_port, http_socket)}"
            run.update_manifest(http_address=http_address)
            log(f"Open Inference Protocol over HTTP/REST on {http_address}")
        log(f"serving {', '.join(service.inference.models)} on {address}")
        while not stopping.is_set():
            try:
                await asyncio.wait_for(stopping.wait(), PUMP_S)
            except asyncio.TimeoutError:
                pass
            # Parquet writes happen off the loop (pyarrow releases the GIL while encoding),
            # so that requests are not held up behind them.
            await asyncio.to_thread(service.pump, queries)
            if len(service.inference.lost) != losses:  # an instance died; its model is served on by the others
                losses = len(service.inference.lost)
                run.update_manifest(instance_losses=list(service.inference.lost))
            if service.failure is None and not service.check(log):  # the last instance of a model just died
                await health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
                await health_servicer.set(SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
        log(f"stopping: refusing new queries, finishing those in flight (grace {grace_s:g} s)")
        await health_servicer.enter_graceful_shutdown()
        if rest is not None:
            rest.stop_accepting()
        await server.stop(grace_s)
        if rest is not None:
            await rest.close(grace_s)
    except BaseException:  # a fault (a full disk under the records): stopped now, while its event loop runs
        await server.stop(None)
        if rest is not None:
            await rest.close(0)
        raise
    finally:
        for signum in STOP_SIGNALS:
            loop.remove_signal_handler(signum)
    log("stopped")

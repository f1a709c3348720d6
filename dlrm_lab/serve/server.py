"""`dlrm-lab serve`: a gRPC server in front of the inference lab's InferenceServer.

    grpc.aio handler: decode + check the payload -> InferenceServer.submit(Query(payload=...))
        -> batcher -> instances -> on_done (completion thread) -> loop.call_soon_threadsafe
        -> the awaiting handler answers with the scores and the server's timestamps

Two methods: Infer (one call per query) and InferStream (one long-lived stream per client, queries and answers
both ways, no call set-up per query; a refused query is answered in-band and the stream goes on).

Bad requests are refused (INVALID_ARGUMENT) before the batcher, so the instances never see them: fields of the wrong
size in the handler, bad values by the InferenceServer's one check at submit; a full queue is RESOURCE_EXHAUSTED at
once (the InferenceServer drops the query at submit); an instance failure is INTERNAL. SIGTERM, SIGHUP or Ctrl-C: stop
accepting, let queries in flight finish (up to the grace period), then stop the instances. Every query (also refused
ones) is a row of the server's own run directory (kind `serve`).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import signal
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from dlrm_lab.config.family import family_of
from dlrm_lab.errors import FieldError, ServingFault, UserError
from dlrm_lab.infer.memory import check_fits
from dlrm_lab.infer.plan import plan_serving
from dlrm_lab.infer.served import ServedModel
from dlrm_lab.infer.server import InferenceServer
from dlrm_lab.infer.sut import Query, query_row
from dlrm_lab.metrics.columns import QueryRow, schema_of
from dlrm_lab.metrics.run import Run, check_writable
from dlrm_lab.metrics.tables import TableWriter
from dlrm_lab.metrics.trust import check_stored_profile
from dlrm_lab.serve.connections import connection_budget
from dlrm_lab.serve.open_inference import SERVICE as OPEN_INFERENCE
from dlrm_lab.serve.open_inference import OpenInferenceService
from dlrm_lab.serve.ports import check_port, claim_port
from dlrm_lab.serve.protocol import (
    CHANNEL_OPTIONS,
    SCORE_DTYPE,
    SERVICE,
    PayloadError,
    Refused,
    client_deadline,
    decode_samples,
    echoed,
    model_info,
    pb,
)

Log = Callable[[str], None]
PUMP_S = 0.5  # records move to the queries table this often ...
FLUSH_S = 2.0  # ... and are on disk (a part file) at most this late


MAX_RECORDED_SAMPLES = 2**31 - 1  # the queries table's `samples` is an int32
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)  # a closed terminal or ssh session stops it too
# Calls gRPC's core holds before the server has taken them. Its default (1,000) ended 4-7% of 2,000 streams opened at
# once with INTERNAL, unrecorded (benchmarks/serve_abuse.py); taken, a query beyond the server's own queue bound is
# answered RESOURCE_EXHAUSTED and recorded as dropped
PENDING_CALLS = 20_000


class InferenceService:
    """The `Inference` service over one InferenceServer; handlers run on the asyncio loop."""

    def __init__(self, inference: InferenceServer) -> None:
        self.inference = inference
        self.describe_response = pb.DescribeResponse(
            models=[model_info(m, inference.library(name).size, inference.seed) for name, m in inference.models.items()]
        )
        self.failure: str | None = None  # an instance died: every query is INTERNAL from then on
        self._ids = itertools.count()  # server-side query ids (clients' ids may collide)
        self._pending: dict[int, asyncio.Future] = {}
        self._refused: collections.deque[QueryRow] = collections.deque()
        self._flushed = time.monotonic()
        self.metrics: Any = None  # serve.prometheus.ServingMetrics: told every row as it moves to the table
        self.stalls = 0  # batches an instance held far beyond their warm time (drained by every pump)
        self.longest_stall_ms = 0.0

    def handler(self) -> grpc.GenericRpcHandler:
        # Infer takes and returns raw bytes so that decoding and encoding the protobuf
        # message are inside the measured server stages; Describe uses the generated classes.
        return grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "Infer": grpc.unary_unary_rpc_method_handler(self.infer),
                "InferStream": grpc.stream_stream_rpc_method_handler(self.infer_stream),
                "Describe": grpc.unary_unary_rpc_method_handler(
                    self.describe,
                    request_deserializer=pb.DescribeRequest.FromString,
                    response_serializer=pb.DescribeResponse.SerializeToString,
                ),
            },
        )

    async def describe(self, request: Any, context: Any) -> Any:
        return self.describe_response

    async def infer(self, body: bytes, context: grpc.aio.ServicerContext) -> bytes:
        receive = time.monotonic_ns()
        req = None
        try:
            req = self.decode(body)
            return await self._reply(req, *self.submit(req, self.samples(req), receive, client_deadline(context)))
        except Refused as exc:
            self.record_refused(req, receive, exc)
            await context.abort(exc.code, str(exc))
            raise  # not reached: abort raises

    async def infer_stream(self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> Any:
        """Answer each request of the stream as its query finishes (any order). A request is
        decoded, checked and submitted as it is read (no task until its answer is awaited)."""
        answers: asyncio.Queue[bytes | None] = asyncio.Queue()
        in_flight: set[asyncio.Task] = set()

        def refused(req: Any, receive: int, exc: Refused) -> bytes:
            self.record_refused(req, receive, exc)
            return pb.InferResponse(
                query_id=0 if req is None else req.query_id, status=exc.code.name, error=str(exc),
                server_receive_ns=receive, client_send_ns=0 if req is None else req.client_send_ns,
            ).SerializeToString()  # fmt: skip

        async def answer(req: Any, q: Query, done: asyncio.Future) -> None:
            try:
                answers.put_nowait(await self._reply(req, q, done))
            except Refused as exc:
                answers.put_nowait(refused(req, q.scheduled_ns, exc))  # scheduled: the receive time

        async def read() -> None:
            try:
                async for body in requests:
                    receive, req = time.monotonic_ns(), None
                    try:
                        req = self.decode(body)
                        q, done = self.submit(req, self.samples(req), receive, client_deadline(context))
                    except Refused as exc:
                        answers.put_nowait(refused(req, receive, exc))
                        continue
                    task = asyncio.ensure_future(answer(req, q, done))
                    in_flight.add(task)
                    task.add_done_callback(in_flight.discard)
                while in_flight:  # the client closed its side: finish what it sent
                    await asyncio.gather(*in_flight, return_exceptions=True)
            finally:
                answers.put_nowait(None)

        reader = asyncio.ensure_future(read())
        try:
            while (body := await answers.get()) is not None:
                yield body
            await reader  # a reading error ends the stream with it
        finally:
            reader.cancel()
            for task in list(in_flight):
                task.cancel()

    @staticmethod
    def decode(body: bytes) -> Any:
        try:
            return pb.InferRequest.FromString(body)
        except DecodeError as exc:
            raise Refused(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"request: not an InferRequest message ({len(body)} bytes: {exc})",
                "rejected",
            ) from None

    def samples(self, req: Any) -> Any:
        """The request's samples, packed (their values are checked by InferenceServer.submit), or
        INVALID_ARGUMENT naming the field whose size is wrong."""
        served = self.inference.models.get(req.model)
        if served is None:
            raise Refused(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"model {echoed(req.model)}: not served here; served: {', '.join(self.inference.models)}",
                "rejected",
            )
        if req.samples > served.max_query_samples:  # before its payload is decoded
            raise Refused(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"query {req.query_id} for {req.model}: {req.samples} samples: this server takes at most "
                f"{served.max_query_samples} a query (--max-query-samples)",
                "rejected",
            )
        try:
            block = decode_samples(req, served.spec)
        except PayloadError as exc:
            raise Refused(
                grpc.StatusCode.INVALID_ARGUMENT, f"query {req.query_id} for {req.model}: {exc}", "rejected"
            ) from None
        return block

    def submit(
        self, req: Any, block: Any, receive: int, deadline_ns: int | None = None
    ) -> tuple[Query, asyncio.Future]:
        """Submit the query to the batcher; its future resolves (on this loop) when it finishes. Past
        `deadline_ns` (the client's), what is not yet computed of it never is."""
        if self.failure is not None:
            raise Refused(grpc.StatusCode.INTERNAL, f"server failure: {self.failure}", "failed")
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()

        def on_done(_q: Query, status: str, scores: np.ndarray | None) -> None:  # completion thread
            stamp = time.monotonic_ns()
            try:
                loop.call_soon_threadsafe(_resolve, done, (status, scores, stamp))
            except RuntimeError:
                pass  # the loop is closed: the server has stopped

        q = Query(next(self._ids), req.model, req.samples, payload=block, scheduled_ns=receive, on_done=on_done,
                  deadline_ns=deadline_ns)  # fmt: skip
        self._pending[q.query_id] = done
        try:
            self.inference.submit(q)  # a full queue calls on_done("dropped") before returning
        except RuntimeError as exc:  # an instance died
            self._pending.pop(q.query_id, None)
            raise Refused(grpc.StatusCode.INTERNAL, f"server failure: {exc}", "failed") from None
        return q, done

    async def _reply(self, req: Any, q: Query, done: asyncio.Future) -> bytes:
        """The serialised answer once the query finished (or Refused with its status)."""
        receive = q.scheduled_ns  # the handler's receive time (see _submit)
        scores, done_ns = await self.result(req, q, done)
        start = q.first_start_ns if q.first_start_ns is not None else done_ns
        batch_samples, instance = q.batch_samples, q.instance
        resp = pb.InferResponse(
            query_id=req.query_id,
            scores=np.asarray(scores, dtype=SCORE_DTYPE).tobytes(),
            server_receive_ns=receive,
            parse_ns=q.issued_ns - receive,
            queue_ns=start - q.issued_ns,
            compute_ns=done_ns - start,
            batch_samples=batch_samples or 0,
            instance=-1 if instance is None else instance,
            pieces=q.pieces,
            instance_compute_ns=q.compute_ns,
            client_send_ns=req.client_send_ns,
        )
        resp.server_send_ns = time.monotonic_ns()  # its own serialisation follows, in network+gRPC
        return resp.SerializeToString()

    async def result(self, req: Any, q: Query, done: asyncio.Future) -> tuple[np.ndarray, int]:
        """The query's scores and when it finished, once it did; Refused with the code its status maps to (for
        every protocol this server speaks)."""
        try:
            status, scores, done_ns = await done
        finally:
            self._pending.pop(q.query_id, None)
        if status == "dropped":
            served = self.inference.models[req.model]
            raise Refused(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"model {req.model}: queue full (at most {served.max_queue} waiting); query {req.query_id} refused",
            )
        if status == "expired":  # the client has gone; the code says what happened for the server's rows
            raise Refused(grpc.StatusCode.DEADLINE_EXCEEDED, f"query {req.query_id}: {q.error}")
        if status == "unfinished":
            raise Refused(grpc.StatusCode.UNAVAILABLE, "the server stopped before the query was computed")
        if status == "rejected":  # the server's check at submit (ids, lengths, dense values): recorded there
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"query {req.query_id} for {req.model}: {q.error}")
        if status != "ok" or scores is None:
            raise Refused(grpc.StatusCode.INTERNAL, f"query {req.query_id}: {status}: {q.error or self.failure}")
        return scores, done_ns

    def record_refused(self, req: Any, receive: int, exc: Refused) -> None:
        if exc.status is None:
            return
        # a refused request's size is what it declared: one no int32 column holds (a shape of 2^62) is not recorded
        samples = None if req is None or not 0 <= req.samples <= MAX_RECORDED_SAMPLES else req.samples
        self._refused.append(query_row(
            next(self._ids), None if req is None else req.model, samples, exc.status,
            epoch_ns=self.inference.epoch_ns, scheduled_ns=receive, issued_ns=receive, end_ns=time.monotonic_ns(),
            error=str(exc), pieces=0,
        ))  # fmt: skip

    def pump(self, queries: TableWriter) -> None:
        """Move finished queries' records to the table; written at least every 2 s."""
        rows = self.inference.take_records()
        while self._refused:  # appended by handlers on the loop thread meanwhile: deque ops are atomic
            rows.append(self._refused.popleft())
        for r in rows:
            r["point"] = 0
        queries.extend(rows)
        stalls = self.inference.take_stalls()  # taken every time: a long serve would otherwise pile them up
        self.stalls += len(stalls)
        self.longest_stall_ms = max([self.longest_stall_ms, *(s["took_ms"] for s in stalls)])
        if self.metrics is not None:
            self.metrics.observe(rows, stalls)
        if time.monotonic() - self._flushed >= FLUSH_S:
            queries.flush()
            self._flushed = time.monotonic()

    def check(self, log: Log) -> bool:
        """False once a model lost its last instance (one of several is routed around by the InferenceServer);
        queries waiting then are answered INTERNAL."""
        if self.failure is not None:
            return False
        try:
            self.inference.check()
        except RuntimeError as exc:
            self.failure = str(exc)
            log(f"error: {exc}; answering INTERNAL from now on")
            now = time.monotonic_ns()
            for fut in list(self._pending.values()):
                _resolve(fut, ("failed", None, now))
            return False
        return True


def _resolve(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():  # cancelled when the client gave up
        fut.set_result(value)


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
    if not 0 <= port < 65536:
        raise FieldError("port", f"{port}: must be in [0, 65535] (0: any free port)")
    for m in models:
        if not (family := family_of(m.spec)).wire_samples:  # the wire format carries DLRM samples
            raise FieldError("model", f"{m.spec.name}: {family.label} presets are served in process only (`infer run`, "
                            "`infer search`); gRPC carries DLRM samples")  # fmt: skip
    if http_port is not None and (not 0 <= http_port < 65536 or (http_port == port and port)):
        raise FieldError("http_port", f"{http_port}: must be in [0, 65535] and not --port (0: any free port)")
    check_port(host, port)  # before the instances take their time to start
    if metrics_port is not None:  # /metrics (serve.prometheus): checked here, served once the instances are up
        from dlrm_lab.serve.prometheus import check_metrics_port

        check_metrics_port(host, metrics_port, port, http_port)
    # The HTTP and metrics ports are claimed now and held until their servers listen on those very sockets: another
    # process cannot take them while the instances start (gRPC binds its own; its port is checked).
    claimed: dict[str, Any] = {}
    try:
        if http_port is not None:
            claimed["http"] = claim_port(host, http_port, "http_port")
        if metrics_port is not None:
            claimed["metrics"] = claim_port(host, metrics_port, "metrics_port")
        return _serve_run(models, host, port, device, pin_cores, seed, grace_s, http_port, claimed, metrics_port,
                          metrics_dir, argv, log)  # fmt: skip
    finally:
        for sock in claimed.values():
            sock.close()


def _serve_run(models: list[ServedModel], host: str, port: int, device: str, pin_cores: bool, seed: int,
               grace_s: float, http_port: int | None, claimed: dict[str, Any], metrics_port: int | None,
               metrics_dir: str | Path, argv: list[str] | None, log: Log) -> Path:  # fmt: skip
    if metrics_port is not None:
        from dlrm_lab.serve.prometheus import start_metrics
    check_writable(metrics_dir, "metrics_dir")
    check_stored_profile(log)
    check_fits(models, device=device)  # a model too big is refused before its run directory exists
    config = {
        "serve": {"host": host, "port": port, "device": device, "pin_cores": pin_cores, "seed": seed,
                  "grace_s": grace_s, "http_port": http_port},
        "models": [m.describe() for m in models],
    }  # fmt: skip
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
                asyncio.run(_serve(service, queries, host, port, grace_s, log, run, http_port, claimed.get("http")))
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
) -> None:
    budget = connection_budget(protocols=2 if http_port is not None else 1)  # each its share of the descriptors
    # Without so_reuseport=0 a second server on a busy port would bind it too and share its traffic.
    server = grpc.aio.server(options=[*CHANNEL_OPTIONS, ("grpc.so_reuseport", 0),
                                      ("grpc.server.max_pending_requests", PENDING_CALLS),
                                      ("grpc.server.max_pending_requests_hard_limit", 2 * PENDING_CALLS),
                                      ("grpc.max_allowed_incoming_connections", budget.per_protocol)])  # fmt: skip
    open_inference = OpenInferenceService(service)  # the Open Inference Protocol (KServe v2) on the same port
    server.add_generic_rpc_handlers((service.handler(), open_inference.handler()))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([SERVICE, OPEN_INFERENCE, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
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

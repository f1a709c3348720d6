"""The lab's gRPC service over an `infer.server.InferenceServer`: `Infer` (one call a query), `InferStream` (a
stream a client, queries and answers both ways), `Describe`; every query, refused ones too, a row of the server's run.

    handler: decode + check the payload -> InferenceServer.submit(Query(payload=...))
        -> batcher -> instances -> on_done (completion thread) -> loop.call_soon_threadsafe
        -> the awaiting handler answers with the scores and the server's timestamps

`serve.server` runs it (the command's lifecycle: ports, signals, the REST front, /metrics).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import time
from collections.abc import AsyncIterator
from typing import Any, cast

import grpc
import numpy as np
from google.protobuf.message import DecodeError

from dlrm_lab.config.values import Log
from dlrm_lab.infer.server import InferenceServer
from dlrm_lab.infer.sut import Query, query_row
from dlrm_lab.metrics.columns import QueryRow
from dlrm_lab.metrics.tables import TableWriter
from dlrm_lab.serve.protocol import (
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

FLUSH_S = 2.0  # records are on disk (a part file) at most this late
MAX_RECORDED_SAMPLES = 2**31 - 1  # the queries table's `samples` is an int32


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
                query_id=0 if req is None else req.query_id,
                status=exc.code.name,
                error=str(exc),
                server_receive_ns=receive,
                client_send_ns=0 if req is None else req.client_send_ns,
            ).SerializeToString()

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

        q = Query(
            next(self._ids),
            req.model,
            req.samples,
            payload=block,
            scheduled_ns=receive,
            on_done=on_done,
            deadline_ns=deadline_ns,
        )
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
        self._refused.append(
            query_row(
                next(self._ids),
                None if req is None else req.model,
                samples,
                exc.status,
                epoch_ns=self.inference.epoch_ns,
                scheduled_ns=receive,
                issued_ns=receive,
                end_ns=time.monotonic_ns(),
                error=str(exc),
                pieces=0,
            )
        )

    def pump(self, queries: TableWriter) -> None:
        """Move finished queries' records to the table; written at least every 2 s."""
        rows = self.inference.take_records()
        while self._refused:  # appended by handlers on the loop thread meanwhile: deque ops are atomic
            rows.append(self._refused.popleft())
        for r in rows:
            r["point"] = 0
        queries.extend(cast(list[dict[str, str | float | bool | None]], rows))  # rows (list is invariant)
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

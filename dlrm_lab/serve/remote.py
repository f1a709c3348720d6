"""The system under test as a gRPC client sees it: `RemoteServer` implements
`infer.sut.SystemUnderTest`, so OpenLoop, ClosedLoop and LoadGenDriver drive a remote server
exactly as they drive an in-process one.

A query names samples of the model's sample library; the client holds the same library as
the server (`serve.connect.library_from_info`: generated from Describe's spec and seed), sends those
samples' bytes, and calls `query.on_done(query, status, scores)` when the answer is decoded.
Every query becomes a row of `queries` (`infer.sut.query_row`), as in process, with its transfer
columns filled: a query's latency (scheduled arrival -> scores decoded) splits into stages that
add up exactly, each from the clock that saw it:

    issue           scheduled -> serialise start            client clock (the load generator's delay)
    serialise       serialise start -> send                 client clock (payload bytes + protobuf)
    network         round trip - server time                client round trip, server durations
    server_parse    receive -> submitted to the batcher     server clock (protobuf decode, checks)
    queue           submitted -> first compute start        server clock
    compute         first compute start -> scores back      server clock (instance + result pipe)
    server_respond  scores back -> response built           server clock
    deserialise     receive -> scores decoded               client clock

Only durations cross hosts, never timestamps: `network` is the client's round trip minus the
server's receive-to-send time, so it holds both directions of the wire, gRPC and HTTP/2
framing, and the response's protobuf encoding. A server that reports no stage times (any
Open Inference Protocol server but the lab's) leaves the server-side stages null.

Queries go as one Infer call each (`rpc="unary"`) or over one InferStream per RemoteServer
(`rpc="stream"`): requests are queued to gRPC's sending thread and a receiving thread
matches answers to queries by id. A stream that breaks (the server went away) ends every
query on it with its status, and the next query opens a new one.
"""

from __future__ import annotations

import functools
import math
import queue
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
from google.protobuf.message import DecodeError

from dlrm_lab.errors import BadAnswer, ServerLost, UserError
from dlrm_lab.infer.library import PackedLibrary
from dlrm_lab.infer.sut import NoInstancesHere, SutDescription, query_row
from dlrm_lab.metrics.columns import QueryRow
from dlrm_lab.serve.protocol import (
    DENSE_DTYPE,
    ID_DTYPE,
    INFER_METHOD,
    INFER_STREAM_METHOD,
    LENGTH_DTYPE,
    MODEL_INFER_METHOD,
    RPC_KINDS,
    SCORE_DTYPE,
    STAGE_PARAMETERS,
    encode_samples,
    pb,
    v2,
)

EXPIRE_POLL_S = 0.25  # a draining stream client looks for queries past their timeout this often
ERROR_BACKOFF_S = 0.01  # before a failed query's on_done: a closed loop must not spin on a dead server


def open_inference_request(model: str, query_id: str, samples: int, dense: bytes, lengths: bytes, ids: bytes) -> bytes:
    """A serialised ModelInferRequest of the Open Inference Protocol holding one query's tensors
    (`serve.open_inference`: dense, lengths, ids in raw_input_contents)."""
    tensor = v2.ModelInferRequest.InferInputTensor
    features = len(lengths) // (LENGTH_DTYPE.itemsize * samples)
    return v2.ModelInferRequest(
        model_name=model,
        id=query_id,
        inputs=[
            tensor(name="dense", datatype="FP32", shape=[samples, len(dense) // (DENSE_DTYPE.itemsize * samples)]),
            tensor(name="lengths", datatype="INT32", shape=[features, samples]),
            tensor(name="ids", datatype="INT64", shape=[len(ids) // ID_DTYPE.itemsize]),
        ],
        raw_input_contents=[dense, lengths, ids],
    ).SerializeToString()


@dataclass
class OpenInferenceAnswer:
    """A ModelInferResponse read as the lab's answer: its scores, and the server's stage times where the server
    reported them (a lab server does, in response parameters; any other: 0, the stage columns then null)."""

    scores: bytes
    server_receive_ns: int = 0
    parse_ns: int = 0
    queue_ns: int = 0
    compute_ns: int = 0
    batch_samples: int = 0
    instance: int = -1
    pieces: int = 0
    instance_compute_ns: int = 0
    server_send_ns: int = 0


def open_inference_answer(body: bytes) -> OpenInferenceAnswer:
    """The scores (the `scores` output, raw or typed) and stage parameters of a serialised ModelInferResponse."""
    resp = v2.ModelInferResponse.FromString(body)
    names = [o.name for o in resp.outputs]
    k = names.index("scores") if "scores" in names else 0
    if resp.raw_output_contents:
        scores = resp.raw_output_contents[k] if k < len(resp.raw_output_contents) else b""
    elif resp.outputs:
        scores = np.asarray(resp.outputs[k].contents.fp32_contents, dtype=SCORE_DTYPE).tobytes()
    else:
        scores = b""
    stages = {key: resp.parameters[key].int64_param for key in STAGE_PARAMETERS if key in resp.parameters}
    return OpenInferenceAnswer(scores=scores, **stages)


# What a gRPC status means in the lab's records (`infer.records.summarize` counts these); the code itself is
# kept in `rpc_status`. Anything else that is not OK (UNAVAILABLE, INTERNAL, a bad answer) is a failed query.
LAB_STATUS = {
    "OK": "ok",
    "ok": "ok",
    "RESOURCE_EXHAUSTED": "dropped",
    "INVALID_ARGUMENT": "rejected",
    "DEADLINE_EXCEEDED": "expired",
}


def lab_status(code: str) -> str:
    return LAB_STATUS.get(code, "failed")


def encode_library_samples(library: PackedLibrary, offset: int, size: int) -> tuple[bytes, bytes, bytes]:
    """(dense, lengths, ids) bytes of samples [offset, offset + size), as the server decodes them."""
    dense, lengths, ids = library.columns(offset, size)
    return (
        np.ascontiguousarray(dense, dtype=DENSE_DTYPE).tobytes(),
        np.asarray(lengths, dtype=LENGTH_DTYPE).tobytes(),
        np.asarray(ids, dtype=ID_DTYPE).tobytes(),
    )


class RemoteServer(NoInstancesHere):
    """Queries to a `dlrm-lab serve` over one channel; thread-safe, `submit` returns at once.

    Times in rows are ms from `epoch_ns` (time.monotonic_ns, system-wide on Linux, so the
    worker processes of one client share it). `check()` raises BadAnswer after an answer that is
    not one score per sample, and ServerLost once the server
    has answered only UNAVAILABLE for more than `unavailable_s`.
    """

    def __init__(
        self,
        channel: grpc.Channel | None,
        libraries: dict[str, PackedLibrary],
        *,
        models: Mapping[str, Any] | None = None,
        worker: int = 0,
        epoch_ns: int | None = None,
        timeout_s: float = 30.0,
        unavailable_s: float = math.inf,
        rpc: str = "stream",
        description: SutDescription | None = None,
        names: Mapping[str, str] | None = None,
    ) -> None:
        if rpc not in RPC_KINDS:
            raise ValueError(f"rpc {rpc!r}: allowed: {', '.join(RPC_KINDS)}")
        self.rpc = rpc
        self.libraries = libraries
        self.models = dict(models or {})  # name -> infer.sut.ModelDescription
        self.description = description
        self.names = dict(names or {})  # the runner's model name -> the server's, where they differ
        self.unavailable_s = unavailable_s
        self.worker = worker
        self.epoch_ns = time.monotonic_ns() if epoch_ns is None else epoch_ns
        self.timeout_s = timeout_s
        if channel is not None:  # None: a subclass sends its queries itself (HTTP/REST, `serve.rest_remote`)
            # Raw bytes in and out: serialising and decoding the messages are client stages.
            self._infer = channel.unary_unary(INFER_METHOD)
            self._model_infer = channel.unary_unary(MODEL_INFER_METHOD)  # rpc "oip": the Open Inference Protocol
            self._open_stream = channel.stream_stream(INFER_STREAM_METHOD)
        self._stream: queue.SimpleQueue | None = None  # requests of the open stream (None ends it)
        self._waiting: dict[int, tuple[Any, tuple[int, int, int], int]] = {}  # stream: query id -> its send
        self._rows: list[QueryRow] = []
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._outstanding = 0
        self._unavailable_since: int | None = None
        self._unavailable_detail = ""
        self._bad: str | None = None  # the first answer that was not one score per sample
        self.issued = 0

    def library(self, model: str) -> PackedLibrary:
        return self.libraries[model]

    def describe(self) -> SutDescription:
        return self.description or SutDescription(models=self.models)

    def configure(self, model: str, **policy: Any) -> None:
        """A remote server's batching and queue are its own: neither protocol sets them (None: nothing asked)."""
        if asked := sorted(k for k, v in policy.items() if v is not None):
            raise UserError(f"model {model}: a remote server's {', '.join(asked)} is set where it is served, not here")

    def _issue(self, q: Any) -> tuple[int, tuple[bytes, ...]]:
        """`q` issued now (and scheduled now, where its load generator set no time): (the time, its samples'
        dense, lengths and ids bytes), from `q.payload` (a SampleBlock) or the library's [q.offset, + q.size)."""
        start = time.monotonic_ns()
        q.issued_ns = start
        if not q.scheduled_ns:
            q.scheduled_ns = start
        if q.payload is None:
            return start, encode_library_samples(self.libraries[q.model], q.offset, q.size)
        return start, encode_samples(q.payload.dense, q.payload.lengths, q.payload.values)

    def submit(self, q: Any) -> None:
        """Serialise and send `q` (an infer.sut.Query); its samples are `q.payload` (a
        SampleBlock) when given, else library samples [q.offset, q.offset + q.size)."""
        start, (dense, lengths, ids) = self._issue(q)
        query_id = (self.worker << 40) | q.query_id  # unique across the workers of a client
        model = self.names.get(q.model, q.model)
        if self.rpc == "oip":
            body = open_inference_request(model, str(query_id), q.size, dense, lengths, ids)
        else:
            body = pb.InferRequest(
                model=model,
                query_id=query_id,
                samples=q.size,
                dense=dense,
                lengths=lengths,
                ids=ids,
                client_send_ns=start,
            ).SerializeToString()
        serialised = time.monotonic_ns()
        with self._lock:
            self._outstanding += 1
            self.issued += 1
            if self.rpc == "stream":
                requests = self._stream or self._start_stream()
                send = time.monotonic_ns()
                self._waiting[query_id] = (q, (start, serialised, send), len(body))
                requests.put(body)
                return
        send = time.monotonic_ns()
        call = (self._model_infer if self.rpc == "oip" else self._infer).future(body, timeout=self.timeout_s)
        call.add_done_callback(functools.partial(self._done, q, (start, serialised, send), len(body)))

    def _start_stream(self) -> queue.SimpleQueue:
        """Open an InferStream (called with the lock held) and the thread reading its answers."""
        requests: queue.SimpleQueue = queue.SimpleQueue()
        responses = self._open_stream(iter(requests.get, None))
        self._stream = requests
        threading.Thread(target=self._read_stream, args=(requests, responses), name="infer-stream", daemon=True).start()
        return requests

    def _read_stream(self, requests: queue.SimpleQueue, responses: Any) -> None:
        try:
            for body in responses:
                receive = time.monotonic_ns()
                try:
                    resp = pb.InferResponse.FromString(body)
                except DecodeError as exc:  # which query it answers is unknown: the stream's queries fail
                    status, error = "BAD_RESPONSE", f"an undecodable answer on the stream ({len(body)} bytes: {exc})"
                    break
                with self._lock:
                    sent = self._waiting.pop(resp.query_id, None)
                if sent is not None:  # else: one this client never sent (an undecodable request's answer)
                    q, stamps, request_bytes = sent
                    self._record(
                        q,
                        stamps,
                        request_bytes,
                        receive,
                        resp=resp,
                        body=body,
                        status=resp.status or "ok",
                        error=resp.error or None,
                    )
            else:
                status, error = "UNAVAILABLE", "the server ended the stream"
        except grpc.RpcError as exc:
            status, error = exc.code().name, exc.details()
        receive = time.monotonic_ns()
        with self._lock:  # what this stream still owes ends with its status; the next query opens a new one
            if self._stream is requests:
                self._stream = None
            left, self._waiting = self._waiting, {}
        requests.put(None)
        for q, stamps, request_bytes in left.values():
            self._record(q, stamps, request_bytes, receive, status=status, error=error)

    def expire(self) -> None:
        """End stream queries unanswered for longer than the timeout (DEADLINE_EXCEEDED, as a unary call would)."""
        limit = time.monotonic_ns() - int(self.timeout_s * 1e9)
        with self._lock:
            late = {k: v for k, v in self._waiting.items() if v[1][2] < limit}
            for k in late:
                del self._waiting[k]
        receive = time.monotonic_ns()
        for q, stamps, request_bytes in late.values():
            self._record(q, stamps, request_bytes, receive, status="DEADLINE_EXCEEDED", error="no answer in time")

    def close(self) -> None:
        """End the open stream (its queries still get their answers)."""
        with self._lock:
            requests, self._stream = self._stream, None
        if requests is not None:
            requests.put(None)

    def _done(self, q: Any, stamps: tuple[int, int, int], request_bytes: int, call: Any) -> None:
        receive = time.monotonic_ns()
        try:
            body = call.result()
        except grpc.RpcError:
            self._record(q, stamps, request_bytes, receive, status=call.code().name, error=call.details())
        except grpc.FutureCancelledError:
            self._record(q, stamps, request_bytes, receive, status="CANCELLED")
        else:
            try:
                resp = open_inference_answer(body) if self.rpc == "oip" else pb.InferResponse.FromString(body)
            except (DecodeError, ValueError) as exc:  # not an answer: a failed query, counted and named
                self._record(
                    q,
                    stamps,
                    request_bytes,
                    receive,
                    status="BAD_RESPONSE",
                    error=f"an undecodable answer ({len(body)} bytes: {exc})",
                )
            else:
                self._record(q, stamps, request_bytes, receive, resp=resp, body=body, status="ok")

    def _record(
        self,
        q: Any,
        stamps: tuple[int, int, int],
        request_bytes: int,
        receive: int,
        *,
        status: str,
        resp: Any = None,
        body: bytes = b"",
        error: str | None = None,
    ) -> None:
        """The query's row (`query_row`, its transfer columns filled) and its on_done: `resp` is the decoded
        answer when the server sent one."""
        start, serialised, send = stamps
        columns: dict[str, float | None] = {  # its transfer columns of `queries`
            "worker": self.worker,
            "round_trip_ms": (receive - send) / 1e6,
            "serialise_ms": (send - start) / 1e6,
            "request_bytes": request_bytes,
        }
        scores, end = None, receive
        if status == "ok":
            scores = np.frombuffer(resp.scores, dtype=SCORE_DTYPE)
            end = time.monotonic_ns()
            columns["response_bytes"] = len(body)
            if len(scores) != q.size:
                status, scores = "BAD_RESPONSE", None
                error = f"{len(resp.scores)} score bytes for {q.size} samples"
            elif not np.isfinite(scores).all():
                error = f"{int(np.count_nonzero(~np.isfinite(scores)))} of its {q.size} scores NaN or infinite"
                status, scores = "BAD_RESPONSE", None
        if status == "BAD_RESPONSE":
            self._bad = self._bad or f"query {q.query_id} was answered with {error}"
        if status == "ok" and resp.server_send_ns:  # the server reported its stages (any lab server)
            server_ns = resp.server_send_ns - resp.server_receive_ns
            respond_ns = server_ns - resp.parse_ns - resp.queue_ns - resp.compute_ns
            columns.update(
                {
                    "network_ms": (receive - send - server_ns) / 1e6,
                    "server_parse_ms": resp.parse_ns / 1e6,
                    "queue_ms": resp.queue_ns / 1e6,
                    "compute_ms": resp.compute_ns / 1e6,
                    "server_respond_ms": respond_ns / 1e6,
                    "server_ms": server_ns / 1e6,
                    "instance_compute_ms": resp.instance_compute_ns / 1e6,
                    "batch_samples": resp.batch_samples,
                    "instance": resp.instance,
                    "pieces": resp.pieces,
                }
            )
        if status == "INVALID_ARGUMENT" and q.payload is None and self._bad is None:
            # library samples refused: the server's model is not the one these samples were made for
            self._bad = (
                f"query {q.query_id} was refused: {error} (its model is not {q.model} as given here: "
                "check --max-rows, --table-scale and the preset)"
            )
        row = query_row(
            q.query_id,
            q.model,
            q.size,
            lab_status(status),
            epoch_ns=self.epoch_ns,
            scheduled_ns=q.scheduled_ns,
            issued_ns=start,
            end_ns=end,
            error=error,
            columns={"rpc_status": status, "deserialise_ms": (end - receive) / 1e6, **columns},
        )
        q.record = row
        with self._lock:
            self._rows.append(row)
            if status == "UNAVAILABLE":
                if self._unavailable_since is None:
                    self._unavailable_since, self._unavailable_detail = receive, row.get("error") or ""
            else:  # any answer from the server, even an error, means it is there
                self._unavailable_since = None
        try:
            if q.on_done is not None:
                if status == "ok":
                    q.on_done(q, status, scores)
                else:
                    threading.Timer(ERROR_BACKOFF_S, q.on_done, (q, row["status"], scores)).start()
        finally:
            with self._lock:
                self._outstanding -= 1
                if self._outstanding == 0:
                    self._idle.notify_all()

    def take_records(self) -> list[QueryRow]:
        with self._lock:
            out, self._rows = self._rows, []
        return out

    def drain(self, timeout_s: float) -> bool:
        """Wait until every sent query was answered; False on timeout. Stream queries past
        their own timeout meanwhile end DEADLINE_EXCEEDED (rows, not silence)."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._idle:
                left = deadline - time.monotonic()
                if self._outstanding == 0 or left <= 0:
                    return self._outstanding == 0
                self._idle.wait(min(left, EXPIRE_POLL_S))
            if self.rpc == "stream":
                self.expire()

    def check(self) -> None:
        if self.rpc == "stream":
            self.expire()
        if self._bad is not None:
            raise BadAnswer(self._bad)
        why = self.lost(self.unavailable_s)
        if why is not None:
            raise ServerLost(why)

    def lost(self, limit_s: float, *, at_end: bool = False) -> str | None:
        """Why the server counts as lost: only UNAVAILABLE answers for more than `limit_s`
        (or, `at_end`, since the last answer that was not). None while it is there."""
        with self._lock:
            since, detail = self._unavailable_since, self._unavailable_detail
        if since is None:
            return None
        seconds = (time.monotonic_ns() - since) / 1e9
        if seconds <= limit_s and not at_end:
            return None
        return f"UNAVAILABLE for {seconds:.1f} s ({detail})"

"""The system under test as a gRPC client sees it: `RemoteServer` implements
`infer.sut.SystemUnderTest`, so OpenLoop, ClosedLoop and LoadGenDriver drive a remote server
exactly as they drive an in-process one.

A query names samples of the model's sample library; the client holds the same library as
the server (`library_from_info`: generated from Describe's spec and seed), sends those
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
import json
import math
import queue
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
from google.protobuf.message import DecodeError

from dlrm_lab.config.family import family_of
from dlrm_lab.errors import BadAnswer, FieldError, ServerLost
from dlrm_lab.infer.library import PackedLibrary
from dlrm_lab.infer.sut import ModelDescription, SutDescription, query_row
from dlrm_lab.serve.protocol import (
    CHANNEL_OPTIONS,
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
    pb_grpc,
    v2,
    v2_grpc,
)

EXPIRE_POLL_S = 0.25  # a draining stream client looks for queries past their timeout this often
ERROR_BACKOFF_S = 0.01  # before a failed query's on_done: a closed loop must not spin on a dead server


def open_inference_request(model: str, query_id: str, samples: int, dense: bytes, lengths: bytes, ids: bytes) -> bytes:
    """A serialised ModelInferRequest of the Open Inference Protocol holding one query's tensors
    (`serve.open_inference`: dense, lengths, ids in raw_input_contents)."""
    tensor = v2.ModelInferRequest.InferInputTensor
    features = len(lengths) // (LENGTH_DTYPE.itemsize * samples)
    return v2.ModelInferRequest(
        model_name=model, id=query_id,
        inputs=[tensor(name="dense", datatype="FP32", shape=[samples, len(dense) // (DENSE_DTYPE.itemsize * samples)]),
                tensor(name="lengths", datatype="INT32", shape=[features, samples]),
                tensor(name="ids", datatype="INT64", shape=[len(ids) // ID_DTYPE.itemsize])],
        raw_input_contents=[dense, lengths, ids],
    ).SerializeToString()  # fmt: skip


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
LAB_STATUS = {"OK": "ok", "ok": "ok", "RESOURCE_EXHAUSTED": "dropped", "INVALID_ARGUMENT": "rejected",
              "DEADLINE_EXCEEDED": "expired"}  # fmt: skip


def lab_status(code: str) -> str:
    return LAB_STATUS.get(code, "failed")


def library_from_info(info: Any) -> PackedLibrary:
    """The server's sample library (info: its pb.ModelInfo): samples [0, library_samples) of
    its generator and seed."""
    from dlrm_lab.config import ModelSpec

    spec = ModelSpec.from_dict(json.loads(info.spec_json))
    return PackedLibrary.generate(spec, info.data_spec or None, info.library_seed, info.library_samples)


@dataclass(frozen=True)
class LibraryRecipe:
    """How a client makes the sample library a query's samples are read from (picklable: each client
    worker makes its own): the generator's samples [0, samples) of `spec` at `seed`."""

    spec: dict[str, Any]  # ModelSpec.to_dict()
    data_spec: str | None
    seed: int
    samples: int

    def library(self) -> PackedLibrary:
        from dlrm_lab.config import ModelSpec

        return PackedLibrary.generate(ModelSpec.from_dict(self.spec), self.data_spec, self.seed, self.samples)


def ready_channel(target: Any, timeout_s: float) -> grpc.Channel:
    """A channel to `target` (`infer.targets.Target`) once its server answers; one line naming the target when
    none does within `timeout_s`."""
    channel = grpc.insecure_channel(target.address, options=CHANNEL_OPTIONS)
    try:
        grpc.channel_ready_future(channel).result(timeout=timeout_s)
    except grpc.FutureTimeoutError:
        channel.close()
        raise FieldError("target", f"{target.url}: no server answered within {timeout_s:g} s") from None
    return channel


def describe_server(target: Any, timeout_s: float) -> list[Any]:
    """The models a `dlrm-lab serve` serves (pb.ModelInfo), waiting up to `timeout_s` for it."""
    channel = ready_channel(target, timeout_s)
    try:
        return list(pb_grpc.InferenceStub(channel).Describe(pb.DescribeRequest(), timeout=timeout_s).models)
    except grpc.RpcError as exc:
        raise FieldError("target", f"{target.url}: Describe failed: {exc.code().name}: {exc.details()}") from None
    finally:
        channel.close()


@contextmanager
def open_lab_server(target: Any, models: list[Any], conn: Any) -> Iterator[Any]:
    """A `dlrm-lab serve` at grpc://HOST:PORT (`infer.targets`): its models as its Describe reports them
    (spec, sample library, how it serves them), matched by name."""
    from dlrm_lab.config import ModelSpec

    infos = {info.name: info for info in describe_server(target, conn.connect_timeout_s)}
    recipes, descriptions = {}, {}
    unplaced = None if target.on_this_host else f"served on {target.address}, not this machine: its profile is not ours"
    for m in models:
        info = infos.get(m.name)
        if info is None:
            raise FieldError("model", f"{m.name}: not served at {target.url}; it serves: "
                             f"{', '.join(infos) or 'nothing'}")  # fmt: skip
        spec = ModelSpec.from_dict(json.loads(info.spec_json))
        recipes[m.name] = LibraryRecipe(spec.to_dict(), info.data_spec or None, info.library_seed,
                                        info.library_samples)  # fmt: skip
        descriptions[m.name] = ModelDescription(
            name=m.name, spec=spec, instances=info.instances or None, threads=info.threads or None,
            max_batch=info.max_batch or None, max_delay_ms=info.max_delay_ms, min_piece=info.min_piece,
            precision=info.precision or None, table_precision=info.table_precision or None, build=info.build or None,
            on_this_host=target.on_this_host, unplaced=unplaced,
            columns=json.loads(info.columns_json) if info.columns_json else {},
        )  # fmt: skip
    with _connected(target, recipes, descriptions, {}, conn.rpc or "stream", conn) as sut:
        yield sut


@contextmanager
def open_inference_server(target: Any, models: list[Any], conn: Any) -> Iterator[Any]:
    """Any Open Inference Protocol (KServe v2) gRPC server at kserve://HOST:PORT[/MODEL] (`infer.targets`):
    live, ready, and serving each model (the URL's name, else the preset's) with the lab's tensors
    (`serve.open_inference.tensors`: dense, lengths, ids in; scores out), checked before any load; the
    samples are the preset's, generated here. It says nothing of how it serves them."""
    from dlrm_lab.infer.memory import library_samples

    if target.model_name and len(models) > 1:
        raise FieldError("target", f"{target.url}: names one model; {len(models)} {{model}} given", "model")
    names = {m.name: target.model_name or m.spec.name for m in models}
    channel = ready_channel(target, conn.connect_timeout_s)
    try:
        stub = v2_grpc.GRPCInferenceServiceStub(channel)
        for m in models:
            if not (family := family_of(m.spec)).wire_samples:
                raise FieldError("model", f"{m.name}: {family.label} presets are served from their server's "
                                 "own library; a remote target takes DLRM samples")  # fmt: skip
            check_open_inference_model(target, stub, names[m.name], m.spec, conn.connect_timeout_s)
    finally:
        channel.close()
    recipes = {m.name: LibraryRecipe(m.spec.to_dict(), m.data_spec, conn.seed,
                                     library_samples(m.max_batch, m.library_samples)) for m in models}  # fmt: skip
    why = "a third-party server: it does not say how it serves (instances, threads, precision)"
    descriptions = {m.name: ModelDescription(name=m.name, spec=m.spec, on_this_host=target.on_this_host, unplaced=why)
                    for m in models}  # fmt: skip
    with _connected(target, recipes, descriptions, names, "oip", conn) as sut:
        yield sut


def check_open_inference_model(target: Any, stub: Any, name: str, spec: Any, timeout_s: float) -> None:
    """The server is live and ready, serves `name`, and its metadata has the lab's tensors for `spec`."""
    from dlrm_lab.serve.open_inference import tensors

    where = f"{target.url}: model {name!r}"
    try:
        if not stub.ServerReady(v2.ServerReadyRequest(), timeout=timeout_s).ready:
            raise FieldError("target", f"{target.url}: the server is not ready")
        if not stub.ModelReady(v2.ModelReadyRequest(name=name), timeout=timeout_s).ready:
            raise FieldError("target", f"{where}: not ready (is it served under that name? kserve://HOST:PORT/MODEL "
                             "names it)")  # fmt: skip
        meta = stub.ModelMetadata(v2.ModelMetadataRequest(name=name), timeout=timeout_s)
    except grpc.RpcError as exc:
        raise FieldError("target", f"{where}: {exc.code().name}: {exc.details()}") from None
    inputs, outputs = tensors(spec)
    for kind, wanted, got in (("input", inputs, meta.inputs), ("output", outputs, meta.outputs)):
        have = {t.name: t for t in got}
        for tensor, datatype, shape in wanted:
            t = have.get(tensor)
            if t is None:
                raise FieldError("target", f"{where}: no {kind} tensor {tensor!r} (it has: "
                                 f"{', '.join(have) or 'none'})")  # fmt: skip
            if t.datatype != datatype:
                raise FieldError("target", f"{where}: {kind} {tensor!r} is {t.datatype}, the lab sends {datatype}")
            dims = list(t.shape)
            fits = len(dims) == len(shape) and all(a == b or -1 in (a, b) for a, b in zip(dims, shape, strict=False))
            if not fits:
                raise FieldError("target", f"{where}: {kind} {tensor!r} has shape {list(t.shape)}, {spec.name} needs "
                                 f"{shape} (-1: any)")  # fmt: skip


@contextmanager
def _connected(target: Any, recipes: dict[str, LibraryRecipe], descriptions: dict[str, Any], names: dict[str, str],
               rpc: str, conn: Any) -> Iterator[Any]:  # fmt: skip
    """One RemoteServer on a channel of this process, or (`conn.concurrency` > 1) a pool of client processes."""
    libraries = {m: recipe.library() for m, recipe in recipes.items()}
    description = SutDescription(models=descriptions, target=target.url, rpc=rpc, concurrency=conn.concurrency)
    if conn.concurrency > 1:
        from dlrm_lab.serve.pool import ClientPool, WorkerPlan, check_workers_fit

        check_workers_fit(conn.concurrency, sum(lib.nbytes for lib in libraries.values()))

        connect = functools.partial(connect_worker, target.address, recipes, names, rpc, conn.timeout_s,
                                    conn.unavailable_s, conn.connect_timeout_s)  # fmt: skip
        epoch = time.monotonic_ns()
        pool = ClientPool([WorkerPlan(k, connect, epoch) for k in range(conn.concurrency)], libraries, description,
                          conn.unavailable_s)  # fmt: skip
        try:
            yield pool
        finally:
            pool.close()
        return
    channel = ready_channel(target, conn.connect_timeout_s)
    try:
        remote = RemoteServer(channel, libraries, models=descriptions, timeout_s=conn.timeout_s, rpc=rpc,
                              unavailable_s=conn.unavailable_s, description=description, names=names)  # fmt: skip
        try:
            yield remote
        finally:
            remote.drain(conn.timeout_s)
            remote.close()
    finally:
        channel.close()


def connect_worker(address: str, recipes: dict[str, LibraryRecipe], names: dict[str, str], rpc: str, timeout_s: float,
                   unavailable_s: float, connect_timeout_s: float, worker: int) -> RemoteServer:  # fmt: skip
    """A client worker's own connection (`serve.pool`): its channel, its libraries, its RemoteServer."""
    channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    try:
        grpc.channel_ready_future(channel).result(timeout=connect_timeout_s)
    except grpc.FutureTimeoutError:
        channel.close()
        raise ConnectionError(f"no server answered within {connect_timeout_s:g} s") from None
    libraries = {m: recipe.library() for m, recipe in recipes.items()}
    return RemoteServer(channel, libraries, worker=worker, timeout_s=timeout_s, unavailable_s=unavailable_s, rpc=rpc,
                        names=names)  # fmt: skip


def encode_library_samples(library: PackedLibrary, offset: int, size: int) -> tuple[bytes, bytes, bytes]:
    """(dense, lengths, ids) bytes of samples [offset, offset + size), as the server decodes them."""
    dense, lengths, ids = library.columns(offset, size)
    return (
        np.ascontiguousarray(dense, dtype=DENSE_DTYPE).tobytes(),
        np.asarray(lengths, dtype=LENGTH_DTYPE).tobytes(),
        np.asarray(ids, dtype=ID_DTYPE).tobytes(),
    )


class RemoteServer:
    """Queries to a `dlrm-lab serve` over one channel; thread-safe, `submit` returns at once.

    Times in rows are ms from `epoch_ns` (time.monotonic_ns, system-wide on Linux, so the
    worker processes of one client share it). `check()` raises BadAnswer after an answer that is
    not one score per sample, and ServerLost once the server
    has answered only UNAVAILABLE for more than `unavailable_s`.
    """

    def __init__(
        self,
        channel: grpc.Channel,
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
        # Raw bytes in and out: serialising and decoding the messages are client stages.
        self._infer = channel.unary_unary(INFER_METHOD)
        self._model_infer = channel.unary_unary(MODEL_INFER_METHOD)  # rpc "oip": the Open Inference Protocol
        self._open_stream = channel.stream_stream(INFER_STREAM_METHOD)
        self._stream: queue.SimpleQueue | None = None  # requests of the open stream (None ends it)
        self._waiting: dict[int, tuple[Any, tuple[int, int, int], int]] = {}  # stream: query id -> its send
        self._rows: list[dict[str, Any]] = []
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

    def submit(self, q: Any) -> None:
        """Serialise and send `q` (an infer.sut.Query); its samples are `q.payload` (a
        SampleBlock) when given, else library samples [q.offset, q.offset + q.size)."""
        start = time.monotonic_ns()
        q.issued_ns = start
        if not q.scheduled_ns:
            q.scheduled_ns = start
        if q.payload is None:
            dense, lengths, ids = encode_library_samples(self.libraries[q.model], q.offset, q.size)
        else:
            dense, lengths, ids = encode_samples(q.payload.dense, q.payload.lengths, q.payload.values)
        query_id = (self.worker << 40) | q.query_id  # unique across the workers of a client
        model = self.names.get(q.model, q.model)
        if self.rpc == "oip":
            body = open_inference_request(model, str(query_id), q.size, dense, lengths, ids)
        else:
            body = pb.InferRequest(
                model=model, query_id=query_id, samples=q.size, dense=dense, lengths=lengths, ids=ids,
                client_send_ns=start,
            ).SerializeToString()  # fmt: skip
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
                    self._record(q, stamps, request_bytes, receive, resp=resp, body=body, status=resp.status or "ok",
                                 error=resp.error or None)  # fmt: skip
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
                self._record(q, stamps, request_bytes, receive, status="BAD_RESPONSE",
                             error=f"an undecodable answer ({len(body)} bytes: {exc})")  # fmt: skip
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
        columns: dict[str, Any] = {
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
            columns.update({
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
            })  # fmt: skip
        if status == "INVALID_ARGUMENT" and q.payload is None and self._bad is None:
            # library samples refused: the server's model is not the one these samples were made for
            self._bad = (f"query {q.query_id} was refused: {error} (its model is not {q.model} as given here: "
                         "check --max-rows, --table-scale and the preset)")  # fmt: skip
        row = query_row(q.query_id, q.model, q.size, lab_status(status), epoch_ns=self.epoch_ns,
                        scheduled_ns=q.scheduled_ns, issued_ns=start, end_ns=end, error=error, rpc_status=status,
                        deserialise_ms=(end - receive) / 1e6, **columns)  # fmt: skip
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

    def take_records(self) -> list[dict[str, Any]]:
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

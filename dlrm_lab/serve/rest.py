"""The Open Inference Protocol's HTTP/REST binding (KServe v2) on `dlrm-lab serve --http-port PORT`: what curl,
KServe's InferenceService probes and `tritonclient.http` speak, driving the same batcher, instances and records as
the gRPC binding (`OpenInferenceService.score`; the tensors checked by `serve.v2_tensors`).

    GET  /v2/health/live, /v2/health/ready          200 {"live"|"ready": true}; not ready: 503 {"ready": false}
    GET  /v2                                        server metadata (extensions: binary_tensor_data, ...)
    GET  /v2/models/{name}[/versions/1]             model metadata: the tensors
    GET  /v2/models/{name}[/versions/1]/ready       200 {"name", "ready": true}; 503 while not
    GET  /v2/models/{name}[/versions/1]/config      Triton's model configuration (max_batch_size 0)
    GET  /v2/models[/{name}[/versions/1]]/stats     Triton's statistics
    POST /v2/models/{name}[/versions/1]/infer       JSON tensors, or Triton's binary-data extension

Binary-data extension (Triton's, what `tritonclient.http` sends): the body is a JSON header of
`Inference-Header-Content-Length` bytes, then each input whose parameters hold `binary_data_size` as that many raw
little-endian bytes, in the inputs' order. The scores come back binary (the same layout, the header's length in
the response's `Inference-Header-Content-Length`) when the request's `binary_data_output` parameter or the output's
own `binary_data` parameter is true, else as a JSON `data` list. A request's `timeout` parameter (microseconds, as
tritonclient sends it) is its deadline. The response's `parameters` hold the lab's stage times as the gRPC binding's
do (`protocol.STAGE_PARAMETERS`).

Errors are a 4xx (a refused query) or 5xx (the server's failure) with `{"error": "..."}`, one line naming the field:
400 malformed JSON, a missing, mistyped or misshapen tensor, a bad value; 404 an unknown model or path; 405 another
method; 411 a body without Content-Length (chunked); 413 a body over `max_body_bytes` (derived from the largest query
the models take); 415 a compressed body; 429 the model's queue is full; 500 an instance failed; 503 stopping; 504 past
the request's timeout. The connection stays open (HTTP/1.1 keep-alive) but after 411, 413 or a request it could not
parse.

Hand-written over asyncio streams on the server's own event loop: no maintained library implements the v2 REST
server without pulling kserve's protobuf pin (< 7; this package's generated code needs 7).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import urllib.parse
from typing import Any, cast

import grpc
import numpy as np

from dlrm_lab.errors import interrupt_blocked
from dlrm_lab.resources import lab_version
from dlrm_lab.serve.open_inference import EXTENSIONS, OpenInferenceService
from dlrm_lab.serve.protocol import SCORE_DTYPE, Refused, echoed
from dlrm_lab.serve.rest_body import BodyFile, parse_body_file, read_body, remove_dead_bodies, whole_number
from dlrm_lab.serve.v2_tensors import (
    OUTPUT,
    VERSION,
    Declared,
    V2Request,
    served_model,
    tensors,
)

REST_EXTENSIONS = [*EXTENSIONS, "binary_tensor_data"]
HEADER_LIMIT = 64 << 10  # request line and headers
SMALL_BODY = 1 << 20  # a body above this is parsed in a process of its own, and counts against BODIES_IN_FLIGHT
BODIES_IN_FLIGHT = 2  # large bodies held at once, in units of the largest body allowed
HEAD_TIMEOUT_S = 30.0  # a connection idle this long between requests, or sending a head this slowly, is closed
BODY_TIMEOUT_S, BODY_BYTES_PER_S = 30.0, 1 << 20  # a body must arrive within 30 s plus 1 s a MiB
JSON_VALUE_BYTES = 24  # the widest JSON number of a tensor (an int64, a float's repr), with its separator
BODY_SLACK = 1 << 20  # the JSON around the tensors
READ_SLICE = 256 << 10  # a large body is read to its file this much at a time
MAX_BODY_CAP = 1 << 30
STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.INTERNAL: 500,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
REASONS = {
    100: "Continue",
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    411: "Length Required",
    413: "Content Too Large",
    415: "Unsupported Media Type",
    429: "Too Many Requests",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    503: "Service Unavailable",
    504: "Gateway Timeout",
}

Response = tuple[int, dict[str, str], bytes]


def max_body_bytes(models: dict[str, Any]) -> int:
    """The largest body a request may have: its largest query (--max-query-samples) as JSON numbers of its dense
    values, lengths and ids at 8 times the tables' mean pooling, plus 1 MiB; at most 1 GiB."""
    widest = 0
    for m in models.values():
        spec = m.spec
        ids = 8 * sum(t.pooling_factor * len(t.feature_names) for t in spec.tables)
        widest = max(widest, int(m.max_query_samples * (spec.num_dense + spec.num_features + ids) * JSON_VALUE_BYTES))
    return min(BODY_SLACK + widest, MAX_BODY_CAP)


async def _read_to(reader: asyncio.StreamReader, body: BodyFile) -> None:
    """The body into its file, a slice at a time (each a short hold of the loop; the write a system call)."""
    left = body.size
    while left:
        chunk = await reader.read(min(left, READ_SLICE))
        if not chunk:
            raise asyncio.IncompleteReadError(b"", left)
        body.file.write(chunk)
        left -= len(chunk)


def _json(status: int, value: Any, headers: dict[str, str] | None = None) -> Response:
    return status, {"Content-Type": "application/json", **(headers or {})}, json.dumps(value).encode()


def error(status: int, message: str) -> Response:
    return _json(status, {"error": " ".join(message.split())})  # one line, whatever the message held


class RestFront:
    """KServe v2's REST binding over an `OpenInferenceService` (its models, statistics and `score`)."""

    def __init__(
        self, v2: OpenInferenceService, max_body: int | None = None, max_connections: int | None = None
    ) -> None:
        self.v2 = v2
        self.max_body = max_body_bytes(v2.models) if max_body is None else max_body
        self.max_connections = max_connections  # beyond it a new client is answered 503 (serve.connections)
        self.turned_away = 0  # clients answered 503 for want of a connection
        self.stopping = False
        self._server: asyncio.base_events.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._busy = 0  # requests being answered
        self._body_bytes = 0  # of the bodies being read or answered: at most BODIES_IN_FLIGHT x the largest body
        self._pool: Any = None  # the process that parses large bodies, started with the first of them

    def _parser(self) -> Any:
        if self._pool is None:
            import concurrent.futures
            import multiprocessing

            from dlrm_lab.errors import end_with_parent

            self._pool = concurrent.futures.ProcessPoolExecutor(
                max_workers=1, mp_context=multiprocessing.get_context("spawn"), initializer=end_with_parent
            )
        return self._pool

    async def start(self, host: str, port: int, sock: Any = None) -> int:
        """Listen on host:port, or on `sock` (bound to it already: claimed before the server started); the bound
        port."""
        remove_dead_bodies()
        if sock is not None:
            self._server = await asyncio.start_server(self._connection, sock=sock, limit=HEADER_LIMIT)
        else:
            self._server = await asyncio.start_server(
                self._connection, host, port, limit=HEADER_LIMIT, reuse_address=True
            )
        return self._server.sockets[0].getsockname()[1]

    def stop_accepting(self) -> None:
        self.stopping = True  # ready turns false, queries are refused UNAVAILABLE
        if self._server is not None:
            self._server.close()

    async def close(self, grace_s: float) -> None:
        """Stop accepting, let requests being answered finish (up to `grace_s`), close every connection."""
        self.stop_accepting()
        deadline = time.monotonic() + grace_s
        while self._busy and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        for writer in list(self._writers):
            writer.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.max_connections is not None and len(self._writers) >= self.max_connections:
            self.turned_away += 1
            with contextlib.suppress(ConnectionError, asyncio.TimeoutError):
                message = f"the server holds its most connections ({self.max_connections}); retry later"
                await asyncio.wait_for(self._write(writer, error(503, message), close=True), HEAD_TIMEOUT_S)
            writer.close()
            return
        self._writers.add(writer)
        try:
            while await self._one(reader, writer):
                pass
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the client went away
        except asyncio.CancelledError:  # the server stopping under a kept-alive or half-sent request (issue 57 B15):
            pass  # ended quietly, where asyncio's stream callback printed a cancelled handler's traceback each
        finally:
            self._writers.discard(writer)
            writer.close()

    async def _one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Read one request, answer it; whether the connection stays open."""
        try:  # an idle keep-alive connection, or a head sent byte by byte, is closed after HEAD_TIMEOUT_S
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HEAD_TIMEOUT_S)
        except (asyncio.IncompleteReadError, asyncio.TimeoutError):
            return False  # closed between requests, or idle too long
        except asyncio.LimitOverrunError:
            await self._write(writer, error(431, f"request head: over {HEADER_LIMIT} bytes"), close=True)
            return False
        try:
            line, *fields = head.decode("latin-1").split("\r\n")
            method, target, version = line.split(" ")
            pairs = [(k.strip().lower(), v.strip()) for k, _, v in (f.partition(":") for f in fields if f)]
            headers = dict(pairs)
        except ValueError:
            await self._write(
                writer, error(400, f"request line {echoed(head[:80].decode('latin-1'))}: not HTTP"), close=True
            )
            return False
        keep = headers.get("connection", "").lower() != "close" and (
            version == "HTTP/1.1" or headers.get("connection", "").lower() == "keep-alive"
        )
        if "chunked" in headers.get("transfer-encoding", "").lower():
            await self._write(writer, error(411, "Transfer-Encoding: chunked: give the body's Content-Length"), True)
            return False
        for name in ("content-length", "inference-header-content-length"):  # each splits the body: one value each
            values = {v for k, v in pairs if k == name}
            if len(values) > 1:  # which one frames the body is ambiguous (request smuggling's way in): refused
                shown = "-".join(w.capitalize() for w in name.split("-"))
                said = f"{shown} given {len(values)} times with other values ({echoed(', '.join(sorted(values)))})"
                await self._write(writer, error(400, f"{said}: give one"), True)
                return False
        length = headers.get("content-length", "0")
        if not whole_number(length):
            await self._write(writer, error(400, f"Content-Length {echoed(length)}: not a number of bytes"), True)
            return False
        if int(length) > self.max_body:
            over = Refused(grpc.StatusCode.INVALID_ARGUMENT, f"body: {length} bytes, over {self.max_body}", "rejected")
            self.v2.service.record_refused(Declared(_model_of(target)), time.monotonic_ns(), over)
            await self._write(
                writer,
                error(
                    413,
                    f"Content-Length {length}: over this server's {self.max_body} bytes (its largest query as JSON)",
                ),
                close=True,
            )
            return False
        size = int(length)
        if size > SMALL_BODY and self._body_bytes + size > BODIES_IN_FLIGHT * self.max_body:
            # memory for bodies is bounded: a large one waits for none, it is refused while others are held
            await self._write(
                writer,
                error(503, f"body: {length} bytes while {self._body_bytes} bytes of other bodies are in flight: retry"),
                close=True,
            )
            return False
        if size and headers.get("expect", "").lower() == "100-continue":
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")  # curl waits for it before a body over 1 KiB
        self._body_bytes += size
        try:
            body: bytes | BodyFile = b""
            allowed_s = BODY_TIMEOUT_S + size / BODY_BYTES_PER_S  # a body trickled in is dropped past it
            try:
                if size > SMALL_BODY:
                    body = BodyFile(size)
                    await asyncio.wait_for(_read_to(reader, body), allowed_s)
                else:
                    body = await asyncio.wait_for(reader.readexactly(size), allowed_s)
            except asyncio.TimeoutError:
                await self._write(writer, error(408, f"body: {length} bytes not received in time"), True)
                return False
            except OSError as exc:  # no room for the body's file (a full or read-only disk): this request's alone
                if isinstance(exc, ConnectionError):
                    raise
                await self._write(
                    writer, error(503, f"body: {length} bytes: no room to hold it ({exc.strerror})"), True
                )
                return False
            self._busy += 1
            try:
                status, out_headers, payload = await self.respond(method, target, headers, body)
            finally:
                self._busy -= 1
        finally:
            self._body_bytes -= size
            if isinstance(body, BodyFile):
                body.remove()
        await self._write(writer, (status, out_headers, payload), close=not keep)
        return keep

    @staticmethod
    async def _write(writer: asyncio.StreamWriter, response: Response, close: bool = False) -> None:
        status, headers, payload = response
        lines = [
            f"HTTP/1.1 {status} {REASONS.get(status, 'Error')}",
            f"Content-Length: {len(payload)}",
            *(f"{k}: {v}" for k, v in headers.items()),
            *(["Connection: close"] if close else []),
        ]
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + payload)
        await writer.drain()

    async def respond(self, method: str, target: str, headers: dict[str, str], body: bytes | BodyFile) -> Response:
        """The answer to one request (headers: lower-case names)."""
        receive = time.monotonic_ns()
        path = urllib.parse.urlsplit(target).path.rstrip("/")
        parts = [urllib.parse.unquote(p) for p in path.split("/")[1:]]
        if parts[:1] != ["v2"]:
            return error(404, f"path {echoed(path)}: not an endpoint of this server (/v2/...)")
        rest = parts[1:]
        route, name, version = _route(rest)
        if route is None:
            return error(404, f"path {echoed(path)}: not an Open Inference Protocol endpoint")
        wanted = "POST" if route == "infer" else "GET"
        if method != wanted:
            return error(405, f"method {echoed(method)}: {path} takes {wanted}")
        if route == "infer":
            return await self.infer(name, version, headers, body, receive)
        return self.get(route, name, version)

    def get(self, route: str, name: str, version: str) -> Response:
        ready = self.v2.service.failure is None and not self.stopping
        if route == "live":
            return _json(200, {"live": True})
        if route == "ready":
            return _json(200 if ready else 503, {"ready": ready})
        if route == "server":
            return _json(200, {"name": "dlrm-lab", "version": lab_version(), "extensions": REST_EXTENSIONS})
        if route == "stats" and not name:
            return _json(200, _numbers(self.v2.statistics()))
        try:
            m = served_model(self.v2.models, name, version)
        except Refused as exc:
            return error(STATUS[exc.code], str(exc))
        if route == "model_ready":
            return _json(200 if ready else 503, {"name": name, "ready": ready})
        if route == "stats":
            return _json(200, _numbers(self.v2.statistics(name)))
        inputs, outputs = tensors(m.spec)
        if route == "config":
            return _json(
                200,
                {
                    "name": name,
                    "platform": "pytorch_torchrec",
                    "backend": "dlrm-lab",
                    "max_batch_size": 0,
                    "input": [{"name": n, "data_type": f"TYPE_{t}", "dims": s} for n, t, s in inputs],
                    "output": [{"name": n, "data_type": f"TYPE_{t}", "dims": s} for n, t, s in outputs],
                    "instance_group": [{"name": name, "count": m.instances, "kind": "KIND_CPU"}],
                },
            )
        meta = [[{"name": n, "datatype": t, "shape": s} for n, t, s in group] for group in (inputs, outputs)]
        return _json(
            200,
            {
                "name": name,
                "versions": [VERSION],
                "platform": "pytorch_torchrec",
                "inputs": meta[0],
                "outputs": meta[1],
            },
        )

    async def infer(
        self, name: str, version: str, headers: dict[str, str], body: bytes | BodyFile, receive: int
    ) -> Response:
        if self.stopping:
            return error(503, "the server is stopping")
        request: dict[str, Any] = {}  # the JSON fields the answer reads (`rest_body.ANSWER_FIELDS`)

        def check() -> Any:
            """The served model's spec, once the body is one the lab reads and the model one it serves."""
            if headers.get("content-encoding", "identity").lower() != "identity":
                raise _refused(
                    name, f"Content-Encoding {echoed(headers['content-encoding'])}: send the body uncompressed"
                )
            return served_model(self.v2.models, name, version).spec

        def read() -> V2Request:
            nonlocal request
            shim, request = read_body(check(), name, headers, cast(bytes, body))  # a BodyFile is read by `reader` below
            return shim

        reader = read
        if isinstance(body, BodyFile):  # parsed in a process of its own: json.loads holds the GIL, even in a thread
            parsed: V2Request | Refused
            try:
                with interrupt_blocked():  # the worker is spawned at the first large body: Ctrl-C stays the server's
                    parsed_later = asyncio.get_running_loop().run_in_executor(
                        self._parser(), parse_body_file, check(), name, headers, body.path
                    )
                parsed, request = await parsed_later
            except Refused as refused:
                parsed = refused

            def reader() -> V2Request:  # a refusal is raised inside `score`, which records it
                if isinstance(parsed, Refused):
                    raise parsed
                return parsed

        params: dict[str, Any] = {}
        try:
            try:
                shim, scores, stages = await self.v2.score(lambda: name, reader, receive, None)
            except _Unsupported as exc:
                return error(415, str(exc))
            params = request.get("parameters") or {}
        except Refused as exc:
            return error(STATUS.get(exc.code, 500), str(exc))
        wanted = (request.get("outputs") or [{}])[0]
        binary = (wanted.get("parameters") or {}).get("binary_data", params.get("binary_data_output", False))
        scores = np.asarray(scores, dtype=SCORE_DTYPE)
        output: dict[str, Any] = {"name": OUTPUT, "datatype": "FP32", "shape": [shim.samples]}
        if binary is True:
            output["parameters"] = {"binary_data_size": scores.nbytes}
        else:
            output["data"] = scores.tolist()
        answer = {"model_name": name, "model_version": VERSION, "outputs": [output], "parameters": stages}
        if "id" in request:
            answer["id"] = request["id"]
        stages["server_send_ns"] = time.monotonic_ns()  # its encoding follows, as the gRPC binding's
        head = json.dumps(answer).encode()
        if binary is not True:
            return 200, {"Content-Type": "application/json"}, head
        return (
            200,
            {"Content-Type": "application/octet-stream", "Inference-Header-Content-Length": str(len(head))},
            (head + scores.tobytes()),
        )


class _Unsupported(Refused):
    pass


def _refused(model: str, message: str) -> Refused:
    return _Unsupported(grpc.StatusCode.INVALID_ARGUMENT, f"model {echoed(model)}: {message}", "rejected")


def _model_of(target: str) -> str | None:
    parts = urllib.parse.urlsplit(target).path.strip("/").split("/")
    return urllib.parse.unquote(parts[2]) if len(parts) > 2 and parts[:2] == ["v2", "models"] else None


def _route(rest: list[str]) -> tuple[str | None, str, str]:
    """(route, model, version) of a path under /v2; route None: no endpoint."""
    fixed = {(): "server", ("health", "live"): "live", ("health", "ready"): "ready", ("models", "stats"): "stats"}
    if tuple(rest) in fixed:
        return fixed[tuple(rest)], "", ""
    if len(rest) < 2 or rest[0] != "models":
        return None, "", ""
    name, tail, version = rest[1], rest[2:], ""
    if tail[:1] == ["versions"] and len(tail) >= 2:
        version, tail = tail[1], tail[2:]
    routes = {
        (): "metadata",
        ("ready",): "model_ready",
        ("config",): "config",
        ("stats",): "stats",
        ("infer",): "infer",
    }
    return routes.get(tuple(tail)), name, version


def _numbers(message: Any) -> dict[str, Any]:
    """A protobuf message as Triton's JSON: int64 fields as numbers, not protobuf's strings."""
    from google.protobuf.json_format import MessageToDict

    def walk(value: Any, key: str = "") -> Any:
        if isinstance(value, dict):
            return {k: walk(v, k) for k, v in value.items()}
        if isinstance(value, list):
            return [walk(v, key) for v in value]
        if isinstance(value, str) and key not in ("name", "version") and value.lstrip("-").isdigit():
            return int(value)
        return value

    return walk(MessageToDict(message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True))

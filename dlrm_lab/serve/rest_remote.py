"""Any Open Inference Protocol (KServe v2) HTTP/REST server as a system under test: `--target
http://HOST:PORT[/MODEL]` (`infer.targets`). `RestServer` is a `serve.remote.RemoteServer` whose queries go as one
POST /v2/models/MODEL/infer each, so the runner, its rows and its stages are those of the gRPC targets:

    serialise       building the request body (JSON header and binary tensors, or JSON data lists)
    network         round trip - the server's own time (its stage parameters, where it reports them: a lab server)
    deserialise     reading the answer's JSON header and its scores (binary or a JSON list)

How the tensors travel (`--rpc`): `rest`, binary (Triton's binary-data extension: an
`Inference-Header-Content-Length` JSON header, then the raw little-endian tensors, and the scores asked for binary
too), or `rest-json`, JSON `data` lists both ways. By default `rest` where the server's metadata (GET /v2) lists the
`binary_tensor_data` extension (Triton, a lab server), else `rest-json` (KServe's ModelServer reads binary tensors
but does not say so). HTTP/1.1 has no multiplexing: each client process keeps one keep-alive connection per query in
flight, opened as the load needs them, up to `MAX_CONNECTIONS`; a query waiting for one is in its issue stage.
"""

from __future__ import annotations

import functools
import http.client
import json
import queue
import threading
import time
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from dlrm_lab.config.family import family_of
from dlrm_lab.errors import FieldError
from dlrm_lab.infer.library import PackedLibrary
from dlrm_lab.infer.sut import ModelDescription, SutDescription
from dlrm_lab.serve.connect import LibraryRecipe, check_tensor_metadata, client_pool, drained
from dlrm_lab.serve.protocol import SCORE_DTYPE, STAGE_PARAMETERS
from dlrm_lab.serve.remote import OpenInferenceAnswer, RemoteServer

MAX_CONNECTIONS = 64  # keep-alive connections of one client process
BINARY = "binary_tensor_data"
# What an HTTP status means in the lab's records (the gRPC code's name, as `serve.remote.lab_status` reads it)
HTTP_STATUS = {
    400: "INVALID_ARGUMENT",
    404: "NOT_FOUND",
    413: "INVALID_ARGUMENT",
    429: "RESOURCE_EXHAUSTED",
    500: "INTERNAL",
    503: "UNAVAILABLE",
    504: "DEADLINE_EXCEEDED",
}


def rest_request(
    model: str,
    query_id: str,
    samples: int,
    dense: bytes,
    lengths: bytes,
    ids: bytes,
    *,
    binary: bool,
    timeout_us: int | None = None,
) -> tuple[bytes, dict[str, str]]:
    """The body and headers of a v2 REST infer request holding one query's tensors (`serve.v2_tensors`)."""
    features = len(lengths) // (4 * samples)
    shapes = {"dense": [samples, len(dense) // (4 * samples)], "lengths": [features, samples], "ids": [len(ids) // 8]}
    raw = {"dense": dense, "lengths": lengths, "ids": ids}
    dtypes = {"dense": ("FP32", "<f4"), "lengths": ("INT32", "<i4"), "ids": ("INT64", "<i8")}
    inputs = []
    for name, (datatype, dtype) in dtypes.items():
        tensor: dict[str, Any] = {"name": name, "datatype": datatype, "shape": shapes[name]}
        if binary:
            tensor["parameters"] = {"binary_data_size": len(raw[name])}
        else:
            tensor["data"] = np.frombuffer(raw[name], dtype=dtype).tolist()
        inputs.append(tensor)
    request: dict[str, Any] = {
        "id": query_id,
        "inputs": inputs,
        "outputs": [{"name": "scores", "parameters": {"binary_data": binary}}],
    }
    if timeout_us:
        request["parameters"] = {"timeout": timeout_us}
    head = json.dumps(request).encode()
    if not binary:
        return head, {"Content-Type": "application/json"}
    headers = {"Content-Type": "application/octet-stream", "Inference-Header-Content-Length": str(len(head))}
    return head + dense + lengths + ids, headers


def rest_answer(body: bytes, header_length: str | None) -> OpenInferenceAnswer:
    """The scores (the `scores` output, binary or a JSON list) and the server's stage parameters of a v2 REST infer
    response; ValueError when it is not one."""
    cut = len(body) if header_length is None else int(header_length)
    answer = json.loads(body[:cut])
    outputs = answer.get("outputs") if isinstance(answer, dict) else None
    if not isinstance(outputs, list) or not outputs or not all(isinstance(o, dict) for o in outputs):
        raise ValueError("no outputs")
    names = [o.get("name") for o in outputs]
    k = names.index("scores") if "scores" in names else 0
    at = 0
    for o in outputs[:k]:  # the binary outputs before it
        at += int((o.get("parameters") or {}).get("binary_data_size") or 0)
    size = (outputs[k].get("parameters") or {}).get("binary_data_size")
    if size is not None:
        scores = body[cut + at : cut + at + int(size)]
    else:
        scores = np.asarray(outputs[k].get("data", []), dtype=SCORE_DTYPE).reshape(-1).tobytes()
    params = answer.get("parameters") or {}
    stages = {key: int(params[key]) for key in STAGE_PARAMETERS if isinstance(params.get(key), int)}
    return OpenInferenceAnswer(scores=bytes(scores), **stages)


def _host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def http_get(address: str, path: str, timeout_s: float) -> tuple[int, Any]:
    """GET `path`: its status and JSON (None when it is none)."""
    conn = http.client.HTTPConnection(*_host_port(address), timeout=timeout_s)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        body = resp.read()
    finally:
        conn.close()
    try:
        return resp.status, json.loads(body)
    except ValueError:
        return resp.status, None


class RestServer(RemoteServer):
    """Queries to a v2 REST server, one POST each over keep-alive connections (a thread each); `submit` returns at
    once. Rows, stages and on_done are RemoteServer's."""

    def __init__(self, address: str, libraries: dict[str, Any], *, rpc: str = "rest", **options: Any) -> None:
        super().__init__(None, libraries, rpc=rpc, **options)
        self.address = address
        self._queries: queue.SimpleQueue = queue.SimpleQueue()
        self._senders = self._idle_senders = self._waiting_queries = 0

    def submit(self, q: Any) -> None:
        with self._lock:
            self._outstanding += 1
            self.issued += 1
            self._waiting_queries += 1
            if self._waiting_queries > self._idle_senders and self._senders < MAX_CONNECTIONS:
                self._senders += 1
                threading.Thread(target=self._sender, name="rest-client", daemon=True).start()
        self._queries.put(q)

    def close(self) -> None:
        with self._lock:
            senders = self._senders
        for _ in range(senders):
            self._queries.put(None)

    def _sender(self) -> None:
        conn: http.client.HTTPConnection | None = None
        while True:
            with self._lock:
                self._idle_senders += 1
            q = self._queries.get()
            with self._lock:
                self._idle_senders -= 1
                if q is not None:
                    self._waiting_queries -= 1
            if q is None:
                break
            conn = self._send(conn, q)
        if conn is not None:
            conn.close()

    def _send(self, conn: http.client.HTTPConnection | None, q: Any) -> http.client.HTTPConnection | None:
        """Serialise and send `q`, read its answer, record it; the connection to keep (None: closed)."""
        start, (dense, lengths, ids) = self._issue(q)
        model = self.names.get(q.model, q.model)
        body, headers = rest_request(
            model,
            str((self.worker << 40) | q.query_id),
            q.size,
            dense,
            lengths,
            ids,
            binary=self.rpc == "rest",
            timeout_us=int(self.timeout_s * 1e6),
        )
        serialised = time.monotonic_ns()
        path = f"/v2/models/{urllib.parse.quote(model, safe='')}/infer"
        status, error, data, resp = "ok", None, b"", None
        for attempt in (0, 1):
            reused = conn is not None
            conn = conn or http.client.HTTPConnection(*_host_port(self.address), timeout=self.timeout_s)
            send = time.monotonic_ns()
            try:
                conn.request("POST", path, body, headers)
                resp = conn.getresponse()
                data = resp.read()
                break
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError) as exc:
                conn.close()
                conn = None
                if reused and attempt == 0:  # a kept-alive connection the server had closed: once more, anew
                    continue
                status, error = "UNAVAILABLE", f"{type(exc).__name__}: {exc}"
            except TimeoutError:
                conn.close()
                conn = None
                status, error = "DEADLINE_EXCEEDED", f"no answer within {self.timeout_s:g} s"
            except (OSError, http.client.HTTPException) as exc:
                conn.close()
                conn = None
                status, error = "UNAVAILABLE", f"{type(exc).__name__}: {exc}"
            break
        receive = time.monotonic_ns()
        answer = None
        if resp is not None:
            if resp.will_close and conn is not None:
                conn.close()
                conn = None
            if resp.status == 200:
                try:
                    answer = rest_answer(data, resp.getheader("Inference-Header-Content-Length"))
                except (ValueError, TypeError, KeyError) as exc:
                    status, error = "BAD_RESPONSE", f"an undecodable answer ({len(data)} bytes: {exc})"
            else:
                status = HTTP_STATUS.get(resp.status, f"HTTP_{resp.status}")
                error = f"HTTP {resp.status}: {_error_text(data)}"
        self._record(
            q, (start, serialised, send), len(body), receive, resp=answer, body=data, status=status, error=error
        )
        return conn


def _error_text(data: bytes) -> str:
    try:
        return str(json.loads(data)["error"])[:500]
    except (ValueError, KeyError, TypeError):
        return data[:200].decode("utf-8", "replace")


def _wait_ready(target: Any, timeout_s: float) -> None:
    """Until GET /v2/health/ready answers 200; one line naming the target when it does not within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while True:
        try:
            status, _ = http_get(target.address, "/v2/health/ready", max(0.1, deadline - time.monotonic()))
            if status == 200:
                return
            last = f"GET /v2/health/ready answered {status}"
        except (OSError, http.client.HTTPException) as exc:
            last = f"{type(exc).__name__}: {exc}"
        if time.monotonic() >= deadline:
            raise FieldError("target", f"{target.url}: no ready server within {timeout_s:g} s ({last})")
        time.sleep(0.1)


def check_rest_model(target: Any, name: str, spec: Any, timeout_s: float) -> None:
    """The server serves `name`, ready, with the lab's tensors for `spec` in its metadata."""
    where = f"{target.url}: model {name!r}"
    path = f"/v2/models/{urllib.parse.quote(name, safe='')}"
    try:
        status, _ = http_get(target.address, f"{path}/ready", timeout_s)
        if status != 200:
            raise FieldError(
                "target",
                f"{where}: not ready (GET {path}/ready answered {status}; is it served under "
                "that name? http://HOST:PORT/MODEL names it)",
            )
        status, meta = http_get(target.address, path, timeout_s)
    except (OSError, http.client.HTTPException) as exc:
        raise FieldError("target", f"{where}: {type(exc).__name__}: {exc}") from None
    if status != 200 or not isinstance(meta, dict):
        raise FieldError("target", f"{where}: GET {path} answered {status}, not the model's metadata")

    def listed(key: str) -> list[tuple]:
        return [
            (t.get("name"), t.get("datatype"), t.get("shape") or []) for t in meta.get(key) or [] if isinstance(t, dict)
        ]

    check_tensor_metadata(where, spec, listed("inputs"), listed("outputs"))


@contextmanager
def open_rest_server(target: Any, models: list[Any], conn: Any) -> Iterator[Any]:
    """Any v2 REST server at http://HOST:PORT[/MODEL] (`infer.targets`): ready, serving each model (the URL's name,
    else the preset's) with the lab's tensors, checked before any load; the samples are the preset's, generated
    here, as for kserve://. It says nothing of how it serves them."""
    from dlrm_lab.infer.memory import library_samples

    if target.model_name and len(models) > 1:
        raise FieldError("target", f"{target.url}: names one model; {len(models)} {{model}} given", "model")
    for m in models:
        if not (family := family_of(m.spec)).wire_samples:
            raise FieldError(
                "model",
                f"{m.name}: {family.label} presets are served from their server's own library; "
                "a remote target takes DLRM samples",
            )
    names = {m.name: target.model_name or m.spec.name for m in models}
    _wait_ready(target, conn.connect_timeout_s)
    try:
        _, meta = http_get(target.address, "/v2", conn.connect_timeout_s)
    except (OSError, http.client.HTTPException):
        meta = None
    extensions = meta.get("extensions") if isinstance(meta, dict) else None
    rpc = conn.rpc or ("rest" if isinstance(extensions, list) and BINARY in extensions else "rest-json")
    for m in models:
        check_rest_model(target, names[m.name], m.spec, conn.connect_timeout_s)
    recipes = {
        m.name: LibraryRecipe(m.spec.to_dict(), m.data_spec, conn.seed, library_samples(m.max_batch, m.library_samples))
        for m in models
    }
    why = "a third-party server: it does not say how it serves (instances, threads, precision)"
    descriptions = {
        m.name: ModelDescription(name=m.name, spec=m.spec, on_this_host=target.on_this_host, unplaced=why)
        for m in models
    }
    libraries = {m: recipe.library() for m, recipe in recipes.items()}
    description = SutDescription.over_network(descriptions, target.url, rpc, conn.concurrency)
    if conn.concurrency > 1:
        connect = functools.partial(
            connect_rest_worker, target.address, libraries, names, rpc, conn.timeout_s, conn.unavailable_s
        )
        with client_pool(conn, libraries, description, connect) as pool:
            yield pool
        return
    remote = RestServer(
        target.address,
        libraries,
        models=descriptions,
        timeout_s=conn.timeout_s,
        rpc=rpc,
        unavailable_s=conn.unavailable_s,
        description=description,
        names=names,
    )
    with drained(remote, conn.timeout_s):
        yield remote


def connect_rest_worker(
    address: str,
    libraries: dict[str, PackedLibrary],
    names: dict[str, str],
    rpc: str,
    timeout_s: float,
    unavailable_s: float,
    worker: int,
) -> RestServer:
    """A client worker's own connections (`serve.pool`): its copy of the libraries, its RestServer."""
    return RestServer(
        address, libraries, worker=worker, timeout_s=timeout_s, unavailable_s=unavailable_s, rpc=rpc, names=names
    )

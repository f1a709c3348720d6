"""A v2 REST request's body read into the lab's packed request: torch-free, so that a large body can be parsed in a
process of its own (`RestFront`: `json.loads` holds the GIL for its whole parse, which stalled every client of the
event loop for a second a 70 MB body), and the same code reads a small one in the serving process.

`read_body` is what both run; `parse_body` is its form for a worker process: the outcome (the request, or the
refusal) and the parts of the JSON the answer needs (`id`, `parameters`, `outputs`), each picklable.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import tempfile
from typing import Any

import numpy as np

from dlrm_lab.config.values import JsonObject
from dlrm_lab.serve.protocol import Refused, echoed
from dlrm_lab.serve.v2_tensors import DTYPES, V2Request, check_tensors, nbytes, packed_request, refuse

ANSWER_FIELDS = ("id", "parameters", "outputs")  # what the answer reads of a request's JSON
MAX_TIMEOUT_US = 3_600_000_000  # a request's own timeout: an hour at most


def whole_number(text: str) -> bool:
    """ASCII digits only, at most 18 (`str.isdigit` also takes '²' and other scripts' digits, which `int` refuses)."""
    return text.isascii() and text.isdigit() and len(text) <= 18


def split_body(model: str, headers: dict[str, str], body: bytes | memoryview) -> tuple[dict[str, Any], memoryview]:
    """The request's JSON and the binary data after it (Triton's extension: Inference-Header-Content-Length)."""
    size = headers.get("inference-header-content-length")
    if size is not None and (not whole_number(size) or int(size) > len(body)):
        raise refuse(
            model, f"Inference-Header-Content-Length {echoed(size)}: not a length within the body's {len(body)} bytes"
        )
    cut = len(body) if size is None else int(size)
    try:
        request = json.loads(bytes(body[:cut]))
    except (UnicodeDecodeError, ValueError) as exc:
        raise refuse(model, f"request body: not JSON ({exc})") from None
    except RecursionError:
        raise refuse(model, "request body: JSON nested too deep (a tensor's data nests as deep as its shape)") from None
    if not isinstance(request, dict):
        raise refuse(model, f"request body: a JSON object expected, not {type(request).__name__}")
    return request, memoryview(body)[cut:]


def body_tensors(spec: Any, model: str, request: dict[str, Any], blobs: memoryview) -> V2Request:
    """The request's tensors, JSON `data` or binary, as the lab's packed request (checked as the gRPC binding's)."""
    if not isinstance(request.get("id", ""), str):
        raise refuse(model, f"id {echoed(json.dumps(request['id']))}: must be a string")
    for key in ("parameters",):
        if not isinstance(request.get(key) or {}, dict):
            raise refuse(model, f"{key}: must be a JSON object")
    timeout = (request.get("parameters") or {}).get("timeout")  # microseconds, as tritonclient sends it
    if timeout is not None and (  # a deadline the server cannot read is refused, never dropped silently
        isinstance(timeout, bool) or not isinstance(timeout, int) or not 0 < timeout <= MAX_TIMEOUT_US
    ):
        raise refuse(model, f"parameters.timeout {echoed(json.dumps(timeout))}: microseconds in [1, {MAX_TIMEOUT_US}]")
    inputs, outputs = request.get("inputs"), request.get("outputs") or []
    if not isinstance(inputs, list) or not all(isinstance(t, dict) for t in inputs):
        raise refuse(model, "inputs: a list of tensor objects expected (name, datatype, shape, data)")
    if not isinstance(outputs, list) or not all(isinstance(o, dict) for o in outputs):
        raise refuse(model, "outputs: a list of objects with a name expected")
    for k, o in enumerate(outputs):  # checked before the query is scored: its answer reads them
        if not isinstance(o.get("parameters") or {}, dict):
            raise refuse(model, f"outputs[{k}]: parameters must be a JSON object")
    triples = []
    for k, t in enumerate(inputs):
        name, datatype, shape = t.get("name"), t.get("datatype"), t.get("shape")
        where = f"inputs[{k}]" if not isinstance(name, str) else f"input {echoed(name)}"
        if not isinstance(name, str) or not isinstance(datatype, str):
            raise refuse(model, f"{where}: name and datatype must be strings")
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
            raise refuse(model, f"{where}: shape {echoed(json.dumps(shape))}: a list of whole numbers expected")
        if not isinstance(t.get("parameters") or {}, dict):
            raise refuse(model, f"{where}: parameters must be a JSON object")
        triples.append((name, datatype, shape))
    shapes = check_tensors(model, spec, triples, [o.get("name") for o in outputs])
    raw: dict[str, bytes] = {}
    at = 0
    for name, datatype, shape in triples:
        t = next(t for t in inputs if t["name"] == name)
        size = (t.get("parameters") or {}).get("binary_data_size")
        if size is not None:
            if not isinstance(size, int) or isinstance(size, bool) or size < 0 or at + size > len(blobs):
                raise refuse(
                    model,
                    f"input {name}: binary_data_size {echoed(json.dumps(size))}: not a size within "
                    f"the {len(blobs) - at} bytes left after the JSON header",
                )
            raw[name], at = bytes(blobs[at : at + size]), at + size
        elif "data" in t:
            raw[name] = json_values(model, name, datatype, t["data"], shape)
        else:
            raise refuse(model, f"input {name}: no data (give `data`, or binary data with `binary_data_size`)")
    if at != len(blobs):
        raise refuse(
            model, f"binary data: {len(blobs)} bytes after the JSON header, the inputs' binary_data_size sum to {at}"
        )
    shim = packed_request(model, request.get("id", ""), shapes, raw)
    if timeout is not None:
        shim.timeout_ns = timeout * 1000
    return shim


def json_values(model: str, name: str, datatype: str, data: Any, shape: list[int]) -> bytes:
    """A JSON `data` list (flat, row-major, or nested to the shape) as the tensor's bytes."""
    want = nbytes(name, shape) // DTYPES[datatype].itemsize
    try:
        values = np.asarray(data)
        if values.size == 0:
            values = values.astype(DTYPES[datatype])
        if values.dtype.kind not in ("iu" if datatype != "FP32" else "iuf"):
            raise ValueError(f"{datatype} values expected, got {values.dtype.kind!r} kind")
        if datatype == "INT32" and values.size and not (-(2**31) <= values.min() and values.max() < 2**31):
            raise ValueError("a value outside int32")
        values = values.astype(DTYPES[datatype])
    except (ValueError, TypeError, OverflowError) as exc:
        why = " ".join(str(exc).split())[:200]
        raise refuse(model, f"input {name}: data: not {datatype} numbers ({why})") from None
    if values.size != want:
        raise refuse(model, f"input {name}: {values.size} values in data for shape {shape} ({want} expected)")
    return values.tobytes()


def read_body(spec: Any, model: str, headers: dict[str, str], body: bytes | memoryview) -> tuple[V2Request, JsonObject]:
    """The request a body holds, checked as the gRPC binding's is, and the JSON fields its answer reads."""
    request, blobs = split_body(model, headers, body)
    return body_tensors(spec, model, request, blobs), {k: request[k] for k in ANSWER_FIELDS if k in request}


def parse_body(spec: Any, model: str, headers: dict[str, str], body: bytes) -> tuple[V2Request | Refused, JsonObject]:
    """`read_body` in a worker process: a refusal is returned, not raised (raised there it would lose its code)."""
    try:
        return read_body(spec, model, headers, body)
    except Refused as refused:
        return refused, {}


class BodyFile:
    """A large body as it arrives, in a file of its own (on tmpfs where there is one): read from the socket a slice at
    a time and parsed by the worker process from the file, so that the serving process never copies it whole (two
    copies of a 68 MB body, into one bytes object and down the pipe to the worker, held every other client up to
    72 ms: issue 57 B9)."""

    PREFIX = "dlrm-lab-body-"  # then the serving process's pid: `remove_dead_bodies` knows whose it is

    def __init__(self, size: int) -> None:
        where = None  # the temporary directory, where tmpfs is absent, read-only or too small (a container's 64 MB)
        with contextlib.suppress(OSError):
            if os.access("/dev/shm", os.W_OK) and shutil.disk_usage("/dev/shm").free > 2 * size:
                where = "/dev/shm"
        fd, self.path = tempfile.mkstemp(prefix=f"{self.PREFIX}{os.getpid()}-", dir=where)
        self.file = os.fdopen(fd, "wb", buffering=0)
        self.size = size

    def __len__(self) -> int:
        return self.size

    def remove(self) -> None:
        self.file.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


def parse_body_file(spec: Any, model: str, headers: dict[str, str], path: str) -> tuple[V2Request | Refused, Any]:
    """`parse_body` of a body the serving process wrote to `path` (`BodyFile`)."""
    with open(path, "rb") as f:
        return parse_body(spec, model, headers, f.read())


def remove_dead_bodies() -> None:
    """Remove the body files of serving processes no longer running (killed mid-request)."""
    for path in glob.glob(f"/dev/shm/{BodyFile.PREFIX}*"):
        pid = os.path.basename(path)[len(BodyFile.PREFIX) :].split("-", 1)[0]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            with contextlib.suppress(OSError):  # gone meanwhile, or not ours to remove
                os.unlink(path)

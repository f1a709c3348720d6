"""The Open Inference Protocol's (KServe v2) tensors of a DLRM query, checked once for both of its bindings: gRPC
(`serve.open_inference`) and HTTP/REST (`serve.rest`). A binding reads its request into (name, datatype, shape)
triples and raw little-endian bytes; these functions refuse what does not describe a query of the model, naming the
field, and give the lab's packed request (`V2Request`, what `InferenceService.samples` and `submit` read).

    dense    FP32  [N, num_dense]       the samples' dense features
    lengths  INT32 [num_features, N]    ids per feature per sample (feature-major, as a KeyedJaggedTensor)
    ids      INT64 [sum(lengths)]       feature 0's ids for every sample, then feature 1's, ...
    scores   FP32  [N]                  the output: each sample's click probability
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import grpc
import numpy as np

from dlrm_lab.config import ModelSpec
from dlrm_lab.serve.protocol import DENSE_DTYPE, ID_DTYPE, LENGTH_DTYPE, Refused, echoed

VERSION = "1"  # the one version of each model a lab server holds
INPUTS = ("dense", "lengths", "ids")
OUTPUT = "scores"
DTYPES = {"FP32": DENSE_DTYPE, "INT32": LENGTH_DTYPE, "INT64": ID_DTYPE}
WANTED = {"dense": "FP32", "lengths": "INT32", "ids": "INT64"}

Tensor = tuple[str, str, list[int]]  # name, datatype, shape


def tensors(spec: ModelSpec) -> tuple[list[Tensor], list[Tensor]]:
    """The model's (name, datatype, shape) inputs and outputs; -1: the number of samples or ids."""
    return (
        [
            ("dense", "FP32", [-1, spec.num_dense]),
            ("lengths", "INT32", [spec.num_features, -1]),
            ("ids", "INT64", [-1]),
        ],
        [(OUTPUT, "FP32", [-1])],
    )


class V2Request:
    """A v2 request in the shape the lab's checks read (`InferenceService.samples`, `submit`)."""

    def __init__(self, model: str, query_id: int, samples: int, dense: bytes, lengths: bytes, ids: bytes) -> None:
        self.model, self.query_id, self.samples = model, query_id, samples
        self.dense, self.lengths, self.ids = dense, lengths, ids
        self.client_send_ns = 0
        self.timeout_ns: int | None = None  # the request's own timeout (REST's `timeout` parameter)


class Declared:
    """A request refused before its tensors were read: the model it named, its size unknown (`record_refused`)."""

    def __init__(self, model: str | None) -> None:
        self.model, self.samples, self.query_id = model, -1, 0


def refuse(model: str, message: str) -> Refused:
    return Refused(grpc.StatusCode.INVALID_ARGUMENT, f"model {echoed(model)}: {message}", "rejected")


def served_model(models: Mapping[str, Any], name: str, version: str) -> Any:
    """The served model (infer.served.ServedModel) a request names at the version it names ("" or VERSION), or
    Refused NOT_FOUND. The version has no default: every endpoint, inference included, answers only the versions
    its metadata lists."""
    if name not in models:
        raise Refused(
            grpc.StatusCode.NOT_FOUND,
            f"model {echoed(name)}: not served here; served: {', '.join(models) or 'no DLRM'}",
            "rejected",
        )
    if version not in ("", VERSION):
        raise Refused(grpc.StatusCode.NOT_FOUND, f"model {name} version {echoed(version)}: only {VERSION}", "rejected")
    return models[name]


def check_tensors(model: str, spec: ModelSpec, inputs: Sequence[Tensor], outputs: Sequence[str]) -> dict[str, list]:
    """The inputs' shapes by name, once their names, datatypes and shapes are those of `spec`'s query and the outputs
    asked for (none: all) are its one; else Refused (INVALID_ARGUMENT) naming the tensor."""
    if outputs and list(outputs) != [OUTPUT]:
        raise refuse(model, f"outputs {list(outputs)}: the model has one, {OUTPUT!r}")
    names = [name for name, _, _ in inputs]
    if sorted(names) != sorted(INPUTS):
        raise refuse(model, f"inputs {names}: expected {', '.join(INPUTS)} (see the model's metadata)")
    shapes: dict[str, list[int]] = {}
    for name, datatype, shape in inputs:
        if datatype != WANTED[name]:
            raise refuse(model, f"input {name}: datatype {echoed(datatype)}, expected {WANTED[name]}")
        shapes[name] = list(shape)
    dense, lengths = shapes["dense"], shapes["lengths"]
    if len(dense) != 2 or dense[1] != spec.num_dense or dense[0] < 1:
        raise refuse(model, f"input dense: shape {dense}, expected [N, {spec.num_dense}]")
    n = dense[0]
    if lengths != [spec.num_features, n]:
        raise refuse(model, f"input lengths: shape {lengths}, expected [{spec.num_features}, {n}]")
    if len(shapes["ids"]) != 1 or shapes["ids"][0] < 0:
        raise refuse(model, f"input ids: shape {shapes['ids']}, expected [sum of lengths]")
    return shapes


def nbytes(name: str, shape: Sequence[int]) -> int:
    """The bytes of input `name` at `shape` (its datatype checked)."""
    return int(np.prod(shape, dtype=np.float64)) * DTYPES[WANTED[name]].itemsize


def packed_request(model: str, request_id: str, shapes: Mapping[str, list[int]], raw: Mapping[str, bytes]) -> V2Request:
    """The checked tensors' bytes as the lab's packed request, or Refused naming the input whose bytes do not fill
    its shape. Sizes against the model (ids within tables, --max-query-samples) are checked after, by the same rules
    as the lab's own protocol (`InferenceService.samples`)."""
    for name in INPUTS:
        size = nbytes(name, shapes[name])
        if len(raw[name]) != size:
            raise refuse(model, f"input {name}: {len(raw[name])} bytes for shape {shapes[name]} ({size} expected)")
    # any id is echoed as sent; a plain number (one an int64 holds) also names the query in the rows
    query_id = int(request_id) if request_id.isascii() and request_id.isdigit() and len(request_id) <= 18 else 0
    return V2Request(model, query_id, shapes["dense"][0], raw["dense"], raw["lengths"], raw["ids"])

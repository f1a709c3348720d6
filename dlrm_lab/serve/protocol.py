"""The wire format: generated protobuf modules, packed payloads, channel options.

A query's samples travel as three packed little-endian byte fields, in the layout the
serving instances read (feature-major, like a KeyedJaggedTensor):

    dense    float32 [samples, num_dense]
    lengths  int32   [features, samples]
    ids      int64   feature 0's ids for every sample, then feature 1's, ...

Decoding only reinterprets the received bytes (np.frombuffer): no copy, no per-value work.
"""

from __future__ import annotations

import time
from typing import Any

import grpc
import numpy as np

from dlrm_lab.config import ModelSpec
from dlrm_lab.errors import UserError
from dlrm_lab.infer.library import PackedLibrary

try:
    from dlrm_lab.serve import inference_pb2 as pb
    from dlrm_lab.serve import inference_pb2_grpc as pb_grpc
    from dlrm_lab.serve import open_inference_pb2 as v2
    from dlrm_lab.serve import open_inference_pb2_grpc as v2_grpc
except ImportError as exc:  # a checkout used without installing it
    raise UserError(
        f"the gRPC modules generated from dlrm_lab/serve/*.proto are missing ({exc}); "
        "they are built by the install: pip install -e ."
    ) from None

SERVICE = pb.DESCRIPTOR.services_by_name["Inference"].full_name  # dlrm_lab.serve.Inference
INFER_METHOD = f"/{SERVICE}/Infer"
INFER_STREAM_METHOD = f"/{SERVICE}/InferStream"
# How a client sends its queries: one InferStream, an Infer call each, or a ModelInfer call each of the Open
# Inference Protocol (KServe v2, `serve.open_inference`); over its HTTP/REST binding (`serve.rest_remote`), a POST
# each with binary tensors (Triton's extension) or JSON ones
RPC_KINDS = ("stream", "unary", "oip", "rest", "rest-json")
DESCRIBE_METHOD = f"/{SERVICE}/Describe"
# The Open Inference Protocol (KServe v2): its service, and the response parameters (int64) in which a lab server
# reports a query's stages, as its own protocol does (`serve.open_inference`)
OPEN_INFERENCE_SERVICE = v2.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name  # inference.GRPC...
MODEL_INFER_METHOD = f"/{OPEN_INFERENCE_SERVICE}/ModelInfer"
STAGE_PARAMETERS = (
    "server_receive_ns",
    "parse_ns",
    "queue_ns",
    "compute_ns",
    "batch_samples",
    "instance",
    "pieces",
    "instance_compute_ns",
    "server_send_ns",
)

# gRPC's default 4 MiB receive limit is below a 1024-sample query of a large preset.
MAX_MESSAGE_BYTES = 256 << 20
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
]

DENSE_DTYPE, LENGTH_DTYPE, ID_DTYPE, SCORE_DTYPE = np.dtype("<f4"), np.dtype("<i4"), np.dtype("<i8"), np.dtype("<f4")

__all__ = [
    "pb",
    "pb_grpc",
    "v2",
    "v2_grpc",
    "PayloadError",
    "Refused",
    "client_deadline",
    "decode_samples",
    "model_info",
]


class Refused(Exception):
    """A query answered with an error code; `status`: its row's status when the
    InferenceServer never saw it (None: the InferenceServer recorded it)."""

    def __init__(self, code: grpc.StatusCode, message: str, status: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.status = status

    def __reduce__(self) -> tuple[Any, ...]:  # pickled whole (a large REST body is read in a worker process)
        return type(self), (self.code, str(self), self.status)


def client_deadline(context: Any) -> int | None:
    """The client's deadline on this process's monotonic clock (None: it set none)."""
    remaining = context.time_remaining()
    return None if remaining is None else time.monotonic_ns() + int(remaining * 1e9)


class PayloadError(ValueError):
    """A request whose fields do not describe a valid query (the message names the field)."""


def decode_samples(req: Any, spec: ModelSpec) -> Any:
    """The samples of an InferRequest, packed as an instance reads them (`infer.library.PackedLibrary`,
    views of the received bytes), after checking every field's size. Lengths, ids against the
    tables and finite dense values are checked by `infer.library.validate_payload`."""
    n, d, f = req.samples, spec.num_dense, spec.num_features
    if n < 1:
        raise PayloadError(f"samples: {n}, must be >= 1")
    dense, lengths, ids = req.dense, req.lengths, req.ids  # each access of a bytes field copies it
    want = n * d * DENSE_DTYPE.itemsize
    if len(dense) != want:
        raise PayloadError(f"dense: {len(dense)} bytes, expected {want} (samples {n} x num_dense {d} x 4-byte float32)")
    want = f * n * LENGTH_DTYPE.itemsize
    if len(lengths) != want:
        raise PayloadError(
            f"lengths: {len(lengths)} bytes, expected {want} (features {f} x samples {n} x 4-byte int32)"
        )
    per_sample = np.frombuffer(lengths, dtype=LENGTH_DTYPE).reshape(f, n)
    total = int(per_sample.sum(dtype=np.int64))
    if len(ids) != total * ID_DTYPE.itemsize:
        raise PayloadError(
            f"ids: {len(ids)} bytes, expected {total * ID_DTYPE.itemsize} (the lengths sum to {total} int64 ids)"
        )
    return PackedLibrary.from_columns(
        np.frombuffer(dense, dtype=DENSE_DTYPE).reshape(n, d), per_sample, np.frombuffer(ids, dtype=ID_DTYPE)
    )


def echoed(text: str, limit: int = 100) -> str:
    """A client's string as an error message repeats it: quoted, and cut at `limit` characters (gRPC's status
    details travel in 8 KB of metadata: a longer echo would turn the refusal into RESOURCE_EXHAUSTED)."""
    return repr(text) if len(text) <= limit else f"{text[:limit]!r}... ({len(text):,} characters)"


def encode_samples(dense: np.ndarray, lengths: list[np.ndarray], values: list[np.ndarray]) -> tuple[bytes, ...]:
    """(dense, lengths, ids) bytes of samples given per feature, as `decode_samples` reads them."""
    return (
        np.ascontiguousarray(dense, dtype=DENSE_DTYPE).tobytes(),
        np.concatenate([np.asarray(ln, dtype=LENGTH_DTYPE) for ln in lengths]).tobytes(),
        np.concatenate([np.asarray(v, dtype=ID_DTYPE) for v in values]).tobytes(),
    )


def model_info(served: Any, library_samples: int, seed: int) -> Any:
    """A served model as Describe reports it (served: infer.served.ServedModel)."""
    import json

    spec: ModelSpec = served.spec
    return pb.ModelInfo(
        name=served.name,
        preset=spec.name,
        table_scale=spec.table_scale,
        max_rows=spec.max_rows or 0,
        num_dense=spec.num_dense,
        feature_names=spec.feature_names,
        rows_per_feature=spec.rows_per_feature,
        library_seed=seed,
        library_samples=library_samples,
        data_spec=served.data_spec or "",
        spec_json=json.dumps(spec.to_dict()),
        max_batch=served.max_batch,
        instances=served.instances,
        threads=served.threads,
        precision=served.precision,
        table_precision=served.table_precision,
        build=served.build,
        max_delay_ms=served.max_delay_ms,
        min_piece=served.min_piece,
        columns_json=json.dumps(served.describe()),
    )

"""The Open Inference Protocol (KServe v2 gRPC) on `dlrm-lab serve`, beside the lab's own protocol.

Any v2 client (Triton's `tritonclient`, KServe's, perf_analyzer) can then talk to the lab's server: the
same batcher, instances and records as `dlrm_lab.serve.Inference`. A DLRM query is three input tensors
and one output, all little-endian and row-major, in `raw_input_contents` (or typed `contents`):

    dense    FP32  [N, num_dense]       the samples' dense features
    lengths  INT32 [num_features, N]    ids per feature per sample (feature-major, as a KeyedJaggedTensor)
    ids      INT64 [sum(lengths)]       feature 0's ids for every sample, then feature 1's, ...
    scores   FP32  [N]                  the output: each sample's click probability

ModelConfig (Triton's extension, asked for by perf_analyzer before it starts) says max_batch_size 0: the
shapes are given whole, with -1 for the sample count, since the lab batches behind the protocol.
ModelStatistics counts, per model, the queries answered over this protocol (gRPC and HTTP/REST, `serve.rest`)
and their time in queue and compute. The tensors are checked by the rules both bindings share (`serve.v2_tensors`),
and `OpenInferenceService.score` runs a query for either. An HSTU ranker's requests are not expressed as v2
tensors here: its models are not listed.

Hand-written over grpc's generic handlers: the servicer classes KServe and Triton ship need their own
protobuf runtimes, older than this package's.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
from google.protobuf.message import DecodeError

from dlrm_lab.config.family import family_of
from dlrm_lab.infer.served import ServedModel
from dlrm_lab.resources import lab_version
from dlrm_lab.serve.protocol import (
    OPEN_INFERENCE_SERVICE,
    SCORE_DTYPE,
    Refused,
    client_deadline,
    v2,
)
from dlrm_lab.serve.v2_tensors import (
    DTYPES,
    OUTPUT,
    VERSION,
    V2Request,
    check_tensors,
    packed_request,
    refuse,
    served_model,
    tensors,
)

__all__ = ["EXTENSIONS", "SERVICE", "VERSION", "OpenInferenceService", "tensors"]

SERVICE = OPEN_INFERENCE_SERVICE  # inference.GRPCInferenceService
EXTENSIONS = ["model_configuration", "statistics"]
_CONTENTS = {"FP32": "fp32_contents", "INT32": "int_contents", "INT64": "int64_contents"}


@dataclass
class _Stats:
    """One model's queries over this protocol, Triton's statistics."""

    samples: int = 0
    queries: int = 0
    success_ns: int = 0
    failures: int = 0
    fail_ns: int = 0
    queue_ns: int = 0
    compute_ns: int = 0
    last_ms: int = 0


class OpenInferenceService:
    """`inference.GRPCInferenceService` over the lab's `InferenceService` (its batcher, instances and rows)."""

    def __init__(self, service: Any) -> None:
        self.service = service
        self.models: dict[str, ServedModel] = {
            name: m for name, m in service.inference.models.items() if family_of(m.spec).wire_samples
        }
        self.stats: dict[str, _Stats] = {name: _Stats() for name in self.models}

    def handler(self) -> grpc.GenericRpcHandler:
        def unary(fn: Any, request: Any, response: Any) -> Any:
            return grpc.unary_unary_rpc_method_handler(
                fn, request_deserializer=request.FromString, response_serializer=response.SerializeToString
            )

        return grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "ServerLive": unary(self.server_live, v2.ServerLiveRequest, v2.ServerLiveResponse),
                "ServerReady": unary(self.server_ready, v2.ServerReadyRequest, v2.ServerReadyResponse),
                "ModelReady": unary(self.model_ready, v2.ModelReadyRequest, v2.ModelReadyResponse),
                "ServerMetadata": unary(self.server_metadata, v2.ServerMetadataRequest, v2.ServerMetadataResponse),
                "ModelMetadata": unary(self.model_metadata, v2.ModelMetadataRequest, v2.ModelMetadataResponse),
                "ModelConfig": unary(self.model_config, v2.ModelConfigRequest, v2.ModelConfigResponse),
                "ModelStatistics": unary(self.model_statistics, v2.ModelStatisticsRequest, v2.ModelStatisticsResponse),
                # raw bytes: decoding and encoding the message are inside the server's measured stages
                "ModelInfer": grpc.unary_unary_rpc_method_handler(self.model_infer),
            },
        )

    async def server_live(self, request: Any, context: Any) -> Any:
        return v2.ServerLiveResponse(live=True)

    async def server_ready(self, request: Any, context: Any) -> Any:
        return v2.ServerReadyResponse(ready=self.service.failure is None)

    async def model_ready(self, request: Any, context: Any) -> Any:
        """Ready: the model at the version asked (none: its only one) is served, and the server has not failed; a
        version its metadata would refuse is NOT_FOUND there too (the REST binding's /versions/V/ready likewise)."""
        await self._model(request.name, request.version, context)
        return v2.ModelReadyResponse(ready=self.service.failure is None)

    async def server_metadata(self, request: Any, context: Any) -> Any:
        return v2.ServerMetadataResponse(name="dlrm-lab", version=lab_version(), extensions=EXTENSIONS)

    async def _model(self, name: str, version: str, context: Any) -> ServedModel:
        try:
            return served_model(self.models, name, version)
        except Refused as exc:
            await context.abort(exc.code, str(exc))
            raise  # not reached: abort raises

    async def model_metadata(self, request: Any, context: Any) -> Any:
        m = await self._model(request.name, request.version, context)
        inputs, outputs = tensors(m.spec)
        meta = v2.ModelMetadataResponse.TensorMetadata
        return v2.ModelMetadataResponse(
            name=m.name,
            versions=[VERSION],
            platform="pytorch_torchrec",
            inputs=[meta(name=n, datatype=t, shape=s) for n, t, s in inputs],
            outputs=[meta(name=n, datatype=t, shape=s) for n, t, s in outputs],
        )

    async def model_config(self, request: Any, context: Any) -> Any:
        m = await self._model(request.name, request.version, context)
        inputs, outputs = tensors(m.spec)
        kind = {"INT32": v2.TYPE_INT32, "INT64": v2.TYPE_INT64, "FP32": v2.TYPE_FP32}
        config = v2.ModelConfig(
            name=m.name,
            platform="pytorch_torchrec",
            backend="dlrm-lab",
            max_batch_size=0,
            input=[v2.ModelInput(name=n, data_type=kind[t], dims=s) for n, t, s in inputs],
            output=[v2.ModelOutput(name=n, data_type=kind[t], dims=s) for n, t, s in outputs],
            instance_group=[v2.ModelInstanceGroup(name=m.name, count=m.instances, kind=v2.ModelInstanceGroup.KIND_CPU)],
        )
        return v2.ModelConfigResponse(config=config)

    async def model_statistics(self, request: Any, context: Any) -> Any:
        if request.name:
            await self._model(request.name, request.version, context)
        return self.statistics(request.name)

    def statistics(self, name: str = "") -> Any:
        """Triton's ModelStatisticsResponse of one model (`name`) or all, over both bindings of this protocol."""
        out = []
        for model in [name] if name else list(self.models):
            s = self.stats[model]
            duration = v2.StatisticDuration
            out.append(
                v2.ModelStatistics(
                    name=model,
                    version=VERSION,
                    last_inference=s.last_ms,
                    inference_count=s.samples,
                    execution_count=s.queries,
                    inference_stats=v2.InferStatistics(
                        success=duration(count=s.queries, ns=s.success_ns),
                        fail=duration(count=s.failures, ns=s.fail_ns),
                        queue=duration(count=s.queries, ns=s.queue_ns),
                        compute_infer=duration(count=s.queries, ns=s.compute_ns),
                    ),
                )
            )
        return v2.ModelStatisticsResponse(model_stats=out)

    async def model_infer(self, body: bytes, context: grpc.aio.ServicerContext) -> bytes:
        receive = time.monotonic_ns()
        req: v2.ModelInferRequest | None = None

        def read() -> V2Request:
            nonlocal req
            try:
                req = v2.ModelInferRequest.FromString(body)
            except DecodeError as exc:
                raise Refused(
                    grpc.StatusCode.INVALID_ARGUMENT, f"request: not a ModelInferRequest ({exc})", "rejected"
                ) from None
            return self._request(req)

        try:
            shim, scores, stages = await self.score(
                lambda: None if req is None else req.model_name, read, receive, client_deadline(context)
            )
        except Refused as exc:
            await context.abort(exc.code, str(exc))
            raise  # not reached: abort raises
        assert req is not None  # parsed: `score` answers only a request `read` gave it
        out = v2.ModelInferResponse.InferOutputTensor(name=OUTPUT, datatype="FP32", shape=[shim.samples])
        resp = v2.ModelInferResponse(
            model_name=shim.model,
            model_version=VERSION,
            id=req.id,
            outputs=[out],
            raw_output_contents=[np.asarray(scores, dtype=SCORE_DTYPE).tobytes()],
        )
        for key, value in stages.items():  # the lab's stage times, for a client that reads them (protocol.STAGE_...)
            resp.parameters[key].int64_param = int(value)
        resp.parameters["server_send_ns"].int64_param = time.monotonic_ns()  # its serialisation follows
        return resp.SerializeToString()

    async def score(
        self, model: Callable[[], str | None], read: Callable[[], V2Request], receive: int, deadline_ns: int | None
    ) -> tuple[V2Request, np.ndarray, dict[str, int]]:
        """One v2 query through the server, whichever binding carried it: `read()` gives its checked request (or
        raises Refused), which the batcher and instances score. Returns the request, its scores and the server's
        stage times (the response parameters of `protocol.STAGE_PARAMETERS` but server_send_ns); a refusal is
        counted in the statistics, recorded as a row of the serve run (as the lab's own protocol records it) and
        raised. `model()`: the model the request named, once read (None: unknown)."""
        shim: V2Request | None = None
        try:
            shim = read()
            if shim.timeout_ns is not None:  # the request's own deadline, where its binding carries one
                deadline_ns = receive + shim.timeout_ns
            q, done = self.service.submit(shim, self.service.samples(shim), receive, deadline_ns)
            scores, done_ns = await self.service.result(shim, q, done)
        except Refused as exc:
            if (name := model()) in self.stats:
                s = self.stats[name]
                s.failures, s.fail_ns = s.failures + 1, s.fail_ns + time.monotonic_ns() - receive
            self.service.record_refused(shim, receive, exc)
            raise
        start = q.first_start_ns if q.first_start_ns is not None else done_ns
        s = self.stats[shim.model]
        s.samples, s.queries = s.samples + shim.samples, s.queries + 1
        s.success_ns += done_ns - receive
        s.queue_ns += start - q.issued_ns
        s.compute_ns += done_ns - start
        s.last_ms = int(time.time() * 1e3)
        stages = {
            "server_receive_ns": receive,
            "parse_ns": q.issued_ns - receive,
            "queue_ns": start - q.issued_ns,
            "compute_ns": done_ns - start,
            "batch_samples": q.batch_samples or 0,
            "instance": -1 if q.instance is None else q.instance,
            "pieces": q.pieces,
            "instance_compute_ns": q.compute_ns,
        }
        return shim, scores, stages

    def _request(self, req: Any) -> V2Request:
        """The ModelInferRequest's three tensors (raw_input_contents, else typed contents) as the lab's packed
        request, checked by the rules both bindings share (`serve.v2_tensors`)."""
        m = served_model(self.models, req.model_name, req.model_version)
        shapes = check_tensors(
            req.model_name,
            m.spec,
            [(t.name, t.datatype, list(t.shape)) for t in req.inputs],
            [o.name for o in req.outputs],
        )
        if req.raw_input_contents and len(req.raw_input_contents) != len(req.inputs):
            raise refuse(
                req.model_name, f"{len(req.raw_input_contents)} raw_input_contents for {len(req.inputs)} inputs"
            )
        raw: dict[str, bytes] = {}
        for k, t in enumerate(req.inputs):
            if req.raw_input_contents:
                raw[t.name] = req.raw_input_contents[k]
            else:
                values = getattr(t.contents, _CONTENTS[t.datatype])
                raw[t.name] = np.asarray(values, dtype=DTYPES[t.datatype]).tobytes()
        return packed_request(req.model_name, req.id, shapes, raw)

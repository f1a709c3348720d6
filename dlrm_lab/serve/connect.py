"""Opening a served target for the load generator: wait until its server answers, learn the models it serves (a
`dlrm-lab serve`'s Describe) or check them (an Open Inference Protocol server's readiness and tensor metadata), make
the client's copy of each model's sample library (`LibraryRecipe`, generated from the same spec and seed as the
server's), and hand the runner one `serve.remote.RemoteServer` on a channel of this process or, beyond one
connection, a `serve.pool.ClientPool` whose worker processes each connect with `connect_worker`. `infer.targets`
names the openers (`open_lab_server`, `open_inference_server`) by module path.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import grpc

from dlrm_lab.config.family import family_of
from dlrm_lab.config.values import JsonObject
from dlrm_lab.errors import FieldError
from dlrm_lab.infer.library import PackedLibrary
from dlrm_lab.infer.sut import ModelDescription, SutDescription
from dlrm_lab.serve.protocol import CHANNEL_OPTIONS, pb, pb_grpc, v2, v2_grpc
from dlrm_lab.serve.remote import RemoteServer


def library_from_info(info: Any) -> PackedLibrary:
    """The server's sample library (info: its pb.ModelInfo): samples [0, library_samples) of
    its generator and seed."""
    from dlrm_lab.config import ModelSpec

    spec = ModelSpec.from_dict(json.loads(info.spec_json))
    return PackedLibrary.generate(spec, info.data_spec or None, info.library_seed, info.library_samples)


@dataclass(frozen=True)
class LibraryRecipe:
    """How a client makes the sample library a query's samples are read from: the generator's samples
    [0, samples) of `spec` at `seed`. Made once, in the runner's process; its client workers are handed a copy
    (numpy arrays: a worker imports no torch, which the generator's package does)."""

    spec: JsonObject  # ModelSpec.to_dict()
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
            raise FieldError(
                "model", f"{m.name}: not served at {target.url}; it serves: {', '.join(infos) or 'nothing'}"
            )
        spec = ModelSpec.from_dict(json.loads(info.spec_json))
        recipes[m.name] = LibraryRecipe(spec.to_dict(), info.data_spec or None, info.library_seed, info.library_samples)
        descriptions[m.name] = ModelDescription(
            name=m.name,
            spec=spec,
            instances=info.instances or None,
            threads=info.threads or None,
            max_batch=info.max_batch or None,
            max_delay_ms=info.max_delay_ms,
            min_piece=info.min_piece,
            precision=info.precision or None,
            table_precision=info.table_precision or None,
            build=info.build or None,
            on_this_host=target.on_this_host,
            unplaced=unplaced,
            columns=json.loads(info.columns_json) if info.columns_json else {},
        )
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
                raise FieldError(
                    "model",
                    f"{m.name}: {family.label} presets are served from their server's "
                    "own library; a remote target takes DLRM samples",
                )
            check_open_inference_model(target, stub, names[m.name], m.spec, conn.connect_timeout_s)
    finally:
        channel.close()
    recipes = {
        m.name: LibraryRecipe(m.spec.to_dict(), m.data_spec, conn.seed, library_samples(m.max_batch, m.library_samples))
        for m in models
    }
    why = "a third-party server: it does not say how it serves (instances, threads, precision)"
    descriptions = {
        m.name: ModelDescription(name=m.name, spec=m.spec, on_this_host=target.on_this_host, unplaced=why)
        for m in models
    }
    with _connected(target, recipes, descriptions, names, "oip", conn) as sut:
        yield sut


def check_open_inference_model(target: Any, stub: Any, name: str, spec: Any, timeout_s: float) -> None:
    """The server is live and ready, serves `name`, and its metadata has the lab's tensors for `spec`."""
    where = f"{target.url}: model {name!r}"
    try:
        if not stub.ServerReady(v2.ServerReadyRequest(), timeout=timeout_s).ready:
            raise FieldError("target", f"{target.url}: the server is not ready")
        if not stub.ModelReady(v2.ModelReadyRequest(name=name), timeout=timeout_s).ready:
            raise FieldError(
                "target", f"{where}: not ready (is it served under that name? kserve://HOST:PORT/MODEL names it)"
            )
        meta = stub.ModelMetadata(v2.ModelMetadataRequest(name=name), timeout=timeout_s)
    except grpc.RpcError as exc:
        raise FieldError("target", f"{where}: {exc.code().name}: {exc.details()}") from None
    check_tensor_metadata(
        where,
        spec,
        [(t.name, t.datatype, list(t.shape)) for t in meta.inputs],
        [(t.name, t.datatype, list(t.shape)) for t in meta.outputs],
    )


def check_tensor_metadata(where: str, spec: Any, inputs: list[tuple], outputs: list[tuple]) -> None:
    """A v2 server's (name, datatype, shape) inputs and outputs of a model (either binding's metadata) hold the lab's
    tensors for `spec` (`serve.v2_tensors.tensors`); one line naming the first that does not."""
    from dlrm_lab.serve.v2_tensors import tensors

    want_in, want_out = tensors(spec)
    for kind, wanted, got in (("input", want_in, inputs), ("output", want_out, outputs)):
        have = {name: (datatype, dims) for name, datatype, dims in got}
        for tensor, datatype, shape in wanted:
            if tensor not in have:
                raise FieldError(
                    "target", f"{where}: no {kind} tensor {tensor!r} (it has: {', '.join(have) or 'none'})"
                )
            got_type, dims = have[tensor]
            if got_type != datatype:
                raise FieldError("target", f"{where}: {kind} {tensor!r} is {got_type}, the lab sends {datatype}")
            dims = list(dims)
            fits = len(dims) == len(shape) and all(a == b or -1 in (a, b) for a, b in zip(dims, shape, strict=False))
            if not fits:
                raise FieldError(
                    "target", f"{where}: {kind} {tensor!r} has shape {dims}, {spec.name} needs {shape} (-1: any)"
                )


@contextmanager
def _connected(
    target: Any,
    recipes: dict[str, LibraryRecipe],
    descriptions: dict[str, ModelDescription],
    names: dict[str, str],
    rpc: str,
    conn: Any,
) -> Iterator[Any]:
    """One RemoteServer on a channel of this process, or (`conn.concurrency` > 1) a pool of client processes."""
    libraries = {m: recipe.library() for m, recipe in recipes.items()}
    description = SutDescription.over_network(descriptions, target.url, rpc, conn.concurrency)
    if conn.concurrency > 1:
        connect = functools.partial(
            connect_worker,
            target.address,
            libraries,
            names,
            rpc,
            conn.timeout_s,
            conn.unavailable_s,
            conn.connect_timeout_s,
        )
        with client_pool(conn, libraries, description, connect) as pool:
            yield pool
        return
    channel = ready_channel(target, conn.connect_timeout_s)
    try:
        remote = RemoteServer(
            channel,
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
    finally:
        channel.close()


@contextmanager
def client_pool(
    conn: Any, libraries: dict[str, PackedLibrary], description: SutDescription, connect: Any
) -> Iterator[Any]:
    """`conn.concurrency` client processes (`serve.pool`), each making its own connection with `connect(worker)`:
    any remote target's clients, whatever its protocol."""
    from dlrm_lab.serve.pool import ClientPool, WorkerPlan, check_workers_fit

    check_workers_fit(conn.concurrency, sum(lib.nbytes for lib in libraries.values()))
    epoch = time.monotonic_ns()
    pool = ClientPool(
        [WorkerPlan(k, connect, epoch) for k in range(conn.concurrency)], libraries, description, conn.unavailable_s
    )
    try:
        yield pool
    finally:
        pool.close()


@contextmanager
def drained(remote: RemoteServer, timeout_s: float) -> Iterator[RemoteServer]:
    """A client of this process that lets its queries in flight finish (up to `timeout_s`) before it closes."""
    try:
        yield remote
    finally:
        remote.drain(timeout_s)
        remote.close()


def connect_worker(
    address: str,
    libraries: dict[str, PackedLibrary],
    names: dict[str, str],
    rpc: str,
    timeout_s: float,
    unavailable_s: float,
    connect_timeout_s: float,
    worker: int,
) -> RemoteServer:
    """A client worker's own connection (`serve.pool`): its channel, its copy of the libraries, its RemoteServer."""
    channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    try:
        grpc.channel_ready_future(channel).result(timeout=connect_timeout_s)
    except grpc.FutureTimeoutError:
        channel.close()
        raise ConnectionError(f"no server answered within {connect_timeout_s:g} s") from None
    return RemoteServer(
        channel, libraries, worker=worker, timeout_s=timeout_s, unavailable_s=unavailable_s, rpc=rpc, names=names
    )

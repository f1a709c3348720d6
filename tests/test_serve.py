"""Inference over gRPC: `dlrm-lab serve` answers like the model, refuses bad input, sheds
load at its queue bound, drains on SIGTERM; `infer run --target` (and `client`, its alias) measures
every stage of a remote query through the one runner."""

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import grpc
import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from conftest import ROOT, run_cli_in_process, store_profile

from dlrm_lab.config import load_preset
from dlrm_lab.data import synthetic_generator
from dlrm_lab.data.source import block_to_batch
from dlrm_lab.metrics.run import read_manifest
from dlrm_lab.model.dlrm import build_model
from dlrm_lab.serve.protocol import (
    CHANNEL_OPTIONS,
    INFER_METHOD,
    INFER_STREAM_METHOD,
    SERVICE,
    encode_samples,
    pb,
    pb_grpc,
)

SEED = 3


class Process:
    """A `dlrm-lab` command in the background whose output lines are collected as they come."""

    def __init__(self, *args: str, prefix: tuple[str, ...] = ()) -> None:
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, "-m", "dlrm_lab", *args], cwd=ROOT, text=True,
            env={**os.environ, "PYTHONWARNINGS": "ignore"},  # now: the session's isolated machine profiles
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
        )  # fmt: skip
        self.out: list[str] = []
        self.err: list[str] = []
        for stream, lines in ((self.proc.stdout, self.out), (self.proc.stderr, self.err)):
            threading.Thread(target=lambda s=stream, ls=lines: ls.extend(s), daemon=True).start()

    def wait_for(self, text: str, timeout_s: float = 120) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            hit = next((line for line in self.err if text in line), None)
            if hit is not None:
                return hit
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise AssertionError(f"no {text!r} (exit code {self.proc.poll()}): {''.join(self.err)[-3000:]}")


class Server(Process):
    """`serve --preset tiny` on a free port. In fp32: its scores are compared with the fp32 model's, and an `auto`
    precision would time the machine's GEMMs at start (probing its peaks first where no profile is stored yet)."""

    def __init__(self, metrics_dir, *options: str, prefix: tuple[str, ...] = (), host: str = "127.0.0.1") -> None:
        self.metrics_dir = metrics_dir
        super().__init__("serve", "--preset", "tiny", "--host", host, "--port", "0", "--seed", str(SEED),
                         "--precision", "fp32", "--metrics-dir", str(metrics_dir), *options, prefix=prefix)  # fmt: skip
        self.target = ""
        self.http = ""  # with --http-port: its HTTP/REST address
        self.terminated = False
        self.link = None  # in another network namespace: the veth link to it

    def ready(self) -> "Server":
        if not self.target:  # "serving tiny on 127.0.0.1:PORT", after the REST front's line
            self.target = self.wait_for("serving tiny on ").split(" on ")[1].strip()
            rest = next((line for line in self.err if "Open Inference Protocol over HTTP/REST on " in line), "")
            self.http = rest.rsplit(" on ", 1)[-1].strip() if rest else ""
        return self

    def channel(self) -> grpc.Channel:
        return grpc.insecure_channel(self.ready().target, options=CHANNEL_OPTIONS)

    def terminate(self) -> None:
        """SIGTERM, once: a second one would cancel the queries in flight."""
        if self.proc.poll() is None and not self.terminated:
            self.terminated = True
            self.proc.send_signal(signal.SIGTERM)

    def stop(self) -> None:
        self.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)


FULL_DISK = """
import errno
import pyarrow.parquet as pq
_write = pq.write_table
def _full(table, where, *args, **kwargs):  # the disk under the queries table is full
    if "_parts/queries" in str(where):
        raise OSError(errno.ENOSPC, "No space left on device")
    return _write(table, where, *args, **kwargs)
pq.write_table = _full
"""


# The servers of this module and of test_serve_http.py: the fixture a test names -> its server's options (`netns`: a
# server in another network namespace; `rest`, test_serve_http.py's, is `server`'s HTTP port). A test that ends its
# server (a full disk, SIGKILL, SIGTERM) has one to itself.
SERVER_OPTIONS: dict[str, tuple[str, ...]] = {
    "server": ("--max-batch", "64", "--metrics-port", "0", "--http-port", "0"),  # shared: tests that leave it serving
    "full_disk": (),
    # one waiting query at most, and it waits 300 ms for its batch to fill; two instances, one of them to kill
    "queue_server": ("--max-queue", "1", "--max-delay-ms", "300", "--instances", "2", "--no-pin-cores"),
    "doomed": ("--http-port", "0"),  # started at a file-descriptor limit of FD_LIMIT (FD_LIMITED)
}
FD_LIMIT = 400
# a command's prefix that runs it with at most `limit` file descriptors, hard and soft
FD_LIMITED = (
    "import os, resource, sys; n = int(sys.argv[1]); resource.setrlimit(resource.RLIMIT_NOFILE, (n, n)); "
    "os.execv(sys.argv[2], sys.argv[2:])"
)
FLEET_MODULES = ("test_serve", "test_serve_http")
FLEET_FIXTURES = {*SERVER_OPTIONS, "netns", "rest", "prometheus"}
SERVED_BY = {"rest": "server", "prometheus": "server"}  # fixtures on another's server (Prometheus: scraping it)


class Fleet:
    """The servers that the selected tests of FLEET_MODULES name, started on first use: the shared one first, alone
    (the first tests need it alone), then the others together, their start-ups overlapping those tests. Stopped
    once no test left to run names one. pytest makes a module's fixture once per module that defines or imports
    it: the modules' fixtures all take this one fleet."""

    def __init__(self) -> None:
        self.servers: dict[str, Server] = {}
        self.prometheus: Prometheus | None = None
        self.link = None

    @staticmethod
    def named(items) -> set[str]:
        """The fleet's fixtures that `items` of FLEET_MODULES name."""
        return FLEET_FIXTURES & {n for item in items if item.module.__name__ in FLEET_MODULES
                                 for n in item.fixturenames}  # fmt: skip

    def start(self, request, tmp_path_factory) -> dict[str, Server]:
        """Start the servers that the session's selected tests name and are not started yet."""
        from dlrm_lab.serve.netns import VethLink

        if not self.servers:  # and stop them when the session ends, whatever ended it (-x, a failed fixture)
            request.config.add_cleanup(self.stop)
        wanted = {SERVED_BY.get(n, n) for n in self.named(request.session.items)}
        root = tmp_path_factory.mktemp("serve")
        if "server" in wanted and "server" not in self.servers:
            self.servers["server"] = Server(root / "server", *SERVER_OPTIONS["server"])
            self.servers["server"].ready()
        for name, options in SERVER_OPTIONS.items():
            if name not in wanted or name in self.servers:
                continue
            prefix: tuple[str, ...] = ()
            if name == "full_disk":
                (root / "full_disk_site").mkdir()
                (root / "full_disk_site" / "sitecustomize.py").write_text(FULL_DISK)
                prefix = ("env", f"PYTHONPATH={root / 'full_disk_site'}")
            if name == "doomed":
                prefix = (sys.executable, "-c", FD_LIMITED, str(FD_LIMIT))
            self.servers[name] = Server(root / name, *options, prefix=prefix)
        if "netns" in wanted and self.link is None and VethLink.available() is None:
            self.link = VethLink("dlrm-lab-test", server_ip="10.232.0.1", client_ip="10.232.0.2").__enter__()
            self.servers["netns"] = Server(root / "netns", host=self.link.server_ip, prefix=tuple(self.link.prefix()))
            self.servers["netns"].link = self.link
        return self.servers

    def release(self, request) -> None:
        """Stop every server (and Prometheus) unless a test after this module's last names one and will run."""
        items = request.session.items
        last = max(k for k, item in enumerate(items) if item.module is request.module)
        if request.session.shouldstop or request.session.shouldfail or not self.named(items[last + 1 :]):
            self.stop()

    def stop(self) -> None:
        if self.prometheus is not None:
            self.prometheus.stop()
            self.prometheus = None
        for s in self.servers.values():  # all told at once, then each waited for
            s.terminate()
        for s in self.servers.values():
            s.stop()
        self.servers = {}
        if self.link is not None:
            self.link.close()
            self.link = None


FLEET = Fleet()


@pytest.fixture(scope="module")
def servers(request, tmp_path_factory):
    """The fleet's servers (`Fleet`), each taken by its fixture once ready."""
    try:
        yield FLEET.start(request, tmp_path_factory)
    finally:
        FLEET.release(request)


@pytest.fixture(scope="module")
def server(request, servers, tmp_path_factory):
    """The shared server. Where a selected test reads Prometheus (`prometheus`), it scrapes this one from now on, so
    that its scrapes are there when that test comes."""
    main = servers["server"].ready()
    binary = _prometheus()
    if FLEET.prometheus is None and binary and "prometheus" in FLEET.named(request.session.items):
        FLEET.prometheus = Prometheus(binary, main, tmp_path_factory.mktemp("prometheus"))
    return main


@pytest.fixture(scope="module")
def prometheus(server):
    """Prometheus (Debian's package) scraping `server` every second since it was ready."""
    if FLEET.prometheus is None:
        pytest.skip("no prometheus binary: apt-get install prometheus, or set DLRM_LAB_PROMETHEUS")
    return FLEET.prometheus


@pytest.fixture(scope="module")
def full_disk(servers):
    return servers["full_disk"].ready()


@pytest.fixture(scope="module")
def queue_server(servers):
    return servers["queue_server"].ready()


@pytest.fixture(scope="module")
def doomed(servers):
    return servers["doomed"].ready()


@pytest.fixture(scope="module")
def netns(servers):
    """A server in another network namespace, joined to this one by a veth link (`serve.netns`); skipped where
    no namespace can be made here."""
    from dlrm_lab.serve.netns import VethLink

    if "netns" not in servers:
        pytest.skip(f"cannot join two network namespaces here: {VethLink.available()}")
    return servers["netns"].ready()


@pytest.fixture(scope="module")
def library():
    return synthetic_generator(load_preset("tiny"), seed=SEED).samples(0, 4096)


def _request(block, **fields) -> bytes:
    dense, lengths, ids = encode_samples(block.dense, block.lengths, block.values)
    base = {"model": "tiny", "query_id": 1, "samples": block.size, "dense": dense, "lengths": lengths, "ids": ids}
    return pb.InferRequest(**{**base, **fields}).SerializeToString()


def test_scores_over_grpc_equal_the_models_scores(server, library):
    spec = load_preset("tiny")
    torch.manual_seed(SEED)
    model = build_model(spec).eval()
    with server.channel() as channel:
        stub = pb_grpc.InferenceStub(channel)  # the generated client, as any other language would use
        (info,) = stub.Describe(pb.DescribeRequest(), timeout=10).models
        assert (info.name, info.preset, info.library_seed, info.num_dense) == ("tiny", "tiny", SEED, 4)
        assert list(info.feature_names) == spec.feature_names and list(info.rows_per_feature) == [100, 50, 200, 30]
        for k, (offset, size) in enumerate([(0, 1), (10, 7), (100, 64), (2000, 150)]):  # 150: split 64 + 64 + 22
            block = library.slice(offset, offset + size)
            dense, lengths, ids = encode_samples(block.dense, block.lengths, block.values)
            req = pb.InferRequest(model="tiny", query_id=k, samples=size, dense=dense, lengths=lengths, ids=ids)
            resp = stub.Infer(req, timeout=30)
            batch = block_to_batch(block, spec.feature_names)
            with torch.inference_mode():
                want = torch.sigmoid(model(batch.dense_features, batch.sparse_features)).numpy()
            np.testing.assert_allclose(np.frombuffer(resp.scores, dtype="<f4"), want, rtol=1e-5, atol=1e-6)
            assert resp.query_id == k and resp.pieces == (3 if size == 150 else 1) and resp.instance == 0
            assert 1 <= resp.batch_samples <= 64
            server_ns = resp.server_send_ns - resp.server_receive_ns
            assert min(resp.parse_ns, resp.queue_ns, resp.compute_ns) >= 0
            assert resp.parse_ns + resp.queue_ns + resp.compute_ns <= server_ns


STREAMS_CLIENT = """
import asyncio, sys
import grpc
from dlrm_lab.serve.protocol import CHANNEL_OPTIONS, pb, pb_grpc
target, body = sys.argv[1], open(sys.argv[2], "rb").read()
async def load():
    async with grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS) as channel:
        stub = pb_grpc.InferenceStub(channel)
        async def one():
            async def requests():
                for _ in range(3):
                    yield pb.InferRequest.FromString(body)
            return [r.status async for r in stub.InferStream(requests(), timeout=120)]
        return await asyncio.gather(*(one() for _ in range(1000)), return_exceptions=True)
answers = asyncio.run(load())
failed = [a for a in answers if isinstance(a, BaseException)]
ok = ("", "RESOURCE_EXHAUSTED")  # answered, or refused in band
bad = [a for a in answers if not isinstance(a, BaseException) and not (len(a) == 3 and set(a) <= set(ok))]
print(len(failed), len(bad), failed[0].details() if failed else "")
"""


def test_two_thousand_streams_opened_at_once_are_all_answered(server, library, tmp_path):
    """gRPC's core holds 1,000 calls the server has not taken by default: past them (two clients of 1,000 streams at
    once), streams ended INTERNAL and were never recorded (benchmarks/serve_abuse.py). Every one is now taken, and
    answered or refused in band."""
    (tmp_path / "body").write_bytes(_request(library.slice(0, 2)))
    clients = [subprocess.Popen([sys.executable, "-c", STREAMS_CLIENT, server.target, str(tmp_path / "body")],
                                cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for _ in range(2)]  # fmt: skip
    for client in clients:
        out, err = client.communicate(timeout=300)
        assert client.returncode == 0, err[-2000:]
        assert out.split()[:2] == ["0", "0"], out  # streams failed, streams answered wrongly


def test_bad_requests_are_invalid_argument_and_the_server_keeps_serving(server, library):
    block = library.slice(0, 4)
    ids = np.concatenate(block.values).astype("<i8")
    ids[0] = 100  # the first id of cat_0, whose table has 100 rows
    nan = block.dense.astype("<f4")
    nan[1, 2] = np.nan
    _, lengths, _ = encode_samples(block.dense, block.lengths, block.values)
    cases = {
        b"\xff\xff\xff\xff": "request: not an InferRequest message (4 bytes",
        _request(block, model="rm9"): "model 'rm9': not served here; served: tiny",
        _request(block, samples=5): "dense: 64 bytes, expected 80 (samples 5 x num_dense 4",
        _request(block, lengths=lengths[:-4]): "lengths: 60 bytes, expected 64 (features 4 x samples 4",
        _request(block, ids=ids[:-1].tobytes()): f"ids: {8 * (len(ids) - 1)} bytes, expected {8 * len(ids)}",
        _request(block, ids=ids.tobytes()): "feature cat_0: id 100 outside its table [0, 100)",
        _request(block, dense=nan.tobytes()): "dense features: not finite",
        _request(block, samples=65_537): "65537 samples: this server takes at most 65536 a query (--max-query-samples)",
        # a name the refusal repeats is cut: 10 KB of it would not fit gRPC's status metadata (RESOURCE_EXHAUSTED)
        _request(block, model="m" * 10_000): f"model {'m' * 100!r}... (10,000 characters): not served here",
    }
    with server.channel() as channel:
        infer = channel.unary_unary(INFER_METHOD)  # raw bytes: anything can be sent
        for body, message in cases.items():
            with pytest.raises(grpc.RpcError) as refused:
                infer(body, timeout=10)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert message in refused.value.details()
        for k in range(3):  # still serving
            resp = pb.InferResponse.FromString(infer(_request(block, query_id=k), timeout=10))
            assert resp.query_id == k and len(resp.scores) == 4 * 4


def test_one_stream_answers_many_queries_as_unary_calls_do_and_refuses_in_band(server, library):
    """InferStream: queries sent back to back on one stream are answered by id with the
    scores Infer gives; a bad one is answered with its status and error, and the stream goes on."""
    blocks = {k: library.slice(10 * k, 10 * k + size) for k, size in enumerate([1, 7, 64, 150, 3])}
    bodies = [_request(b, query_id=k) for k, b in blocks.items()]
    bad = _request(blocks[1], query_id=99, samples=8)  # dense holds 7 samples
    bodies.insert(2, bad)
    with server.channel() as channel:
        unary = {k: pb.InferResponse.FromString(channel.unary_unary(INFER_METHOD)(body, timeout=30))
                 for k, body in zip(blocks, [b for b in bodies if b is not bad], strict=True)}  # fmt: skip
        answers = [pb.InferResponse.FromString(b) for b in channel.stream_stream(INFER_STREAM_METHOD)(iter(bodies))]
    by_id = {a.query_id: a for a in answers}
    assert sorted(by_id) == [0, 1, 2, 3, 4, 99] and len(answers) == 6
    refused = by_id.pop(99)
    assert refused.status == "INVALID_ARGUMENT" and "dense: 112 bytes, expected 128" in refused.error
    assert not refused.scores
    for k, a in by_id.items():
        assert a.status == "" and a.error == ""
        np.testing.assert_array_equal(np.frombuffer(a.scores, "<f4"), np.frombuffer(unary[k].scores, "<f4"))
        assert len(a.scores) == 4 * blocks[k].size and a.server_send_ns >= a.server_receive_ns


def test_junk_on_the_port_is_closed_and_the_server_keeps_serving(server, library):
    """Not gRPC at all: an HTTP/1.1 request, an HTTP/2 preface followed by garbage frames,
    random bytes and a connection dropped mid-request. gRPC's transport closes each; the
    server stays up and answers the next real query."""
    import os
    import socket

    host, port = server.target.rsplit(":", 1)
    preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
    junk = [  # (bytes, whether the client waits for the server to close)
        (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", True),
        (preface + b"\x00\x00\x08\x07\x00\x00\x00\x00\x00" + os.urandom(64), True),  # GOAWAY-ish nonsense
        (os.urandom(4096), True),
        (preface, False),  # the server's settings back, and then the client goes away (the server would wait)
    ]
    for body, until_closed in junk:
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(body)
            sock.settimeout(10)
            try:
                # the server answers (an HTTP/2 error) and closes, or just closes
                while sock.recv(4096) and until_closed:
                    pass
            except (ConnectionResetError, TimeoutError):
                pass
    block = library.slice(0, 4)
    with server.channel() as channel:
        resp = pb.InferResponse.FromString(channel.unary_unary(INFER_METHOD)(_request(block), timeout=10))
    assert len(resp.scores) == 4 * 4 and server.proc.poll() is None


def test_health_is_serving_and_reflection_describes_the_service(server):
    from google.protobuf.descriptor_pool import DescriptorPool
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    with server.channel() as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", SERVICE):
            status = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status
            assert status == health_pb2.HealthCheckResponse.SERVING
        reflected = ProtoReflectionDescriptorDatabase(channel)
        assert SERVICE in reflected.get_services()
        infer = DescriptorPool(reflected).FindServiceByName(SERVICE).methods_by_name["Infer"]
        assert {"dense", "lengths", "ids"} <= set(infer.input_type.fields_by_name)


def _metrics_series(server) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The server's /metrics (`serve --metrics-port`), scraped now: (name, labels) -> value."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    url = server.wait_for("Prometheus metrics on ").split(" on ")[1].strip()
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}  # fmt: skip


def _send_metered_queries(server, library) -> int:
    """20 queries of 1-20 samples and one for a model not served (rejected); their samples."""
    with server.channel() as channel:
        infer = channel.unary_unary(INFER_METHOD)
        for k in range(20):
            infer(_request(library.slice(k, 2 * k + 1), query_id=k), timeout=30)
        with pytest.raises(grpc.RpcError):
            infer(_request(library.slice(0, 2), model="not-served"), timeout=30)
    return sum(k + 1 for k in range(20))


def _agree_with_the_rows(server, read, before: dict, sent: int, timeout_s: float = 30) -> dict:
    """`read()`'s counts by (metric, status or stage), once they hold the queries sent since `before` (a `read()`:
    `sent` samples and a rejected query) and equal the server's rows on disk (the queries table's parts, flushed
    every 2 s; the metrics are at most a pump, 0.5 s, and a scrape behind): they must get there. (Without the first
    condition, a server still pumping the rows of a burst agreed with its disk on neither holding them.)"""
    import pandas as pd

    (run_dir,) = server.metrics_dir.iterdir()
    deadline = time.monotonic() + timeout_s
    while True:
        parts = sorted((run_dir / "_parts" / "queries").glob("*.parquet"))
        rows = pd.concat([pq.read_table(p).to_pandas() for p in parts]) if parts else pd.DataFrame()
        got = read()
        ok = rows[rows.status == "ok"] if len(rows) else rows
        want = {("queries", s): float(n) for s, n in rows.status.value_counts().items()} if len(rows) else {}
        want |= {("samples", "ok"): float(ok.samples.sum()) if len(ok) else 0.0}
        want |= {
            (stage, "sum"): float(ok[column].sum()) / 1e3 if len(ok) else 0.0
            for stage, column in (("latency", "latency_ms"), ("queue", "queue_ms"), ("compute", "compute_ms"))
        }
        counts = {k: v for k, v in got.items() if k[0] in ("queries", "samples") and v}
        agree = {k: v for k, v in want.items() if k[0] in ("queries", "samples")} == counts
        if (agree and _holds_sent(got, before, sent)) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert _holds_sent(got, before, sent), (got, before)
    assert counts == {k: v for k, v in want.items() if k[0] in ("queries", "samples")}
    for stage in ("latency", "queue", "compute"):  # the histograms' sums: the same rows' values, summed
        assert got[stage, "sum"] == pytest.approx(want[stage, "sum"], rel=1e-6)
        assert got[stage, "count"] == want["queries", "ok"]
    return got


def _holds_sent(got: dict, before: dict, sent: int) -> bool:
    """Whether counts `got` hold `sent` samples and a rejected query more than `before`."""
    more = {("samples", "ok"): sent, ("queries", "rejected"): 1}
    return all(got.get(k, 0.0) >= before.get(k, 0.0) + n for k, n in more.items())


def _summed(series: dict) -> dict[tuple[str, str], float]:
    """Prometheus's series as the rows' counts: queries by status, samples, each stage's sum and count."""
    out: dict[tuple[str, str], float] = {}
    for (name, labels), value in series.items():
        labels = dict(labels)
        if name == "dlrm_lab_queries_total":
            out["queries", labels["status"]] = out.get(("queries", labels["status"]), 0.0) + value
        elif name == "dlrm_lab_samples_total":
            out["samples", "ok"] = out.get(("samples", "ok"), 0.0) + value
        elif name.startswith("dlrm_lab_query_") and name.endswith(("_seconds_sum", "_seconds_count")):
            stage, what = name.removeprefix("dlrm_lab_query_").split("_seconds_")
            out[stage, what] = out.get((stage, what), 0.0) + value
        elif name.startswith("dlrm_lab_instances_") or name in ("dlrm_lab_batch_samples_count", "dlrm_lab_model_info"):
            out[name, labels.get("build", "")] = value
    return out


def test_the_servers_metrics_are_its_rows_summed_and_its_instances_now(server, library):
    """`serve --metrics-port`'s /metrics, parsed as Prometheus would: the counters and the histograms' sums equal
    the run's queries table; the one instance is alive and idle."""

    def read() -> dict[tuple[str, str], float]:
        return _summed(_metrics_series(server))

    before = read()
    sent = _send_metered_queries(server, library)
    got = _agree_with_the_rows(server, read, before, sent)
    assert got["samples", "ok"] >= sent and got["queries", "rejected"] >= 1
    assert got["dlrm_lab_batch_samples_count", ""] >= 1
    assert [got[f"dlrm_lab_instances_{k}", ""] for k in ("alive", "busy", "stalled")] == [1, 0, 0]
    ((build, _),) = [(k[1], v) for k, v in got.items() if k[0] == "dlrm_lab_model_info"]
    assert build in ("eager", "fused", "compiled")


def _prometheus() -> str | None:
    """Prometheus's binary: $DLRM_LAB_PROMETHEUS, on PATH (Debian's `prometheus`), or the Debian package extracted
    under ~/.cache/dlrm-lab/prometheus (.ci/run: `apt-get download prometheus` and `dpkg -x`)."""
    import shutil
    from pathlib import Path

    cached = Path.home() / ".cache" / "dlrm-lab" / "prometheus" / "usr" / "bin" / "prometheus"
    found = os.environ.get("DLRM_LAB_PROMETHEUS") or shutil.which("prometheus") or str(cached)
    return found if os.access(found, os.X_OK) else None


class Prometheus:
    """Prometheus (`binary`) scraping `server`'s /metrics every second; queried through its HTTP API."""

    def __init__(self, binary: str, server: "Server", root) -> None:
        self.root = root
        target = server.wait_for("Prometheus metrics on ").split("http://")[1].split("/")[0]
        (root / "prometheus.yml").write_text(
            "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
            f"scrape_configs: [{{job_name: dlrm-lab, static_configs: [{{targets: ['{target}']}}]}}]\n"
        )
        self.api = f"http://127.0.0.1:{_free_port()}/api/v1/query"
        self.log = open(root / "prometheus.log", "w")  # noqa: SIM115 - closed in stop(), after it
        self.proc = subprocess.Popen([binary, f"--config.file={root / 'prometheus.yml'}", "--web.listen-address=" +
                                      self.api.split("/")[2], f"--storage.tsdb.path={root / 'data'}"], stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip

    def query(self, promql: str) -> list[dict]:
        import json
        import urllib.parse
        import urllib.request

        with urllib.request.urlopen(f"{self.api}?{urllib.parse.urlencode({'query': promql})}", timeout=10) as resp:
            answer = json.load(resp)
        assert answer["status"] == "success", answer
        return answer["data"]["result"]

    def scraped(self) -> float:
        """Its scrapes of the server in the last minute, 0 unless the last one found it up."""
        try:
            (up,) = self.query('count_over_time(up{job="dlrm-lab"}[1m]) and on() up{job="dlrm-lab"} == 1') or [None]
        except OSError:  # not listening yet
            return 0
        return 0 if up is None else float(up["value"][1])

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.log.close()


def test_a_real_prometheus_scrapes_the_server_and_its_series_agree_with_the_rows(prometheus, server, library):
    """Prometheus (Debian's package) scrapes `serve --metrics-port` every second; after two scrapes, queries; its
    series, read back through its HTTP API, agree with the run's queries table within a scrape."""
    deadline = time.monotonic() + 60
    while prometheus.scraped() < 2:  # two scrapes, the last one up
        assert time.monotonic() < deadline and prometheus.proc.poll() is None, (
            prometheus.root / "prometheus.log").read_text()  # fmt: skip
        time.sleep(0.25)

    def read() -> dict[tuple[str, str], float]:
        series = {}
        for r in prometheus.query('{__name__=~"dlrm_lab_.*", job="dlrm-lab"}'):
            labels = {k: v for k, v in r["metric"].items() if k not in ("__name__", "job", "instance")}
            series[r["metric"]["__name__"], tuple(sorted(labels.items()))] = float(r["value"][1])
        return _summed(series)

    before = read()
    sent = _send_metered_queries(server, library)
    got = _agree_with_the_rows(server, read, before, sent)
    assert got["samples", "ok"] >= sent and got["queries", "rejected"] >= 1
    assert got["dlrm_lab_instances_alive", ""] == 1
    # Triton's averages from ours, in PromQL (docs/serving.md): the mean queue time of a query, in us
    (mean,) = prometheus.query("1e6 * sum(dlrm_lab_query_queue_seconds_sum) / sum(dlrm_lab_query_queue_seconds_count)")
    assert float(mean["value"][1]) == pytest.approx(1e6 * got["queue", "sum"] / got["queue", "count"], rel=1e-6)


TRANSFER = ("serialise", "network", "server_parse", "server_respond", "deserialise")


@pytest.mark.parametrize("target", ["grpc", "kserve"])  # kserve: the Open Inference Protocol, stages as parameters
def test_infer_run_against_a_remote_target_records_stages_that_add_up(server, tmp_path, target, monkeypatch):
    """The one runner drives a remote server over two client connections (processes): the rows are the
    in-process schema with their transfer columns, the stages and latency parts add up, the summary is the
    one summariser's with the transfer columns (the latency floor placed with a profile of this machine)."""
    monkeypatch.setenv("DLRM_LAB_MACHINE_DIR", str(tmp_path / "machines"))
    store_profile(tmp_path / "machines")
    url = f"grpc://{server.target}" if target == "grpc" else f"kserve://{server.target}/tiny"
    extra = ["--rpc", "unary"] if target == "grpc" else []
    # the command in this process (its second connection is a process of its own all the same)
    code, out, err = run_cli_in_process("infer", "run", "--model", "tiny", "--target", url, *extra, "--concurrency",
                                        "2", "--qps", "120", "--query-size", "uniform:1,8", "--duration", "1",
                                        "--sla-ms", "200", "--no-progress", "--metrics-dir",
                                        str(tmp_path / "runs"))  # fmt: skip
    assert code == 0, err
    assert f"connected to {url}: 2 connection(s)" in err
    (run_dir,) = (tmp_path / "runs").iterdir()
    manifest = read_manifest(run_dir)
    assert manifest["kind"] == "infer" and manifest["status"] == "ok" and manifest["target"]["url"] == url
    q = pq.read_table(run_dir / "queries.parquet").to_pandas()
    q = q[q.point == 0]
    assert set(q.worker) == {0, 1} and (q.status == "ok").all() and (q.rpc_status == "ok").all()
    assert 60 <= len(q) <= 190  # 120 Poisson arrivals expected (1 s at 120 queries/s)
    assert (q[[f"{s}_ms" for s in TRANSFER]] >= 0).all().all()
    server_side = q.server_parse_ms + q.queue_ms + q.compute_ms + q.server_respond_ms
    np.testing.assert_allclose(q.network_ms + server_side, q.round_trip_ms, atol=1e-6)
    np.testing.assert_allclose(q.lat_issue_ms + q.serialise_ms + q.round_trip_ms + q.deserialise_ms, q.latency_ms,
                               atol=1e-6)  # fmt: skip
    parts = q.lat_issue_ms + q.lat_transport_ms + q.lat_queue_ms + q.lat_roof_ms + q.lat_beyond_roof_ms
    np.testing.assert_allclose(parts, q.latency_ms, atol=1e-6)  # the latency parts of a remote query
    assert q.lat_slowdown_ms.isna().all() and q.start_ms.isna().all()  # not told apart / the server's clock
    (s,) = pq.read_table(run_dir / "summary.parquet").to_pylist()
    assert s["target"] == url and s["rpc"] == ("unary" if target == "grpc" else "oip") and s["concurrency"] == 2
    assert s["completed_queries"] == len(q) and s["server_lost"] is False
    assert s["queries_per_s"] == pytest.approx(len(q) / s["duration_s"])
    assert s["latency_p50_ms"] <= s["latency_p99_ms"] <= s["latency_max_ms"]
    assert 0 < s["transfer_share"] < 1 and s["transfer_mean_ms"] == pytest.approx(
        sum(s[f"{stage}_mean_ms"] for stage in TRANSFER))  # fmt: skip
    assert s["request_bytes_per_sample"] > 4 * 4 + 4 * 4  # dense + lengths + ids
    if target == "grpc":  # what the lab server said of how it serves; a v2 server says nothing of it
        assert s["instances"] == 1 and s["max_batch"] == 64 and s["latency_floor_ms"] > 0
    else:
        assert s["instances"] is None and s["latency_floor_ms"] is None
    # the server elsewhere measures its own host; this one's, the client's, stands beside the figures
    assert s["canary_readings"] >= 1 and s["canary_ratio"] > 0 and s["canary_basis"]  # (its cost: over a 1 s point
    # one reading, taken as the load starts beside the connections' start, is no measure of it; test_canary's are)
    assert "over the network" in out


def test_a_search_against_a_remote_server_finds_its_rate_as_it_serves(server, tmp_path):
    """`infer search --target`: the server's own configuration (one frontier row, described by the server), its
    capacity and bisection over the rate, certified by LoadGen's Server scenario through the same target."""
    from dlrm_lab.infer.lab import InferConfig
    from dlrm_lab.infer.load import QuerySizes, Stream
    from dlrm_lab.infer.search import SearchGrid, SearchOptions, search
    from dlrm_lab.infer.served import ServedModel

    # a bound and a step a loaded host meets (the rate's bisection is under test here, not the host's tail): with 3
    # steps at 50 ms, a suite's slow phase once left no probe under the bound
    cfg = InferConfig(duration_s=0.5, sla_ms=200.0, warmup_s=0.1, target=f"grpc://{server.target}", price_per_hour=3.6)
    options = SearchOptions(repeats=1, steps=4, capacity_s=0.5, min_queries=50, max_duration_s=1.0, certify_s=1.0,
                            certify_tries=1)  # fmt: skip
    grid = SearchGrid([(1, 1), (2, 1)], [64, 256], [0.5])  # in process only: a remote server is searched as it serves
    run_dir = search(ServedModel("tiny", load_preset("tiny")), Stream("tiny", 1.0, QuerySizes.parse("fixed:1")),
                     grid, cfg, options, metrics_dir=tmp_path)  # fmt: skip
    (row,) = pq.read_table(run_dir / "frontier.parquet").to_pylist()
    assert row["instances"] == 1 and row["max_batch"] == 64  # the server's own, as its Describe says
    assert row["capacity_queries_per_s"] > 0 and row["best_qps"] > 0 and row["probes"] >= 1
    if row["certified_qps"] == 0:  # the 1 s certification did not hold (a busy host): no answer, so no cost
        assert row["cost_rate"] is None and row["cost_per_1m_samples"] is None
    else:  # costed at what it certified, else its best probed rate
        rate = row["certified_samples_per_s"] if row["certified_qps"] else row["best_samples_per_s"]
        assert row["cost_rate"] in ("certified", "best") and row["cost_per_1m_samples"] == pytest.approx(1e3 / rate)
    summary = pq.read_table(run_dir / "summary.parquet").to_pylist()
    assert {r["target"] for r in summary} == {f"grpc://{server.target}"} and {r["rpc"] for r in summary} == {"stream"}
    assert any(r["scenario"] == "server" for r in summary)  # the certification ran through the same target


def test_the_client_command_is_infer_run_against_the_server(server, tmp_path):
    """`dlrm-lab client` is an alias: MLPerf LoadGen's system under test is the remote server, every
    query crosses gRPC, and the run is an `infer` run."""
    code, _, err = run_cli_in_process("client", "--target", server.target, "--scenario", "single-stream", "--qps",
                                      "100", "--duration", "1", "--sla-ms", "50", "--metrics-dir",
                                      str(tmp_path))  # fmt: skip
    (run_dir,) = tmp_path.iterdir()
    assert read_manifest(run_dir)["kind"] == "infer"
    (s,) = pq.read_table(run_dir / "summary.parquet").to_pylist()
    assert s["scenario"] == "single-stream" and s["loadgen_result"] in ("VALID", "INVALID")
    # as infer run: an INVALID verdict (1 s is below LoadGen's minimum duration) fails the command
    assert code == (0 if s["loadgen_result"] == "VALID" else 1), err
    assert s["loadgen_p99_ms"] > 0 and s["completed_queries"] > 10 and s["failed_queries"] == 0
    assert (run_dir / "loadgen" / "point-0" / "mlperf_log_summary.txt").is_file()
    q = pq.read_table(run_dir / "queries.parquet").to_pandas()
    assert (q.round_trip_ms > q.compute_ms).all()  # LoadGen's latency holds the network too


def test_bad_remote_targets_are_one_line(server, tmp_path):
    """A URL, an RPC kind, a model a server does not serve, a v2 model whose tensors are not the lab's; refused
    before a run directory exists."""
    from dlrm_lab.errors import UserError
    from dlrm_lab.infer.load import LoadSettings, QuerySizes, Stream
    from dlrm_lab.infer.served import ServedModel
    from dlrm_lab.infer.targets import Connection, check_connection, open_target, parse_target
    from dlrm_lab.serve.connect import check_open_inference_model
    from dlrm_lab.serve.protocol import v2

    for url, why in (
        ("https://h:1", "allowed: in-process, grpc://HOST:PORT, kserve://HOST:PORT[/MODEL] or http://HOST:PORT"),
        ("grpc://h", "expected grpc://HOST:PORT"),
        ("grpc://h:1/m", "only a kserve:// or http:// target names"),
    ):
        with pytest.raises(UserError, match=re.escape(why)):
            parse_target(url)
    assert parse_target("kserve://[::1]:8001/dlrm").on_this_host and not parse_target("grpc://10.9.9.9:1").on_this_host
    with pytest.raises(UserError, match="^rpc 'oip': grpc:// speaks stream, unary"):
        check_connection(parse_target("grpc://h:1"), Connection(rpc="oip"))
    with pytest.raises(UserError, match="^concurrency 0: must be a whole number >= 1"):
        check_connection(parse_target("grpc://h:1"), Connection(concurrency=0))
    kaggle = ServedModel("kaggle", load_preset("kaggle", max_rows=1000))
    with pytest.raises(UserError, match="^model kaggle: not served at grpc://.*; it serves: tiny"):
        with open_target(parse_target(f"grpc://{server.target}"), [kaggle], Connection()):
            pass
    with pytest.raises(UserError, match="model 'kaggle': NOT_FOUND: model 'kaggle': not served here"):
        with open_target(parse_target(f"kserve://{server.target}"), [kaggle], Connection()):
            pass
    from dlrm_lab.infer.lab import InferConfig, run_inference

    for url in (f"grpc://{server.target}", f"kserve://{server.target}"):
        with pytest.raises(UserError, match="kaggle"):
            run_inference([kaggle], [Stream("kaggle", 10.0, QuerySizes.parse("fixed:1"))],
                          InferConfig(target=url, duration_s=1.0), metrics_dir=tmp_path)  # fmt: skip
    assert list(tmp_path.iterdir()) == []  # no run directory of a mistake in --target
    # samples made for another model than the server's (tables 100x larger): the first refusal ends the load
    from dlrm_lab.config import ModelSpec
    from dlrm_lab.errors import BadAnswer
    from dlrm_lab.infer.drivers import drive, make_driver

    wide = load_preset("tiny").to_dict()
    wide["tables"] = [{**t, "num_embeddings": 100 * t["num_embeddings"]} for t in wide["tables"]]
    other = ServedModel("tiny", ModelSpec.from_dict(wide))
    with open_target(parse_target(f"kserve://{server.target}/tiny"), [other], Connection()) as sut:
        driver = make_driver(sut, [Stream("tiny", 50.0, QuerySizes.parse("fixed:16"))],
                             LoadSettings("open-loop", duration_s=2.0))  # fmt: skip
        with pytest.raises(BadAnswer, match="was refused: .* outside its table .* check --max-rows, --table-scale"):
            drive(sut, driver, drain_s=10)

    class Stub:  # a v2 server whose model takes another tensor
        def __init__(self, inputs):
            self.inputs = inputs

        def ServerReady(self, *a, **k):  # noqa: N802 - the protocol's names
            return v2.ServerReadyResponse(ready=True)

        def ModelReady(self, *a, **k):  # noqa: N802
            return v2.ModelReadyResponse(ready=True)

        def ModelMetadata(self, *a, **k):  # noqa: N802
            meta = v2.ModelMetadataResponse.TensorMetadata
            return v2.ModelMetadataResponse(name="m", inputs=[meta(name=n, datatype=t, shape=sh) for n, t, sh in
                                                              self.inputs], outputs=[meta(name="scores",
                                                              datatype="FP32", shape=[-1])])  # fmt: skip

    tiny, where = load_preset("tiny"), parse_target("kserve://h:1/m")
    good = [("dense", "FP32", [-1, tiny.num_dense]), ("lengths", "INT32", [tiny.num_features, -1]),
            ("ids", "INT64", [-1])]  # fmt: skip
    check_open_inference_model(where, Stub(good), "m", tiny, 1.0)
    for inputs, why in ((good[:2], "no input tensor 'ids'"), ([good[0], ("lengths", "INT64", [-1, -1]), good[2]],
                        "input 'lengths' is INT64, the lab sends INT32"),
                        ([("dense", "FP32", [-1, 99]), *good[1:]], "input 'dense' has shape [-1, 99]")):  # fmt: skip
        with pytest.raises(UserError, match=re.escape(f"target kserve://h:1/m: model 'm': {why}")):
            check_open_inference_model(where, Stub(inputs), "m", tiny, 1.0)


def test_a_full_disk_under_serve_ends_it_in_one_line_and_nothing_after(full_disk, library):
    full = full_disk
    with full.channel() as channel:
        pb_grpc.InferenceStub(channel).Infer(pb.InferRequest.FromString(_request(library.slice(0, 4))), timeout=30)
    full.proc.wait(timeout=60)
    time.sleep(0.2)  # the last lines read
    err = "".join(full.err)
    assert full.proc.returncode == 1, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: ") and "No space left on device" in last and "_parts/queries" in last, err
    assert "Exception ignored" not in err and "never awaited" not in err and "Traceback" not in err, err


def test_beyond_its_queue_bound_the_server_answers_resource_exhausted_at_once(queue_server, library):
    from dlrm_lab.infer.drivers import drive, make_driver
    from dlrm_lab.infer.load import LoadSettings, QuerySizes, Stream

    server = queue_server
    body = _request(library.slice(0, 1))
    with server.channel() as channel:
        infer = channel.unary_unary(INFER_METHOD)
        answered: list[tuple[grpc.StatusCode, float, str]] = []
        sent = time.monotonic()
        calls = [infer.future(body, timeout=10) for _ in range(12)]  # one burst

        def done(call):
            answered.append((call.code(), time.monotonic() - sent, call.details() or ""))

        for call in calls:
            call.add_done_callback(done)
        for call in calls:
            call.exception()  # waits
    ok = [t for code, t, _ in answered if code == grpc.StatusCode.OK]
    refused = [(t, why) for code, t, why in answered if code == grpc.StatusCode.RESOURCE_EXHAUSTED]
    assert len(ok) + len(refused) == 12 and len(ok) >= 1 and len(refused) >= 8
    assert "queue full (at most 1 waiting)" in refused[0][1]
    # refused at once: every refusal came back before the query that held the queue, which waited its 300 ms
    # batching delay (the burst's first went at once: nothing had come before it to wait for; an order and a
    # lower bound, which hold on a loaded machine too; no upper time bound)
    assert max(t for t, _ in refused) < max(ok) and max(ok) >= 0.3

    # The client's rows say dropped (the lab's word) with the code kept: the lab's open-loop driver against the
    # remote server, summarised by the one summariser.
    from dlrm_lab.infer.records import summarize
    from dlrm_lab.infer.served import ServedModel
    from dlrm_lab.infer.targets import Connection, open_target, parse_target

    rows = []
    with open_target(parse_target(f"grpc://{server.target}"), [ServedModel("tiny", load_preset("tiny"))],
                     Connection()) as remote:  # fmt: skip
        stream = Stream("tiny", 200.0, QuerySizes.parse("fixed:2"))
        driver = make_driver(remote, [stream], LoadSettings("open-loop", duration_s=1.0))
        assert drive(remote, driver, drain_s=10, take=rows.extend)
        rows += remote.take_records()
    s = summarize(rows, duration_s=1.0, sla_ms=1000.0, sla_percentile=99.0)
    assert s["completed_queries"] >= 1 and s["dropped_queries"] >= 100
    assert {r["rpc_status"] for r in rows if r["status"] == "dropped"} == {"RESOURCE_EXHAUSTED"}
    assert s["queries"] == s["completed_queries"] + s["dropped_queries"] and not s["sla_met"]


def test_at_its_file_descriptor_limit_the_server_turns_new_clients_away_and_serves_the_others(doomed, library):
    """Issue 57 B11: a server started at a limit of FD_LIMIT descriptors, flooded with idle connections on both
    ports past it: the HTTP client past its share is answered 503, gRPC closes the connections past its own, and a
    query on a channel opened before goes on being answered; no traceback in the log."""
    server = doomed
    channel = server.channel()  # connected before the flood
    stub = pb_grpc.InferenceStub(channel)
    request = pb.InferRequest.FromString(_request(library.slice(0, 4)))
    assert len(stub.Infer(request, timeout=30).scores) == 16  # 4 float32 scores
    budget = read_manifest(next(server.metrics_dir.iterdir()))["connection_budget"]
    assert budget["fd_limit"] == FD_LIMIT and 0 < budget["per_protocol"] < FD_LIMIT // 2
    flood = []
    try:
        for address in (server.http, server.target):
            host, port = address.rsplit(":", 1)
            for _ in range(budget["per_protocol"] + 20):
                flood.append(socket.create_connection((host, int(port)), timeout=10))
        time.sleep(0.5)
        host, port = server.http.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=10) as late:
            late.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
            answer = late.recv(4096)
        assert answer.startswith(b"HTTP/1.1 503 ") and b"most connections" in answer, answer
        assert len(stub.Infer(request, timeout=30).scores) == 16  # the client it had is served
        grpc_flood = flood[budget["per_protocol"] + 20 :]
        closed = 0
        for sock in grpc_flood:  # gRPC closed those past its share before any handshake
            sock.settimeout(0.05)
            with contextlib.suppress(TimeoutError, socket.timeout):
                closed += sock.recv(1) == b""
        assert closed >= 20, closed
    finally:
        for sock in flood:
            sock.close()
        channel.close()
    with server.channel() as fresh:  # and a new one once the flood is gone (once the server has seen it go: a busy
        # machine's server closed the first attempt, still at its limit, so the call waits for the channel to connect)
        assert len(pb_grpc.InferenceStub(fresh).Infer(request, timeout=30, wait_for_ready=True).scores) == 16
    assert not any("Traceback" in line for line in server.err), "".join(server.err)[-3000:]


def test_a_run_whose_server_is_killed_exits_nonzero_and_keeps_its_rows(doomed, tmp_path):
    server = doomed
    url = f"grpc://{server.target}"
    client = Process("infer", "run", "--model", "tiny", "--target", url, "--scenario", "closed-loop", "--duration",
                     "60", "--warmup", "0", "--unavailable-s", "1", "--no-progress", "--metrics-dir",
                     str(tmp_path))  # fmt: skip
    try:
        client.wait_for("connected to")
        time.sleep(0.5)  # the load itself (no warm-up): rows to keep
        os.killpg(server.proc.pid, signal.SIGKILL)  # the server and its instances, as when its host dies
        code = client.proc.wait(timeout=60)
    finally:
        if client.proc.poll() is None:
            os.killpg(client.proc.pid, signal.SIGKILL)
        for snapshot in (server.proc.pid,):  # the killed server's tables in /dev/shm
            subprocess.run(f"rm -rf /dev/shm/dlrm-lab-{snapshot}-*", shell=True, check=False)
    time.sleep(0.2)  # the last output lines
    errors = [line for line in client.err if line.startswith("error:")]
    assert code == 1 and len(errors) == 1, "".join(client.err)
    assert f"lost the server at {url}" in errors[0] and "UNAVAILABLE for" in errors[0] and "rows kept in" in errors[0]
    (run_dir,) = tmp_path.iterdir()
    assert read_manifest(run_dir)["status"] == "failed"
    rows = pq.read_table(run_dir / "queries.parquet").to_pandas()
    assert (rows.status == "ok").sum() > 10 and (rows.rpc_status == "UNAVAILABLE").sum() > 0
    assert set(rows.status[rows.rpc_status == "UNAVAILABLE"]) == {"failed"}
    (s,) = pq.read_table(run_dir / "summary.parquet").to_pylist()
    assert s["server_lost"] and "UNAVAILABLE for" in s["error"]


@pytest.mark.multiprocess
def test_a_server_in_another_network_namespace_is_reached_over_a_veth_link(netns, tmp_path):
    assert netns.target.startswith(netns.link.server_ip)
    try:
        code, _, err = run_cli_in_process("client", "--target", netns.target, "--closed-loop", "--query-size",
                                          "fixed:16", "--duration", "1", "--metrics-dir", str(tmp_path))  # fmt: skip
        assert code == 0, err
    finally:
        netns.terminate()
        assert netns.proc.wait(timeout=60) == 0
    (run_dir,) = tmp_path.iterdir()
    (s,) = pq.read_table(run_dir / "summary.parquet").to_pylist()
    assert s["completed_queries"] > 5 and s["failed_queries"] == 0
    assert s["network_mean_ms"] > 0 and s["target"] == f"grpc://{netns.target}"


def test_a_stream_query_unanswered_past_its_timeout_ends_deadline_exceeded():
    """On a stream there is no per-call deadline: the client's check() ends queries waiting
    longer than --timeout, as a unary call's deadline would."""
    from dlrm_lab.infer.sut import Query
    from dlrm_lab.serve.remote import RemoteServer

    done = []
    with grpc.insecure_channel("127.0.0.1:1") as channel:  # nothing listens: never connected
        remote = RemoteServer(channel, {}, timeout_s=0.5)
        now = time.monotonic_ns()
        for k, sent in enumerate((now - 2_000_000_000, now)):  # sent 2 s ago, and just now
            q = Query(k, "tiny", 1, scheduled_ns=sent, on_done=lambda q, status, _s: done.append((q.query_id, status)))
            remote._waiting[k] = (q, (sent, sent, sent), 100)
            remote._outstanding += 1
        remote.check()
        time.sleep(0.2)  # a failed query's on_done comes after the client's error back-off
        assert done == [(0, "expired")] and list(remote._waiting) == [1]
        (row,) = remote.take_records()
        assert row["status"] == "expired" and row["rpc_status"] == "DEADLINE_EXCEEDED"
        assert row["error"] == "no answer in time" and row["latency_ms"] >= 2000
        # draining at the end of a run: the other one expires too, and becomes a row
        assert remote.drain(5.0) and not remote._waiting
        (row,) = remote.take_records()
        assert row["query_id"] == 1 and row["status"] == "expired"


def test_an_unknown_rpc_kind_is_one_line():
    code, _, err = run_cli_in_process("client", "--target", "127.0.0.1:1", "--closed-loop", "--rpc", "http")
    assert code == 2 and err.strip().splitlines() == ["error: --rpc 'http': allowed: stream, unary, oip"]


def test_a_killed_instance_is_routed_around_and_sigterm_answers_queries_in_flight_then_exits_0(queue_server, library):
    """`serve --instances 2`, one instance SIGKILLed: later queries are answered by the other; the loss is said in
    one line and recorded in the manifest. SIGTERM then answers the query waiting in the batcher (300 ms) and ends
    the server with exit 0 and no traceback, the query in its rows."""
    server = queue_server
    (run_dir,) = server.metrics_dir.iterdir()
    victim = read_manifest(run_dir)["instances"][1]
    os.kill(victim["pid"], signal.SIGKILL)
    server.wait_for(
        f"instance 1 (pid {victim['pid']}) was killed by signal SIGKILL; tiny is served on by instance(s) 0"
    )
    deadline = time.monotonic() + 30
    while not read_manifest(run_dir).get("instance_losses") and time.monotonic() < deadline:
        time.sleep(0.2)
    (loss,) = read_manifest(run_dir)["instance_losses"]
    assert loss["instance"] == 1 and loss["live_instances"] == [0] and "SIGKILL" in loss["how"]

    with server.channel() as channel:
        infer = channel.unary_unary(INFER_METHOD)
        for k in range(6):
            resp = pb.InferResponse.FromString(infer(_request(library.slice(4 * k, 4 * k + 4), query_id=k), timeout=30))
            assert resp.query_id == k and len(resp.scores) == 4 * 4 and resp.instance == 0
        # a lone query waits for no companion (`BatchClock.worth_waiting`: one is expected within its 300 ms only
        # after 4 arrivals in the last second; queries sent one after another, each waiting 300 ms, come at 3 a
        # second), so the query the SIGTERM finds waiting comes right after a burst (its refusals count as arrivals)
        burst = [infer.future(_request(library.slice(k, k + 1), query_id=100 + k), timeout=30) for k in range(6)]
        for sent in burst:
            sent.exception()  # answered or refused (the queue holds one)
        call = infer.future(_request(library.slice(0, 3), query_id=42), timeout=30)
        time.sleep(0.1)  # the query now waits in the batcher (300 ms max delay)
        server.terminate()
        resp = pb.InferResponse.FromString(call.result())
    assert resp.query_id == 42 and len(resp.scores) == 3 * 4 and resp.queue_ns >= 0.25e9
    assert server.proc.wait(timeout=60) == 0
    assert any("stopping: refusing new queries" in line for line in server.err)
    assert not any("Traceback" in line for line in server.err)
    assert read_manifest(run_dir)["kind"] == "serve" and read_manifest(run_dir)["status"] == "ok"
    rows = pq.read_table(run_dir / "queries.parquet").to_pylist()
    assert any(r["samples"] == 3 and r["status"] == "ok" for r in rows)  # the server's own record of it


def _v2_request(block, model: str = "tiny", query_id: str = "7"):
    """The client's own ModelInferRequest of these samples (`serve.remote.open_inference_request`)."""
    from dlrm_lab.serve.protocol import v2
    from dlrm_lab.serve.remote import open_inference_request

    body = open_inference_request(model, query_id, block.size, *encode_samples(block.dense, block.lengths,
                                                                               block.values))  # fmt: skip
    return v2.ModelInferRequest.FromString(body)


def _expected(library, offset: int, size: int) -> np.ndarray:
    spec = load_preset("tiny")
    torch.manual_seed(SEED)
    model = build_model(spec).eval()
    block = library.slice(offset, offset + size)
    batch = block_to_batch(block, spec.feature_names)
    with torch.inference_mode():
        return torch.sigmoid(model(batch.dense_features, batch.sparse_features)).numpy()


def test_the_server_speaks_the_open_inference_protocol(server, library):
    """KServe v2 on the same port, through stubs generated from the protocol: liveness, metadata, Triton's model
    configuration, ModelInfer with the model's scores, statistics; a malformed tensor is one INVALID_ARGUMENT."""
    from dlrm_lab.serve import open_inference_pb2 as v2
    from dlrm_lab.serve import open_inference_pb2_grpc as v2_grpc

    with server.channel() as channel:
        stub = v2_grpc.GRPCInferenceServiceStub(channel)
        assert stub.ServerLive(v2.ServerLiveRequest(), timeout=10).live
        assert stub.ServerReady(v2.ServerReadyRequest(), timeout=10).ready
        assert stub.ModelReady(v2.ModelReadyRequest(name="tiny"), timeout=10).ready
        for name, version in (("tiny", "v7"), ("rm9", "")):  # as ModelMetadata answers them (issue 57, round 4)
            with pytest.raises(grpc.RpcError) as refused:
                stub.ModelReady(v2.ModelReadyRequest(name=name, version=version), timeout=10)
            assert refused.value.code() == grpc.StatusCode.NOT_FOUND, refused.value.details()
        assert "model_configuration" in stub.ServerMetadata(v2.ServerMetadataRequest(), timeout=10).extensions
        meta = stub.ModelMetadata(v2.ModelMetadataRequest(name="tiny"), timeout=10)
        assert [(t.name, t.datatype, list(t.shape)) for t in meta.inputs] == [
            ("dense", "FP32", [-1, 4]), ("lengths", "INT32", [4, -1]), ("ids", "INT64", [-1])]  # fmt: skip
        config = stub.ModelConfig(v2.ModelConfigRequest(name="tiny"), timeout=10).config
        assert config.max_batch_size == 0 and [i.name for i in config.input] == ["dense", "lengths", "ids"]
        resp = stub.ModelInfer(_v2_request(library.slice(100, 164)), timeout=30)
        assert resp.id == "7" and resp.outputs[0].name == "scores" and list(resp.outputs[0].shape) == [64]
        np.testing.assert_allclose(np.frombuffer(resp.raw_output_contents[0], dtype="<f4"), _expected(library, 100, 64),
                                   rtol=1e-5, atol=1e-6)  # fmt: skip
        for odd in ("\u00b2", "9" * 40, "q-1 \u00e9"):  # any id is echoed: one int() rejects is no server error
            assert stub.ModelInfer(_v2_request(library.slice(0, 2), query_id=odd), timeout=30).id == odd
        bad = _v2_request(library.slice(0, 4))
        bad.inputs[0].shape[:] = [4, 5]
        with pytest.raises(grpc.RpcError) as refused:
            stub.ModelInfer(bad, timeout=10)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "input dense: shape [4, 5], expected [N, 4]" in refused.value.details()
        with pytest.raises(grpc.RpcError) as missing:
            stub.ModelMetadata(v2.ModelMetadataRequest(name="rm9"), timeout=10)
        assert missing.value.code() == grpc.StatusCode.NOT_FOUND
        (stats,) = stub.ModelStatistics(v2.ModelStatisticsRequest(name="tiny"), timeout=10).model_stats
        assert stats.inference_count >= 64 and stats.execution_count >= 1 and stats.inference_stats.fail.count >= 1


# needs protobuf < 7 (grpc), urllib3 >= 2 (http; torchx pins < 1.27): its own environment, made once and cached
TRITONCLIENT = "tritonclient[grpc,http]==2.73.0"
TRITON_SCRIPT = """
import json, sys
import numpy as np
import tritonclient.grpc as tc
target, dense, lengths, ids = sys.argv[1], *(np.load(p) for p in sys.argv[2:5])
client = tc.InferenceServerClient(url=target)
assert client.is_server_live() and client.is_model_ready("tiny")
meta = client.get_model_metadata("tiny", as_json=True)
config = client.get_model_config("tiny", as_json=True)["config"]
inputs = [tc.InferInput("dense", list(dense.shape), "FP32"), tc.InferInput("lengths", list(lengths.shape), "INT32"),
          tc.InferInput("ids", list(ids.shape), "INT64")]
for tensor, values in zip(inputs, (dense, lengths, ids)):
    tensor.set_data_from_numpy(values)
result = client.infer("tiny", inputs, outputs=[tc.InferRequestedOutput("scores")])
stats = client.get_inference_statistics("tiny", as_json=True)
print(json.dumps({"inputs": [i["name"] for i in meta["inputs"]], "max_batch_size": config.get("max_batch_size", 0),
                  "scores": result.as_numpy("scores").tolist(), "stats": stats["model_stats"][0]["name"]}))
"""


def _make_venv(requirement: str) -> tuple[str, str | None]:
    """(the python of a cached venv holding `requirement`, why it could not be made or None): tritonclient and kserve
    both need protobuf < 7, the lab's generated code 7. Made once per machine."""
    import venv
    from pathlib import Path

    name = re.sub(r"[\[\],=]+", "-", requirement).strip("-")  # tritonclient-grpc-http-2.73.0
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "dlrm-lab" / "venvs" / name
    python = root / "bin" / "python"
    if (root / ".installed").exists():
        return str(python), None
    venv.EnvBuilder(with_pip=True, clear=True).create(root)
    out = subprocess.run([str(python), "-m", "pip", "install", "-q", requirement, "numpy"], capture_output=True,
                         text=True, timeout=900)  # fmt: skip
    if out.returncode != 0:
        return str(python), f"cannot install {requirement} into {root}: {out.stderr.strip()[-300:]}"
    (root / ".installed").write_text(requirement)
    return str(python), None


_VENVS: dict[str, Future] = {}  # requirement -> the future of `_make_venv`


@pytest.fixture(scope="module", autouse=True)
def _third_party_venvs_made_in_the_background(request):
    """The venvs of the selected tests that need one, begun at the file's first test: their pip installs (~45 s on a
    new machine, network and disk mostly) run beside the file's other tests, not in front of the test that needs them
    (on a fresh clone the kserve server's set-up waited 38 s for its install)."""
    wanted = {
        requirement
        for item in request.session.items
        if item.path == request.node.path
        for fixture, requirement in (("kserve_server", KSERVE), ("tritonclient", TRITONCLIENT))
        if fixture in getattr(item, "fixturenames", ()) or fixture in item.name
    }
    pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="venv")
    for requirement in wanted:
        _VENVS[requirement] = pool.submit(_make_venv, requirement)
    yield
    pool.shutdown(wait=True)
    _VENVS.clear()


def _third_party_python(requirement: str) -> str:
    """The python of the cached venv holding `requirement` (made in the background where the file's fixture began it,
    else here), skipped where it cannot be made (no package index)."""
    future = _VENVS.get(requirement)
    python, why = future.result() if future is not None else _make_venv(requirement)
    if why is not None:
        pytest.skip(why)
    return python


def test_nvidias_tritonclient_drives_the_server_and_gets_the_models_scores(server, library, tmp_path):
    import json

    python = _third_party_python(TRITONCLIENT)
    block = library.slice(300, 350)
    dense, lengths, ids = encode_samples(block.dense, block.lengths, block.values)
    paths = []
    for name, raw, dtype, shape in (("dense", dense, "<f4", (50, 4)), ("lengths", lengths, "<i4", (4, 50)),
                                    ("ids", ids, "<i8", (-1,))):  # fmt: skip
        path = tmp_path / f"{name}.npy"
        np.save(path, np.frombuffer(raw, dtype=dtype).reshape(shape))
        paths.append(str(path))
    out = subprocess.run([python, "-c", TRITON_SCRIPT, server.ready().target, *paths], capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["inputs"] == ["dense", "lengths", "ids"] and got["max_batch_size"] == 0 and got["stats"] == "tiny"
    np.testing.assert_allclose(np.array(got["scores"], dtype=np.float32), _expected(library, 300, 50), rtol=1e-5,
                               atol=1e-6)  # fmt: skip


def test_an_open_inference_answer_without_stage_times_leaves_them_null():
    """A v2 server that is not the lab's reports no stages: the scores are read (raw or typed), the stages 0."""
    from dlrm_lab.serve.protocol import v2
    from dlrm_lab.serve.remote import open_inference_answer

    out = v2.ModelInferResponse.InferOutputTensor
    typed = v2.ModelInferResponse(outputs=[out(name="other"), out(name="scores", datatype="FP32", shape=[2])])
    typed.outputs[1].contents.fp32_contents.extend([0.25, 0.5])
    answer = open_inference_answer(typed.SerializeToString())
    assert np.frombuffer(answer.scores, dtype="<f4").tolist() == [0.25, 0.5] and answer.server_send_ns == 0
    raw = v2.ModelInferResponse(outputs=[out(name="scores")], raw_output_contents=[np.float32([0.75]).tobytes()])
    raw.parameters["queue_ns"].int64_param = 5
    answer = open_inference_answer(raw.SerializeToString())
    assert np.frombuffer(answer.scores, dtype="<f4").tolist() == [0.75] and answer.queue_ns == 5


def test_an_answer_that_is_not_one_is_a_failed_query_named_and_the_point_fails():
    """A broken v2 server: bytes that do not decode, NaN scores; each query fails (BAD_RESPONSE, counted) and the
    point fails naming the first, as BadAnswer."""
    import grpc

    from dlrm_lab.errors import BadAnswer
    from dlrm_lab.infer.sut import Query
    from dlrm_lab.serve.protocol import v2
    from dlrm_lab.serve.remote import RemoteServer

    class Call:  # a finished unary call, as grpc hands it to the done callback
        def __init__(self, body: bytes) -> None:
            self.body = body

        def result(self) -> bytes:
            return self.body

    out = v2.ModelInferResponse.InferOutputTensor
    nan = v2.ModelInferResponse(outputs=[out(name="scores")], raw_output_contents=[np.float32([0.5, np.nan]).tobytes()])
    for body, why in ((b"\xff\xfe\x00garbage", "an undecodable answer (10 bytes: "),
                      (nan.SerializeToString(), "1 of its 2 scores NaN or infinite")):  # fmt: skip
        with grpc.insecure_channel("127.0.0.1:1") as channel:
            remote = RemoteServer(channel, {"tiny": None}, rpc="oip")
            remote._done(Query(3, "tiny", 2), (0, 0, 0), 10, Call(body))
            (row,) = remote.take_records()
            assert row["rpc_status"] == "BAD_RESPONSE" and row["status"] == "failed" and why in row["error"]
            with pytest.raises(BadAnswer, match=f"query 3 was answered with {re.escape(why)}"):
                remote.check()


KSERVE = "kserve==0.21.0"  # needs protobuf < 7 (and pandas < 3, psutil < 6): its own environment, made once and cached


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def kserve_server(tmp_path_factory):
    """KServe's own model server (tests/kserve_predictor.py) serving the lab's tiny DLRM, its weights exported."""
    from torch import nn

    python = _third_party_python(KSERVE)
    root = tmp_path_factory.mktemp("kserve")
    spec = load_preset("tiny")
    torch.manual_seed(SEED)
    model = build_model(spec).eval()
    weights: dict[str, np.ndarray] = {"n_tables": np.array(len(spec.tables))}
    for part, module in (("bottom", model.dense_arch), ("top", model.over_arch)):
        linear = [m for m in module.modules() if isinstance(m, nn.Linear)]
        weights[f"n_{part}"] = np.array(len(linear))
        for i, m in enumerate(linear):
            weights[f"{part}_w{i}"], weights[f"{part}_b{i}"] = m.weight.detach().numpy(), m.bias.detach().numpy()
    bags = model.sparse_arch.embedding_bag_collection.embedding_bags
    for f, table in enumerate(spec.tables):
        weights[f"table_{f}"] = bags[table.name].weight.detach().numpy()
    np.savez(root / "tiny.npz", **weights)
    port, http_port = _free_port(), _free_port()
    log = open(root / "kserve.log", "w")  # noqa: SIM115 - closed below, after the server
    proc = subprocess.Popen([python, str(ROOT / "tests" / "kserve_predictor.py"), "tiny", str(root / "tiny.npz"),
                             str(port), str(http_port)], stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            grpc.channel_ready_future(channel).result(timeout=120)
        yield f"127.0.0.1:{port}", model, f"127.0.0.1:{http_port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


def test_infer_run_drives_kserves_own_model_server_and_gets_the_models_scores(kserve_server, tmp_path):
    """A third-party Open Inference Protocol server (KServe's Python model server, a predictor written here): its
    metadata checked, the model's scores back, the one runner's rows with the stages it does not report null; an
    answer short of one score per sample ends the run in one line."""
    from dlrm_lab.infer.batches import QueryRef
    from dlrm_lab.infer.served import ServedModel
    from dlrm_lab.infer.serving_parts import make_runner
    from dlrm_lab.infer.sut import Query
    from dlrm_lab.infer.targets import Connection, open_target, parse_target

    address, model, _ = kserve_server
    answers: list[tuple[str, np.ndarray]] = []
    done = threading.Event()
    with open_target(parse_target(f"kserve://{address}/tiny"), [ServedModel("tiny", model.spec)],
                     Connection(seed=SEED)) as sut:  # fmt: skip
        sut.submit(Query(1, "tiny", 40, 100, on_done=lambda q, status, scores: (answers.append((status, scores)),
                                                                                done.set())))  # fmt: skip
        assert done.wait(30)
        expected = make_runner(model, sut.library("tiny"), torch.device("cpu"), "fp32")([QueryRef(-1, 40, 100)])
    ((status, scores),) = answers
    assert status == "ok"
    np.testing.assert_allclose(scores, expected, rtol=1e-5, atol=1e-6)

    code, _, err = run_cli_in_process("infer", "run", "--model", "tiny", "--target", f"kserve://{address}/tiny",
                                      "--qps", "40", "--query-size", "uniform:1,8", "--duration", "1", "--sla-ms",
                                      "200", "--no-progress", "--metrics-dir", str(tmp_path / "ok"))  # fmt: skip
    assert code == 0, err
    (run_dir,) = (tmp_path / "ok").iterdir()
    q = pq.read_table(run_dir / "queries.parquet").to_pandas()
    assert len(q) > 10 and (q.status == "ok").all() and (q.rpc_status == "ok").all()
    assert q.serialise_ms.notna().all() and q.deserialise_ms.notna().all() and q.round_trip_ms.notna().all()
    assert q.queue_ms.isna().all() and q.network_ms.isna().all()  # KServe reports no stage times
    np.testing.assert_allclose(q.lat_issue_ms + q.serialise_ms + q.round_trip_ms + q.deserialise_ms, q.latency_ms,
                               atol=1e-6)  # fmt: skip
    (s,) = pq.read_table(run_dir / "summary.parquet").to_pylist()
    assert s["rpc"] == "oip" and s["completed_queries"] == len(q) and s["queue_mean_ms"] is None
    assert s["round_trip_p50_ms"] > 0 and s["transfer_mean_ms"] is None and s["latency_floor_ms"] is None

    code, _, err = run_cli_in_process("infer", "run", "--model", "tiny", "--target", f"kserve://{address}/tiny-short",
                                      "--qps", "20", "--duration", "1", "--no-progress", "--metrics-dir",
                                      str(tmp_path / "bad"))  # fmt: skip
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 1 and len(errors) == 1, err
    assert f"the server at kserve://{address}/tiny-short answered badly: query" in errors[0]
    assert "score bytes for" in errors[0] and "rows kept in" in errors[0]
    (run_dir,) = (tmp_path / "bad").iterdir()
    assert read_manifest(run_dir)["status"] == "failed"
    rows = pq.read_table(run_dir / "queries.parquet").to_pandas()
    assert (rows.rpc_status == "BAD_RESPONSE").any() and set(rows.status[rows.rpc_status == "BAD_RESPONSE"]) == {
        "failed"}  # fmt: skip


def test_infer_run_drives_kserves_model_server_over_rest_and_gets_the_models_scores(kserve_server, tmp_path):
    """The same ModelServer over its HTTP/REST binding (`--target http://...`): it lists no binary_tensor_data
    extension, so the tensors go as JSON (rpc rest-json); the model's scores back, the stages it does not report
    null."""
    from dlrm_lab.infer.batches import QueryRef
    from dlrm_lab.infer.served import ServedModel
    from dlrm_lab.infer.serving_parts import make_runner
    from dlrm_lab.infer.sut import Query
    from dlrm_lab.infer.targets import Connection, open_target, parse_target

    _, model, address = kserve_server
    answers: list[tuple[str, np.ndarray]] = []
    with open_target(parse_target(f"http://{address}/tiny"), [ServedModel("tiny", model.spec)],
                     Connection(seed=SEED, connect_timeout_s=60)) as sut:  # fmt: skip
        assert sut.describe().rpc == "rest-json"
        sut.submit(Query(1, "tiny", 40, 100, on_done=lambda q, status, scores: answers.append((status, scores))))
        assert sut.drain(30)
        expected = make_runner(model, sut.library("tiny"), torch.device("cpu"), "fp32")([QueryRef(-1, 40, 100)])
    ((status, scores),) = answers
    assert status == "ok"
    np.testing.assert_allclose(scores, expected, rtol=1e-5, atol=1e-6)

    code, _, err = run_cli_in_process("infer", "run", "--model", "tiny", "--target", f"http://{address}/tiny",
                                      "--qps", "40", "--query-size", "uniform:1,8", "--duration", "1", "--sla-ms",
                                      "200", "--no-progress", "--metrics-dir", str(tmp_path))  # fmt: skip
    assert code == 0, err
    (run_dir,) = tmp_path.iterdir()
    q = pq.read_table(run_dir / "queries.parquet").to_pandas()
    assert len(q) > 10 and (q.status == "ok").all() and q.queue_ms.isna().all() and q.round_trip_ms.notna().all()
    (s,) = pq.read_table(run_dir / "summary.parquet").to_pylist()
    assert s["rpc"] == "rest-json" and s["completed_queries"] == len(q)


def test_a_refused_request_declaring_an_absurd_size_is_recorded_without_its_size(tmp_path):
    """An Open Inference Protocol request declaring shape [2^62, 4] is refused; its row must still fit the queries
    table (an int32 `samples`), or writing it would end the server (issue 44)."""
    import types

    from dlrm_lab.metrics.columns import schema_of
    from dlrm_lab.metrics.tables import TableWriter
    from dlrm_lab.serve.protocol import Refused
    from dlrm_lab.serve.service import InferenceService

    inference = types.SimpleNamespace(models={}, epoch_ns=time.monotonic_ns(), take_records=list, take_stalls=list)
    service = InferenceService(inference)
    refused = Refused(grpc.StatusCode.INVALID_ARGUMENT, "model 'm': 4611686018427387904 samples: too many", "rejected")
    for samples in (2**62, 3):
        service.record_refused(types.SimpleNamespace(model="m", samples=samples), time.monotonic_ns(), refused)
    writer = TableWriter(tmp_path, "queries", schema_of("queries"), "run-0")
    service.pump(writer)
    writer.close()
    rows = pq.read_table(tmp_path / "queries.parquet", columns=["samples", "status"]).to_pylist()
    assert rows == [{"samples": None, "status": "rejected"}, {"samples": 3, "status": "rejected"}]

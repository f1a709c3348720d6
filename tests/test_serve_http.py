"""The Open Inference Protocol over HTTP/REST (KServe v2's REST binding): `dlrm-lab serve --http-port` answers curl,
`tritonclient.http` and the lab's runner (`infer run --target http://...`) with the model's scores, JSON or binary
(Triton's extension), through the same batcher and records as gRPC; malformed requests are a 4xx naming the field,
and the server goes on. The runner against KServe's own ModelServer over REST is in test_serve.py (its fixture)."""

import asyncio
import http.client
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
import types
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
from conftest import run_cli_in_process
from test_serve import FLEET, SEED, TRITONCLIENT, _expected, _third_party_python

from dlrm_lab.config import load_preset
from dlrm_lab.data import synthetic_generator
from dlrm_lab.serve.protocol import encode_samples


@pytest.fixture(scope="module")
def rest(request, tmp_path_factory):
    """test_serve.py's shared server (`--max-batch 64`, gRPC and HTTP/REST), started with that module's servers
    (`test_serve.Fleet`); its HTTP address is `rest.http`."""
    try:
        yield FLEET.start(request, tmp_path_factory)["server"].ready()
    finally:
        FLEET.release(request)


@pytest.fixture(scope="module")
def library():
    return synthetic_generator(load_preset("tiny"), seed=SEED).samples(0, 4096)


def _arrays(library, offset: int, size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    block = library.slice(offset, offset + size)
    dense, lengths, ids = encode_samples(block.dense, block.lengths, block.values)
    return (np.frombuffer(dense, "<f4").reshape(size, 4), np.frombuffer(lengths, "<i4").reshape(4, size),
            np.frombuffer(ids, "<i8"))  # fmt: skip


def _json_request(library, offset: int, size: int, **extra) -> dict:
    dense, lengths, ids = _arrays(library, offset, size)
    inputs = [{"name": "dense", "datatype": "FP32", "shape": [size, 4], "data": dense.ravel().tolist()},
              {"name": "lengths", "datatype": "INT32", "shape": [4, size], "data": lengths.ravel().tolist()},
              {"name": "ids", "datatype": "INT64", "shape": [len(ids)], "data": ids.tolist()}]  # fmt: skip
    return {"inputs": inputs, **extra}


def _call(conn: http.client.HTTPConnection, method: str, path: str, body: bytes | None = None, headers=None):
    conn.request(method, path, body, headers or {})
    resp = conn.getresponse()
    return resp, resp.read()


def test_the_rest_binding_answers_health_metadata_and_scores_json_and_binary(rest, library):
    conn = http.client.HTTPConnection(*rest.http.rsplit(":", 1), timeout=30)  # one keep-alive connection throughout
    for path, want in (("/v2/health/live", {"live": True}), ("/v2/health/ready", {"ready": True}),
                       ("/v2/models/tiny/ready", {"name": "tiny", "ready": True})):  # fmt: skip
        resp, body = _call(conn, "GET", path)
        assert resp.status == 200 and json.loads(body) == want
    resp, body = _call(conn, "GET", "/v2")
    assert json.loads(body)["name"] == "dlrm-lab" and "binary_tensor_data" in json.loads(body)["extensions"]
    meta = json.loads(_call(conn, "GET", "/v2/models/tiny/versions/1")[1])
    assert [(t["name"], t["datatype"], t["shape"]) for t in meta["inputs"]] == [
        ("dense", "FP32", [-1, 4]), ("lengths", "INT32", [4, -1]), ("ids", "INT64", [-1])]  # fmt: skip
    assert json.loads(_call(conn, "GET", "/v2/models/tiny/config")[1])["max_batch_size"] == 0

    resp, body = _call(conn, "POST", "/v2/models/tiny/infer", json.dumps(_json_request(library, 100, 64, id="q7")))
    answer = json.loads(body)
    assert resp.status == 200 and answer["id"] == "q7" and answer["outputs"][0]["shape"] == [64]
    np.testing.assert_allclose(answer["outputs"][0]["data"], _expected(library, 100, 64), rtol=1e-5, atol=1e-6)
    stages = answer["parameters"]
    assert stages["server_send_ns"] >= stages["server_receive_ns"] and stages["batch_samples"] >= 1

    dense, lengths, ids = _arrays(library, 200, 30)  # Triton's binary extension, both ways
    head = json.dumps({"inputs": [{"name": n, "datatype": t, "shape": list(a.shape),
                                   "parameters": {"binary_data_size": a.nbytes}}
                                  for n, t, a in (("dense", "FP32", dense), ("lengths", "INT32", lengths),
                                                  ("ids", "INT64", ids))],
                       "parameters": {"binary_data_output": True}}).encode()  # fmt: skip
    resp, body = _call(conn, "POST", "/v2/models/tiny/infer", head + dense.tobytes() + lengths.tobytes() +
                       ids.tobytes(), {"Inference-Header-Content-Length": str(len(head))})  # fmt: skip
    cut = int(resp.getheader("Inference-Header-Content-Length"))
    assert json.loads(body[:cut])["outputs"][0]["parameters"]["binary_data_size"] == 120
    np.testing.assert_allclose(np.frombuffer(body[cut:], "<f4"), _expected(library, 200, 30), rtol=1e-5, atol=1e-6)
    stats = json.loads(_call(conn, "GET", "/v2/models/tiny/stats")[1])["model_stats"][0]
    assert stats["name"] == "tiny" and stats["inference_count"] >= 94 and stats["execution_count"] >= 2
    conn.close()


def test_curl_scores_samples_equal_to_the_model(rest, library, tmp_path):
    curl = shutil.which("curl")
    if curl is None:
        pytest.skip("no curl on this machine")
    path = tmp_path / "request.json"  # 40 samples: over 1 KiB, so curl sends Expect: 100-continue
    path.write_text(json.dumps(_json_request(library, 500, 40)))
    out = subprocess.run([curl, "-sS", "-X", "POST", "-H", "Content-Type: application/json", "--data-binary",
                          f"@{path}", f"http://{rest.http}/v2/models/tiny/infer"], capture_output=True, text=True,
                         timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    scores = json.loads(out.stdout)["outputs"][0]["data"]
    np.testing.assert_allclose(scores, _expected(library, 500, 40), rtol=1e-5, atol=1e-6)
    out = subprocess.run([curl, "-s", "-o", "/dev/null", "-w", "%{http_code}", f"http://{rest.http}/v2/health/ready"],
                         capture_output=True, text=True, timeout=30)  # fmt: skip
    assert out.stdout == "200"


TRITON_HTTP_SCRIPT = """
import json, sys
import numpy as np
import tritonclient.http as tc
target, dense, lengths, ids = sys.argv[1], *(np.load(p) for p in sys.argv[2:5])
client = tc.InferenceServerClient(url=target)
assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("tiny")
meta = client.get_model_metadata("tiny")
config = client.get_model_config("tiny")
out = {"inputs": [i["name"] for i in meta["inputs"]], "max_batch_size": config["max_batch_size"]}
for binary in (True, False):  # Triton's binary extension, then JSON tensors and a JSON answer
    inputs = [tc.InferInput("dense", list(dense.shape), "FP32"), tc.InferInput("lengths", list(lengths.shape), "INT32"),
              tc.InferInput("ids", list(ids.shape), "INT64")]
    for tensor, values in zip(inputs, (dense, lengths, ids)):
        tensor.set_data_from_numpy(values, binary_data=binary)
    result = client.infer("tiny", inputs, outputs=[tc.InferRequestedOutput("scores", binary_data=binary)])
    out[f"scores_{binary}"] = result.as_numpy("scores").tolist()
out["default"] = client.infer("tiny", inputs).as_numpy("scores").tolist()  # no outputs named: binary_data_output
out["stats"] = client.get_inference_statistics("tiny")["model_stats"][0]["name"]
print(json.dumps(out))
"""


def test_nvidias_tritonclient_http_scores_samples_equal_to_the_model(rest, library, tmp_path):
    python = _third_party_python(TRITONCLIENT)
    paths = []
    for name, values in zip(("dense", "lengths", "ids"), _arrays(library, 300, 50), strict=True):
        np.save(tmp_path / f"{name}.npy", values)
        paths.append(str(tmp_path / f"{name}.npy"))
    out = subprocess.run([python, "-c", TRITON_HTTP_SCRIPT, rest.http, *paths], capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["inputs"] == ["dense", "lengths", "ids"] and got["max_batch_size"] == 0 and got["stats"] == "tiny"
    for key in ("scores_True", "scores_False", "default"):
        np.testing.assert_allclose(np.array(got[key], dtype=np.float32), _expected(library, 300, 50), rtol=1e-5,
                                   atol=1e-6)  # fmt: skip


def test_infer_run_against_the_rest_binding_records_stages_that_add_up(rest, tmp_path):
    """The one runner over HTTP/REST: binary tensors (the server lists the extension), two client processes; the
    stages the server reports add up to each query's latency as over gRPC."""
    code, out, err = run_cli_in_process("infer", "run", "--model", "tiny", "--target", f"http://{rest.http}/tiny",
                                        "--qps", "90", "--query-size", "uniform:1,16", "--duration", "1", "--sla-ms",
                                        "500", "--concurrency", "2", "--no-progress", "--metrics-dir",
                                        str(tmp_path))  # fmt: skip
    assert code == 0, err
    assert "rpc rest" in out + err
    (run_dir,) = tmp_path.iterdir()
    q = pq.read_table(run_dir / "queries.parquet").to_pandas()
    assert len(q) > 20 and (q.status == "ok").all() and set(q.worker) == {0, 1}
    np.testing.assert_allclose(q.lat_issue_ms + q.serialise_ms + q.round_trip_ms + q.deserialise_ms, q.latency_ms,
                               atol=1e-6)  # fmt: skip
    np.testing.assert_allclose(q.network_ms + q.server_parse_ms + q.queue_ms + q.compute_ms + q.server_respond_ms,
                               q.round_trip_ms, atol=1e-6)  # fmt: skip
    assert (q.network_ms > 0).all() and (q.request_bytes > 0).all()
    (s,) = pq.read_table(run_dir / "summary.parquet").to_pylist()
    assert s["rpc"] == "rest" and s["target"] == f"http://{rest.http}/tiny" and s["transfer_share"] > 0


def test_a_json_query_through_the_runners_system_under_test_scores_like_the_model(rest, library):
    from dlrm_lab.infer.served import ServedModel
    from dlrm_lab.infer.sut import Query
    from dlrm_lab.infer.targets import Connection, open_target, parse_target

    answers = []
    block = library.slice(0, 12)
    with open_target(parse_target(f"http://{rest.http}/tiny"), [ServedModel("tiny", load_preset("tiny"))],
                     Connection(rpc="rest-json")) as sut:  # fmt: skip
        assert sut.describe().rpc == "rest-json"
        sut.submit(Query(1, "tiny", 12, payload=block, on_done=lambda q, status, scores: answers.append(
            (status, scores))))  # fmt: skip
        assert sut.drain(30)
        (row,) = sut.take_records()
    ((status, scores),) = answers
    assert status == "ok" and row["rpc_status"] == "ok" and row["server_parse_ms"] is not None
    np.testing.assert_allclose(scores, _expected(library, 0, 12), rtol=1e-5, atol=1e-6)


BAD = [  # (body, headers, status, the one line's words)
    (b"{not json", {}, 400, "request body: not JSON"),
    (b"[1, 2]", {}, 400, "request body: a JSON object expected"),
    (json.dumps({"inputs": 3}).encode(), {}, 400, "inputs: a list of tensor objects"),
    ("dtype", {}, 400, "input dense: datatype 'FP64', expected FP32"),
    ("shape", {}, 400, "input dense: shape [4, 5], expected [N, 4]"),
    ("count", {}, 400, "input lengths: 15 values in data for shape [4, 4] (16 expected)"),
    ("strings", {}, 400, "input ids: data: not INT64 numbers"),
    ("floats", {}, 400, "input ids: data: not INT64 numbers"),
    ("id", {}, 400, "id '7': must be a string"),
    ("output", {}, 400, "outputs ['probabilities']: the model has one, 'scores'"),
    ("binary", {"Inference-Header-Content-Length": "HEAD"}, 400, "input dense: binary_data_size '999': not a size"),
    ("table", {}, 400, "outside its table"),  # the lab's own value checks, as over gRPC
]


def _bad_body(library, kind: str) -> bytes:
    request = _json_request(library, 0, 4)
    dense, lengths, ids = request["inputs"]
    if kind == "dtype":
        dense["datatype"] = "FP64"
    elif kind == "shape":
        dense["shape"] = [4, 5]
    elif kind == "count":
        lengths["data"] = lengths["data"][:-1]
    elif kind == "strings":
        ids["data"] = ["a"] * len(ids["data"])
    elif kind == "floats":
        ids["data"] = [0.5] * len(ids["data"])
    elif kind == "id":
        request["id"] = 7
    elif kind == "output":
        request["outputs"] = [{"name": "probabilities"}]
    elif kind == "binary":
        del dense["data"]
        dense["parameters"] = {"binary_data_size": 999}
    elif kind == "table":
        ids["data"] = [10**9] * len(ids["data"])
    return json.dumps(request).encode()


def test_malformed_requests_are_a_4xx_naming_the_field_and_the_server_goes_on(rest, library):
    """Over the wire, on one keep-alive connection: each refusal one JSON line naming the field; an unknown model
    404; then a good query on the same connection; an oversized body 413 (and that connection closed); the serve
    run records every refused query as rejected, as over gRPC."""
    conn = http.client.HTTPConnection(*rest.http.rsplit(":", 1), timeout=30)
    # the server is test_serve.py's too: the rows of this test are those after this refusal's
    mark = "model 'rows-from-here': not served here"
    resp, answer = _call(conn, "POST", "/v2/models/rows-from-here/infer", json.dumps(_json_request(library, 0, 4)))
    assert resp.status == 404 and mark in json.loads(answer)["error"]
    for body, headers, status, words in BAD:
        body = body if isinstance(body, bytes) else _bad_body(library, body)
        if headers.get("Inference-Header-Content-Length") == "HEAD":
            headers = {"Inference-Header-Content-Length": str(len(body))}
        resp, answer = _call(conn, "POST", "/v2/models/tiny/infer", body, headers)
        assert resp.status == status and words in json.loads(answer)["error"], (words, answer)
        assert answer.count(b"\n") == 0 and list(json.loads(answer)) == ["error"]
    resp, answer = _call(conn, "POST", "/v2/models/rm9/infer", json.dumps(_json_request(library, 0, 4)).encode())
    assert resp.status == 404 and "model 'rm9': not served here; served: tiny" in json.loads(answer)["error"]
    resp, answer = _call(conn, "GET", "/v2/models/rm9")
    assert resp.status == 404 and "model 'rm9'" in json.loads(answer)["error"]
    resp, answer = _call(conn, "POST", "/v2/models/tiny/infer", json.dumps(_json_request(library, 8, 4)).encode())
    assert resp.status == 200
    np.testing.assert_allclose(json.loads(answer)["outputs"][0]["data"], _expected(library, 8, 4), rtol=1e-5, atol=1e-6)
    conn.close()

    big = http.client.HTTPConnection(*rest.http.rsplit(":", 1), timeout=30)
    big.putrequest("POST", "/v2/models/tiny/infer")
    big.putheader("Content-Length", str(10**10))  # nothing sent beyond it: refused from the header
    big.endheaders()
    resp = big.getresponse()
    assert resp.status == 413 and "Content-Length 10000000000: over this server's" in json.loads(resp.read())["error"]
    big.close()
    conn = http.client.HTTPConnection(*rest.http.rsplit(":", 1), timeout=30)
    assert _call(conn, "GET", "/v2/health/ready")[0].status == 200
    conn.close()

    def refused() -> pd.DataFrame:  # the serve run's rejected rows since the mark, as on disk now (every 2 s)
        parts = list((next(rest.metrics_dir.iterdir()) / "_parts").rglob("*.parquet"))
        if not parts:
            return pd.DataFrame({"status": [], "error": [], "scheduled_ms": []})
        rows = pq.read_table(parts).to_pandas()
        rows = rows[rows.status == "rejected"]
        since = rows.scheduled_ms[rows.error.str.contains(mark, regex=False)]
        return rows[rows.scheduled_ms > since.iloc[0]] if len(since) else rows.iloc[:0]

    deadline = time.monotonic() + 30
    while len(rows := refused()) < len(BAD) + 2 and time.monotonic() < deadline:
        time.sleep(0.25)
    assert len(rows) >= len(BAD) + 2 and rows.error.str.contains("input dense: shape \\[4, 5\\]").any()


def _front(max_body: int | None = None):
    """A REST front over a service whose batcher is never reached (the refusals come first)."""
    from dlrm_lab.infer.served import ServedModel
    from dlrm_lab.serve.open_inference import OpenInferenceService
    from dlrm_lab.serve.rest import RestFront
    from dlrm_lab.serve.service import InferenceService

    inference = types.SimpleNamespace(models={"tiny": ServedModel("tiny", load_preset("tiny"))}, seed=0,
                                      epoch_ns=time.monotonic_ns(), take_records=list,
                                      library=lambda name: types.SimpleNamespace(size=0))  # fmt: skip
    return RestFront(OpenInferenceService(InferenceService(inference)), max_body)


def test_the_rest_refusals_in_process_name_their_field():
    front = _front()
    request = json.dumps({"inputs": []}).encode()
    cases = [
        ("GET", "/v2/models/tiny/infer", {}, b"", 405, "method 'GET': /v2/models/tiny/infer takes POST"),
        ("POST", "/v2/health/ready", {}, b"", 405, "takes GET"),
        ("GET", "/v1/models/tiny", {}, b"", 404, "path '/v1/models/tiny': not an endpoint"),
        ("GET", "/v2/models/tiny/explain", {}, b"", 404, "not an Open Inference Protocol endpoint"),
        ("GET", "/v2/models/tiny/versions/2", {}, b"", 404, "model tiny version '2': only 1"),
        ("GET", "/v2/models/rm9/ready", {}, b"", 404, "model 'rm9': not served here"),
        ("POST", "/v2/models/tiny/infer", {"content-encoding": "gzip"}, request, 415, "Content-Encoding 'gzip'"),
        ("POST", "/v2/models/tiny/infer", {}, request, 400, "inputs []: expected dense, lengths, ids"),
        ("POST", "/v2/models/tiny/infer", {"inference-header-content-length": "99"}, request, 400,
         "Inference-Header-Content-Length '99': not a length within the body's 14 bytes"),
    ]  # fmt: skip
    for method, path, headers, body, status, words in cases:
        got, _, answer = asyncio.run(front.respond(method, path, headers, body))
        assert got == status and words in json.loads(answer)["error"], (path, answer)
    rows = front.v2.service._refused
    assert [r["status"] for r in rows] == ["rejected"] * 3  # the refused queries, not the bad paths


def test_a_client_string_utf8_cannot_hold_is_refused_and_recorded_escaped(tmp_path):
    """A lone surrogate in a tensor's name (valid JSON, `"\\ud800"`): refused 400, and its row written to the queries
    table escaped (it killed the server at the table's flush: UnicodeEncodeError)."""
    import pyarrow.parquet as pq

    from dlrm_lab.metrics.columns import schema_of
    from dlrm_lab.metrics.tables import TableWriter

    front = _front()
    got, _, answer = asyncio.run(front.respond("POST", "/v2/models/tiny/infer", {}, b'{"inputs":[{"name":"\\ud800"}]}'))
    assert got == 400 and "input '\\ud800': name and datatype must be strings" in json.loads(answer)["error"]
    writer = TableWriter(tmp_path, "queries", schema_of("queries"), "run")
    writer.extend([*front.v2.service._refused, {"error": "a message that kept one: \ud800", "query_id": 1}])
    errors = pq.read_table(writer.close()).column("error").to_pylist()  # any such text: escaped, never fatal
    assert errors[-1] == "a message that kept one: \\ud800"


def test_the_rest_front_keeps_connections_alive_and_closes_them_after_a_bad_frame():
    """Raw HTTP/1.1 on one socket: two requests kept alive; a chunked body is 411, a body over the limit 413 and an
    unreadable request line 400, each then closing the connection; a header over the limit is 431."""
    front = _front(max_body=1000)

    async def exchange(raw: bytes) -> list[bytes]:
        port = await front.start("127.0.0.1", 0)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(raw)
        await writer.drain()
        data = await asyncio.wait_for(reader.read(), 10)  # until the server closes
        writer.close()
        await front.close(0)
        return re.findall(rb"HTTP/1\.1 \d+ [A-Za-z ]+", data)  # the status lines, bodies between them

    live = b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n"
    assert asyncio.run(exchange(live * 2 + b"GET /v2/health/live HTTP/1.1\r\nConnection: close\r\n\r\n")) == [
        b"HTTP/1.1 200 OK"] * 3  # fmt: skip
    chunked = b"POST /v2/models/tiny/infer HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
    assert asyncio.run(exchange(live + chunked + live)) == [b"HTTP/1.1 200 OK", b"HTTP/1.1 411 Length Required"]
    over = b"POST /v2/models/tiny/infer HTTP/1.1\r\nContent-Length: 1001\r\n\r\n"
    assert asyncio.run(exchange(over + live)) == [b"HTTP/1.1 413 Content Too Large"]
    assert asyncio.run(exchange(b"NONSENSE\r\n\r\n")) == [b"HTTP/1.1 400 Bad Request"]
    huge = b"GET /v2/health/live HTTP/1.1\r\nX-Pad: " + b"a" * 70_000 + b"\r\n\r\n"
    assert asyncio.run(exchange(huge)) == [b"HTTP/1.1 431 Request Header Fields Too Large"]


def test_the_body_limit_follows_the_largest_query():
    from dlrm_lab.infer.served import ServedModel
    from dlrm_lab.serve.rest import BODY_SLACK, max_body_bytes

    tiny = load_preset("tiny")
    small = max_body_bytes({"tiny": ServedModel("tiny", tiny, max_query_samples=100)})
    ids = 8 * sum(t.pooling_factor * len(t.feature_names) for t in tiny.tables)  # 8x the mean ids of a sample
    assert small == BODY_SLACK + int(100 * (tiny.num_dense + tiny.num_features + ids) * 24)
    assert max_body_bytes({"tiny": ServedModel("tiny", tiny)}) > small


def test_a_taken_http_port_is_refused_before_anything_starts_and_a_free_one_is_held_from_then(tmp_path):
    """The HTTP port is claimed before the run exists or an instance starts: taken, it is one line naming
    --http-port and no run directory; claimed, no other process can bind it while the server starts (issue 57 A6)."""
    import socket

    import dlrm_lab
    from dlrm_lab.errors import UserError
    from dlrm_lab.infer.served import ServedModel
    from dlrm_lab.serve.ports import claim_port
    from dlrm_lab.serve.server import serve

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        with pytest.raises(UserError, match=f"^http_port {busy}: cannot listen on 127.0.0.1:{busy}"):
            serve([ServedModel("tiny", dlrm_lab.load_preset("tiny"))], host="127.0.0.1", port=0, http_port=busy,
                  metrics_dir=tmp_path / "runs")  # fmt: skip
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())
    held = claim_port("127.0.0.1", 0, "http_port")
    try:
        with socket.socket() as other, pytest.raises(OSError):
            other.bind(held.getsockname())
        with socket.socket() as reusing, pytest.raises(OSError):  # as most servers bind: the claim holds them off too
            reusing.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            reusing.bind(held.getsockname())
    finally:
        held.close()
    # gRPC's port too: claimed before the instances start, given up to gRPC as it binds (the run's start line names
    # the port it took, the claimed one)
    from dlrm_lab.serve.ports import release_to

    claim = claim_port("127.0.0.1", 0, "port")
    port = claim.getsockname()[1]
    assert release_to(claim) == port and claim.fileno() == -1
    with socket.socket() as after:  # free for its server the moment it is given up
        after.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        after.bind(("127.0.0.1", port))


def test_hostile_frames_get_an_answer_and_idle_or_trickling_connections_are_closed(monkeypatch):
    """Raw HTTP on the in-process front (issue 57 B11, B13, B14): two different Content-Lengths are 400 (never a
    wait for bytes that do not come); a Content-Length or Inference-Header-Content-Length of '²' is 400, not a
    traceback; JSON nested 100,000 deep is 400; an output whose parameters are not an object is 400 before the query
    is scored; an idle connection is closed after its timeout and a trickled body answered 408."""
    from dlrm_lab.serve import rest as rest_module

    monkeypatch.setattr(rest_module, "HEAD_TIMEOUT_S", 0.3)
    monkeypatch.setattr(rest_module, "BODY_TIMEOUT_S", 0.3)
    front = _front(max_body=10 << 20)

    async def exchange(raw: bytes, then: bytes = b"", pause_s: float = 0.0) -> list[bytes]:
        port = await front.start("127.0.0.1", 0)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(raw)
        await writer.drain()
        if pause_s:
            await asyncio.sleep(pause_s)
            writer.write(then)
        data = await asyncio.wait_for(reader.read(), 10)  # until the server closes
        writer.close()
        await front.close(0)
        return re.findall(rb"HTTP/1\.1 \d+ [A-Za-z ]+", data)

    two = b"POST /v2/models/tiny/infer HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 50\r\n\r\nhello"
    assert asyncio.run(exchange(two)) == [b"HTTP/1.1 400 Bad Request"]
    split_twice = (b"POST /v2/models/tiny/infer HTTP/1.1\r\nContent-Length: 5\r\nInference-Header-Content-Length: 2\r\n"
                   b"Inference-Header-Content-Length: 5\r\n\r\nhello")  # fmt: skip
    assert asyncio.run(exchange(split_twice)) == [b"HTTP/1.1 400 Bad Request"]
    odd = "POST /v2/models/tiny/infer HTTP/1.1\r\nContent-Length: ²\r\n\r\n".encode()
    assert asyncio.run(exchange(odd)) == [b"HTTP/1.1 400 Bad Request"]
    assert asyncio.run(exchange(b"", pause_s=0.01)) == []  # idle: closed without a word, after the timeout
    trickle = b"POST /v2/models/tiny/infer HTTP/1.1\r\nContent-Length: 100\r\n\r\nab"
    assert asyncio.run(exchange(trickle, b"cd", pause_s=0.1)) == [b"HTTP/1.1 408 Request Timeout"]
    deep = b"[" * 100_000 + b"]" * 100_000
    good = {"name": "dense", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}
    timeouts = [({}, json.dumps({"inputs": [good], "parameters": {"timeout": t}}).replace('"T"', t).encode(),
                 "parameters.timeout") for t in ('"x"', "NaN", "1e400", "-1", "0")]  # fmt: skip
    cases = [*timeouts, ({"inference-header-content-length": "²"}, b"{}", "Inference-Header-Content-Length '²'"),
             ({}, deep, "JSON nested too deep"),
             ({}, json.dumps({"inputs": [], "outputs": [{"name": "scores", "parameters": 7}]}).encode(),
              "outputs[0]: parameters must be a JSON object")]  # fmt: skip
    front = _front(max_body=10 << 20)  # the one above stopped with its last exchange
    for headers, body, words in cases:
        got, _, answer = asyncio.run(front.respond("POST", "/v2/models/tiny/infer", headers, body))
        assert got == 400 and words in json.loads(answer)["error"], answer


def test_past_its_share_of_file_descriptors_a_client_is_answered_503_and_the_others_are_served():
    """Issue 57 B11: each protocol accepts at most its share of the descriptors (serve.connections); the client past
    it gets a 503 and a closed connection, while the clients already held are still answered."""
    front = _front(max_body=1000)
    front.max_connections = 3
    live = b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n"

    async def scene() -> tuple[list[bytes], bytes]:
        port = await front.start("127.0.0.1", 0)
        held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(3)]
        await asyncio.sleep(0.1)  # all three accepted
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        turned = await asyncio.wait_for(reader.read(), 10)  # answered, then closed
        writer.close()
        answers = []
        for r, w in held:  # the held clients go on being served
            w.write(live)
            await w.drain()
            answers.append(await asyncio.wait_for(r.readuntil(b"\r\n"), 10))
            w.close()
        await front.close(0)
        return answers, turned

    answers, turned = asyncio.run(scene())
    assert answers == [b"HTTP/1.1 200 OK\r\n"] * 3
    assert turned.startswith(b"HTTP/1.1 503 ") and b"Connection: close" in turned and b"most connections (3)" in turned
    assert front.turned_away == 1


def test_connections_cancelled_as_the_server_stops_end_without_a_traceback():
    """Issue 57 B15: SIGTERM with kept-alive clients, one of them half-way through a body, printed a traceback per
    connection as the loop cancelled their handlers; they end quietly."""
    front = _front(max_body=1000)
    told = []  # what the event loop's exception handler heard

    async def scene() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda _loop, context: told.append(context))
        port = await front.start("127.0.0.1", 0)
        clients = [await asyncio.open_connection("127.0.0.1", port) for _ in range(3)]
        for reader, writer in clients[:2]:  # kept alive after one answer
            writer.write(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
            await reader.readuntil(b"\r\n\r\n")
        clients[2][1].write(b"POST /v2/models/tiny/infer HTTP/1.1\r\nContent-Length: 100\r\n\r\nab")
        await asyncio.sleep(0.2)
        front.stop_accepting()
        for task in asyncio.all_tasks():  # as the loop's end cancels them
            if task is not asyncio.current_task():
                task.cancel()
        await asyncio.sleep(0.2)
        for _, writer in clients:
            writer.close()

    asyncio.run(scene())
    assert told == []


def test_the_connection_budget_raises_the_soft_limit_and_shares_what_is_left():
    import resource

    from dlrm_lab.serve.connections import RESERVE_FDS, connection_budget

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        if hard != resource.RLIM_INFINITY and hard > 512:
            resource.setrlimit(resource.RLIMIT_NOFILE, (512, hard))
        budget = connection_budget(protocols=2)
        raised, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        assert raised == budget.fd_limit and (hard == resource.RLIM_INFINITY or raised == hard)
        assert budget.per_protocol == max(1, (budget.fd_limit - budget.fds_at_start - RESERVE_FDS) // 2)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_large_bodies_are_parsed_off_the_loop_and_their_memory_is_bounded(monkeypatch):
    """A body over SMALL_BODY is parsed in a process of its own (`json.loads` holds the GIL for its whole parse, even
    in a thread, and stalled every client of the event loop), and its refusal comes back whole; a small one is read
    in the serving process. The bodies held at once are bounded (BODIES_IN_FLIGHT x the largest allowed): one more is
    503 at once, never buffered (issue 57 B9, B10)."""
    from dlrm_lab.serve import rest as rest_module
    from dlrm_lab.serve.rest_body import BodyFile

    front = _front(max_body=100)
    body = json.dumps({"inputs": []}).encode()  # 14 bytes, refused once parsed
    got, _, answer = asyncio.run(front.respond("POST", "/v2/models/tiny/infer", {}, body))
    assert got == 400 and "inputs []" in json.loads(answer)["error"] and front._pool is None  # read here
    monkeypatch.setattr(rest_module, "SMALL_BODY", 10)
    dead = Path("/dev/shm") / f"{BodyFile.PREFIX}999999999-left"  # a killed server's body: removed at start
    if Path("/dev/shm").is_dir():
        dead.write_bytes(b"{}")

    async def one_large() -> bytes:  # read to a file a slice at a time, parsed from it in the worker
        port = await front.start("127.0.0.1", 0)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v2/models/tiny/infer HTTP/1.1\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
        size = int(re.search(rb"Content-Length: (\d+)", head)[1])
        answer = await reader.readexactly(size)
        writer.close()
        return head + answer

    answer = asyncio.run(one_large())
    assert answer.startswith(b"HTTP/1.1 400 ") and b"inputs []" in answer  # the refusal, whole, from the worker
    (worker,) = front._pool._processes.values()
    assert worker.pid != os.getpid() and worker.is_alive()
    assert not dead.exists() and not list(Path(tempfile.gettempdir()).glob(f"{BodyFile.PREFIX}{os.getpid()}-*"))
    assert not list(Path("/dev/shm").glob(f"{BodyFile.PREFIX}{os.getpid()}-*"))  # its file gone with its answer

    class FullDisk(BodyFile):
        def __init__(self, size: int) -> None:
            import errno

            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(rest_module, "BodyFile", FullDisk)  # no room for its file: this request's 503 alone
    answer = asyncio.run(one_large())
    assert answer.startswith(b"HTTP/1.1 503 ") and b"no room to hold it (No space left on device)" in answer
    asyncio.run(front.close(0))
    assert front._pool is None

    async def three_uploads() -> list[bytes]:
        port = await front.start("127.0.0.1", 0)
        head = b"POST /v2/models/tiny/infer HTTP/1.1\r\nContent-Length: 90\r\n\r\n"
        held = []
        for _ in range(2):  # two bodies declared and not sent: 180 of the 200 bytes allowed in flight
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(head)
            await writer.drain()
            held.append(writer)
        await asyncio.sleep(0.2)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(head)
        await writer.drain()
        data = await asyncio.wait_for(reader.read(), 10)
        for w in (*held, writer):
            w.close()
        await front.close(0)
        return re.findall(rb"HTTP/1\.1 \d+ [A-Za-z ]+", data)

    assert asyncio.run(three_uploads()) == [b"HTTP/1.1 503 Service Unavailable"]


def test_every_v2_endpoint_answers_only_the_versions_its_metadata_lists():
    """ModelMetadata refuses version 'v7'; so does ModelInfer over gRPC and REST (round 4's class, issue 57): one
    NOT_FOUND naming the version, never a query served for a model version that does not exist."""
    import grpc

    from dlrm_lab.serve.protocol import Refused, v2

    front = _front()
    with pytest.raises(Refused, match=r"model tiny version 'v7': only 1") as refused:
        front.v2._request(v2.ModelInferRequest(model_name="tiny", model_version="v7"))
    assert refused.value.code == grpc.StatusCode.NOT_FOUND
    got, _, answer = asyncio.run(front.respond("POST", "/v2/models/tiny/versions/v7/infer", {}, b"{}"))
    assert got == 404 and "version 'v7': only 1" in json.loads(answer)["error"]

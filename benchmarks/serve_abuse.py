"""`dlrm-lab serve` under abuse (issues 44 and 57): held connections, a maximal body, malicious requests, streams.

    python benchmarks/serve_abuse.py [--streams 2000] [--queries-per-stream 3]

One server (tiny, one instance, its REST front and /metrics) is started through the CLI. Then:
  held       `--idle` connections to the REST port that send nothing, as many sending half a head, and as many to
             /metrics, all open at once: the server's RSS and threads (issue 57's B targets: at most 200 MB and 50
             threads more) and a query answered while they are held;
  fd-limit   a second server started at `--fd-limit` descriptors, flooded on both ports past each one's share: a
             late REST client is answered 503, gRPC closes what is past its share, the client it had is served; then
             SIGTERM with the flood open: exit 0 and no traceback after "stopped";
  body       the largest JSON body the REST front takes, sent while small gRPC queries run: their worst delay
             (target: at most 50 ms);
  malicious  Open Inference Protocol and lab requests that lie about their shapes, sizes, ids and
             datatypes (a shape of 2^62 with no contents, negative and empty shapes, a datatype the
             tensor is not, a body that is no message, a lab query of 2^31 - 1 samples, ids of any text):
             each must be answered (refused, or served where it is valid) and the server must keep serving.
  streams    `--streams` InferStream calls open at once (grpc.aio, one channel), each sending
             `--queries-per-stream` good queries and reading their answers.
After each part a good query is served and its scores compared with the first answer; the serving process's
RSS (with its instances') is read before and after each part. Passes when the server is alive, answers right
and its RSS grew by at most `--rss-growth-mb`; whether every stream was answered in full is reported beside it.
The verdict and figures go to results-serve_abuse-DATE.json.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import psutil
from common import header, results_path, write_results

from dlrm_lab.config import load_preset
from dlrm_lab.data import synthetic_generator
from dlrm_lab.serve.protocol import CHANNEL_OPTIONS, INFER_METHOD, encode_samples, pb, pb_grpc, v2
from dlrm_lab.serve.remote import open_inference_request

ROOT = Path(__file__).resolve().parents[1]
OIP_INFER = "/inference.GRPCInferenceService/ModelInfer"


# runs a command at most N file descriptors, hard and soft: python -c FD_LIMITED N COMMAND...
FD_LIMITED = (
    "import os, resource, sys; n = int(sys.argv[1]); resource.setrlimit(resource.RLIMIT_NOFILE, (n, n)); "
    "os.execv(sys.argv[2], sys.argv[2:])"
)


def start_server(metrics_dir: Path, fd_limit: int | None = None) -> tuple[subprocess.Popen[str], str, dict[str, int]]:
    """A tiny server with its REST front and /metrics (at most `fd_limit` descriptors); (its process, gRPC target,
    {"http": port, "metrics": port})."""
    prefix = [sys.executable, "-c", FD_LIMITED, str(fd_limit)] if fd_limit else []
    proc = subprocess.Popen(
        [*prefix, sys.executable, "-m", "dlrm_lab", "serve", "--preset", "tiny", "--host", "127.0.0.1", "--port", "0",
         "--http-port", "0", "--metrics-port", "0", "--metrics-dir", str(metrics_dir)],
        cwd=ROOT, text=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
    )  # fmt: skip
    assert proc.stderr is not None
    ports: dict[str, int] = {}
    for line in proc.stderr:
        if "Prometheus metrics on http://" in line:
            ports["metrics"] = int(line.rsplit(":", 1)[1].split("/")[0])
        if "Open Inference Protocol over HTTP/REST on " in line:
            ports["http"] = int(line.strip().rsplit(":", 1)[1])
        if "serving tiny on " in line:
            return proc, line.split(" on ")[1].strip(), ports
    raise RuntimeError(f"the server did not start (exit {proc.wait()})")


def threads_of(pid: int) -> int:
    return psutil.Process(pid).num_threads()


def idle_connections(port: int, n: int, slow: bool) -> list[Any]:
    """`n` connections to 127.0.0.1:port that send nothing, or (`slow`) half a request head and then nothing."""
    import socket

    out = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        if slow:
            s.sendall(b"POST /v2/models/tiny/infer HTTP/1.1\r\nContent-Le")
        out.append(s)
    return out


def held_connections(proc: Any, target: str, block: Any, want: bytes, ports: dict[str, int], n: int
                     ) -> dict[str, Any]:  # fmt: skip
    """`n` idle connections to the REST port, `n` slow ones, and `n` to /metrics, held at once: the server's RSS
    and threads while they are open (B targets: at most 200 MB and 50 threads more), and a query answered then."""
    before = {"rss_mb": rss_mb(proc.pid), "threads": threads_of(proc.pid)}
    held = []
    try:
        held += idle_connections(ports["http"], n, slow=False)
        held += idle_connections(ports["http"], n, slow=True)
        held += idle_connections(ports["metrics"], n, slow=False)
        time.sleep(1.0)
        during = {"rss_mb": rss_mb(proc.pid), "threads": threads_of(proc.pid)}
        answered = still_serving(target, block, want)[0]
    finally:
        for s in held:
            s.close()
    return {
        "connections": 3 * n,
        "before": before,
        "during": during,
        "answered_while_held": answered,
        "rss_growth_mb": during["rss_mb"] - before["rss_mb"],
        "thread_growth": during["threads"] - before["threads"],
    }


def one_maximal_body(target: str, block: Any, ports: dict[str, int], queries: int = 200) -> dict[str, Any]:
    """A small gRPC query's latency alone, then while the largest JSON body the REST front takes is sent and parsed:
    the body's delay to other clients (B target: at most 50 ms at its worst)."""
    import http.client
    import json
    import statistics
    import threading

    def latencies(n: int) -> list[float]:
        out = []
        with grpc.insecure_channel(target, options=CHANNEL_OPTIONS) as channel:
            call = channel.unary_unary(INFER_METHOD)
            for k in range(n):
                t = time.perf_counter()
                call(lab_request(block, query_id=k), timeout=30)
                out.append((time.perf_counter() - t) * 1e3)
        return out

    from dlrm_lab.infer.served import ServedModel
    from dlrm_lab.serve.rest import max_body_bytes

    alone = latencies(queries)
    limit = max_body_bytes({"tiny": ServedModel("tiny", load_preset("tiny"))})
    rows = int(0.95 * limit / (12 * 5))  # 12 numbers a row (dense 4, lengths 4, ids 4) of ~5 bytes: under the limit
    body = json.dumps({"inputs": [
        {"name": "dense", "datatype": "FP32", "shape": [rows, 4], "data": [0.5] * (rows * 4)},
        {"name": "lengths", "datatype": "INT32", "shape": [4, rows], "data": [1] * (rows * 4)},
        {"name": "ids", "datatype": "INT64", "shape": [rows * 4], "data": [1] * (rows * 4)}]}).encode()  # fmt: skip
    assert len(body) <= limit, (len(body), limit)
    sent: dict[str, Any] = {}

    def send() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", ports["http"], timeout=300)
        t = time.perf_counter()
        conn.request("POST", "/v2/models/tiny/infer", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        sent.update(status=resp.status, seconds=time.perf_counter() - t, answer=resp.read()[:200].decode())

    sender = threading.Thread(target=send)
    sender.start()
    during = latencies(queries)
    sender.join()
    return {"body_mb": len(body) / 2**20, "body_status": sent.get("status"), "body_seconds": sent.get("seconds"),
            "body_answer": sent.get("answer"), "alone_p50_ms": statistics.median(alone), "alone_max_ms": max(alone),
            "during_p50_ms": statistics.median(during), "during_max_ms": max(during),
            "worst_delay_ms": max(during) - statistics.median(alone)}  # fmt: skip


def rss_mb(pid: int) -> float:
    """The serving process's RSS with its instances' (MB)."""
    proc = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)]) / 2**20


def lab_request(block: Any, query_id: int = 1, **fields: Any) -> bytes:
    dense, lengths, ids = encode_samples(block.dense, block.lengths, block.values)
    base = {"model": "tiny", "query_id": query_id, "samples": block.size, "dense": dense, "lengths": lengths,
            "ids": ids}  # fmt: skip
    return pb.InferRequest(**{**base, **fields}).SerializeToString()


def oip_request(block: Any, query_id: str = "1") -> Any:
    body = open_inference_request("tiny", query_id, block.size, *encode_samples(block.dense, block.lengths,
                                                                               block.values))  # fmt: skip
    return v2.ModelInferRequest.FromString(body)


def malicious(target: str, block: Any) -> dict[str, Any]:
    """Send every malicious request; how each was answered (its gRPC status, or OK)."""
    cases: dict[str, bytes] = {}
    huge = oip_request(block)
    huge.inputs[0].shape[:] = [2**62, 4]
    huge.ClearField("raw_input_contents")
    cases["oip: dense shape [2^62, 4], no contents"] = huge.SerializeToString()
    negative = oip_request(block)
    negative.inputs[0].shape[:] = [-5, 4]
    cases["oip: negative shape"] = negative.SerializeToString()
    empty = oip_request(block)
    empty.inputs[1].shape[:] = []
    cases["oip: empty shape"] = empty.SerializeToString()
    wrong = oip_request(block)
    wrong.inputs[2].datatype = "BYTES"
    cases["oip: ids declared BYTES"] = wrong.SerializeToString()
    missing = oip_request(block)
    del missing.inputs[2]
    cases["oip: no ids tensor"] = missing.SerializeToString()
    for text in ("\u00b2", "9" * 40, "x" * 10_000, ""):
        cases[f"oip: id {text[:12]!r} ({len(text)} chars)"] = oip_request(block, text).SerializeToString()
    cases["oip: not a message"] = b"\xff\xff\xff\xff\x00garbage"
    lab: dict[str, bytes] = {
        "lab: 2^31 - 1 samples (the field's largest)": lab_request(block, samples=2**31 - 1),
        "lab: -1 samples": lab_request(block, samples=-1),
        "lab: not a message": b"\xff\xfe\x00",
        "lab: model of 10 KB name": lab_request(block, model="m" * 10_000),
    }
    long_name = oip_request(block)
    long_name.model_name = "m" * 10_000
    cases["oip: model of 10 KB name"] = long_name.SerializeToString()
    answers: dict[str, str] = {}
    with grpc.insecure_channel(target, options=CHANNEL_OPTIONS) as channel:
        for calls, method in ((cases, OIP_INFER), (lab, INFER_METHOD)):
            call = channel.unary_unary(method)  # raw bytes: anything can be sent
            for name, body in calls.items():
                try:
                    call(body, timeout=30)
                    answers[name] = "OK"
                except grpc.RpcError as exc:
                    answers[name] = exc.code().name
    return answers


async def _streams(target: str, requests: list[bytes], streams: int) -> tuple[int, dict[str, int], float]:
    """`streams` InferStream calls at once, each sending `requests`; (answered, failed streams by why, seconds)."""
    answered, failed = 0, {}
    async with grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS) as channel:
        stub = pb_grpc.InferenceStub(channel)

        async def one() -> int:
            call = stub.InferStream(iter([pb.InferRequest.FromString(r) for r in requests]), timeout=300)
            return sum([1 async for _ in call])

        start = time.monotonic()
        for got in await asyncio.gather(*(one() for _ in range(streams)), return_exceptions=True):
            if isinstance(got, BaseException):
                why = got.code().name if isinstance(got, grpc.RpcError) else type(got).__name__
                failed[why] = failed.get(why, 0) + 1
            else:
                answered += got
        return answered, failed, time.monotonic() - start


def at_fd_limit(block: Any, want: bytes, limit: int, tmp: Path) -> dict[str, Any]:
    """A second server started at `limit` descriptors, flooded with idle connections on both ports past each one's
    share (B target: a client at the limit gets a refusal and the others go on being served), then SIGTERM with the
    flood's REST connections still open (B15: nothing after "stopped")."""
    import json
    import socket

    proc, target, ports = start_server(tmp / "fd-limit", fd_limit=limit)
    flood: list[Any] = []
    out: dict[str, Any] = {"fd_limit": limit}
    try:
        (manifest,) = (tmp / "fd-limit").glob("*/manifest.json")
        share = json.loads(manifest.read_text())["connection_budget"]["per_protocol"]
        out["per_protocol"] = share
        channel = grpc.insecure_channel(target, options=CHANNEL_OPTIONS)  # a client it had before the flood
        call = channel.unary_unary(INFER_METHOD)
        call(lab_request(block), timeout=30)
        for port in (ports["http"], int(target.rsplit(":", 1)[1])):
            flood += [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(share + 20)]
        time.sleep(0.5)
        with socket.create_connection(("127.0.0.1", ports["http"]), timeout=10) as late:
            late.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
            out["late_http_answer"] = late.recv(4096).split(b"\r\n", 1)[0].decode()
        answer = pb.InferResponse.FromString(call(lab_request(block), timeout=30))
        out["served_the_client_it_had"] = answer.scores == want
        channel.close()
        for sock in flood[share + 20 :]:  # the gRPC ones: those past its share closed before any handshake
            sock.settimeout(0.05)
            try:
                out["grpc_closed"] = out.get("grpc_closed", 0) + (sock.recv(1) == b"")
            except (TimeoutError, OSError):
                pass
        proc.send_signal(signal.SIGTERM)  # the flood's REST connections still open
        out["exit_code"] = proc.wait(timeout=60)
    finally:
        for sock in flood:
            sock.close()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.stderr is not None
    after = proc.stderr.read()
    out["traceback_after_stop"] = "Traceback" in after
    return out


def still_serving(target: str, block: Any, want: bytes | None) -> tuple[bool, bytes]:
    with grpc.insecure_channel(target, options=CHANNEL_OPTIONS) as channel:
        resp = pb.InferResponse.FromString(channel.unary_unary(INFER_METHOD)(lab_request(block), timeout=30))
    return want is None or resp.scores == want, resp.scores


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=2000)
    ap.add_argument("--queries-per-stream", type=int, default=3)
    ap.add_argument("--rss-growth-mb", type=float, default=300.0)
    ap.add_argument("--idle", type=int, default=2000, help="idle, slow and /metrics connections held, each")
    ap.add_argument("--fd-limit", type=int, default=400, help="descriptors of the second server, flooded past it")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    block = synthetic_generator(load_preset("tiny"), seed=0).samples(0, 8)
    results = header(streams=args.streams, queries_per_stream=args.queries_per_stream)
    with tempfile.TemporaryDirectory() as tmp:
        proc, target, ports = start_server(Path(tmp))
        try:
            ok, want = still_serving(target, block, None)
            held = held_connections(proc, target, block, want, ports, args.idle)
            limited = at_fd_limit(block, want, args.fd_limit, Path(tmp))
            body = one_maximal_body(target, block, ports)
            rss = {"start": rss_mb(proc.pid)}
            answers = malicious(target, block)
            alive_after_malicious = proc.poll() is None and still_serving(target, block, want)[0]
            rss["after_malicious"] = rss_mb(proc.pid)
            requests = [lab_request(block, query_id=k) for k in range(args.queries_per_stream)]
            answered, failed, seconds = asyncio.run(_streams(target, requests, args.streams))
            alive_after_streams = proc.poll() is None and still_serving(target, block, want)[0]
            time.sleep(2.0)  # the streams' state released
            rss["after_streams"] = rss_mb(proc.pid)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
            code = proc.wait(timeout=60)
    growth = max(rss.values()) - rss["start"]
    results.update(held_connections=held, maximal_body=body, at_fd_limit=limited)
    b_targets = {"memory": held["rss_growth_mb"] <= 200, "threads": held["thread_growth"] <= 50,
                 "served_while_held": held["answered_while_held"], "body_delay": body["worst_delay_ms"] <= 50,
                 "fd_limit": limited["late_http_answer"].startswith("HTTP/1.1 503") and limited["grpc_closed"] >= 20
                 and limited["served_the_client_it_had"],
                 "quiet_stop": limited["exit_code"] == 0 and not limited["traceback_after_stop"]}  # fmt: skip
    results["b_targets"] = b_targets
    print(
        f"{held['connections']:,} idle and slow connections held: RSS +{held['rss_growth_mb']:.0f} MB, threads "
        f"+{held['thread_growth']}, a query answered meanwhile: {held['answered_while_held']}"
    )
    print(
        f"a {body['body_mb']:.0f} MB JSON body (HTTP {body['body_status']}, {body['body_seconds']:.1f} s): small "
        f"gRPC queries p50 {body['alone_p50_ms']:.2f} ms alone, {body['during_p50_ms']:.2f} ms during it, worst "
        f"{body['during_max_ms']:.1f} ms (delay {body['worst_delay_ms']:.1f} ms)"
    )
    print(
        f"at {limited['fd_limit']} descriptors ({limited['per_protocol']} connections a protocol), flooded: a late "
        f"REST client got {limited['late_http_answer']!r}, gRPC closed {limited.get('grpc_closed', 0)} past its "
        f"share, the client it had served: {limited['served_the_client_it_had']}; SIGTERM with the flood open: "
        f"exit {limited['exit_code']}, traceback after: {limited['traceback_after_stop']}"
    )
    print("B targets: " + ", ".join(f"{k} {'met' if v else 'NOT met'}" for k, v in b_targets.items()))
    results.update(answers=answers, alive_after_malicious=alive_after_malicious, streams_answered=answered,
                   streams_failed=failed, streams_seconds=seconds, alive_after_streams=alive_after_streams,
                   rss_mb=rss, rss_growth_mb=growth, exit_code=code)  # fmt: skip
    # the rule: serve keeps serving with its RSS bounded; every stream answered in full is reported apart
    passed = alive_after_malicious and alive_after_streams and growth <= args.rss_growth_mb and code == 0
    results["passed"] = bool(passed)
    results["all_streams_answered"] = not failed and answered == args.streams * args.queries_per_stream
    for name, status in answers.items():
        print(f"  {name}: {status}")
    print(f"malicious: server alive {alive_after_malicious}; {args.streams} streams x {args.queries_per_stream}: "
          f"{answered:,} answered, streams failed {failed or 'none'} in {seconds:.1f} s; alive {alive_after_streams}; "
          "RSS "
          + ", ".join(f"{k} {v:.0f} MB" for k, v in rss.items()) + f" (grew {growth:.0f} MB); exit {code}")  # fmt: skip
    print(
        ("PASS: serve kept serving, its RSS bounded" if passed else "FAIL")
        + ("" if results["all_streams_answered"] else f"; NOT every stream answered in full ({failed})")
    )
    write_results(results_path("serve_abuse", args.out), results)
    sys.exit(0 if passed else 1)


if __name__ == "__main__":
    main()

"""Client/server inference over gRPC: what the network hop costs (issue 6's benchmark).

    python benchmarks/serve.py            # ~6 min on 2 cores
    python benchmarks/serve.py --quick    # shorter loads

Parts (each through the real CLI, `dlrm-lab serve` + `dlrm-lab client`, or the library):
  codec     serialisation throughput: the client's encoding and the server's decoding of
            packed payloads, MB/s and samples/s, at query sizes 1 to 1024 (in-process).
  sizes     transfer cost per query and per sample at query sizes 1 to 1024 on loopback:
            one closed-loop client (no queueing), the stage breakdown of every query.
  overhead  256-sample queries: loopback gRPC against in-process serving (`dlrm-lab infer
            run` at the same low open-loop rate): the extra latency over the compute time.
            Target: protocol and transfer overhead <= 20% of compute time.
  veth      the same 256-sample point with the server in another network namespace joined
            by a veth link (skipped with the reason where namespaces cannot be made).
  clients   equal samples/s two ways: 8 concurrent clients of 16-sample queries against 1
            client of 128-sample queries (iBench's comparison).
  loadgen   MLPerf LoadGen's Server scenario through the gRPC system under test.
  rpc       256-sample queries, one InferStream per client (`--rpc stream`, the default)
            against one Infer call per query (`--rpc unary`) and one ModelInfer call per query of
            the Open Inference Protocol (`--rpc oip`, issue 33): closed loop and open loop at
            20 queries/s, runs interleaved, medians of 3 (issue 15: transfer <= 20% of compute).
            `--only rpc` runs this part alone.
  triton    our client against NVIDIA's `tritonclient` (gRPC, from its cached venv), the same 256-sample
            requests to the same server over the Open Inference Protocol, one at a time for `--duration`
            each: `infer run --target kserve://... --scenario closed-loop` against tritonclient's own
            perf_counter around `client.infer()`, interleaved, medians of 3 (issue 33: within 10%).
            `--only triton` runs this part alone.
  rest      the transfer share at 256 samples over the Open Inference Protocol's HTTP/REST binding next to its
            gRPC one (issue 47): `infer run --target kserve://...` (gRPC), `http://...` with binary tensors (rpc
            rest, Triton's extension) and with JSON tensors (rpc rest-json), one `serve --http-port` answering all
            three; closed loop and open loop at 20 queries/s, runs interleaved, medians of 3. `--only rest` runs
            this part alone (`--samples N --repeats 1 --quick` checks it at a small size).
The model is the Criteo Kaggle shape with tables capped at 100k rows, one instance.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
from common import child_failed, header, results_path, write_results

MODEL = ["--preset", "kaggle", "--max-rows", "100000"]
SERVER = [*MODEL, "--instances", "1", "--threads", "1", "--max-batch", "1024", "--max-delay-ms", "0.5"]
SIZES = (1, 4, 16, 64, 256, 1024)


def codec(repeats: int) -> list[dict[str, Any]]:
    import dlrm_lab
    from dlrm_lab.data import synthetic_generator
    from dlrm_lab.serve.protocol import decode_samples, encode_samples, pb

    spec = dlrm_lab.load_preset("kaggle", max_rows=100_000)
    block = synthetic_generator(spec, seed=0).samples(0, max(SIZES))
    rows = []
    for n in SIZES:
        part = block.slice(0, n)
        enc, dec = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            dense, lengths, ids = encode_samples(part.dense, part.lengths, part.values)
            req = pb.InferRequest(model="kaggle", query_id=1, samples=n, dense=dense, lengths=lengths, ids=ids)
            wire = req.SerializeToString()
            t1 = time.perf_counter()
            decode_samples(pb.InferRequest.FromString(wire), spec)
            t2 = time.perf_counter()
            enc.append(t1 - t0)
            dec.append(t2 - t1)
        e, d = statistics.median(enc), statistics.median(dec)
        rows.append({"samples": n, "bytes": len(wire), "encode_us": e * 1e6, "decode_us": d * 1e6,
                     "encode_mb_per_s": len(wire) / e / 1e6, "decode_mb_per_s": len(wire) / d / 1e6,
                     "encode_samples_per_s": n / e, "decode_samples_per_s": n / d})  # fmt: skip
        print(f"  codec {n:>5} samples, {len(wire):>8,} B: encode {e * 1e6:8.1f} us, decode {d * 1e6:8.1f} us",
              flush=True)  # fmt: skip
    return rows


class Server:
    def __init__(self, root: Path, prefix: list[str] | None = None, host: str = "127.0.0.1", *extra: str) -> None:
        self.log = root / "server.log"
        root.mkdir(parents=True, exist_ok=True)
        cmd = [*(prefix or []), sys.executable, "-m", "dlrm_lab", "serve", *SERVER, "--host", host, "--port", "0",
               "--metrics-dir", str(root), *extra]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(self.log, "w"), start_new_session=True)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            # the start line, "serving MODELS on HOST:PORT" (not a plan line that says "serving ... on ...")
            hits = [ln for ln in self.log.read_text().splitlines() if ln.startswith("serving ") and " on " in ln]
            if hits:
                self.target = hits[0].split(" on ")[1].strip()
                rest = [ln for ln in self.log.read_text().splitlines() if "HTTP/REST on " in ln]
                self.http = rest[0].split(" on ")[1].strip() if rest else None  # `serve --http-port`
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise SystemExit(f"server did not start:\n{self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)


def client(root: Path, target: str, *args: str) -> dict[str, Any]:
    out = root / f"client-{len(list(root.glob('client-*')))}"
    cmd = [sys.executable, "-m", "dlrm_lab", "client", "--target", target, "--metrics-dir", str(out), *args]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0 and not list(out.glob("*/summary.parquet")):  # 1 with a summary: LoadGen said INVALID
        raise child_failed(f"client {' '.join(args)}", done)
    (run_dir,) = [p for p in out.iterdir() if p.is_dir()]
    (summary,) = pq.read_table(run_dir / "summary.parquet").to_pylist()
    return summary


KEYS = ("queries_per_s", "samples_per_s", "latency_p50_ms", "latency_p99_ms", "latency_mean_ms", "round_trip_p50_ms",
        "compute_mean_ms", "transfer_mean_ms", "transfer_per_sample_us", "transfer_share",
        "transfer_to_compute", "serialise_mean_ms", "network_mean_ms", "server_parse_mean_ms", "queue_mean_ms",
        "server_respond_mean_ms", "deserialise_mean_ms", "request_bytes_mean", "failed_queries", "dropped_queries",
        "loadgen_result", "loadgen_queries_per_s", "loadgen_p99_ms")  # fmt: skip


def pick(summary: dict[str, Any]) -> dict[str, Any]:
    return {k: summary.get(k) for k in KEYS}


def in_process(root: Path, qps: float, size: int, duration: float) -> dict[str, Any]:
    out = root / f"inproc-{size}"
    args = ["infer", "run", *SERVER, "--query-size", f"fixed:{size}", "--qps", str(qps), "--duration", str(duration),
            "--sla-ms", "100", "--metrics-dir", str(out)]  # fmt: skip
    done = subprocess.run([sys.executable, "-m", "dlrm_lab", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise child_failed("infer run", done)
    (run_dir,) = [p for p in out.iterdir() if p.is_dir()]
    (row,) = pq.read_table(run_dir / "summary.parquet").to_pylist()
    q = pq.read_table(run_dir / "queries.parquet", columns=["latency_ms", "compute_ms", "status"]).to_pandas()
    q = q[q.status == "ok"]
    return {"latency_mean_ms": float(q.latency_ms.mean()), "latency_p50_ms": row["latency_p50_ms"],
            "latency_p99_ms": row["latency_p99_ms"], "compute_mean_ms": float(q.compute_ms.mean()),
            "queries_per_s": row["queries_per_s"]}  # fmt: skip


def rpc_compare(root: Path, target: str, duration: str, repeats: int = 3) -> dict[str, Any]:
    """Stream, unary and the Open Inference Protocol at 256 samples per query, interleaved; medians of `repeats`."""
    loads = {"closed": ["--closed-loop"], "open_20": ["--qps", "20"]}
    rpcs = ("stream", "unary", "oip")
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {load: {rpc: [] for rpc in rpcs} for load in loads}
    for _ in range(repeats):
        for load, how in loads.items():
            for rpc in rpcs:
                runs[load][rpc].append(pick(client(root, target, *how, "--query-size", "fixed:256", "--duration",
                                                   duration, "--rpc", rpc)))  # fmt: skip
    out: dict[str, Any] = {}
    for load, by_rpc in runs.items():
        for rpc, rows in by_rpc.items():
            med = {k: statistics.median(r[k] for r in rows) for k in KEYS if isinstance(rows[0][k], (int, float))}
            out[f"{load}_{rpc}"] = {**med, "transfer_to_compute_runs": [r["transfer_to_compute"] for r in rows]}
            each = [round(r["transfer_to_compute"], 3) for r in rows]
            print(f"  rpc {rpc:>6} {load:>7}: transfer/compute {med['transfer_to_compute']:.3f} (runs {each}), "
                  f"network+gRPC {med['network_mean_ms']:.3f} ms, compute {med['compute_mean_ms']:.3f} ms, "
                  f"p99 {med['latency_p99_ms']:.2f} ms", flush=True)  # fmt: skip
    return out


def rest_compare(root: Path, server: Server, duration: str, samples: int = 256, repeats: int = 3) -> dict[str, Any]:
    """The Open Inference Protocol over gRPC, REST with binary tensors and REST with JSON ones, `samples` per query,
    interleaved through `infer run`; medians of `repeats` (issue 47: the REST transfer share next to gRPC's)."""
    targets = {"grpc": f"kserve://{server.target}/kaggle", "rest": f"http://{server.http}/kaggle",
               "rest-json": f"http://{server.http}/kaggle"}  # fmt: skip
    loads = {"closed": ["--scenario", "closed-loop"], "open_20": ["--qps", "20"]}
    runs: dict[str, list[dict[str, Any]]] = {f"{load}_{way}": [] for load in loads for way in targets}
    for k in range(repeats):
        for load, how in loads.items():
            for way, target in targets.items():
                out = root / f"rest-{load}-{way}-{k}"
                cmd = [sys.executable, "-m", "dlrm_lab", "infer", "run", *MODEL, "--target", target, *how,
                       "--query-size", f"fixed:{samples}", "--duration", duration, "--sla-ms", "1000",
                       "--no-progress", "--metrics-dir", str(out)]  # fmt: skip
                cmd += ["--rpc", way] if way != "grpc" else []
                done = subprocess.run(cmd, capture_output=True, text=True)
                if done.returncode != 0:
                    raise child_failed(f"infer run ({way}, {load})", done)
                (run_dir,) = [p for p in out.iterdir() if p.is_dir()]
                (summary,) = pq.read_table(run_dir / "summary.parquet").to_pylist()
                runs[f"{load}_{way}"].append(pick(summary))
    out: dict[str, Any] = {"samples": samples, "repeats": repeats}
    for key, rows in runs.items():
        med = {k: statistics.median(r[k] for r in rows) for k in KEYS if isinstance(rows[0][k], (int, float))}
        out[key] = {**med, "transfer_share_runs": [r["transfer_share"] for r in rows]}
        print(f"  {key:>17}: transfer share {med['transfer_share']:.3f}, transfer {med['transfer_mean_ms']:.3f} ms "
              f"(serialise {med['serialise_mean_ms']:.3f}, network {med['network_mean_ms']:.3f}, parse "
              f"{med['server_parse_mean_ms']:.3f}), compute {med['compute_mean_ms']:.3f} ms, "
              f"{med['request_bytes_mean']:,.0f} B a request", flush=True)  # fmt: skip
    return out


ECHO_SERVER = """
import asyncio, sys, grpc
from dlrm_lab.serve.protocol import CHANNEL_OPTIONS
async def main():
    server = grpc.aio.server(options=CHANNEL_OPTIONS)
    async def echo(requests, context):
        async for body in requests:
            yield body[: int(sys.argv[1])]
    stream = grpc.stream_stream_rpc_method_handler(echo)
    handler = grpc.method_handlers_generic_handler("floor.Echo", {"Stream": stream})
    server.add_generic_rpc_handlers((handler,))
    print(server.add_insecure_port("127.0.0.1:0"), flush=True)
    await server.start()
    await server.wait_for_termination()
asyncio.run(main())
"""


def grpc_floor(request_bytes: int, response_bytes: int, gap_s: float, queries: int = 150) -> float:
    """Median round trip (ms) of one stream's messages through an echo server (grpc.aio, its own process)
    that does nothing but answer: what the transport costs on this host at this size and pace."""
    import queue

    import grpc

    from dlrm_lab.serve.protocol import CHANNEL_OPTIONS

    proc = subprocess.Popen([sys.executable, "-c", ECHO_SERVER, str(response_bytes)], stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())
        outbox: queue.Queue[bytes | None] = queue.Queue()
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS) as channel:
            answers = channel.stream_stream("/floor.Echo/Stream")(iter(outbox.get, None))
            body, times = bytes(request_bytes), []
            for _ in range(queries):
                t0 = time.perf_counter()
                outbox.put(body)
                next(answers)
                times.append((time.perf_counter() - t0) * 1e3)
                time.sleep(gap_s)
            outbox.put(None)
        return statistics.median(times[10:])
    finally:
        proc.kill()
        proc.wait()


TRITON_LOOP = """
import json, sys, time
import numpy as np
import tritonclient.grpc as tc
target, seconds, paths = sys.argv[1], float(sys.argv[2]), sys.argv[3:]
client = tc.InferenceServerClient(url=target)
blocks = [np.load(p, allow_pickle=True).item() for p in paths]
def request(block):
    inputs = []
    for name, dtype in (("dense", "FP32"), ("lengths", "INT32"), ("ids", "INT64")):
        t = tc.InferInput(name, list(block[name].shape), dtype)
        t.set_data_from_numpy(block[name])
        inputs.append(t)
    return inputs
for block in blocks[:3]:
    client.infer("kaggle", request(block))  # warm-up
times, k, end = [], 0, time.perf_counter() + seconds
while time.perf_counter() < end:
    block = blocks[k % len(blocks)]
    t0 = time.perf_counter()
    scores = client.infer("kaggle", request(block), outputs=[tc.InferRequestedOutput("scores")]).as_numpy("scores")
    times.append((time.perf_counter() - t0) * 1e3)
    k += 1
print(json.dumps({"latency_ms": times}))
"""


def triton_compare(root: Path, target: str, duration: str, repeats: int = 3) -> dict[str, Any]:
    """Our client against tritonclient's own timing of the same 256-sample requests, one at a time."""
    import numpy as np

    import dlrm_lab
    from dlrm_lab.data import synthetic_generator

    # the venv `tests/test_serve.py` makes (`_third_party_python("tritonclient[grpc,http]==2.73.0")`), where it makes it
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    python = cache / "dlrm-lab" / "venvs" / "tritonclient-grpc-http-2.73.0" / "bin" / "python"
    if not python.exists():
        return {"skipped": f"no tritonclient venv at {python} (tests/test_serve.py makes it)"}
    spec = dlrm_lab.load_preset("kaggle", max_rows=100_000)
    library = synthetic_generator(spec, seed=0).samples(0, 256 * 16)  # the server's library seed is 0
    paths = []
    for k in range(16):
        block = library.slice(256 * k, 256 * (k + 1))
        arrays = {"dense": np.ascontiguousarray(block.dense, dtype=np.float32),
                  "lengths": np.stack([np.asarray(x, dtype=np.int32) for x in block.lengths]),
                  "ids": np.concatenate([np.asarray(x, dtype=np.int64) for x in block.values])}  # fmt: skip
        paths.append(str(root / f"block-{k}.npy"))
        np.save(paths[-1], arrays, allow_pickle=True)
    ours, theirs = [], []
    for _ in range(repeats):  # interleaved
        out = root / f"ours-{len(ours)}"
        cmd = [sys.executable, "-m", "dlrm_lab", "infer", "run", *MODEL, "--target", f"kserve://{target}/kaggle",
               "--scenario", "closed-loop", "--query-size", "fixed:256", "--duration", duration, "--sla-ms", "1000",
               "--no-progress", "--metrics-dir", str(out)]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise child_failed("infer run --target", done)
        (run_dir,) = [p for p in out.iterdir() if p.is_dir()]
        q = pq.read_table(run_dir / "queries.parquet").to_pandas()
        lat = q.latency_ms[q.point == 0]
        ours.append({"p50_ms": float(lat.median()), "mean_ms": float(lat.mean()), "queries": len(lat)})
        done = subprocess.run([str(python), "-c", TRITON_LOOP, target, duration, *paths], capture_output=True,
                              text=True)  # fmt: skip
        if done.returncode != 0:
            raise child_failed("tritonclient", done)
        t = np.array(json.loads(done.stdout.strip().splitlines()[-1])["latency_ms"])
        theirs.append({"p50_ms": float(np.median(t)), "mean_ms": float(t.mean()), "queries": len(t)})
        print(f"  ours p50 {ours[-1]['p50_ms']:.3f} ms ({ours[-1]['queries']} queries), tritonclient p50 "
              f"{theirs[-1]['p50_ms']:.3f} ms ({theirs[-1]['queries']})", flush=True)  # fmt: skip
    med = {who: {k: statistics.median(r[k] for r in runs) for k in ("p50_ms", "mean_ms")}
           for who, runs in (("ours", ours), ("tritonclient", theirs))}  # fmt: skip
    ratio = {k: med["ours"][k] / med["tritonclient"][k] for k in ("p50_ms", "mean_ms")}
    print(f"  ours / tritonclient: p50 {ratio['p50_ms']:.3f}, mean {ratio['mean_ms']:.3f}", flush=True)
    return {"ours": ours, "tritonclient": theirs, "median": med, "ours_over_tritonclient": ratio}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", choices=["rpc", "triton", "rest"], help="run one part alone")
    parser.add_argument("--samples", type=int, default=256, help="rest: samples per query")
    parser.add_argument("--repeats", type=int, default=3, help="rest: interleaved repeats")
    parser.add_argument(
        "--json", type=Path, help="results file (default: results/results-serve[-PART]-DATE.json, canary beside)"
    )
    args = parser.parse_args()
    duration = "3" if args.quick else "8"
    results: dict[str, Any] = header()
    if args.only == "triton":
        with tempfile.TemporaryDirectory() as tmp_dir:
            server = Server(Path(tmp_dir) / "loopback")
            try:
                results["triton_256"] = triton_compare(Path(tmp_dir), server.target, duration)
            finally:
                server.stop()
        write_results(results_path(f"serve-{args.only}", args.json), results)
        return
    if args.only == "rest":
        with tempfile.TemporaryDirectory() as tmp_dir:
            server = Server(Path(tmp_dir) / "loopback", None, "127.0.0.1", "--http-port", "0")
            try:
                results["rest"] = rest_compare(Path(tmp_dir), server, duration, args.samples, args.repeats)
            finally:
                server.stop()
        write_results(results_path(f"serve-{args.only}", args.json), results)
        return
    if args.only == "rpc":
        with tempfile.TemporaryDirectory() as tmp_dir:
            server = Server(Path(tmp_dir) / "loopback")
            try:
                results["rpc_256"] = rpc = rpc_compare(Path(tmp_dir), server.target, duration)
            finally:
                server.stop()
        # the transport's own floor at the same sizes and paces: a 256-sample request, a 256-score answer
        request = int(rpc["closed_stream"]["request_bytes_mean"])
        for load, gap in (("closed", 0.0), ("open_20", 0.05)):
            floor = grpc_floor(request, 4 * 256, gap)
            compute = rpc[f"{load}_stream"]["compute_mean_ms"]
            rpc[f"{load}_grpc_floor"] = {"round_trip_ms": floor, "over_compute": floor / compute}
            print(f"  gRPC floor {load:>7}: echo round trip {floor:.3f} ms ({request:,} B request) = "
                  f"{floor / compute:.3f} of the compute", flush=True)  # fmt: skip
        write_results(results_path(f"serve-{args.only}", args.json), results)
        return
    print("codec (in-process):", flush=True)
    results["codec"] = codec(20 if args.quick else 100)
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        server = Server(tmp / "loopback")
        try:
            results["sizes"] = []
            for n in SIZES:
                s = pick(client(tmp, server.target, "--closed-loop", "--query-size", f"fixed:{n}", "--duration",
                                duration))  # fmt: skip
                results["sizes"].append({"samples": n, **s})
                line = (f"  loopback {n:>5} samples: round trip {s['round_trip_mean_ms']:.3f} ms, transfer "
                        f"{s['transfer_mean_ms']:.3f} ms ({s['transfer_per_sample_us']:.2f} us/sample), compute "
                        f"{s['compute_mean_ms']:.3f} ms, transfer/compute {s['transfer_to_compute']:.3f}")  # fmt: skip
                print(line, flush=True)
            qps = "20"
            grpc_256 = pick(client(tmp, server.target, "--qps", qps, "--query-size", "fixed:256", "--duration",
                                   duration))  # fmt: skip
            results["clients"] = {
                "8x16": pick(client(tmp, server.target, "--concurrency", "8", "--qps", "400", "--query-size",
                                    "fixed:16", "--duration", duration)),
                "1x128": pick(client(tmp, server.target, "--concurrency", "1", "--qps", "50", "--query-size",
                                     "fixed:128", "--duration", duration)),
            }  # fmt: skip
            print("  clients:", json.dumps(results["clients"], default=str), flush=True)
            results["loadgen_server"] = pick(client(tmp, server.target, "--scenario", "server", "--qps", "50",
                                                    "--query-size", "fixed:16", "--duration", duration,
                                                    "--sla-ms", "20"))  # fmt: skip
            print("  loadgen:", json.dumps(results["loadgen_server"], default=str), flush=True)
            results["rpc_256"] = rpc_compare(tmp, server.target, duration)
        finally:
            server.stop()
        inproc = in_process(tmp, float(qps), 256, float(duration))
        extra = grpc_256["latency_mean_ms"] - inproc["latency_mean_ms"]
        results["overhead_256"] = {"grpc": grpc_256, "in_process": inproc, "extra_latency_ms": extra,
                                   "extra_over_compute": extra / inproc["compute_mean_ms"],
                                   "transfer_over_compute": grpc_256["transfer_to_compute"]}  # fmt: skip
        print("  256 samples, loopback vs in-process:", json.dumps(results["overhead_256"], default=str), flush=True)
        from dlrm_lab.serve.netns import VethLink

        why = VethLink.available()
        if why is None:
            with VethLink("dlrm-lab-bench", server_ip="10.233.0.1", client_ip="10.233.0.2") as link:
                remote = Server(tmp / "veth", prefix=link.prefix(), host=link.server_ip)
                try:
                    results["veth_256"] = pick(client(tmp, remote.target, "--qps", qps, "--query-size", "fixed:256",
                                                      "--duration", duration))  # fmt: skip
                    results["veth_sizes"] = []
                    for n in (1, 64, 1024):
                        s = pick(client(tmp, remote.target, "--closed-loop", "--query-size", f"fixed:{n}",
                                        "--duration", duration))  # fmt: skip
                        results["veth_sizes"].append({"samples": n, **s})
                finally:
                    remote.stop()
            print("  veth 256:", json.dumps(results["veth_256"], default=str), flush=True)
        else:
            results["veth_skipped"] = why
            print(f"  veth skipped: {why}", flush=True)
    write_results(results_path("serve", args.json), results)


if __name__ == "__main__":
    main()

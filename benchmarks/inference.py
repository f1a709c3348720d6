"""Latency-bounded inference throughput on this machine (issue 5's benchmark).

    python benchmarks/inference.py            # all parts, ~20 min on 2 cores
    python benchmarks/inference.py --quick    # fewer configurations, ~12 min

Parts, each a real `dlrm-lab infer search` (closed-loop capacity, then bisection on the
open-loop rate, p99 <= 10 ms decided by the median of repeats):
  rm2  rm2 scaled to 10% rows (50k per table, 410 MB), queries of 1 and of 8 samples:
       (a) batch 1, one instance; (b) best batching, one instance; (c) best batching and
       co-location. Target (c) >= 10 x (a) in samples/s.
  kaggle  the Criteo Kaggle shape with MLPerf query sizes (100-700 samples), bf16 dense:
       the best layout and batching. Target >= 70k samples/s under p99 <= 10 ms.
  loadgen  the kaggle winner searched again with our open loop and with MLPerf LoadGen's
       Server scenario as the load, under --loadgen-sla-ms: the two latency-bounded rates
       should agree within 10%.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
from common import child_failed, header, results_path, write_results

# rm2 queries are single user-item requests: batching must come from the server. (With
# 8-sample queries batch 1 means 8 sequential pieces, ~19 ms: (a) meets no 10 ms bound.)
RM2_SIZES = ("fixed:1",)


def search(tmp: Path, *args: str) -> list[dict[str, Any]]:
    root = tmp / f"search-{len(list(tmp.iterdir()))}"
    cmd = [sys.executable, "-m", "dlrm_lab", "infer", "search", "--metrics-dir", str(root), *args]
    print("$", " ".join(cmd[2:]), flush=True)
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise child_failed("dlrm-lab " + " ".join(cmd[3:5]), out)
    (run_dir,) = [p for p in root.iterdir() if p.is_dir()]
    rows = pq.read_table(run_dir / "frontier.parquet").to_pylist()
    for r in rows:
        print(
            f"  {r['instances']}x{r['threads_per_instance']} batch {r['max_batch']:>5} delay {r['max_delay_ms']:g} ms: "
            f"{r['best_qps']:8.1f} +/- {r['best_qps_uncertainty']:.1f} queries/s, "
            f"{r['best_samples_per_s']:9.0f} samples/s (capacity {r['capacity_queries_per_s']:.1f} q/s)",
            flush=True,
        )
    return rows


def best(rows: list[dict[str, Any]]) -> dict[str, Any]:
    return max(rows, key=lambda r: r["best_samples_per_s"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--parts", default="rm2,kaggle,loadgen")
    ap.add_argument(
        "--loadgen-sla-ms", type=float, default=30.0,
        help="bound of the LoadGen-vs-open-loop comparison (at 10 ms no kaggle rate passes on 2 cores)",
    )  # fmt: skip
    ap.add_argument("--out", default=None, help="JSON results file (default: results/results-inference-DATE.json)")
    args = ap.parse_args()
    parts = args.parts.split(",")
    probe = ["--duration", "2", "--repeats", "2", "--steps", "6",
             "--capacity-duration", "2", "--sla-ms", "10", "--percentile", "99"]  # fmt: skip
    results: dict[str, Any] = header(probe=probe)
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        if "rm2" in parts:
            batches = "16,64" if args.quick else "16,64,256"
            results["rm2"] = {}
            for sizes in RM2_SIZES:
                rm2 = ["--model", "rm2", "--table-scale", "0.1", "--query-size", sizes, *probe]
                a = search(tmp, *rm2, "--layouts", "1x1", "--max-batch", "1", "--max-delay-ms", "0")
                b = search(tmp, *rm2, "--layouts", "1x1", "--max-batch", batches, "--max-delay-ms", "0.5,2")
                layouts = "2x1" if args.quick else "2x1,1x2"
                c = search(tmp, *rm2, "--layouts", layouts, "--max-batch", batches, "--max-delay-ms", "0.5,2")
                ra, rb, rc = best(a), best(b), best(c)
                entry = {
                    "a_batch1_one_instance": ra,
                    "b_best_batching_one_instance": rb,
                    "c_best_batching_colocated": rc,
                    "b_over_a": rb["best_samples_per_s"] / ra["best_samples_per_s"],
                    "c_over_a": rc["best_samples_per_s"] / ra["best_samples_per_s"],
                    "frontier": a + b + c,
                }
                results["rm2"][sizes] = entry
                print(f"rm2 {sizes}: (b)/(a) {entry['b_over_a']:.2f}x, (c)/(a) {entry['c_over_a']:.2f}x", flush=True)
        kaggle = ["--model", "kaggle", "--table-scale", "0.1", "--query-size", "mlperf", "--precision", "bf16"]
        if "kaggle" in parts or "loadgen" in parts:
            batches = "1024,2048" if args.quick else "1024,2048,4096"
            k = search(tmp, *kaggle, *probe, "--layouts", "2x1,1x2", "--max-batch", batches, "--max-delay-ms", "1,3")
            rk = best(k)
            results["kaggle"] = {"best": rk, "frontier": k, "target_samples_per_s": 70_000}
            print(f"kaggle: {rk['best_samples_per_s']:.0f} samples/s under p99 <= 10 ms")
        if "loadgen" in parts:
            layout = f"{rk['instances']}x{rk['threads_per_instance']}"
            same = [
                "--layouts",
                layout,
                "--max-batch",
                str(rk["max_batch"]),
                "--max-delay-ms",
                f"{rk['max_delay_ms']:g}",
            ]
            bound = ["--sla-ms", f"{args.loadgen_sla_ms:g}"]  # after probe's: the last --sla-ms wins
            open_loop = best(search(tmp, *kaggle, *probe, *same, *bound))
            loadgen = best(search(tmp, *kaggle, *probe, *same, *bound, "--scenario", "server"))
            ratio = loadgen["best_qps"] / open_loop["best_qps"] if open_loop["best_qps"] else None
            results["loadgen_vs_open_loop"] = {"open_loop": open_loop, "loadgen_server": loadgen, "ratio": ratio}
            print(f"LoadGen Server / open loop latency-bounded rate: {ratio:.3f}")
    write_results(results_path("inference", args.out), results)


if __name__ == "__main__":
    main()

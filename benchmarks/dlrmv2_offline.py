"""MLPerf's DLRMv2 shape served Offline (issue 31, part 5): samples/s per core beside the roof.

    python benchmarks/dlrmv2_offline.py --checkpoint DIR [--table-scale 0.05] [--duration 30] [--repeats 2]

`dcnv2` (MLPerf DLRMv2: 26 tables of dim 128, DCNv2 cross layers, the 13-feature dense tower), tables
scaled by `--table-scale` to fit the machine, served from a checkpoint `train --checkpoint-dir` wrote for
that shape (without one: the untrained model, said in the output), MLPerf DLRMv2's query sizes (its quantile
table: 100-700 samples, mean 270), LoadGen's Offline scenario, one instance per core x 1 thread,
`--precision auto`, `--build auto`, `--max-batch auto` (Offline has no bound: the batch that amortises its fixed
cost), int8 and fp32 tables alternated. Reported per run: samples/s, queries/s (an MLPerf DLRM "sample" is one of
our queries) per core, the fraction of the roof, and Intel's published ~72 per core (MLPerf Inference v4.0-v5.1, int8 on
AMX, full tables) beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
from common import header, lab_run, results_path, write_results

INTEL_PER_CORE = 72.0  # MLPerf DLRMv2 Offline "samples" (queries) per second per core, Intel's submissions


def run(tmp: Path, table_precision: str, args: argparse.Namespace, cores: int) -> dict[str, Any]:
    checkpoint = ["--checkpoint", args.checkpoint] if args.checkpoint else []
    run_dir = lab_run(tmp, "infer", "run", "--model", "dcnv2", "--table-scale", str(args.table_scale), *checkpoint,
                      "--query-size", "mlperf", "--scenario", "offline", "--qps", str(args.qps), "--duration",
                      str(args.duration), "--instances", str(cores), "--threads", "1", "--table-precision",
                      table_precision, "--max-batch", args.max_batch)  # fmt: skip
    (row,) = pq.read_table(run_dir / "summary.parquet").to_pylist()
    keep = {k: row.get(k) for k in ("samples_per_s", "queries_per_s", "loadgen_result", "loadgen_queries_per_s",
                                    "roofline_fraction", "roofline_bound", "precision", "build", "batch_fixed_ms",
                                    "batch_per_sample_us", "achieved_flops_per_s", "max_batch", "canary_ratio",
                                    "canary_phase")}  # fmt: skip
    manifest = json.loads((run_dir / "manifest.json").read_text())
    choice = manifest.get("precision_choices", {}).get("dcnv2", {}).get("build_choice") or {}
    keep["build_choice"] = {k: choice.get(k) for k in ("build", "reason", "batch_ms", "skipped", "lookup")}
    keep["accuracy"] = {k: (choice.get("accuracy") or {}).get(k) for k in ("passed", "labels", "auc", "auc_fp32",
                                                                           "passes_99_9", "passes_99")}  # fmt: skip
    keep["mean_query_samples"] = row["samples_per_s"] / row["queries_per_s"] if row.get("queries_per_s") else None
    keep["queries_per_s_per_core"] = row["queries_per_s"] / cores
    keep["samples_per_s_per_core"] = row["samples_per_s"] / cores
    print(f"  tables {table_precision}: {row['samples_per_s']:,.0f} samples/s, {keep['queries_per_s_per_core']:.2f} "
          f"queries/s per core (Intel ~{INTEL_PER_CORE:g}), roofline fraction {row.get('roofline_fraction')}, "
          f"bound {row.get('roofline_bound')}, precision {row['precision']}, build {row['build']}, LoadGen "
          f"{row['loadgen_result']}", flush=True)  # fmt: skip
    return keep


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--table-scale", type=float, default=0.05)
    ap.add_argument("--duration", type=float, default=30.0)
    # LoadGen's Offline issues qps x duration x 1.1 queries at once: above the rate served, or the run ends early
    ap.add_argument("--qps", type=float, default=300.0, help="LoadGen's expected Offline queries/s")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--checkpoint", help="a `train --preset dcnv2 --table-scale S --checkpoint-dir` directory")
    ap.add_argument("--max-batch", default="auto")
    ap.add_argument("--out", default=None, help="the results file (default results/results-dlrmv2_offline-<date>.json)")
    args = ap.parse_args()
    cores = len(os.sched_getaffinity(0))
    t0 = time.time()
    if not args.checkpoint:
        print("no --checkpoint: serving an untrained dcnv2 (reduced precision judged on its own ranking)")
    out: dict[str, Any] = {"header": header(table_scale=args.table_scale, cores=cores, duration_s=args.duration,
                                            checkpoint=args.checkpoint, max_batch=args.max_batch),
                           "runs": {"int8": [], "fp32": []}}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.repeats):  # interleaved
            for tp in out["runs"]:
                out["runs"][tp].append(run(Path(tmp), tp, args, cores))
    out["median_queries_per_s_per_core"] = {
        tp: statistics.median(r["queries_per_s_per_core"] for r in runs) for tp, runs in out["runs"].items()
    }
    out["wall_s"] = time.time() - t0
    print(f"median queries/s per core: {out['median_queries_per_s_per_core']} (Intel ~{INTEL_PER_CORE:g})")
    write_results(results_path("dlrmv2_offline", args.out), out)


if __name__ == "__main__":
    main()

"""Machine peaks and where the lab's benchmark runs sit on the roofline (issue 7's benchmark).

    python benchmarks/roofline.py            # full probe, training and inference points, ~6 min
    python benchmarks/roofline.py --quick    # quick probe, shorter runs

Steps, each through the real CLI so that what is recorded is what users get:
  1. `dlrm-lab machine probe` (stored under this machine's fingerprint, where later runs
     find it), then a 2-rank `--comms-only` probe for gloo's collectives.
  2. The foundation's training benchmark configuration (kaggle, tables capped at 1M rows,
     batch 2048, default row-wise Adagrad, fp32 and bf16) and its 2-rank weak-scaling point.
  3. The inference lab's best point (rm2 at 10% rows, 1-sample queries, one instance,
     max batch 16, delay 0.5 ms, 900 queries/s).
Each run's summary gives achieved FLOP/s and bytes/s, the roofline bound, the fraction of
it achieved and the bounding resource.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
from common import child_failed, header, write_results

from dlrm_lab.metrics.roofline import ROOFLINE_COLUMNS, load_profile

COLUMNS = (
    "samples_per_s",
    "achieved_flops_per_s",
    "achieved_bytes_per_s",
    *ROOFLINE_COLUMNS,
    "step_time_ms_mean",
    "batch_compute_mean_ms",
    "batch_samples_mean",
    "latency_p99_ms",
    "energy_per_sample_j",
    "energy_unavailable",
)


def cli(*args: str) -> str:
    cmd = [sys.executable, "-m", "dlrm_lab", *args]
    print("$ dlrm-lab", " ".join(args), flush=True)
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise child_failed("dlrm-lab " + " ".join(cmd[3:5]), out)
    return out.stdout


def summary(root: Path) -> list[dict[str, Any]]:
    (run_dir,) = [p for p in root.iterdir() if p.is_dir()]
    rows = pq.read_table(run_dir / "summary.parquet").to_pylist()
    for r in rows:
        fraction = r.get("roofline_fraction")
        gflops, gbytes = (r.get("achieved_flops_per_s") or 0) / 1e9, (r.get("achieved_bytes_per_s") or 0) / 1e9
        print(
            f"  {r.get('samples_per_s') or 0:,.0f} samples/s, {gflops:.1f} GFLOP/s, {gbytes:.2f} GB/s of rows; "
            f"bound {r.get('roofline_bound_ms') or 0:.3f} ms ({r.get('roofline_bound_by')}), "
            f"fraction {fraction if fraction is None else round(fraction, 3)}",
            flush=True,
        )
    return [{k: r.get(k) for k in COLUMNS} for r in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--skip-probe", action="store_true", help="use the stored machine profile")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    quick = ["--quick"] if args.quick else []
    results: dict[str, Any] = header()
    if not args.skip_probe:
        print(cli("machine", "probe", *quick))
        print(cli("launch", "--nproc", "2", "--", "machine", "probe", "--comms-only", *quick))
    results["profile"] = load_profile()
    steps = "25" if args.quick else "60"
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        kaggle = ["--preset", "kaggle", "--max-rows", "1000000", "--batch-size", "2048", "--steps", steps,
                  "--eval-batches", "1", "--no-progress"]  # fmt: skip
        for precision in ("fp32", "bf16"):
            root = tmp_path / f"train-{precision}"
            cli("train", *kaggle, "--precision", precision, "--metrics-dir", str(root))
            results[f"train_kaggle_{precision}"] = summary(root)
        root = tmp_path / "train-2ranks"
        cli("launch", "--nproc", "2", "--", "train", *kaggle, "--metrics-dir", str(root))
        results["train_kaggle_fp32_2ranks"] = summary(root)
        root = tmp_path / "infer-rm2"
        cli("infer", "run", "--model", "rm2", "--table-scale", "0.1", "--query-size", "fixed:1", "--qps", "900",
            "--duration", "5" if args.quick else "15", "--instances", "1", "--max-batch", "16", "--max-delay-ms", "0.5",
            "--sla-ms", "10", "--metrics-dir", str(root))  # fmt: skip
        results["infer_rm2_best_batching"] = summary(root)
    if args.json:
        write_results(args.json, results)
        print(f"results in {args.json}")


if __name__ == "__main__":
    main()

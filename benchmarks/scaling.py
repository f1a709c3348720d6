"""Training scaling on this machine: weak and strong efficiency at 1 and 2 ranks, and step
time with phase shares by sharding type.

    python benchmarks/scaling.py                 # medians of 3 sweeps
    python benchmarks/scaling.py --quick

Each point is a real `dlrm-lab scale` sweep (torchrun, gloo, 1 thread per rank, every rank
pinned to its own core with its data thread). Rates are global samples/s after warm-up.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
from common import child_failed, header, write_results

from dlrm_lab.config import SHARDING_TYPES
from dlrm_lab.metrics.columns import PHASES


def cli(*args: str) -> None:
    out = subprocess.run([sys.executable, "-m", "dlrm_lab", *args], capture_output=True, text=True)
    if out.returncode != 0:
        raise child_failed(f"dlrm-lab {' '.join(args)}", out)


def sweep(tmp: Path, mode: str, batch: int, train_args: list[str]) -> list[dict[str, Any]]:
    root = tmp / f"{mode}-{len(list(tmp.iterdir()))}"
    cli(
        "scale",
        "--ranks",
        "1,2",
        "--mode",
        mode,
        "--batch-size",
        str(batch),
        "--metrics-dir",
        str(root),
        "--threads-per-rank",
        "1",
        "--",
        *train_args,
    )
    (sweep_dir,) = list(root.glob("scale-*"))
    return pq.read_table(sweep_dir / "summary.parquet").to_pylist()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only-pipeline", action="store_true", help="measure only the pipelined-vs-plain speedup")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    if args.quick:
        args.repeats, args.steps = 1, 8
    results: dict[str, Any] = header()
    kaggle = ["--preset", "kaggle", "--max-rows", "100000", "--steps", str(args.steps)]
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        # TorchRec's TrainPipelineSparseDist against the plain loop, same runs otherwise
        plain = [sweep(tmp, "weak", 2048, kaggle) for _ in range(args.repeats)]
        piped = [sweep(tmp, "weak", 2048, [*kaggle, "--pipeline"]) for _ in range(args.repeats)]
        results["pipeline speedup"] = {
            f"{n} rank(s)": {
                "plain_samples_per_s": statistics.median(r[i]["samples_per_s"] for r in plain),
                "pipelined_samples_per_s": statistics.median(r[i]["samples_per_s"] for r in piped),
                "speedup": statistics.median(r[i]["samples_per_s"] for r in piped)
                / statistics.median(r[i]["samples_per_s"] for r in plain),
            }
            for i, n in enumerate((1, 2))
        }
        print(json.dumps({"pipeline speedup": results["pipeline speedup"]}), flush=True)
        if args.only_pipeline:
            if args.json:
                write_results(Path(args.json), results)
            return
        for mode, batch in (("weak", 2048), ("strong", 4096)):
            runs = [sweep(tmp, mode, batch, kaggle) for _ in range(args.repeats)]
            results[f"kaggle {mode}"] = {
                "batch": batch,
                "samples_per_s_1": statistics.median(r[0]["samples_per_s"] for r in runs),
                "samples_per_s_2": statistics.median(r[1]["samples_per_s"] for r in runs),
                "efficiency_2": statistics.median(r[1]["efficiency"] for r in runs),
                "efficiencies": [r[1]["efficiency"] for r in runs],
            }
            print(json.dumps({f"kaggle {mode}": results[f"kaggle {mode}"]}), flush=True)
        rm2 = ["--preset", "rm2", "--table-scale", "0.01", "--steps", str(args.steps // 2)]
        by_type = {}
        for kind in SHARDING_TYPES:
            points = sweep(tmp, "weak", 256, [*rm2, "--sharding", kind])
            two = points[1]
            by_type[kind] = {
                "step_time_ms_p50_2_ranks": two["step_time_ms_p50"],
                "samples_per_s_2_ranks": two["samples_per_s"],
                "efficiency_2": two["efficiency"],
                **{f"{p}_share": two[f"{p}_share"] for p in PHASES},
            }
            print(json.dumps({f"rm2 {kind}": by_type[kind]}), flush=True)
        results["rm2 by sharding"] = by_type
    if args.json:
        write_results(Path(args.json), results)


if __name__ == "__main__":
    main()

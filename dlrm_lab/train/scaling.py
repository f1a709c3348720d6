"""Weak and strong scaling sweeps: one launched training run per rank count.

Weak scaling keeps the per-rank batch, strong scaling the global batch. In both,
speedup(N) = throughput(N) / throughput(1) and efficiency(N) = speedup(N) / N, with
throughput the run's global samples/s after warm-up. (When the smallest count n0 is not
1, throughput(1) is taken as throughput(n0) / n0.) Every point uses the same threads per
rank, so N ranks use N times the cores of one: the honest comparison.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from dlrm_lab.distributed.launch import launch
from dlrm_lab.distributed.launch import threads_per_rank as default_threads
from dlrm_lab.errors import UserError
from dlrm_lab.metrics.run import Run, find_runs, read_manifest
from dlrm_lab.train.timing import PHASES

MODES = ("weak", "strong")

POINT_SCHEMA = pa.schema(
    [
        ("kind", pa.string()),
        ("mode", pa.string()),
        ("ranks", pa.int32()),
        ("threads_per_rank", pa.int32()),
        ("batch_size_per_rank", pa.int32()),
        ("global_batch_size", pa.int64()),
        ("samples_per_s", pa.float64()),
        ("samples_per_s_per_rank", pa.float64()),
        ("step_time_ms_p50", pa.float64()),
        ("speedup", pa.float64()),
        ("efficiency", pa.float64()),
        *[(f"{p}_share", pa.float64()) for p in PHASES],
        ("point_run_id", pa.string()),
        ("point_status", pa.string()),
    ]
)


def parse_ranks(text: str) -> list[int]:
    try:
        ranks = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"--ranks {text!r}: expected a comma-separated list of rank counts, e.g. 1,2,4") from None
    if not ranks or any(r < 1 for r in ranks) or len(set(ranks)) != len(ranks):
        raise UserError(f"--ranks {text!r}: rank counts must be distinct integers >= 1")
    return sorted(ranks)


def scaling_sweep(
    ranks: list[int],
    mode: str,
    batch_size: int,
    train_args: list[str],
    metrics_dir: str | Path,
    launcher: str = "torchrun",
    threads_per_rank: int | None = None,
    argv: list[str] | None = None,
) -> tuple[Path, list[dict[str, Any]]]:
    """Run `dlrm-lab train TRAIN_ARGS` at each rank count; return the sweep dir and its points.

    `batch_size` is per rank for weak scaling and global for strong scaling.
    """
    if mode not in MODES:
        raise UserError(f"--mode {mode!r}: allowed: {', '.join(MODES)}")
    banned = {"--batch-size", "--metrics-dir"} & set(a.split("=")[0] for a in train_args)
    if banned:
        raise UserError(f"give {', '.join(sorted(banned))} to `scale`, not to the train options")
    if mode == "strong" and any(batch_size % n for n in ranks):
        raise UserError(f"--batch-size {batch_size}: strong scaling splits it over {ranks} ranks; make it divisible")
    threads = threads_per_rank or default_threads(max(ranks))
    config = {
        "ranks": ranks,
        "mode": mode,
        "batch_size": batch_size,
        "threads_per_rank": threads,
        "launcher": launcher,
        "train_args": train_args,
    }
    points: list[dict[str, Any]] = []
    with Run.create(metrics_dir, kind="scale", config=config, argv=argv) as sweep:
        base: float | None = None  # samples/s of one rank
        for n in ranks:
            per_rank = batch_size if mode == "weak" else batch_size // n
            out = sweep.dir / "points" / f"ranks-{n}"
            args = ["train", *train_args, "--batch-size", str(per_rank), "--metrics-dir", str(out), "--no-progress"]
            args.append("--pin-cores")  # each rank, data thread included, on its own cores
            os.environ["OMP_NUM_THREADS"] = str(threads)
            code = launch(n, launcher, args, log=out / "launch.log")
            runs = find_runs(out) if out.exists() else []
            summary = (
                pq.read_table(runs[0] / "summary.parquet").to_pylist()[0]
                if runs and (runs[0] / "summary.parquet").is_file()
                else {}
            )
            status = read_manifest(runs[0])["status"] if runs else "failed"
            rate = summary.get("samples_per_s") if code == 0 else None
            if n == ranks[0] and rate:
                base = rate / n
            speedup = rate / base if rate and base else None
            points.append(
                {
                    "kind": "scale",
                    "mode": mode,
                    "ranks": n,
                    "threads_per_rank": threads,
                    "batch_size_per_rank": per_rank,
                    "global_batch_size": per_rank * n,
                    "samples_per_s": rate,
                    "samples_per_s_per_rank": summary.get("samples_per_s_per_rank"),
                    "step_time_ms_p50": summary.get("step_time_ms_p50"),
                    "speedup": speedup,
                    "efficiency": speedup / n if speedup else None,
                    **{f"{p}_share": summary.get(f"{p}_share") for p in PHASES},
                    "point_run_id": runs[0].name if runs else None,
                    "point_status": status if code == 0 else "failed",
                }
            )
        sweep.write_summary(points, POINT_SCHEMA)
    return sweep.dir, points

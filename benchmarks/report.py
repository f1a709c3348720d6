"""Reports and sweep statistics: how long they take (issue 8's benchmark).

    python benchmarks/report.py            # 100 training runs, a 10,000-query sweep, a real sweep
    python benchmarks/report.py --quick    # fewer repeats

1. `write_report` over 100 training runs (300 step rows, 3 evaluations, a summary each),
   written with the project's own run writers.
2. `write_report` over an inference sweep of 10 points x 1 repeat, 1,000 queries each
   (10,000 query rows), its tables built by `dlrm_lab.sweep.tables.write_sweep_tables`.
3. The statistics' overhead on a real sweep (`dlrm-lab sweep`, tiny training, 2 points x 3
   repeats): time spent in the sweep's tables and bootstrap statistics against the wall
   time of the sweep.
Times are the median of repeats, on this machine, nothing else running.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from common import header, write_results

from dlrm_lab.metrics.columns import schema_of
from dlrm_lab.metrics.run import Run
from dlrm_lab.report.html import write_report
from dlrm_lab.sweep import run as sweep_run
from dlrm_lab.sweep.grid import SweepSpec, load_spec
from dlrm_lab.sweep.results import PointResult, SweepResult
from dlrm_lab.sweep.run import run_sweep
from dlrm_lab.sweep.tables import aggregate, write_sweep_tables
from dlrm_lab.train.records import EVAL_SCHEMA, PHASES, STEP_SCHEMA, SUMMARY_SCHEMA


def training_runs(root: Path, n: int, rng: np.random.Generator) -> None:
    for k in range(n):
        with Run.create(root, kind="train", config={"model": {"name": "kaggle"}}) as run:
            times = 30 + rng.gamma(2.0, 1.0, 300)
            steps = run.table("steps", STEP_SCHEMA)
            for s, t in enumerate(times):
                steps.append({"step": s, "rank": 0, "world_size": 1, "batch_size": 2048, "global_samples": 2048,
                              "warmup": s < 5, "loss": 0.5, "step_time_ms": float(t), "samples_per_s": 2048 / t * 1e3,
                              **{f"{p}_ms": float(t) / len(PHASES) for p in PHASES}})  # fmt: skip
            run.table("eval", EVAL_SCHEMA).extend(
                [
                    {"step": s, "num_samples": 8192, "auc": 0.7, "loss": 0.5, "eval_time_ms": 100.0}
                    for s in (99, 199, 299)
                ]
            )
            run.write_summary(
                [{"kind": "train", "status": "ok", "preset": "kaggle", "world_size": 1, "batch_size": 2048,
                  "samples_per_s": float(2048 / times.mean() * 1e3), "step_time_ms_mean": float(times.mean()),
                  "step_time_ms_p50": float(np.median(times)), "eval_auc": 0.7 + k * 1e-4,
                  "flops_per_sample": 2.9e6, "bytes_per_sample": 3500.0, "achieved_flops_per_s": 6e10,
                  "roofline_fraction": 0.4, **{f"{p}_share": 1 / len(PHASES) for p in PHASES}}],
                SUMMARY_SCHEMA,
            )  # fmt: skip


def query_sweep(root: Path, points: int, queries: int, rng: np.random.Generator) -> Path:
    spec = SweepSpec(root / "grid.toml", "infer run", {}, {"qps": [100 * (p + 1) for p in range(points)]}, {})
    with Run.create(root, kind="sweep", config={}) as sweep:
        result = SweepResult(sweep.dir)
        for p in range(points):
            with Run.create(sweep.dir / "points" / f"p{p:04d}-r0", kind="infer", config={}) as child:
                lat = rng.lognormal(1.0, 0.5, queries)
                child.table("queries", schema_of("queries")).extend(
                    [{"point": 0, "query_id": q, "model": "rm2", "samples": 1, "status": "ok",
                      "scheduled_ms": q * 10.0, "end_ms": q * 10.0 + float(lat[q]), "latency_ms": float(lat[q])}
                     for q in range(queries)]
                )  # fmt: skip
                child.write_summary(
                    [{"point": 0, "model": "rm2", "mode": "together", "queries_per_s": 100.0 * (p + 1),
                      "samples_per_s": 100.0 * (p + 1), "latency_p99_ms": float(np.percentile(lat, 99)),
                      "sla_latency_ms": float(np.percentile(lat, 99)), "sla_ms": 10.0, "target_qps": 100.0 * (p + 1)}],
                    schema_of("infer summary"),
                )  # fmt: skip
            result.points.append(PointResult(p, 0, {"qps": 100 * (p + 1)}, "ok", child.dir))
        write_sweep_tables(sweep, spec, result)
    return sweep.dir


def timed_report(paths: list[Path], out: Path, repeats: int) -> dict[str, Any]:
    times = []
    for r in range(repeats):
        t0 = time.perf_counter()
        result = write_report(paths, out / f"r{r}")
        times.append(time.perf_counter() - t0)
    return {"seconds_median": statistics.median(times), "seconds": times, "runs": len(result.runs),
            "plots": sorted(result.plots)}  # fmt: skip


def stats_overhead(tmp: Path) -> dict[str, Any]:
    grid = tmp / "grid.toml"
    grid.write_text('command = "train"\nrepeats = 3\n[options]\npreset = "tiny"\nsteps = 30\nbatch-size = 64\n'
                    'eval-batches = 1\nprogress = false\n[grid]\nseed = [1, 2]\n')  # fmt: skip
    spent: list[float] = []
    original = sweep_run.write_sweep_tables

    def timed_tables(*args: Any, **kwargs: Any) -> None:
        t0 = time.perf_counter()
        original(*args, **kwargs)
        spent.append(time.perf_counter() - t0)

    sweep_run.write_sweep_tables = timed_tables  # type: ignore[assignment]
    try:
        t0 = time.perf_counter()
        result = run_sweep(load_spec(grid, out=tmp / "real-sweep"))
        wall = time.perf_counter() - t0
    finally:
        sweep_run.write_sweep_tables = original  # type: ignore[assignment]
    t0 = time.perf_counter()
    aggregate(result, load_spec(grid))
    aggregate_s = time.perf_counter() - t0
    return {"sweep_wall_s": wall, "tables_and_stats_s": sum(spent), "calls": len(spent),
            "overhead_share": sum(spent) / wall, "one_aggregate_s": aggregate_s,
            "point_repeats": len(result.points)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    repeats = 2 if args.quick else 5
    rng = np.random.default_rng(0)
    out: dict[str, Any] = header()
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        t0 = time.perf_counter()
        training_runs(tmp / "train", 100, rng)
        print(f"wrote 100 training runs in {time.perf_counter() - t0:.1f} s", flush=True)
        out["report_100_training_runs"] = timed_report([tmp / "train"], tmp / "out-train", repeats)
        print("report of 100 training runs:", out["report_100_training_runs"]["seconds_median"], "s", flush=True)
        sweep_dir = query_sweep(tmp / "sweep", 10, 1000, rng)
        out["report_10000_query_sweep"] = timed_report([sweep_dir], tmp / "out-sweep", repeats)
        print("report of a 10,000-query sweep:", out["report_10000_query_sweep"]["seconds_median"], "s", flush=True)
        out["stats_overhead"] = stats_overhead(tmp)
        print("statistics on a real sweep:", json.dumps(out["stats_overhead"]), flush=True)
    if args.json:
        write_results(args.json, out)
        print(f"results in {args.json}")


if __name__ == "__main__":
    main()

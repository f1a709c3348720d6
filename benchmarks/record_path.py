"""The serving process's record path (issue 56): what a query's row costs, and what the same load's p99 is.

    python benchmarks/record_path.py [--parts rows,points] [--rates 7000,10000] [--seconds 5] [--rounds 2]

`rows`: in process, the completion thread's rows (`QueryRecords.record_finished`, a batch's columns made once) and
the load point's work on them once its load ended (late flags, latency parts, the queries table), in us a query
over 20,000 queries, gc off, median of 5. `points`: tiny served as the search's 1x1 layout (fp32, batch 256, 0.5 ms
delay), one open-loop and one LoadGen Server point at each rate, each `--seconds` long, a round each: the lab's p99
and LoadGen's. To compare two revisions, run each checkout's copy alternately (a process a round): the host drifts.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from common import header, results_path, write_results

from dlrm_lab.config import load_preset
from dlrm_lab.infer.completions import QueryRecords
from dlrm_lab.infer.load import QuerySizes, Stream
from dlrm_lab.infer.load_point import Point, measure
from dlrm_lab.infer.options import InferConfig, ServingOptions
from dlrm_lab.infer.records import latency_parts, with_late_flags
from dlrm_lab.infer.served import ServedModel
from dlrm_lab.infer.sut import Query
from dlrm_lab.infer.targets import open_target, parse_target
from dlrm_lab.metrics.columns import schema_of
from dlrm_lab.metrics.run import Run

QUERIES, BATCH = 20_000, 8  # queries a round, queries a batch


def rows_part(repeats: int = 5) -> dict[str, float]:
    """us a query: making its row, then its late flag and latency parts, then writing it to the queries table."""
    models = {"tiny": ServedModel("tiny", load_preset("tiny"))}
    took: dict[str, list[float]] = {"row": [], "parts": [], "table": []}
    gc.disable()  # as a load point runs
    try:
        for _ in range(repeats):
            records = QueryRecords(models, failed=print)
            t = time.monotonic_ns()
            queries = []
            for i in range(QUERIES):
                q = Query(i, "tiny", 1, i, scheduled_ns=t + i * 1000, issued_ns=t + i * 1000 + 500)
                q.first_start_ns, q.compute_ns, q.pieces = t + i * 1000 + 900, 300_000, 1
                queries.append(q)
                records.opened()
            a = time.perf_counter()
            for k in range(0, QUERIES, BATCH):
                batch = records.batch_columns(
                    batch_id=k, batch_samples=BATCH, batch_queries=BATCH, instance=0, batch_compute_ms=0.3,
                    batch_start_ns=t + k * 1000, batch_stages=(0.01, 0.1, 0.1, 0.05), batch_completion_ms=0.05,
                    batch_expected_ms=0.29,
                )  # fmt: skip
                end = t + k * 1000 + 2_000_000
                records.record_finished([(q, q.status, q.error, end) for q in queries[k : k + BATCH]], batch)
            b = time.perf_counter()
            rows = with_late_flags(records.take_records(), {"tiny": 10.0}, 0)
            for r in rows:
                r.update(latency_parts(r, 0.1))
            c = time.perf_counter()
            with Run.create(Path(tempfile.mkdtemp()), "infer", {}) as run:
                table = run.table("queries", schema_of("queries"))
                table.extend(rows)  # type: ignore[arg-type]
                table.flush()
                d = time.perf_counter()
            for name, seconds in (("row", b - a), ("parts", c - b), ("table", d - c)):
                took[name].append(seconds / QUERIES * 1e6)
    finally:
        gc.enable()
    out = {f"{name}_us": statistics.median(v) for name, v in took.items()}
    print("a query's row " + ", ".join(f"{k} {v:.2f}" for k, v in out.items()), flush=True)
    return out


def points_part(rates: list[float], seconds: float, rounds: int) -> list[dict[str, Any]]:
    """The lab's p99 (and LoadGen's) of tiny, 1x1, at each rate, open loop and LoadGen Server, `rounds` rounds."""
    (served,) = ServingOptions(instances=1, threads=1, max_batch=256, max_delay_ms=0.5, precision="fp32").served(
        ["tiny"]
    )
    cfg = InferConfig(duration_s=seconds, sla_ms=10.0)
    out: list[dict[str, Any]] = []
    target = parse_target(cfg.target)
    with (
        open_target(target, [served], cfg.connection(), device="cpu", seed=0, pin_cores=True) as server,
        Run.create(Path(tempfile.mkdtemp()), "infer", {}) as run,
    ):
        queries = run.table("queries", schema_of("queries"))
        index = 0
        for r in range(rounds):
            for rate in rates:
                for scenario in ("open-loop", "server"):
                    point = Point(index, [Stream("tiny", rate, QuerySizes.parse("fixed:1"))], scenario=scenario)
                    (row,) = measure(server, point, replace(cfg, scenario=scenario), queries, run.dir)
                    index += 1
                    got = {
                        "round": r,
                        "rate": rate,
                        "scenario": scenario,
                        "p99_ms": row["sla_latency_ms"],
                        "loadgen_p99_ms": row.get("loadgen_p99_ms"),
                        "loadgen_result": row.get("loadgen_result"),
                        "queries_per_s": row["queries_per_s"],
                    }
                    out.append(got)
                    print(got, flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parts", default="rows,points")
    parser.add_argument("--rates", default="7000,10000")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--out", default=None, help="the results file (default: results/results-record_path-<date>.json)"
    )
    args = parser.parse_args()
    results = header(parts=args.parts)
    parts = args.parts.split(",")
    if "rows" in parts:
        results["rows"] = rows_part()
    if "points" in parts:
        rates = [float(r) for r in args.rates.split(",")]
        results["points"] = points_part(rates, args.seconds, args.rounds)
    write_results(results_path("record_path", args.out), results)


if __name__ == "__main__":
    main()

"""Serving at the machine's floor (issue 31's benchmark): ~8 min on 2 cores.

    python benchmarks/serving_build.py [--parts batch,points,policy,hstu]

batch   The Criteo Kaggle shape (tables capped at 1M rows), one thread, the precision `auto` picks:
        each build (eager: the training module under autocast, what was served before; fused;
        compiled; aoti) timed at 1, 100 and 400 samples, interleaved, median of 15 (`infer.build.time_builds`),
        beside the roof of that batch at the precision it runs in (the profile's GEMM peak, gather
        and copy bandwidth). Targets: a batch's framework cost (its 1-sample time) <= 0.3 ms; 400
        samples >= 0.7 of the roof, 100 >= 0.5. Each build's accuracy check is printed too.
points  The same model served through the CLI, `--build eager` against `--build auto`, one after the
        other, twice: (a) 1 instance x 1 thread at 3 queries/s (~3% load), MLPerf query sizes,
        30 s: p99 over the floor (target <= 2x, goal 1.5x); (b) `make run`'s inference point
        (2 instances, --qps auto --sla-ms auto, max batch 2048, delay 2 ms, 10 s): p99 over the
        floor (target <= 3x). Each line names the latency parts of the tail.
policy  The same two points, build auto, with the batching policy given (low load: max batch 256, delay
        1 ms; make run: max batch 2048, delay 2 ms; no spin) against chosen by measurement (`--max-batch
        auto --max-delay-ms auto --spin-ms auto`, infer.tune), interleaved: p99 over the floor, and what
        was chosen.
hstu    The HSTU ranker's builds (eager under autocast; fused: its tables in TorchRec's fused quantised
        EmbeddingCollection, the rest stored in the precision served), one thread, at fp32 and bf16:
        hstu-tiny, and dlrmv3's layers with hstu_serve.py's short requests (tables at 1e5 rows), timed
        at 1, 8 and 32 requests a batch, interleaved, median of 9; each build's accuracy check.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import torch
from common import header, lab_run, results_path, write_results

import dlrm_lab
from dlrm_lab.config.family import family_of
from dlrm_lab.data import synthetic_generator
from dlrm_lab.infer import accuracy
from dlrm_lab.infer import build as builds
from dlrm_lab.infer.builds import dense_weight_bytes
from dlrm_lab.infer.library import PackedLibrary
from dlrm_lab.infer.records import batch_roof
from dlrm_lab.metrics.columns import LATENCY_PARTS
from dlrm_lab.metrics.precision import AUTO, choose_precision
from dlrm_lab.metrics.roofline import load_profile, peaks_for
from dlrm_lab.model.dlrm import build_model

KAGGLE = ["--model", "kaggle", "--max-rows", "1000000"]
SIZES = (1, 100, 400)


def batch_part() -> dict[str, Any]:
    spec = dlrm_lab.load_preset("kaggle", max_rows=1_000_000)
    precision = choose_precision(AUTO, spec, allowed=("fp32", "bf16", "fp16"), threads=1, rows=400).precision
    torch.manual_seed(0)
    model = build_model(spec).eval()
    library = PackedLibrary.generate(spec, None, 0, 4096)
    held_out = synthetic_generator(spec, None, seed=0).samples(4096, 4096 + accuracy.CHECK_SAMPLES)
    peaks = peaks_for(load_profile(), "cpu", precision, 1)
    out: dict[str, Any] = {"precision": precision, "builds": {}}
    for table_precision in ("fp32", "int8"):
        modules = {b: builds.make_build(model, b, precision=precision, table_precision=table_precision)
                   for b in family_of(spec).builds}  # fmt: skip
        times = builds.time_builds(modules, SIZES, 1, library, precision, repeats=15)
        for b, module in modules.items():
            roof = batch_roof(spec, table_precision, peaks, dense_weight_bytes(b, precision))
            check = accuracy.check_accuracy(model, module, b, held_out, precision=precision,
                                          table_precision=table_precision)  # fmt: skip
            per_sample_us = (times[b][max(SIZES)] - times[b][1]) / (max(SIZES) - 1) * 1e3
            row = {
                "per_batch_ms": times[b][1] - per_sample_us / 1e3,
                "per_sample_us": per_sample_us,
                "ms": {n: times[b][n] for n in SIZES},
                "roof_ms": {n: roof(n) for n in SIZES},
                "fraction_of_roof": {n: roof(n) / times[b][n] for n in SIZES},
                "framework_ms": times[b][1],
                "accuracy": check.to_dict(),
            }
            out["builds"][f"{b}/{table_precision}"] = row
            print(f"  {b:8s} tables {table_precision}: " + ", ".join(
                f"{n} samples {row['ms'][n]:.3f} ms ({row['fraction_of_roof'][n]:.2f} of roof {row['roof_ms'][n]:.3f})"
                for n in SIZES) + f"; {row['per_batch_ms']:.3f} ms a batch + {per_sample_us:.2f} us a sample; "
                f"accuracy {'pass' if check.passed else 'FAIL'} (max diff {check.max_abs_diff:.1e}, "
                f"AUC {check.auc:.4f} vs {check.auc_fp32:.4f})", flush=True)  # fmt: skip
    return out


def cli(tmp: Path, *args: str) -> dict[str, Any]:
    """One `infer run`'s summary row, with its queries' median compute and pieces."""
    run_dir = lab_run(tmp, *args)
    (row,) = pq.read_table(run_dir / "summary.parquet").to_pylist()
    q = pq.read_table(run_dir / "queries.parquet").to_pandas()
    ok = q[q.status == "ok"]
    row["query_compute_p50_ms"] = float(np.median(ok.compute_ms)) if len(ok) else None
    row["pieces_mean"] = float(ok.pieces.mean()) if len(ok) else None
    parts = ", ".join(f"{p} {row[f'tail_{p}_ms']:.2f}" for p in LATENCY_PARTS if row.get(f"tail_{p}_ms") is not None)
    print(f"  build {row['build']}: p99 {row['sla_latency_ms']:.2f} ms, floor {row['latency_floor_ms']:.3f} ms, "
          f"{row['latency_floor_ratio']:.1f}x; {row['queries_per_s']:.1f} q/s; batch fixed {row['batch_fixed_ms']:.3f} "
          f"ms + {row['batch_per_sample_us']:.2f} us/sample; slowdown p50 {row['compute_slowdown_p50']:.2f}x p99 "
          f"{row['compute_slowdown_p99']:.2f}x; tail parts (ms): {parts}", flush=True)  # fmt: skip
    return row


KEEP = ("build", "queries_per_s", "sla_latency_ms", "latency_floor_ms", "latency_floor_ratio", "batch_fixed_ms",
        "batch_per_sample_us", "compute_slowdown_p50", "compute_slowdown_p99", "target_qps", "query_compute_p50_ms",
        "pieces_mean", *[f"tail_{p}_ms" for p in LATENCY_PARTS],
        *[f"batch_{s}_mean_ms" for s in ("assembly", "lookup", "dense", "interaction", "completion")])  # fmt: skip


def alternate(tmp: Path, args: list[str], variants: dict[str, list[str]], repeats: int,
              keep: tuple[str, ...] = KEEP) -> dict[str, Any]:  # fmt: skip
    """`infer run ARGS` under each variant's extra options, alternated `repeats` times: per variant its
    runs' `keep` columns and the median p99 over the floor."""
    rows: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    for _ in range(repeats):  # interleaved
        for v, extra in variants.items():
            row = cli(tmp, "infer", "run", *args, *extra)
            rows[v].append({k: row.get(k) for k in keep})
    return {v: {"runs": r, "floor_ratio_median": statistics.median(x["latency_floor_ratio"] for x in r)}
            for v, r in rows.items()}  # fmt: skip


LOW_LOAD = [*KAGGLE, "--query-size", "mlperf", "--qps", "3", "--duration", "30", "--instances", "1", "--threads", "1",
            "--sla-ms", "100"]  # fmt: skip
MAKE_RUN = [*KAGGLE, "--query-size", "mlperf", "--qps", "auto", "--sla-ms", "auto", "--duration", "10",
            "--instances", "2"]  # fmt: skip


def points_part(repeats: int) -> dict[str, Any]:
    points = {"low_load": LOW_LOAD, "make_run": [*MAKE_RUN, "--max-batch", "2048", "--max-delay-ms", "2"]}
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, args in points.items():
            out[name] = alternate(Path(tmp), args, {b: ["--build", b] for b in ("eager", "auto")}, repeats)
            print(f"{name}: floor ratio eager {out[name]['eager']['floor_ratio_median']:.2f}x -> auto "
                  f"{out[name]['auto']['floor_ratio_median']:.2f}x", flush=True)  # fmt: skip
    return out


def policy_part(repeats: int) -> dict[str, Any]:
    given = {"low_load": ["--max-batch", "256", "--max-delay-ms", "1"],
             "make_run": ["--max-batch", "2048", "--max-delay-ms", "2"]}  # fmt: skip
    chosen = ["--max-batch", "auto", "--max-delay-ms", "auto", "--spin-ms", "auto"]
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, args in (("low_load", LOW_LOAD), ("make_run", MAKE_RUN)):
            out[name] = alternate(Path(tmp), args, {"given": given[name], "measured": chosen}, repeats,
                                  keep=(*KEEP, "max_batch", "max_delay_ms", "spin_ms"))  # fmt: skip
            for run in out[name]["measured"]["runs"]:
                print(f"  chosen: max batch {run['max_batch']}, delay {run['max_delay_ms']} ms, spin "
                      f"{run['spin_ms']} ms", flush=True)  # fmt: skip
            print(f"{name}: floor ratio, policy given {out[name]['given']['floor_ratio_median']:.2f}x -> measured "
                  f"{out[name]['measured']['floor_ratio_median']:.2f}x", flush=True)  # fmt: skip
    return out


def hstu_part(repeats: int = 9) -> dict[str, Any]:
    from hstu_serve import SHAPE

    from dlrm_lab.config import load_any_preset
    from dlrm_lab.data.sequences import SequenceGenerator, with_overrides
    from dlrm_lab.infer.requests import RequestLibrary
    from dlrm_lab.model.hstu import build_ranker

    sizes = (1, 8, 32)
    shapes = {"hstu-tiny": load_any_preset("hstu-tiny"),
              "dlrmv3-short": with_overrides(load_any_preset("dlrmv3", max_rows=100_000), SHAPE)}  # fmt: skip
    out: dict[str, Any] = {}
    for name, spec in shapes.items():
        torch.manual_seed(0)
        model = build_ranker(spec).eval()
        library = RequestLibrary.generate(spec, 0, 256)
        gen = SequenceGenerator(spec.data, seed=0)
        held_out = gen.requests(0, min(accuracy.CHECK_REQUESTS, gen.num_requests("train")), "train")
        for precision in ("fp32", "bf16"):
            modules = {b: builds.make_build(model, b, precision=precision, table_precision="fp32")
                       for b in family_of(spec).builds}  # fmt: skip
            ms = builds.time_builds(modules, sizes, 1, library, precision, repeats=repeats)
            checks = {
                b: accuracy.check_accuracy(model, m, b, held_out, precision=precision, table_precision="fp32").to_dict()
                for b, m in modules.items()
            }
            out[f"{name}/{precision}"] = {"batch_ms": {b: {str(n): v for n, v in per.items() if n > 0}
                                                        for b, per in ms.items()}, "accuracy": checks}  # fmt: skip
            print(f"{name} {precision}: " + "; ".join(
                f"{n} requests eager {ms['eager'][n]:.2f} ms, fused {ms['fused'][n]:.2f} ms "
                f"({ms['eager'][n] / ms['fused'][n]:.2f}x)" for n in sizes)
                + "; accuracy " + ", ".join(f"{b} {'passed' if c['passed'] else 'FAILED'} "
                                            f"(max diff {c['max_abs_score_diff']:.1e})" for b, c in checks.items()),
                flush=True)  # fmt: skip
            del modules
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="batch,points")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    t0 = time.time()
    results: dict[str, Any] = {"header": header()}
    if "batch" in args.parts:
        print("batch: one instance's batch time per build, 1 thread", flush=True)
        results["batch"] = batch_part()
    if "points" in args.parts:
        results["points"] = points_part(args.repeats)
    if "policy" in args.parts:
        results["policy"] = policy_part(args.repeats)
    if "hstu" in args.parts:
        results["hstu"] = hstu_part()
    results["wall_s"] = time.time() - t0
    only = args.parts if args.parts in ("policy", "hstu") else None
    write_results(results_path("serving_build" + (f"-{only}" if only else "")), results)


if __name__ == "__main__":
    main()

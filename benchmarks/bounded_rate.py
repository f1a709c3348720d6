"""`make run`'s latency-bounded rate against closed-loop capacity and its queueing roof (issue 56's target: the
bounded rate >= 0.7 of capacity). ~1 min a repeat on 2 cores, after a trained checkpoint exists (`make run` makes it).

    python benchmarks/bounded_rate.py [--repeats 3] [--checkpoint checkpoints/kaggle] [--allocators glibc,auto]

Each repeat runs `make run`'s serving step (`infer run ... --qps auto --sla-ms auto`, the policy auto) in a metrics
directory of its own and reads its `load_choice`: capacity, the highest probed rate under the bound, the queueing
roof (`dlrm_lab.infer.queueing`: what an ideal server with the same batch cost and batching rule holds under the
same bound), the point it then served and the speed canary of its phase. Prints one line a repeat and the medians.
With `--allocators`, each repeat runs once under each `--allocator` named, in turn (paired in time), and the medians
are per allocator. Each repeat also says where its bisection would have stopped under the coarser rule of
earlier sessions (`--coarser`, default 0.1 of the bracket's top), replayed on its own probes: the same run, the
figure's resolution apart.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import pyarrow.parquet as pq
from common import header, lab_run, results_path, write_results

from dlrm_lab.infer.calibrate import knee_found

SERVE = [
    "infer",
    "run",
    "--preset",
    "kaggle",
    "--max-rows",
    "1000000",
    "--query-size",
    "mlperf",
    "--qps",
    "auto",
    "--sla-ms",
    "auto",
    "--duration",
    "10",
    "--instances",
    "2",
    "--max-delay-ms",
    "auto",
    "--spin-ms",
    "auto",
]


def settled_at(probes: list[dict[str, object]], capacity: float, tolerance: float) -> float:
    """The highest passing rate where `infer.calibrate.choose_load`'s bisection would have stopped at `tolerance`
    (its probes being a prefix of a finer one's: the same rates in the same order)."""
    lo, hi = 0.0, capacity
    for p in probes:
        if knee_found(lo, hi, tolerance):
            break
        qps = float(p["qps"])  # type: ignore[arg-type]
        lo, hi = (qps, hi) if p["passed"] else (lo, qps)
    return lo


def repeat(tmp: Path, checkpoint: str, allocator: str, coarser: float) -> dict[str, object]:
    run_dir = lab_run(tmp, *SERVE, "--checkpoint", checkpoint, "--allocator", allocator)
    choice = json.loads((run_dir / "manifest.json").read_text())["load_choice"]
    (point,) = pq.read_table(run_dir / "summary.parquet").to_pylist()
    roof = choice["queueing_roof"] or {}
    best, capacity = choice["best_passing_qps"], choice["capacity_qps"]
    return {
        "capacity_qps": capacity,
        "bounded_qps": best,
        "bounded_share": best / capacity if capacity else None,
        "coarser_share": settled_at(choice["probes"], capacity, coarser) / capacity if capacity else None,
        "sla_ms": choice["sla_ms"],
        "unloaded_latency_ms": choice["unloaded_latency_ms"],
        "unloaded_idle_ms": choice.get("unloaded_idle_ms"),  # each query after the server idled this long
        "roof_qps": roof.get("rate_qps"),
        "roof_share": roof.get("share"),
        "of_roof": best / roof["rate_qps"] if roof.get("rate_qps") else None,
        "point_qps": point["queries_per_s"],
        "point_p99_ms": point["latency_p99_ms"],
        "sla_met": point["sla_met"],
        "canary_ratio": point.get("canary_ratio"),
        "canary_foreign": point.get("canary_foreign"),
        "probes": choice["probes"],
        "allocator": point.get("allocator"),
        "batch_fixed_ms": point.get("batch_fixed_ms"),
        "batch_per_sample_us": point.get("batch_per_sample_us"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--checkpoint", default="checkpoints/kaggle", help="a `train --checkpoint-dir` (make run's)")
    ap.add_argument("--allocators", default="auto", help="each repeat once under each (--allocator), in turn")
    ap.add_argument("--coarser", type=float, default=0.1, help="the bisection's earlier tolerance, replayed")
    ap.add_argument("--out", default=None)
    opts = ap.parse_args()
    if not Path(opts.checkpoint).is_dir():
        raise SystemExit(f"checkpoint: {opts.checkpoint}: no such directory (run `make run` first, or give one)")
    allocators = opts.allocators.split(",")
    rows: dict[str, list[dict[str, object]]] = {a: [] for a in allocators}
    with tempfile.TemporaryDirectory() as d:
        for k in range(opts.repeats):
            for a in allocators:
                r = repeat(Path(d), opts.checkpoint, a, opts.coarser)
                rows[a].append(r)
                print(
                    f"repeat {k + 1} --allocator {a} ({r['allocator']}): capacity {r['capacity_qps']:.0f} q/s, "
                    f"bounded {r['bounded_qps']:.0f} ({r['bounded_share']:.2f} of capacity; target 0.7; "
                    f"{r['coarser_share']:.2f} at tolerance {opts.coarser:g}) under "
                    f"{r['sla_ms']:g} ms; queueing roof {r['roof_qps'] or 0:.0f} ({r['roof_share'] or 0:.2f}), "
                    f"bounded {r['of_roof'] or 0:.2f} of it; point {r['point_qps']:.0f} q/s p99 "
                    f"{r['point_p99_ms']:.2f} ms, SLA {'met' if r['sla_met'] else 'missed'}; batch "
                    f"{r['batch_fixed_ms'] or 0:.3f} ms + {r['batch_per_sample_us'] or 0:.2f} us; canary r "
                    f"{r['canary_ratio'] or 0:.2f}",
                    flush=True,
                )
    med = {
        a: {
            k: statistics.median(r[k] for r in rs if r[k] is not None)
            for k in ("bounded_share", "coarser_share", "of_roof", "capacity_qps")
        }
        for a, rs in rows.items()
    }
    for a, m in med.items():
        print(
            f"median --allocator {a}: bounded {m['bounded_share']:.2f} of capacity ({m['capacity_qps']:.0f} q/s; "
            f"{m['coarser_share']:.2f} at tolerance {opts.coarser:g}), "
            f"{m['of_roof']:.2f} of the queueing roof"
        )
    write_results(results_path("bounded_rate", opts.out), header(command=SERVE, repeats=rows, median=med))


if __name__ == "__main__":
    main()

"""HSTU ranker training (issue 17): requests/s and AUC against the teacher, at the published request
shape and at shapes that fit a small machine, 1 and 2 ranks, and a request's FLOPs against its history.

    python benchmarks/hstu_train.py            # ~6 min on 2 cores

Cases (each a real `train` through the lab's loop, one rank unless said):
- hstu-tiny, batch 32: learning curve to the teacher's AUC;
- dlrmv3 at the published request shape (tables at --table-scale 1e-4), batch 1: time per request
  and the fraction of the GEMM roof;
- dlrmv3's layers with short requests (--set candidates=16, max_history=128): learning;
- hstu-tiny weak scaling 1 -> 2 ranks (`dlrm-lab scale`);
- forward FLOPs of one dlrmv3 request against history length, jagged and padded (the cost model).
Results: results/results-hstu_train-<date>.json.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
from common import header, results_path, write_results

from dlrm_lab.config import TrainConfig, load_any_preset
from dlrm_lab.data.sequences import with_overrides
from dlrm_lab.train import preflight, train

KEEP = ("samples_per_s", "step_time_ms_mean", "eval_auc", "teacher_auc", "flops_per_sample", "achieved_flops_per_s",
        "roofline_fraction", "roofline_bound_by", "loss_first", "loss_last")  # fmt: skip


def run_case(name: str, preset: str, overrides: list[str], cfg: TrainConfig, **scaling: Any) -> dict[str, Any]:
    spec = with_overrides(load_any_preset(preset, **scaling), overrides)
    t0 = time.perf_counter()
    result = train(preflight(spec, cfg))
    out = {k: result.summary.get(k) for k in KEEP}
    out.update(name=name, preset=preset, set=overrides, scaling=scaling, wall_s=time.perf_counter() - t0,
               batch_size=cfg.batch_size, steps=cfg.steps, mean_history=spec.mean_history,
               candidates=spec.data.candidates, aucs=[round(e["auc"], 4) for e in result.evals])  # fmt: skip
    print(f"{name}: {out['samples_per_s']:.2f} requests/s, step {out['step_time_ms_mean']:.0f} ms, AUC {out['aucs']} "
          f"(teacher {out['teacher_auc']:.4f}), {out['achieved_flops_per_s'] / 1e9:.1f} GFLOP/s = "
          f"{out['roofline_fraction']:.2f} of the roof (bound by {out['roofline_bound_by']})", flush=True)  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    opts = ap.parse_args()
    results: dict[str, Any] = header(cases=[])
    cases = results["cases"]
    cases.append(run_case("hstu-tiny", "hstu-tiny", [], TrainConfig(steps=300, batch_size=32, eval_every=100,
                                                                    eval_batches=16)))  # fmt: skip
    cases.append(
        run_case(
            "dlrmv3 published request shape",
            "dlrmv3",
            [],
            TrainConfig(steps=4, batch_size=1, eval_batches=1, warmup_steps=1),
            table_scale=1e-4,
        )
    )
    cases.append(
        run_case(
            "dlrmv3 layers, short requests",
            "dlrmv3",
            ["candidates=16", "max_history=128", "interactions_mean=10", "interactions_sd=3"],
            TrainConfig(steps=200, batch_size=16, eval_every=100, eval_batches=8),
            table_scale=1e-4,
        )
    )
    with tempfile.TemporaryDirectory() as root:
        args = ["scale", "--ranks", "1,2", "--mode", "weak", "--batch-size", "32", "--metrics-dir", root, "--",
                "--preset", "hstu-tiny", "--steps", "60"]  # fmt: skip
        printed = subprocess.run([sys.executable, "-m", "dlrm_lab", *args], capture_output=True, text=True, check=True)
        (sweep,) = Path(root).glob("scale-*")
        rows = pq.read_table(sweep / "summary.parquet").to_pylist()
        keep = ("ranks", "samples_per_s", "efficiency", "efficiency_vs_ceiling", "rank_step_ms", "prediction_error")
        results["scale"] = {"command": "dlrm-lab " + " ".join(a for a in args if a != root),
                            "points": [{k: r.get(k) for k in keep} for r in rows]}  # fmt: skip
        print(printed.stdout[-1500:], flush=True)
    shape = load_any_preset("dlrmv3").shape
    results["flops_per_request"] = [
        {"history": h, "candidates": 2048, "jagged_gflop": shape.request_flops(h, 2048) / 1e9,
         "padded_gflop": shape.request_flops(h, 2048, path="padded") / 1e9}
        for h in (0, 256, 1024, 2048, 4096, 6400, 8192, 14335)
    ]  # fmt: skip
    for row in results["flops_per_request"]:
        h, jagged, padded = row["history"], row["jagged_gflop"], row["padded_gflop"]
        print(f"history {h:>6}: {jagged:8.1f} GFLOP jagged, {padded:8.1f} padded", flush=True)
    write_results(results_path("hstu_train", opts.out), results)


if __name__ == "__main__":
    main()

"""What a leaner pooled all-to-all would give a 2-rank training step (issue 18): measured before building.

TorchRec's CPU `PooledEmbeddingsAllToAll` copies the pooled rows into a fresh buffer before the
collective, concatenates the ranks' blocks after it, and regroups the gradient by rank in two
copies (`.contiguous()` per block, then a concatenation). An all-to-all straight from the lookup's
output, one concatenation forward and one regrouping copy backward is the least a step can do on
one host. This experiment runs kaggle weak scaling through TorchRec's table-wise output
distribution and through that leaner one (`train --distribution lean`, `dlrm_lab.distributed.lean`;
the lab's default stays TorchRec's), alternated, over MPI:

    python benchmarks/lean_pooled.py --repeats 2      # ~3 min on 2 cores

Numerically the same step (the same collectives of the same bytes; TorchRec's gradient division
kept): the losses are compared. Results: results-lean_pooled-<date>.json.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from statistics import median
from typing import Any

from common import child_failed

TRAIN = ["train", "--preset", "kaggle", "--max-rows", "100000", "--batch-size", "2048", "--pin-cores",
         "--sharding", "table_wise", "--no-progress"]  # fmt: skip
PHASES_SHOWN = ("embedding_all_to_all", "embedding_all_to_all_backward", "backward")


def one_run(ranks: int, variant: str, steps: int, out: Path) -> dict[str, Any]:
    import pyarrow.parquet as pq

    from dlrm_lab.train.scaling_model import StepTimes

    args = [*TRAIN, "--steps", str(steps), "--metrics-dir", str(out), "--distribution",
            "lean" if variant == "lean" else "torchrec"]  # fmt: skip
    if ranks > 1:
        args += ["--collectives", "mpi"]
    cmd = [sys.executable, "-m", "dlrm_lab", *args]
    if ranks > 1:
        cmd = [str(Path(sys.executable).parent / "mpiexec"), "-n", str(ranks), *cmd]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise child_failed(" ".join(cmd), done)
    run_dir = max(out.glob("train-*"), key=lambda p: p.stat().st_mtime)
    times = StepTimes.from_run(run_dir)  # per rank over the measured steps, then over ranks
    every = pq.read_table(run_dir / "steps.parquet").to_pylist()
    losses = [r["loss"] for r in sorted(every, key=lambda r: (r["step"], r["rank"]))]  # warm-up steps too
    return {"step_ms": times.step_ms, **{f"{p}_ms": times.phases[p] for p in PHASES_SHOWN}, "losses": losses,
            "run_dir": str(run_dir)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2, help="pairs of runs, alternated (ABBA): the host drifts")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--out", default=None)
    opts = ap.parse_args()
    from common import header, results_path, write_results

    from dlrm_lab.metrics.roofline import load_profile

    ceiling = (((load_profile() or {}).get("devices") or {}).get("cpu") or {}).get("ceiling", {}).get("2", {})
    ceiling_eff = (ceiling.get("gemm") or {}).get("efficiency")
    results: dict[str, Any] = {**header(), "ceiling": ceiling_eff, "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(opts.repeats):
            order = ("torchrec", "lean") if k % 2 == 0 else ("lean", "torchrec")
            one = one_run(1, "torchrec", opts.steps, Path(tmp) / f"one-{k}")
            pair = {"one_rank_step_ms": one["step_ms"]}
            for variant in order:
                two = one_run(2, variant, opts.steps, Path(tmp) / f"{variant}-{k}")
                eff = one["step_ms"] / two["step_ms"]
                pair[variant] = {**two, "efficiency": eff,
                                 "efficiency_vs_ceiling": eff / ceiling_eff if ceiling_eff else None}  # fmt: skip
                shown = ", ".join(f"{p} {two[f'{p}_ms']:.2f}" for p in PHASES_SHOWN)
                print(f"pair {k + 1} {variant:8s}: 1 rank {one['step_ms']:.1f} ms, 2 ranks {two['step_ms']:.1f} ms, "
                      f"efficiency {eff:.3f} ({pair[variant]['efficiency_vs_ceiling'] or 0:.3f} of the ceiling); "
                      f"{shown}", flush=True)  # fmt: skip
            a, b = pair["torchrec"]["losses"], pair["lean"]["losses"]
            pair["max_loss_difference"] = max(abs(x - y) for x, y in zip(a, b, strict=True))
            for variant in ("torchrec", "lean"):
                del pair[variant]["losses"], pair[variant]["run_dir"]
            results["runs"].append(pair)
    for variant in ("torchrec", "lean"):
        effs = [p[variant]["efficiency_vs_ceiling"] or 0.0 for p in results["runs"]]
        results[f"{variant}_median_efficiency_vs_ceiling"] = median(effs)
        print(f"{variant}: efficiency / ceiling {', '.join(f'{e:.3f}' for e in effs)} (median {median(effs):.3f})")
    print(f"largest loss difference between the two: {max(p['max_loss_difference'] for p in results['runs']):.2e}")
    write_results(results_path("lean_pooled", opts.out), results)


if __name__ == "__main__":
    main()

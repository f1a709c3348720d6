"""Training scaling against the machine (issue 18): the 2-rank gap named item by item, the
efficiency against the probed two-process ceiling, predicted against measured step times,
gloo against MPI collectives, and projections to published GPU fabrics.

    python benchmarks/scaling_gap.py            # ~6 min on 2 cores

Needs a machine profile with the ceiling and both transports (the script makes them when
missing: `dlrm-lab machine probe`, then `dlrm-lab launch --launcher mpi --nproc 2 -- machine
probe --comms-only`). Each case is one real `dlrm-lab scale` sweep at ranks 1,2 (torchrun,
gloo, one pinned core and thread per rank). Results: results-scaling_gap-<date>.json.
`--cases "rm2 weak table_wise" "kaggle weak row_wise" ...` runs a case under one sharding type for all tables;
`--collectives gloo mpi` runs each case under mpiexec once per transport (alternating).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
from common import child_failed, header, results_path, write_results

from dlrm_lab.metrics.roofline import load_profile

CASES = {  # name: (mode, batch for --batch-size, train options)
    "kaggle weak": ("weak", 2048, ["--preset", "kaggle", "--max-rows", "100000"]),
    "kaggle strong": ("strong", 4096, ["--preset", "kaggle", "--max-rows", "100000"]),
    "rm2 weak": ("weak", 512, ["--preset", "rm2", "--table-scale", "0.01"]),
    "rm2 strong": ("strong", 1024, ["--preset", "rm2", "--table-scale", "0.01"]),
}
# weak scaling under each sharding type for all tables (`--cases` names them, e.g. "rm2 weak row_wise")
SHARDING_TYPES = ("table_wise", "row_wise", "column_wise", "table_row_wise", "table_column_wise", "data_parallel")
CASES.update({f"{case} {t}": (CASES[case][0], CASES[case][1], [*CASES[case][2], "--sharding", t])
              for case in ("rm2 weak", "kaggle weak") for t in SHARDING_TYPES})  # fmt: skip
KEEP = ("ranks", "samples_per_s", "efficiency", "ceiling_efficiency", "efficiency_vs_ceiling", "roof_efficiency",
        "library_roof_efficiency", "efficiency_vs_roof", "rank_step_ms", "predicted_step_ms", "prediction_error",
        "predicted_step_ms_mpi", "gap_ms")  # fmt: skip


def cli(*args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "dlrm_lab", *args], capture_output=True, text=True)
    if out.returncode != 0:
        raise child_failed(f"dlrm-lab {' '.join(args)}", out)
    return out.stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--cases", nargs="*", default=list(CASES)[:4], help=f"of: {', '.join(CASES)}")
    ap.add_argument("--out", default=None, help="results file (default: results/results-scaling_gap-<date>.json)")
    ap.add_argument("--collectives", nargs="*", default=None,
                    help="run each case under mpiexec with these collectives (gloo, mpi), alternating")  # fmt: skip
    ap.add_argument("--repeats", type=int, default=1,
                    help="run the cases this many times, in alternating order (ABBA...): the host drifts")  # fmt: skip
    opts = ap.parse_args()
    profile = load_profile()
    if not profile or "ceiling" not in profile.get("devices", {}).get("cpu", {}):
        cli("machine", "probe")
    if "mpi/2" not in (load_profile() or {}).get("comms", {}):
        cli("launch", "--launcher", "mpi", "--nproc", "2", "--", "machine", "probe", "--comms-only")
    profile = load_profile() or {}
    results: dict[str, Any] = {
        **header(),
        "ceiling": profile["devices"]["cpu"].get("ceiling"),
        "collectives": profile.get("comms"),
        "cases": {},
    }
    runs = [(name, c) for name in opts.cases for c in (opts.collectives or [None])]
    order = [r for rep in range(opts.repeats) for r in (runs if rep % 2 == 0 else runs[::-1])]
    if opts.collectives:  # alternate the transports' order from case to case too (ABBA)
        width = len(opts.collectives)
        blocks = [order[k : k + width] for k in range(0, len(order), width)]
        order = [r for i, block in enumerate(blocks) for r in (block if i % 2 == 0 else block[::-1])]
    with tempfile.TemporaryDirectory() as root:
        for run, (name, collectives) in enumerate(order):
            mode, batch, train = CASES[name]
            extra = ["--project", "8,64,512,4096"] if name == "kaggle weak" and run == 0 else []
            if collectives:  # ranks started by mpiexec, collectives over gloo or MPI
                extra, train = [*extra, "--launcher", "mpi"], [*train, "--collectives", collectives]
                name = f"{name} [{collectives}]"
            out_dir = f"{root}/{run}-{name.replace(' ', '-').replace('[', '').replace(']', '')}"
            args = ["scale", "--ranks", "1,2", "--mode", mode, "--batch-size", str(batch), "--metrics-dir",
                    out_dir, *extra, "--", *train, "--steps", str(opts.steps)]  # fmt: skip
            print("$ dlrm-lab", " ".join(args), flush=True)
            printed = cli(*args)
            (sweep,) = Path(out_dir).glob("scale-*")
            rows = pq.read_table(sweep / "summary.parquet").to_pylist()
            gap_path = sweep / "gap.parquet"
            gap = pq.read_table(gap_path).to_pylist() if gap_path.exists() else []
            choices = {}  # what --sharding resolved to at each rank count (auto: the plans timed)
            for manifest in sorted(sweep.glob("points/*/train-*/manifest.json")):
                config = json.loads(manifest.read_text())["config"]
                choices[config["world_size"]] = config.get("sharding_choice")
            results["cases"].setdefault(name, {"command": "dlrm-lab " + " ".join(a for a in args if a != out_dir),
                                               "runs": []})["runs"].append({
                "order": run,
                "points": [{k: r.get(k) for k in KEEP} for r in rows],
                "gap_ms": {g["item"]: g["ms"] for g in gap},
                "sharding_choice": choices,
                "printed": printed if extra else None,
            })  # fmt: skip
            if choices.get(2):
                print(f"  2 ranks: {choices[2]['sharding']}: {choices[2]['reason']}", flush=True)
            for r in rows:
                print("  " + ", ".join(f"{k}={r.get(k):.3f}" if isinstance(r.get(k), float) else f"{k}={r.get(k)}"
                                       for k in KEEP), flush=True)  # fmt: skip
    for name, case in results["cases"].items():
        two = [p for r in case["runs"] for p in r["points"] if p["ranks"] == 2]
        vs = sorted(p["efficiency_vs_ceiling"] for p in two if p["efficiency_vs_ceiling"] is not None)
        case["efficiency_vs_ceiling_median"] = vs[len(vs) // 2] if vs else None
        print(f"{name}: efficiency / ceiling at 2 ranks {[round(v, 3) for v in vs]}, median "
              f"{case['efficiency_vs_ceiling_median']}", flush=True)  # fmt: skip
    write_results(results_path("scaling_gap", opts.out), results)


if __name__ == "__main__":
    main()

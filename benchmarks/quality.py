"""Time to quality per preset (issue 19's benchmark): steps and seconds until the held-out
AUC reaches 90% and 97% of the teacher's (the best AUC the synthetic data allows), and the
Valid FLOPS of those runs.

    python benchmarks/quality.py                      # every preset, ~15 min on 2 cores
    python benchmarks/quality.py --presets tiny dcnv2 --max-steps 300
    python benchmarks/quality.py --presets terabyte rm1 rm3 --max-steps 2000   # the slow learners

Each (preset, target) is one `dlrm-lab train --target-auc` run through the real CLI, on the
preset's default synthetic data scaled to fit (SCALES), evaluating every `--eval-every` steps
on `--eval-batches` held-out batches; the run stops at the first evaluation at the target.
A preset that does not reach a target within `--max-steps` is recorded as not reached (its
Valid FLOPS are 0 by the rule). Results go to results/results-quality-<date>.json
(a rerun of some presets replaces their entries and keeps the others).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
from common import child_failed, header, results_path, write_results

import dlrm_lab
from dlrm_lab.data import synthetic_generator

# each preset's tables scaled to fit this machine and a step of well under a second
SCALES: dict[str, list[str]] = {
    "tiny": [],
    "kaggle": ["--max-rows", "100000"],
    "terabyte": ["--max-rows", "100000"],
    "rm1": ["--table-scale", "0.01"],
    "rm2": ["--table-scale", "0.01"],
    "rm3": ["--table-scale", "0.01"],
    "dcnv2": ["--table-scale", "0.0005"],
}
FRACTIONS = (0.90, 0.97)


def scaling_kwargs(args: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for flag, value in zip(args[::2], args[1::2], strict=True):
        out[flag.lstrip("-").replace("-", "_")] = float(value) if "scale" in flag else int(value)
    return out


def teacher(preset: str) -> tuple[float, float]:
    """(teacher AUC, click rate) of the preset's default synthetic data."""
    spec = dlrm_lab.load_preset(preset, **scaling_kwargs(SCALES[preset]))
    generator = synthetic_generator(spec, seed=0)
    return generator.teacher_auc, generator.spec.click_rate


def run(preset: str, target: float, opts: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as root:
        cmd = [
            sys.executable, "-m", "dlrm_lab", "train", "--preset", preset, *SCALES[preset],
            "--steps", str(opts.max_steps), "--batch-size", str(opts.batch_size),
            "--eval-every", str(opts.eval_every), "--eval-batches", str(opts.eval_batches),
            "--target-auc", f"{target:.6f}", "--metrics-dir", root, "--no-progress",
        ]  # fmt: skip
        print("$ dlrm-lab", " ".join(cmd[3:-3]), flush=True)
        t0 = time.monotonic()
        out = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.monotonic() - t0
        if out.returncode != 0:
            raise child_failed(f"{preset}: dlrm-lab train", out)
        (run_dir,) = [p for p in Path(root).iterdir() if p.is_dir()]
        s = pq.read_table(run_dir / "summary.parquet").to_pylist()[0]
        numerics = json.loads((run_dir / "manifest.json").read_text())["config"]["numerics"]
    return {
        "target_auc": target,
        "reached": bool(s["target_reached"]),
        "steps_to_target": s.get("steps_to_target"),
        "seconds_to_target": s.get("time_to_target_s"),
        "eval_auc": s["eval_auc"],
        "loss_first": s["loss_first"],
        "valid_flops_per_s": s["valid_flops_per_s"],
        "achieved_flops_per_s": s.get("achieved_flops_per_s"),
        "samples_per_s": s["samples_per_s"],
        "dense_lr": numerics["dense_lr"],
        "wall_s": round(wall, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", nargs="*", default=list(SCALES))
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--max-steps", type=int, default=600)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--eval-batches", type=int, default=8)
    opts = ap.parse_args()
    results: dict[str, Any] = header(settings=vars(opts), presets={})
    for preset in opts.presets:
        teacher_auc, p = teacher(preset)
        entry: dict[str, Any] = {"scaling": SCALES[preset], "teacher_auc": teacher_auc, "click_rate": p,
                                 "click_rate_entropy": -(p * math.log(p) + (1 - p) * math.log(1 - p))}  # fmt: skip
        for fraction in FRACTIONS:
            r = run(preset, fraction * teacher_auc, opts)
            entry[f"{round(fraction * 100)}%"] = r
            print(f"  {preset} {fraction:.0%} of teacher {teacher_auc:.4f}: "
                  + (f"{r['steps_to_target']} steps, {r['seconds_to_target']:.1f} s, "
                     f"Valid FLOPS {r['valid_flops_per_s'] / 1e9:.2f} GFLOP/s" if r["reached"]
                     else f"not reached in {opts.max_steps} steps (AUC {r['eval_auc']:.4f})"), flush=True)  # fmt: skip
            if not r["reached"]:
                break  # 97% cannot come before 90%
        entry["settings"] = vars(opts) | {"date": results["date"]}
        results["presets"][preset] = entry
    path = results_path("quality")
    if path.exists():  # a rerun of some presets keeps the day's others (each entry has its settings)
        earlier = json.loads(path.read_text())
        for entry in earlier.get("presets", {}).values():
            entry.setdefault("settings", earlier.get("settings", {}) | {"date": earlier.get("date")})
        results["presets"] = earlier.get("presets", {}) | results["presets"]
    write_results(path, results)


if __name__ == "__main__":
    main()

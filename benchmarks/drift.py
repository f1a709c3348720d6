"""Comparisons a drifting host cannot spoil (issue 60's targets): `compare` over runs paired in time. ~3 min on 2 cores.

    python benchmarks/drift.py [--trials 10] [--pairs 5] [--steps 300] [--preset tiny]
    python benchmarks/drift.py --preset kaggle --max-rows 100000 --batch-size 2048 --steps 60   # make run's shape

Each trial runs the same training command as BASE and NEW alternately (A B A B ..., `--pairs` of each), then
`compare`s them: the target is no regression in any trial. Then as many trials where NEW sleeps an extra 15% of the
command's step time inside every step (the sleep measured from a first run's p50 step): the target is a regression
reported in every one, at a ratio near 1/1.15. Prints each trial's samples/s verdict, ratio, CI and basis (pairs
used, pairs left out by the speed canary).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from common import header, results_path, write_results

import dlrm_lab
from dlrm_lab.config import TrainConfig
from dlrm_lab.metrics.canary import CANARY_ENV
from dlrm_lab.report.compare import compare
from dlrm_lab.train import loop, preflight, train

SLOWDOWN = 0.15


def run(spec: Any, cfg: TrainConfig, where: Path, sleep_s: float = 0.0) -> dict[str, Any]:
    """One training run under `where`; with `sleep_s`, every step sleeps that long more (inside its timed part)."""
    real = loop.train_step

    def slowed(*args: Any, **kwargs: Any) -> Any:
        time.sleep(sleep_s)
        return real(*args, **kwargs)

    loop.train_step = slowed if sleep_s else real
    try:
        return train(preflight(spec, cfg), metrics_dir=str(where)).summary
    finally:
        loop.train_step = real


def trial(spec: Any, cfg: TrainConfig, root: Path, pairs: int, sleep_s: float) -> dict[str, Any]:
    base, new = root / "base", root / "new"
    for _ in range(pairs):
        run(spec, cfg, base)
        run(spec, cfg, new, sleep_s)
    result = compare(base, new)
    rows = {r.metric: r for r in result.rows if not r.group}
    if "samples_per_s" not in rows:  # too few pairs left: the canaries said the host moved within them
        return {"verdict": "not compared", "ratio": None, "ci": [None, None], "basis": "; ".join(result.notes)}
    r = rows["samples_per_s"]
    return {"verdict": r.verdict, "ratio": r.ratio.median, "ci": [r.ratio.ci_low, r.ratio.ci_high], "basis": r.basis}


def main() -> None:
    os.environ.setdefault(CANARY_ENV, "0.25")  # several readings a run: a pair's canaries are medians, not one reading
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--max-rows", type=int, default=None, help="each table's rows capped (the preset's own)")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--out", default=None, help="the results file (default results/results-drift-<date>.json)")
    args = parser.parse_args()
    spec = dlrm_lab.load_preset(args.preset, **({"max_rows": args.max_rows} if args.max_rows else {}))
    cfg = TrainConfig(steps=args.steps, batch_size=args.batch_size, prefetch=0, eval_batches=1)
    results: dict[str, Any] = {"header": header(**vars(args)), "itself": [], "slowed": []}
    with tempfile.TemporaryDirectory() as tmp:
        first = run(spec, cfg, Path(tmp) / "first")
        sleep_s = SLOWDOWN * first["step_time_ms_p50"] / 1e3
        results["sleep_ms"] = sleep_s * 1e3
        for k in range(args.trials):
            for name, extra in (("itself", 0.0), ("slowed", sleep_s)):
                out = trial(spec, cfg, Path(tmp) / f"{name}-{k}", args.pairs, extra)
                results[name].append(out)
                lo, hi = out["ci"]
                ratio = "" if out["ratio"] is None else f", ratio {out['ratio']:.3f} [{lo:.3f}, {hi:.3f}]"
                print(f"{name} {k}: {out['verdict']}{ratio}, {out['basis']}", flush=True)
    itself = sum(o["verdict"] == "regression" for o in results["itself"])
    slowed = sum(o["verdict"] == "regression" for o in results["slowed"])
    print(f"against itself: {itself} of {args.trials} reported a regression (target 0); 15% slower: {slowed} of "
          f"{args.trials} reported (target all)")  # fmt: skip
    write_results(results_path("drift", args.out), results)


if __name__ == "__main__":
    main()

"""A/B of two commits on this machine: training samples/s and serving p99, interleaved rounds.

    python benchmarks/ab.py --base de9f02e [--head HEAD] [--rounds 3] [--parts train,infer]

Each commit is checked out in a worktree of its own (under a temporary directory) and run by this
venv's Python with that worktree first on its path, so both sides use the same packages. A round runs
the training command, then the serving command, on each side in turn (the order alternating between
rounds), and the figures are their summaries' `samples_per_s` and `latency_p99_ms`. A refactor that
changes no figure shows ratios within the rounds' spread (issue 35's constraint).

The ratio is taken per round (its two sides ran adjacent in time, so the host's drift between rounds cancels), and
the result is the rounds' median with its bootstrap interval; a round whose two sides' speed canaries are over
`metrics.canary.CANARY_APART` apart (the host changed speed between them) is left out, and the result says how many.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import pyarrow.parquet as pq
from common import child_failed, header, results_path, write_results

from dlrm_lab.metrics.canary import CANARY_APART, apart
from dlrm_lab.metrics.stats import estimate

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ["train", "--preset", "kaggle", "--max-rows", "1000000", "--steps", "200", "--batch-size", "2048"]
INFER = ["infer", "run", "--preset", "kaggle", "--max-rows", "1000000", "--query-size", "mlperf", "--qps", "100",
         "--duration", "10", "--instances", "2", "--max-batch", "512", "--max-delay-ms", "1",
         "--sla-ms", "100"]  # fmt: skip


def _run(tree: Path, args: list[str], metrics: Path) -> dict:
    """One command of the lab at `tree`; its (first) summary row."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, "-m", "dlrm_lab", *args, "--metrics-dir", str(metrics), "--no-progress"]
    out = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise child_failed(f"{tree.name}: {' '.join(args[:2])}", out)
    (run,) = [d for d in metrics.iterdir() if d.is_dir()]
    return pq.read_table(run / "summary.parquet").to_pylist()[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="the commit before the change")
    ap.add_argument("--head", default="HEAD")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    one_build = (
        "serve this build on both sides (each side otherwise times the builds once, in its own minute, "
        "and may serve another: a noisy host then decides the p99, not the change)"
    )
    ap.add_argument("--build", default=None, help=one_build)
    ap.add_argument("--parts", default="train,infer", help="the commands each side runs a round: train, infer")
    opts = ap.parse_args()
    revs = {side: subprocess.check_output(["git", "rev-parse", "--short", rev], cwd=ROOT, text=True).strip()
            for side, rev in (("base", opts.base), ("head", opts.head))}  # fmt: skip
    infer_args = [*INFER, "--build", opts.build] if opts.build else INFER
    parts = {p: {"train": TRAIN, "infer": infer_args}[p] for p in opts.parts.split(",")}
    metrics = {"train": "samples_per_s", "infer": "latency_p99_ms"}
    figures: dict[str, dict[str, list[float]]] = {s: {"samples_per_s": [], "latency_p99_ms": []} for s in revs}
    canaries: dict[str, dict[str, list[float | None]]] = {s: {"train": [], "infer": []} for s in revs}
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        trees = {}
        for side, rev in revs.items():
            trees[side] = tmp / side
            subprocess.run(["git", "worktree", "add", "--detach", str(trees[side]), rev], cwd=ROOT, check=True,
                           capture_output=True)  # fmt: skip
        try:
            for k in range(opts.rounds):
                for side in ("base", "head") if k % 2 == 0 else ("head", "base"):
                    done = {p: _run(trees[side], args, tmp / f"m-{side}-{k}-{p}") for p, args in parts.items()}
                    for p, row in done.items():
                        figures[side][metrics[p]].append(row[metrics[p]])
                        canaries[side][p].append(row.get("canary_ratio"))
                    said = {"train": lambda r: f"train {r['samples_per_s']:,.0f} samples/s",
                            "infer": lambda r: f"infer p99 {r['latency_p99_ms']:.2f} ms"}  # fmt: skip
                    line = ", ".join(said[p](r) for p, r in done.items())
                    print(f"round {k} {side} {revs[side]}: {line}", flush=True)
        finally:
            for tree in trees.values():
                subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, capture_output=True)
    paired = {}
    for command in parts:
        metric = metrics[command]
        rounds = zip(figures["base"][metric], figures["head"][metric], canaries["base"][command],
                     canaries["head"][command], strict=True)  # fmt: skip
        kept = [head / base for base, head, cb, ch in rounds if not apart(cb, ch)]
        ratio = estimate(kept)
        paired[metric] = {"median": ratio.median, "ci_low": ratio.ci_low, "ci_high": ratio.ci_high,
                          "rounds": len(kept), "left_out": opts.rounds - len(kept)}  # fmt: skip
        print(
            f"head / base, {command} {metric}: {ratio.median} [{ratio.ci_low}, {ratio.ci_high}] over {len(kept)} "
            f"rounds paired in time ({opts.rounds - len(kept)} left out: canaries over {CANARY_APART:.0%} apart)"
        )
    medians = {side: {m: statistics.median(v) for m, v in figures[side].items() if v} for side in revs}
    ratios = {m: medians["head"][m] / medians["base"][m] for m in medians["head"]}
    print("head / base (medians of each side, unpaired): " + ", ".join(f"{m} {r:.3f}" for m, r in ratios.items()))
    write_results(results_path("ab", opts.out),
                  header(base=revs["base"], head=revs["head"], train=TRAIN, infer=infer_args, figures=figures,
                         canaries=canaries, paired=paired, ratios=ratios))  # fmt: skip


if __name__ == "__main__":
    main()

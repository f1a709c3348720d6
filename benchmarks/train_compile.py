"""Issue 59's Inductor routes on the real training step: the dot interaction compiled alone, and the whole DLRM module
compiled (dense arches and interaction; Dynamo breaks the graph at fbgemm's lookup and runs it eagerly), each against
the eager step in adjacent pairs of `dlrm_lab.train.train` runs (the order alternating), medians of each way's step
p50; and what the compile costs (the first compiled run's wall time over an eager one's; later runs hit Inductor's
cache).

    python benchmarks/train_compile.py [--preset kaggle] [--max-rows 1000000] [--batch-size 2048] [--steps 100]
                                       [--pairs 3] [--target interaction|model|both]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from typing import Any

from common import header, results_path, write_results

import dlrm_lab
import dlrm_lab.train.loop as loop
from dlrm_lab.config import TrainConfig
from dlrm_lab.model.dlrm import DLRM
from dlrm_lab.model.interaction import DotInteractionArch
from dlrm_lab.train import preflight, train

TARGETS = {"interaction": DotInteractionArch, "model": DLRM}


def run(spec: Any, cfg: TrainConfig, compiled: type | None) -> tuple[float, float]:
    """(the run's step p50 ms, its wall seconds), with `compiled`'s modules compiled in place (`nn.Module.compile`:
    the state dict's keys unchanged) once the run's set-up has built them."""
    real = loop.build_setup

    def compiling(*args: Any, **kwargs: Any) -> Any:
        setup = real(*args, **kwargs)
        for module in setup.dmp.modules():
            if compiled is not None and type(module) is compiled:
                module.compile()
        return setup

    loop.build_setup = compiling
    try:
        start = time.monotonic()
        summary = train(preflight(spec, cfg)).summary
        return summary["step_time_ms_p50"], time.monotonic() - start
    finally:
        loop.build_setup = real


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="kaggle")
    ap.add_argument("--max-rows", type=int, default=1_000_000)
    ap.add_argument("--batch-size", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--target", choices=("interaction", "model", "both"), default="both")
    ap.add_argument("--out")
    args = ap.parse_args()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = (
        tempfile.mkdtemp()
    )  # the first compiled run compiles cold, as a user's first
    spec = dlrm_lab.load_preset(args.preset, max_rows=args.max_rows)
    # the lab's step as `train` runs it on this class, fixed so that only the compile differs
    cfg = TrainConfig(steps=args.steps, batch_size=args.batch_size, precision="bf16", dense_update="fused",
                      table_update="batched", eval_batches=1)  # fmt: skip
    results: dict[str, Any] = {**header(**vars(args))}
    for target in ("interaction", "model") if args.target == "both" else (args.target,):
        eager_ms, compiled_ms, first_s, eager_s = [], [], None, []
        for k in range(args.pairs):
            for way in ("eager", "compiled") if k % 2 == 0 else ("compiled", "eager"):
                ms, wall = run(spec, cfg, TARGETS[target] if way == "compiled" else None)
                (compiled_ms if way == "compiled" else eager_ms).append(ms)
                if way == "eager":
                    eager_s.append(wall)
                elif first_s is None:
                    first_s = wall
                print(f"{target} pair {k} {way}: step p50 {ms:.2f} ms, {wall:.1f} s", flush=True)
        ratios = [e / c for e, c in zip(eager_ms, compiled_ms, strict=True)]
        results[target] = {
            "eager_ms": eager_ms,
            "compiled_ms": compiled_ms,
            "speedup_per_pair": ratios,
            "speedup": statistics.median(ratios),
            "first_compiled_run_s": first_s,
            "eager_run_s": statistics.median(eager_s),
        }
        pairs = ", ".join(f"{r:.3f}" for r in ratios)
        print(f"{target}: compiled {statistics.median(ratios):.3f}x the eager step (pairs {pairs}); its first run "
              f"{first_s:.1f} s against an eager run's {statistics.median(eager_s):.1f} s", flush=True)  # fmt: skip
    write_results(results_path("train_compile", args.out), results)


if __name__ == "__main__":
    main()

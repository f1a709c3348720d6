"""The fixed-width gather against the ragged one (issue 56), interleaved: ~3 min on 2 cores.

    python benchmarks/fixed_width_ab.py [--builds aoti,aoti_tuned] [--rounds 7]

Kaggle (one id a feature, tables capped at 1M rows), the precision `auto` picks, one thread. Each build's runner
measures itself as an instance does at start (`batch_cost`: 1 and 256 samples alternated, median of 7) on two
libraries of the same samples: one that takes `gather_into`'s fixed-width path (`bag_width` 1) and one made to take
the ragged path; the two alternate in rounds. Prints each side's fixed ms a batch + us a sample, and their ratio.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from common import header, results_path, write_results
from one_call import kaggle_setup

from dlrm_lab.infer import build as builds
from dlrm_lab.infer.library import PackedLibrary
from dlrm_lab.infer.serving_parts import make_runner


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--builds", default="aoti,aoti_tuned")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    _, precision, model, fast = kaggle_setup()
    ragged = PackedLibrary(fast.dense, fast.lengths, None, fast.values)
    ragged.__dict__["bag_width"] = None  # the general path on the same samples
    results = {"header": header(), "precision": precision, "builds": {}}
    for name in args.builds.split(","):
        module = builds.make_build(model, name, precision=precision, table_precision="fp32")
        runners = {side: make_runner(module, lib, torch.device("cpu"), precision) for side, lib in
                   (("fixed-width", fast), ("ragged", ragged))}  # fmt: skip
        for runner in runners.values():
            runner.warm_up(256)
        costs = {side: [] for side in runners}
        for _ in range(args.rounds):
            for side, runner in runners.items():
                costs[side].append(runner.batch_cost(256, repeats=7))
        row = {
            side: {
                "fixed_ms": statistics.median(c.fixed_ms for c in cs),
                "per_sample_us": statistics.median(c.per_sample_ms for c in cs) * 1e3,
            }
            for side, cs in costs.items()
        }
        results["builds"][name] = row
        f, r = row["fixed-width"], row["ragged"]
        print(
            f"{name}: fixed-width {f['fixed_ms']:.3f} ms + {f['per_sample_us']:.2f} us, ragged "
            f"{r['fixed_ms']:.3f} ms + {r['per_sample_us']:.2f} us: {f['fixed_ms'] / r['fixed_ms']:.2f}x a batch, "
            f"{f['per_sample_us'] / r['per_sample_us']:.2f}x a sample",
            flush=True,
        )
    write_results(results_path("fixed_width_ab"), results)


if __name__ == "__main__":
    main()

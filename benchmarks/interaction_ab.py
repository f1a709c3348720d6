"""The dot interaction as the lab's kernel against torch's ops (issues 56 and 59): ~3 min on 2 cores.

    python benchmarks/interaction_ab.py [--parts alone,packages] [--builds aoti_frozen,aoti_tuned] [--rounds 10]

alone     The interaction alone at kaggle's shape (27 vectors of 16 a sample), one thread: served (forward, no grad;
          batches of 1, 64 and 512; torch's ops eager and compiled by Inductor, the kernel) and trained (forward and
          backward at 2,048, bf16 under autocast and fp32), microseconds a sample, the ways interleaved.
packages  kaggle (tables capped at 1M rows, on 2 MiB pages where the machine allows, one copy shared), the precision
          `auto` picks: each build's whole-batch package made both ways and loaded in this process, each timed as an
          instance times itself at start (`fixed ms a batch + us a sample`), the packages interleaved in `--rounds`
          rounds; each kernel package's ratio to its torch twin in the same round, median over rounds.
          Targets (AMX): <= 0.15 ms a batch, <= 1.5 us a sample.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from common import canary_mark, header, results_path, write_results
from one_call import kaggle_setup

from dlrm_lab.infer import build as builds
from dlrm_lab.infer.interaction import put
from dlrm_lab.infer.serving_parts import make_runner
from dlrm_lab.infer.table_lookup import table_weights
from dlrm_lab.metrics.huge_pages import back_with_huge_pages
from dlrm_lab.model import native
from dlrm_lab.model.interaction import DotInteractionArch

REPEATS = 7


def _us_per_sample(fn: Any, samples: int, seconds: float = 0.05) -> float:
    fn()
    calls = max(1, int(seconds / max(1e-6, _once(fn))))
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls / samples * 1e6


def _once(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def alone() -> dict[str, Any]:
    torch.set_num_threads(1)
    arch = DotInteractionArch(num_sparse_features=26)
    compiled = torch.compile(arch, dynamic=True)
    out: dict[str, Any] = {}
    for batch in (1, 64, 512):
        dense, sparse = torch.randn(batch, 16, dtype=torch.bfloat16), torch.randn(batch, 26, 16, dtype=torch.bfloat16)

        def served(native_way: bool, module: Any = arch, inputs: tuple[Any, ...] = (dense, sparse)) -> Any:
            def call() -> None:
                arch.native = native_way
                with torch.no_grad():
                    module(*inputs)

            return call

        ways = {"torch": served(False), "compiled": served(False, compiled), "native": served(True)}
        times: dict[str, list[float]] = {w: [] for w in ways}
        for k in range(REPEATS):
            for w, fn in ways.items() if k % 2 == 0 else reversed(ways.items()):
                times[w].append(_us_per_sample(fn, batch))
        out[f"served bf16 {batch}"] = {w: round(statistics.median(t), 3) for w, t in times.items()}
        said = ", ".join(f"{w} {v:.3f}" for w, v in out[f"served bf16 {batch}"].items())
        print(f"served bf16, {batch} samples: {said} us a sample", flush=True)
    batch = 2048
    for precision in ("bf16", "fp32"):
        bf16 = precision == "bf16"
        dense = torch.randn(batch, 16, dtype=torch.bfloat16 if bf16 else torch.float32, requires_grad=True)
        sparse = torch.randn(batch, 26, 16, requires_grad=True)
        grad = torch.randn(batch, 16 + 351)

        def trained(native_way: bool, inputs: tuple[Any, ...] = (dense, sparse, grad), bf16: bool = bf16) -> Any:
            def call() -> None:
                arch.native = native_way
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                    result = arch(*inputs[:2])
                result.backward(inputs[2].to(result.dtype))

            return call

        ways = {"torch": trained(False), "native": trained(True)}
        times = {w: [] for w in ways}
        for k in range(REPEATS):
            for w, fn in ways.items() if k % 2 == 0 else reversed(ways.items()):
                times[w].append(_us_per_sample(fn, batch, seconds=0.2) * batch / 1e3)
        out[f"trained {precision} {batch} ms"] = {w: round(statistics.median(t), 3) for w, t in times.items()}
        print(f"trained {precision}, {batch} samples, forward and backward: "
              + ", ".join(f"{w} {v:.2f}" for w, v in out[f"trained {precision} {batch} ms"].items()) + " ms",
              flush=True)  # fmt: skip
    return out


def packages(names: list[str], rounds: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    spec, precision, model, library = kaggle_setup()
    modules = {}
    for way in ("torch", "native"):
        put(model, way)
        for name in names:
            modules[f"{name}/{way}"] = builds.make_build(model, name, precision=precision, table_precision="fp32")
    shared = table_weights(next(iter(modules.values())).tables).clone()
    pages = back_with_huge_pages([shared])
    for module in modules.values():
        module.whole.tables = shared
    runners = {k: make_runner(m, library, torch.device("cpu"), precision) for k, m in modules.items()}
    for runner in runners.values():
        runner.warm_up(256)
    costs: dict[str, list[Any]] = {k: [] for k in runners}
    for r in range(rounds):
        items = list(runners.items())
        for k, runner in items if r % 2 == 0 else items[::-1]:
            costs[k].append(runner.batch_cost(256, repeats=7))
    out: dict[str, Any] = {"precision": precision, "huge_bytes": pages.huge_bytes, "routes": {}}
    for k in runners:
        twin = k.split("/")[0] + "/torch"
        fixed = statistics.median(c.fixed_ms for c in costs[k])
        sample_us = 1e3 * statistics.median(c.per_sample_ms for c in costs[k])
        ratios = [
            (n.fixed_ms / o.fixed_ms, n.per_sample_ms / o.per_sample_ms)
            for o, n in zip(costs[twin], costs[k], strict=True)
        ]
        out["routes"][k] = {
            "fixed_ms": round(fixed, 4),
            "sample_us": round(sample_us, 3),
            "paired_fixed": round(statistics.median(f for f, _ in ratios), 3),
            "paired_sample": round(statistics.median(s for _, s in ratios), 3),
        }
        print(f"{k:24s} {fixed:.3f} ms + {sample_us:.2f} us a sample; against {twin} in the same rounds: "
              f"batch {out['routes'][k]['paired_fixed']:.3f}x, sample {out['routes'][k]['paired_sample']:.3f}x",
              flush=True)  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="alone,packages")
    ap.add_argument("--builds", default="aoti_frozen,aoti_tuned")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--out", help="the results file (default: results/results-interaction_ab-...)")
    args = ap.parse_args()
    if (why := native.load()) is not None:
        raise SystemExit(f"interaction_ab: {why}")
    results: dict[str, Any] = header(rounds=args.rounds)
    parts = args.parts.split(",")
    if "alone" in parts:
        results["alone"] = alone()
        canary_mark(results, "after alone")
    if "packages" in parts:
        results["packages"] = packages(args.builds.split(","), args.rounds)
    write_results(results_path("interaction_ab", args.out), results)


if __name__ == "__main__":
    main()

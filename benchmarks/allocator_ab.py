"""The C allocator an instance runs (issue 56): each installed allocator against glibc's malloc, interleaved.

    python benchmarks/allocator_ab.py [--parts batch,points] [--rounds 3] [--duration 120]

batch   kaggle (tables capped at 1M rows), one thread, the precision `auto` picks: each route's batch as an instance
        measures itself at start (1 and 256 samples alternated on its own weights, median of 7, three times), in a
        fresh process per allocator (its library first in LD_PRELOAD, `infer.allocator.preloaded`; the process
        checks its own mappings), the allocators interleaved over rounds: `fixed ms a batch + us a sample`, and each
        against glibc's in the same round. Routes (`/native` or `/fbgemm` after a name: its packages' table lookup,
        `infer.table_lookup`; fbgemm's where none is named; `+k` after it: the packages' GEMMs at the input widths
        `infer.gemm_widths` chooses, each paired with the same route at the model's own): aoti, aoti_frozen,
        aoti_tuned, by_size (as an instance of `--build auto` serves when aoti_frozen is chosen: each of its
        finalists timed at every batch size it serves and each size served by the fastest, `infer.finalists`) and
        buckets (one static package per size, frozen
        and max-autotuned: `one_call.py`'s). The tables on the pages serving maps them on (`--table-pages`, default
        auto: 2 MiB where the machine's profile measured the gather faster on them, as `infer run`'s default
        chooses; here anonymous memory collapsed onto them, where instances map a tmpfs of them). Targets (AMX):
        <= 0.15 ms a batch, <= 1.5 us a sample.
points  The low-load point (kaggle 100k rows, MLPerf sizes, 3 q/s, 1 x 1, `--duration` s, build auto) under
        `--allocator glibc` and each other installed one, interleaved: p99 over its floor (target <= 3x).

`make run`'s bounded rate under each allocator: `bounded_rate.py --allocators glibc,auto`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from common import child_failed, header, results_path, tables_on_huge_pages, write_results

from dlrm_lab.infer import allocator
from dlrm_lab.metrics.gather_pages import auto_pages

ROUTES = ("aoti", "aoti_frozen", "aoti_tuned", "by_size", "buckets")
FINALISTS = ("aoti_frozen", "aoti_tuned", "aoti")  # by_size: the build served first, then its finalists
SIZES = (1, 256)


def child(routes: list[str], bucket_dir: str, pages: str) -> None:
    """One process's measurement of `routes` (printed as one JSON line), under whatever allocator it was started,
    the tables on `pages` (base or huge). A route `name/native` is `name` with the lab's table lookup in its
    packages (`infer.table_lookup`), `name/fbgemm` with fbgemm's; a bare name takes fbgemm's."""
    import copy
    from types import SimpleNamespace

    import torch
    from one_call import Buckets, kaggle_setup

    from dlrm_lab.infer import build as builds
    from dlrm_lab.infer.builds import build_named
    from dlrm_lab.infer.gemm_widths import choose_widths
    from dlrm_lab.infer.instance import _final_build
    from dlrm_lab.infer.interaction import choose_interaction
    from dlrm_lab.infer.serving_parts import make_runner
    from dlrm_lab.infer.table_lookup import FBGEMM

    torch.set_num_threads(1)
    _, precision, model, library = kaggle_setup()
    # the interaction's way as the serving plan chooses it, before any build (`infer.interaction`)
    interaction = choose_interaction(
        model, precision=precision, sizes=list(SIZES), threads=1, device="cpu", log=lambda _: None
    )
    bases: dict[str, Any] = {}
    widths: dict[str, Any] = {}

    def made_with(build: str, way: str) -> Any:
        """`build` made from a fused base whose packages call the lookup `way` (`lookup+k`: at the GEMM widths
        `infer.gemm_widths` chooses in this process; the model's own widths otherwise)."""
        if way not in bases:
            bases[way] = builds.make_build(model, "fused", precision=precision, table_precision="fp32")
            bases[way].lookup_way = way.partition("+")[0]
            if way.endswith("+k"):
                widths[way] = choose_widths(bases[way], sizes=list(SIZES), threads=1)["widths"]
        return build_named(build).make(model, bases[way], precision=precision, table_precision="fp32")

    modules: dict[str, Any] = {}
    routed: dict[str, Any] = {}  # by_size: (plan, served module), routed as an instance does
    for route in routes:
        name, _, way = route.partition("/")
        way = way or FBGEMM  # a bare name: fbgemm's lookup, as its docstring says
        if name == "by_size":
            made = {b: made_with(b, way) for b in FINALISTS}
            plan = SimpleNamespace(build=FINALISTS[0], finalists=tuple((b, made[b].package) for b in FINALISTS[1:]),
                                   precision=precision, history_cache_mb=0)  # fmt: skip
            routed[route] = (plan, made[FINALISTS[0]])
        elif name == "buckets":
            fused = builds.make_build(model, "fused", precision=precision, table_precision="fp32")
            aoti = modules.get("aoti") or builds.make_build(model, "aoti", precision=precision, table_precision="fp32")
            bucketed = fused.sibling()
            bucketed.whole = copy.copy(aoti.whole)
            bucketed.whole.run = Buckets(fused, SIZES, Path(bucket_dir), aoti.whole.run, reuse=True).run
            modules[route] = bucketed
        else:
            modules[route] = made_with(name, way)
    huge = None
    if pages == "huge":
        huge = tables_on_huge_pages([*modules.values(), *(m for _, m in routed.values())])
    runners = {r: make_runner(m, library, torch.device("cpu"), precision) for r, m in modules.items()}
    for runner in runners.values():
        runner.warm_up(max(SIZES))
    chosen: dict[str, Any] = {}
    for route, (plan, served) in routed.items():  # as an instance serves it: its finalists timed at each size
        _, runners[route], chosen[route] = _final_build(plan, served, library, torch.device("cpu"), max(SIZES))
    runners = {r: runners[r] for r in routes}  # the order asked: interleaved as given
    costs: dict[str, list[Any]] = {r: [] for r in runners}
    for _ in range(3):
        for route, runner in runners.items():
            costs[route].append(runner.batch_cost(max(SIZES), repeats=7))
    out = {
        r: {
            "per_batch_ms": statistics.median(c.fixed_ms for c in cs),
            "per_sample_us": statistics.median(c.per_sample_ms for c in cs) * 1e3,
        }
        for r, cs in costs.items()
    }
    got = {"allocator": allocator.in_use(), "precision": precision, "routes": out, "by_size": chosen, "pages": pages}
    got["interaction"] = interaction["interaction"] if interaction else None
    got["widths"] = widths
    if huge is not None:
        got["huge_bytes"], got["huge_error"] = huge.huge_bytes, huge.error
    print(json.dumps(got), flush=True)


def batch_part(found: dict[str, str], rounds: int, routes: list[str], pages: str) -> dict[str, Any]:
    rows: dict[str, list[dict[str, Any]]] = {a: [] for a in found}
    with tempfile.TemporaryDirectory() as buckets:
        # the packages made once, before any round (each later process loads them from the cache)
        command = [sys.executable, __file__, "--child", ",".join(routes), buckets, pages]
        subprocess.run(command, check=True, capture_output=True)
        for k in range(rounds):
            for name, library in found.items():
                with allocator.preloaded(library):
                    out = subprocess.run(command, capture_output=True, text=True)
                if out.returncode != 0:
                    raise child_failed(f"{name}: its trial", out)
                got = json.loads(out.stdout.strip().splitlines()[-1])
                if got["allocator"] != name:
                    raise SystemExit(f"{name}: the process ran {got['allocator']}")
                rows[name].append(got)
                said = "; ".join(
                    f"{r} {v['per_batch_ms']:.3f} ms + {v['per_sample_us']:.2f} us" for r, v in got["routes"].items()
                )
                print(f"  round {k + 1} {name}: {said}", flush=True)
                for route, served in got["by_size"].items():
                    print(f"    {route} served {served['build']}: {served['reason']}", flush=True)
                for way, chosen in got.get("widths", {}).items():
                    print(f"    {way}: GEMM widths {chosen}", flush=True)
    summary: dict[str, Any] = {}
    for name, runs in rows.items():
        for route in routes:
            fixed = [r["routes"][route]["per_batch_ms"] for r in runs]
            sample = [r["routes"][route]["per_sample_us"] for r in runs]
            base_fixed = [r["routes"][route]["per_batch_ms"] for r in rows["glibc"]]
            base_sample = [r["routes"][route]["per_sample_us"] for r in rows["glibc"]]
            summary[f"{route}/{name}"] = {
                "per_batch_ms": statistics.median(fixed),
                "per_sample_us": statistics.median(sample),
                "per_batch_vs_glibc": statistics.median(f / b for f, b in zip(fixed, base_fixed, strict=True)),
                "per_sample_vs_glibc": statistics.median(s / b for s, b in zip(sample, base_sample, strict=True)),
            }
            s = summary[f"{route}/{name}"]
            print(
                f"{route:12s} {name:9s} {s['per_batch_ms']:.3f} ms a batch ({s['per_batch_vs_glibc']:.3f}x glibc's) + "
                f"{s['per_sample_us']:.2f} us a sample ({s['per_sample_vs_glibc']:.3f}x)",
                flush=True,
            )
    paired: dict[str, Any] = {}  # the lab's table lookup against fbgemm's, paired within each process; and so
    # a package at the chosen GEMM widths (`+k`) against the same at the model's own
    pairs = [(r, r[: -len("native")] + "fbgemm") for r in routes if r.endswith("/native")]
    pairs += [(r, r[: -len("+k")]) for r in routes if r.endswith("+k")]
    for name, runs in rows.items():
        for route, base in ((r, b) for r, b in pairs if b in routes):
            ratio = {
                key: statistics.median(r["routes"][route][key] / r["routes"][base][key] for r in runs)
                for key in ("per_batch_ms", "per_sample_us")
            }
            paired[f"{route}/{name}"] = ratio
            print(f"{route:20s} {name:9s} against {base}: a batch {ratio['per_batch_ms']:.3f}x, a sample "
                  f"{ratio['per_sample_us']:.3f}x (medians of per-round ratios)", flush=True)  # fmt: skip
    return {"rounds": rows, "summary": summary, "paired": paired}


def points_part(found: dict[str, str], rounds: int, duration: str) -> dict[str, Any]:
    from one_call import low_load

    return low_load({a: ["--build", "auto", "--allocator", a] for a in found}, duration, rounds)


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2].split(","), sys.argv[3], sys.argv[4])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parts", default="batch,points")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--routes", default=",".join(ROUTES))
    parser.add_argument("--duration", default="120")
    parser.add_argument("--table-pages", default="auto", choices=("auto", "base", "huge"))
    parser.add_argument("--out", default=None, help="the results file (default: results/results-allocator_ab-...)")
    args = parser.parse_args()
    found = allocator.installed()
    if len(found) == 1:
        raise SystemExit("only glibc's malloc is installed: nothing to compare (apt-get install libjemalloc2 ...)")
    results: dict[str, Any] = header(installed=found)
    parts = args.parts.split(",")
    pages = args.table_pages
    if pages == "auto":  # as `infer run`'s default chooses (`infer.plan.Planner.choose_table_pages`)
        pages, why = auto_pages(1, measure=False)
        print(f"table pages {pages}: {why}", flush=True)
    results["table_pages"] = pages
    if "batch" in parts:
        results["batch"] = batch_part(found, args.rounds, args.routes.split(","), pages)
    if "points" in parts:
        results["points"] = points_part(found, args.rounds, args.duration)
    write_results(results_path("allocator_ab", args.out), results)


if __name__ == "__main__":
    main()

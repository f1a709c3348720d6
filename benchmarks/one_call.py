"""One native call per batch (issue 56's benchmark): ~8 min on 2 cores.

    python benchmarks/one_call.py [--parts batch,points] [--table-precisions fp32,int8]

batch   The Criteo Kaggle shape (tables capped at 1M rows), one thread, the precision `auto` picks, the tables on the
        pages an instance maps them on (`--table-pages auto`). Every route to a batch's fixed cost, as an instance
        measures itself at start (1 and 256 samples alternated on its own weights, median of 7), the routes
        interleaved in 7 rounds, each as `fixed ms a batch + us a sample` beside the roof of a sample at that
        precision:
          fused        fbgemm's TBE from Python, then the dense part from Python (stages apart);
          dense_pkg    the last round's `aoti`: the dense part alone in an AOTInductor package, the lookup from Python;
          aoti         the whole batch (lookup inside) in one package, dynamic batch, one call;
          aoti_frozen  the same, compiled with Inductor's freezing (the dense weights prepacked at build time);
          aoti_tuned   the same, compiled with max_autotune and Inductor's C++ GEMM template beside ATen's;
          aoti_int8    the whole batch with its dense part int8 (torchao PT2E);
          aoti_buckets the lab's bucket build: aoti_frozen, and a static-shape max_autotune package for each small
                       batch size where one is faster (made and chosen as a served instance's are);
          buckets      one static-shape package per batch size (1 and 256 here), max_autotune: the bucket route.
        Targets (AMX): <= 0.15 ms a batch, <= 1.5 us a sample.
points  The low-load point (kaggle 100k rows, MLPerf sizes, 3 q/s, 1 x 1, 120 s; `--duration` to shorten) under
        the builds `fused`, `aoti` and `auto`, interleaved: p99 over its floor (target <= 3x).
idle    The same point, build auto, under each route against an idle tail: none, keep-warm batches every 10 ms,
        an instance that spins, /dev/cpu_dma_latency held at 0, the tables locked, malloc keeping freed memory, the
        haltpoll window raised (`--idle-hold`), interleaved; `--idle-routes` names a subset.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch
from common import header, results_path, tables_on_huge_pages, write_results

import dlrm_lab
from dlrm_lab.infer.build import BuildSet
from dlrm_lab.infer.builds import BuildFailed, build_names, dense_weight_bytes
from dlrm_lab.infer.builds.aoti import WholeBatch, example_batch
from dlrm_lab.infer.gemm_widths import choose_widths
from dlrm_lab.infer.interaction import choose_interaction
from dlrm_lab.infer.library import PackedLibrary
from dlrm_lab.infer.records import batch_roof, build_peaks
from dlrm_lab.infer.serving_parts import make_runner
from dlrm_lab.infer.table_lookup import choose_lookup, table_weights
from dlrm_lab.metrics.gather_pages import auto_pages
from dlrm_lab.metrics.precision import AUTO, choose_precision
from dlrm_lab.metrics.roofline import load_profile
from dlrm_lab.model.dlrm import build_model

SIZES = (1, 256)
ROUNDS = 7
TUNED = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"}


def dense_package(fused: Any, directory: Path) -> Any:
    """The last round's route: the dense part alone exported (dynamic batch) and packaged; the lookup stays Python."""
    module = fused.sibling()
    dense, features = module.dense, module.spec.num_dense
    no_ids = torch.zeros(len(module.spec.feature_names) * 64 + 1, dtype=torch.int32)  # 64 empty bags a feature
    with torch.inference_mode():
        pooled = module.lookup(torch.zeros(0, dtype=torch.int32), no_ids)
    batch = torch.export.Dim("batch", min=1)
    with torch.no_grad():
        exported = torch.export.export(dense, (torch.zeros(64, features, dtype=module.dtype), pooled),
                                       dynamic_shapes=({0: batch}, {0: batch}))  # fmt: skip
        path = directory / "dense.pt2"  # compiled with grad off: Inductor freezes only then
        torch._inductor.aoti_compile_and_package(exported, package_path=str(path), inductor_configs={"freezing": True})
    module.compiled = torch._inductor.aoti_load_package(str(path))
    return module


class Buckets:
    """One static-shape package per batch size, called by the size of the batch it is handed (the bucket route)."""

    def __init__(self, fused: Any, sizes: tuple[int, ...], directory: Path, other: Any, reuse: bool = False) -> None:
        self.tables, self.other = table_weights(fused.tables), other  # `other`: sizes without a bucket (warm-up)
        self.runs = {}
        for n in sizes:
            path = directory / f"bucket-{n}.pt2"
            if reuse and path.is_file():  # made by an earlier process of the same benchmark
                self.runs[n] = torch._inductor.aoti_load_package(str(path)).loader.run
                continue
            whole = WholeBatch(fused).eval()
            with torch.no_grad():
                exported = torch.export.export(
                    whole,
                    example_batch(fused, n),
                    strict=False,
                    dynamic_shapes=(None, {0: torch.export.Dim("ids", min=0)}, None, None),
                )
                torch._inductor.aoti_compile_and_package(exported, package_path=str(path), inductor_configs=TUNED)
            self.runs[n] = torch._inductor.aoti_load_package(str(path)).loader.run

    def run(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        bucket = self.runs.get(inputs[0].shape[0])
        return bucket(inputs) if bucket is not None else self.other(inputs)


def kaggle_setup() -> tuple[Any, str, Any, PackedLibrary]:
    """The batch benchmarks' model (kaggle, tables capped at 1M rows, seed 0), the precision `auto` picks at one
    thread, and a sample library of 4,096: (spec, precision, model, library)."""
    spec = dlrm_lab.load_preset("kaggle", max_rows=1_000_000)
    precision = choose_precision(AUTO, spec, allowed=("fp32", "bf16", "fp16"), threads=1, rows=256).precision
    torch.manual_seed(0)
    return spec, precision, build_model(spec).eval(), PackedLibrary.generate(spec, None, 0, 4096)


def batch_part(table_precisions: list[str]) -> dict[str, Any]:
    spec, precision, model, library = kaggle_setup()
    # the tables on the pages an instance maps them on (`--table-pages auto`: 2 MiB where the machine's profile
    # measured the gather faster on them); until 2026-12-02 they were timed on 4 KiB pages, which no instance serves
    # where 2 MiB pages win (AMX: kaggle's 26 rows a sample, each a TLB miss)
    pages, pages_reason = auto_pages(1, measure=False)
    print(f"table pages {pages}: {pages_reason}", flush=True)
    out: dict[str, Any] = {"precision": precision, "routes": {}, "table_pages": pages}
    # what the serving plan chooses before its builds are made, at the sizes timed here: the dot interaction's way
    # (torch's ops or the lab's kernel), then the packages' table lookup and GEMM widths: the routes are timed as
    # an instance would serve them (until 2026-12-02 they were timed with torch's interaction and no widths chosen)
    cpu = torch.device("cpu")
    interaction = choose_interaction(model, precision=precision, sizes=list(SIZES), threads=1, device=cpu, log=print)
    out["interaction"] = interaction
    with tempfile.TemporaryDirectory() as tmp:
        for table_precision in table_precisions:
            made = BuildSet(model, precision, table_precision)
            choices = {
                "lookup": choose_lookup(made["fused"], library, sizes=list(SIZES), threads=1, log=print),
                "widths": choose_widths(made["fused"], sizes=list(SIZES), threads=1, log=print),
            }
            out.setdefault("choices", {})[table_precision] = choices
            modules = {}
            for b in ("fused", "aoti", "aoti_frozen", "aoti_tuned", "aoti_buckets", "aoti_int8"):
                try:
                    modules[b] = made[b]
                except BuildFailed as e:  # a package that fails a batch size: named, not timed
                    out.setdefault("failed", {})[f"{b}/{table_precision}"] = str(e)
                    print(f"  {b:10s} tables {table_precision}: not timed: {e}", flush=True)
            if "aoti_buckets" in modules:
                print(f"  aoti_buckets: {modules['aoti_buckets'].static_reason}", flush=True)
                out.setdefault("static", {})[table_precision] = modules["aoti_buckets"].static_reason
            modules["dense_pkg"] = dense_package(modules["fused"], Path(tmp))
            bucketed = modules["fused"].sibling()
            bucketed.whole = copy.copy(modules["aoti"].whole)
            bucketed.whole.run = Buckets(modules["fused"], SIZES, Path(tmp), modules["aoti"].whole.run).run
            modules["buckets"] = bucketed
            if pages == "huge":
                huge = tables_on_huge_pages(list(modules.values()))
                out.setdefault("huge_bytes", {})[table_precision] = huge.huge_bytes
                if huge.error:
                    print(f"  tables on huge pages: {huge.error}", flush=True)
            # each route as an instance measures itself at start (`batch_cost`: 1 and 256 samples alternated, median
            # of 7, back to back on its own weights), the routes interleaved in rounds against the host's drift
            runners = {r: make_runner(m, library, cpu, precision) for r, m in modules.items()}
            for runner in runners.values():
                runner.warm_up(max(SIZES))
            costs: dict[str, list[Any]] = {r: [] for r in runners}
            for _ in range(ROUNDS):
                for route, runner in runners.items():
                    costs[route].append(runner.batch_cost(max(SIZES), repeats=7))
            for route in modules:
                weights = dense_weight_bytes(route if route in build_names() else "aoti", precision)
                own = build_peaks(load_profile(), "cpu", route if route in build_names() else "aoti", precision, 1)
                roof = batch_roof(spec, table_precision, own, weights)
                fixed = statistics.median(c.fixed_ms for c in costs[route])
                per_sample_us = statistics.median(c.per_sample_ms for c in costs[route]) * 1e3
                roof_per_sample_us = (roof(256) - roof(1)) / 255 * 1e3
                row = {"per_batch_ms": fixed, "per_sample_us": per_sample_us,
                       "rounds": [[c.fixed_ms, c.per_sample_ms * 1e3] for c in costs[route]],
                       "roof_ms": {n: roof(n) for n in SIZES}, "roof_per_sample_us": roof_per_sample_us,
                       "fraction_of_roof_per_sample": roof_per_sample_us / per_sample_us}  # fmt: skip
                out["routes"][f"{route}/{table_precision}"] = row
                print(f"  {route:10s} tables {table_precision}: {fixed:.3f} ms a batch + {per_sample_us:.2f} us a "
                      f"sample (roof {roof_per_sample_us:.2f} us: {row['fraction_of_roof_per_sample']:.2f} of it)",
                      flush=True)  # fmt: skip
    return out


LOW_LOAD = ["--model", "kaggle", "--max-rows", "100000", "--query-size", "mlperf", "--qps", "3", "--instances", "1",
            "--threads", "1", "--sla-ms", "100"]  # fmt: skip
LOW_LOAD_KEYS = ("build", "allocator", "sla_latency_ms", "latency_floor_ms", "latency_floor_ratio", "batch_fixed_ms",
                 "batch_per_sample_us", "queries", "idle_hold", "spin_ms", "keep_warm_ms", "canary_ratio")  # fmt: skip


def low_load(routes: dict[str, list[str]], duration: str, repeats: int) -> dict[str, Any]:
    """The low-load point (kaggle 100k rows, MLPerf sizes, 3 q/s, 1 x 1) under each route's extra options,
    interleaved `repeats` times: each run's summary and the median p99 over its floor (target <= 3x)."""
    import pyarrow.parquet as pq
    from common import lab_run

    rows: dict[str, list[dict[str, Any]]] = {r: [] for r in routes}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(repeats):
            for route, extra in routes.items():
                run_dir = lab_run(Path(tmp), "infer", "run", *LOW_LOAD, "--duration", duration, *extra)
                (row,) = pq.read_table(run_dir / "summary.parquet").to_pylist()
                keep = {k: row.get(k) for k in LOW_LOAD_KEYS}
                rows[route].append(keep)
                print(
                    f"  {route} ({keep['build']}, {keep['allocator']}): p99 {keep['sla_latency_ms']:.2f} ms, floor "
                    f"{keep['latency_floor_ms']:.3f} ms, {keep['latency_floor_ratio']:.2f}x; batch "
                    f"{keep['batch_fixed_ms']:.3f} ms + {keep['batch_per_sample_us']:.2f} us; canary "
                    f"{keep['canary_ratio'] or 0:.2f}",
                    flush=True,
                )
    return {r: {"runs": v, "floor_ratio_median": statistics.median(x["latency_floor_ratio"] for x in v)}
            for r, v in rows.items()}  # fmt: skip


def points_part(duration: str, repeats: int) -> dict[str, Any]:
    """The low-load point under the builds `fused`, `aoti` and `auto`, interleaved."""
    return low_load({f"--build {b}": ["--build", b] for b in ("fused", "aoti", "auto")}, duration, repeats)


IDLE_ROUTES = {
    "none": [],
    "keep-warm 10 ms": ["--keep-warm-ms", "10"],
    "spin": ["--spin-ms", "1000"],
    "cpu-latency": ["--idle-hold", "cpu-latency"],
    "lock-tables": ["--idle-hold", "lock-tables"],
    "keep-memory": ["--idle-hold", "keep-memory"],
    "halt-poll": ["--idle-hold", "halt-poll"],
}


def idle_part(duration: str, repeats: int, names: list[str]) -> dict[str, Any]:
    """The low-load point, build auto, under each idle-tail route, interleaved."""
    return low_load({r: ["--build", "auto", *IDLE_ROUTES[r]] for r in names}, duration, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parts", default="batch,points")
    parser.add_argument("--table-precisions", default="fp32,int8")
    parser.add_argument("--duration", default="120")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--idle-routes", default=",".join(IDLE_ROUTES))
    parser.add_argument("--out", default=None, help="the results file (default: results/results-one_call-<date>.json)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results: dict[str, Any] = {"header": header()}
    parts = args.parts.split(",")
    if "batch" in parts:
        results["batch"] = batch_part(args.table_precisions.split(","))
    if "points" in parts:
        results["points"] = points_part(args.duration, args.repeats)
    if "idle" in parts:
        results["idle"] = idle_part(args.duration, args.repeats, args.idle_routes.split(","))
    write_results(results_path("one_call", args.out), results)


if __name__ == "__main__":
    main()

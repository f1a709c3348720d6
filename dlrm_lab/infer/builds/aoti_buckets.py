"""`aoti_buckets`: `aoti_frozen`'s package, and beside it one static-shape package per small batch size where one
is faster (the bucket route).

A package exported for one batch size lets Inductor's C++ GEMM template (`max_autotune`) generate kernels for that
M alone, the weights packed at compile time: kaggle bf16 on Zen 4 (one thread, after a 256-sample batch) served a
1-sample batch in 0.115 ms against the dynamic package's 0.31, where at 8 samples it was no faster (0.31 against
0.32). So the sizes of STATIC_SIZES are made smallest first, each timed against the dynamic package at its size as
it is made, and kept only where faster by `MARGIN`; the first size not kept ends the list (each costs a compile,
and a larger static batch did not win where a smaller one lost). Where none is kept the build fails: it would be
`aoti_frozen`; where the median query holds more samples than the largest static size, `auto` does not make it.
The runner pads a batch up to the static size that holds it (`infer.batches.PackagedRunner`): a
batch is still one native call, and the tables stay an input every package shares.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from dlrm_lab.config.values import JsonObject
from dlrm_lab.infer.artefacts import cached_artefact, content_key, dense_package
from dlrm_lab.infer.builds import MARGIN, BuildFailed
from dlrm_lab.infer.builds.aoti import (
    CHECK_SIZES,
    GRAPH,
    AOTIBuild,
    PackagedBatch,
    check_batch_sizes,
    example_batch,
    export_whole,
    load_package,
    package_calls,
)
from dlrm_lab.infer.builds.aoti_frozen import BUILD as FROZEN
from dlrm_lab.infer.builds.aoti_tuned import BUILD as TUNED
from dlrm_lab.infer.gemm_widths import padded
from dlrm_lab.infer.table_lookup import table_weights

STATIC_SIZES = (1, 2, 4, 8)  # powers of two: the runner's buckets (`infer.batches.bucket`)
ROUNDS = 9  # interleaved timings of a static package and the dynamic one at its size, median kept


class AOTIBucketsBuild(AOTIBuild):
    name = "aoti_buckets"
    order = 6
    about = (
        "aoti_frozen, with a static-shape max_autotune package for each small batch size where one is faster "
        "(batches padded up to it)"
    )
    frozen = True

    def make(self, model: Any, base: Any, *, precision: str, table_precision: str) -> Any:
        module = FROZEN.make(model, base, precision=precision, table_precision=table_precision)  # the dynamic one
        even = precision in ("bf16", "fp16")  # the template's AMX kernel takes K in VNNI pairs (`aoti_tuned`)
        widths = dict(module.gemm_widths)
        tables = table_weights(module.tables)
        static: dict[int, str] = {}
        timings: dict[int, tuple[float, float]] = {}
        for n in STATIC_SIZES:

            def export(m: Any, path: Path, n: int = n) -> None:
                dense_part = padded(m.dense, widths, even=even)
                export_whole(m, path, dense_part, inductor_configs=TUNED.inductor_configs, frozen=True, samples=n)

            made_by: JsonObject = {
                "precision": precision,
                "table_precision": table_precision,
                "graph": GRAPH,
                "samples": n,
                "inductor": TUNED.inductor_configs,
                "frozen": True,
                **({"k": "even"} if even else {}),
                **({"widths": widths} if widths else {}),
                **package_calls(module),
            }
            path = str(dense_package(f"{self.name}-{n}", module, ".pt2", export, made_by).path)
            timings[n] = _time_against(load_package(path), module.whole.run, module, n, tables)
            if timings[n][0] * MARGIN > timings[n][1]:
                break
            static[n] = path
        said = ", ".join(f"{n}: {s:.3f} against {d:.3f} ms" for n, (s, d) in timings.items())
        if not static:
            raise BuildFailed(f"{self.name}: no static package beats the dynamic one by {MARGIN:g}x here ({said})")
        module.static = static
        module.static_reason = f"static packages for {sorted(static)} samples ({said}, one batch each)"
        module.whole = PackagedBatch(module.package, tables, static)
        check_batch_sizes(self.name, module, module.whole, tuple(sorted(set(CHECK_SIZES) | set(static))))
        return module

    def skip(self, base_dense_ms: float | None, smallest: int | None = None) -> str | None:
        if smallest is not None and smallest > max(STATIC_SIZES):  # each static package costs a compile
            return (
                f"the batches it is timed at hold {smallest:,} samples or more (the median query): no static package "
                f"(up to {max(STATIC_SIZES)}) would serve one"
            )
        return super().skip(base_dense_ms)

    def in_instance(self, module: Any, device: Any, *, precision: str, table_precision: str) -> Any:
        if device.type == "cuda":
            raise RuntimeError(f"the {self.name} build is made for the CPU: on a GPU serve eager, fused or compiled")
        module.whole = PackagedBatch(module.package, table_weights(module.tables), module.static)  # shared
        return module

    def artefact(self, module: Any) -> str | None:
        """A small file naming its packages (the dynamic one, and the static ones by size), kept beside them."""
        about: JsonObject = {"package": module.package, "static": {str(n): p for n, p in module.static.items()}}

        def write(path: Path) -> None:
            path.write_text(json.dumps(about, indent=1) + "\n")

        return str(cached_artefact(content_key({"buckets": about}), ".buckets.json", write, about).path)

    def from_artefact(self, module: Any, artefact: str) -> Any:
        about = json.loads(Path(artefact).read_text())
        other = module.sibling()  # the tables this instance mapped, not a copy
        other.package, other.static = about["package"], {int(n): p for n, p in about["static"].items()}
        other.whole = PackagedBatch(other.package, table_weights(other.tables), other.static)
        return other


def _time_against(static: Any, dynamic: Any, module: Any, n: int, tables: torch.Tensor) -> tuple[float, float]:
    """Median ms of a batch of `n` samples by the static package and by the dynamic one, interleaved."""
    dense, ids, offsets, _ = example_batch(module, n)
    inputs = [torch.randn(dense.shape, generator=torch.Generator().manual_seed(n)), ids, offsets, tables]
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(ROUNDS + 1):
        for run, kept in zip((static, dynamic), times, strict=True):
            start = time.perf_counter()
            run(inputs)
            kept.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[0][1:]), statistics.median(times[1][1:])  # the first of each: warm-up


BUILD = AOTIBucketsBuild()

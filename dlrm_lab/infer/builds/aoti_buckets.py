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
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch

from dlrm_lab.config.values import JsonObject
from dlrm_lab.infer.artefacts import cached_artefact, content_key, dense_package
from dlrm_lab.infer.builds import MARGIN, BuildFailed
from dlrm_lab.infer.builds.aoti import (
    CHECK_SIZES,
    AOTIBuild,
    PackagedBatch,
    check_batch_sizes,
    example_batch,
    load_package,
)
from dlrm_lab.infer.builds.aoti_frozen import BUILD as FROZEN
from dlrm_lab.infer.builds.aoti_tuned import BUILD as TUNED
from dlrm_lab.infer.table_lookup import table_weights
from dlrm_lab.metrics.interleaved import interleaved_medians

STATIC_SIZES = (1, 2, 4, 8)  # powers of two: the runner's buckets (`infer.batches.bucket`)
ROUNDS = 9  # timings of a static package and the dynamic one at its size (`metrics.interleaved`), median kept


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
        timings: dict[int, tuple[float, float]] = {}
        for n in STATIC_SIZES:
            made_by = TUNED.keyed(module, {**TUNED.made_by(module, precision, table_precision), "samples": n})
            export = partial(TUNED.export, precision=precision, samples=n)
            path = str(dense_package(f"{self.name}-{n}", module, ".pt2", export, made_by).path)
            run = load_package(path)
            timings[n] = _time_against(run, module.whole.run, module, n, module.whole.tables)
            if timings[n][0] * MARGIN > timings[n][1]:
                break
            module.whole.add_static(n, path, run)
        said = ", ".join(f"{n}: {s:.3f} against {d:.3f} ms" for n, (s, d) in timings.items())
        if not module.whole.static:
            raise BuildFailed(f"{self.name}: no static package beats the dynamic one by {MARGIN:g}x here ({said})")
        module.static = dict(module.whole.static)  # what the snapshot carries: an instance loads them (`in_instance`)
        module.static_reason = f"static packages for {sorted(module.static)} samples ({said}, one batch each)"
        check_batch_sizes(self.name, module, module.whole, tuple(sorted(set(CHECK_SIZES) | set(module.static))))
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
    runs = {"static": static, "dynamic": dynamic}

    def timed(way: str) -> float:
        start = time.perf_counter()
        runs[way](inputs)
        return (time.perf_counter() - start) * 1e3

    ms = interleaved_medians(tuple(runs), timed, ROUNDS)
    return ms["static"], ms["dynamic"]


BUILD = AOTIBucketsBuild()

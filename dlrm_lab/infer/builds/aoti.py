"""`aoti`: the `fused` build with its dense part an AOTInductor package, made once and loaded by instances.

The dense part (bottom MLP, interaction, top MLP) is exported with `torch.export` at the served precision
(a dynamic batch dimension), compiled by AOTInductor with freezing (oneDNN prepacks the weights) and the
C++ wrapper, and packaged as one `.pt2` file cached on disk under a content key (`infer.artefacts`: the
weights, the preset, the precision, torch's version and the machine). An instance loads the package; it
compiles nothing at start, unlike `compiled`.

The tables stay in fbgemm's inference TBE, called as in `fused`, and are not in the package: the TBE holds
fbgemm's `AtomicCounter` script objects, which have no fake class for `torch.export` to trace through, and
a package that froze the tables in would give every co-located instance its own copy of them, where the
snapshot lets them share one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dlrm_lab.config.values import JsonObject
from dlrm_lab.infer.artefacts import dense_package, require_verified
from dlrm_lab.infer.builds.compiled import too_small_to_compile

EXAMPLE_BATCH = 64  # the batch the dense part is traced at; the batch dimension is exported as dynamic


def export_dense(module: Any, path: Path) -> None:
    """Export `module.dense` (a FusedDLRM's dense part) and compile it by AOTInductor into the package `path`."""
    dtype, dense = module.dtype, module.dense
    features = module.spec.num_dense
    no_ids = torch.zeros(len(module.spec.feature_names) * EXAMPLE_BATCH + 1, dtype=torch.int32)  # empty bags
    with torch.inference_mode():
        pooled = module.lookup(torch.zeros(0, dtype=torch.int32), no_ids)
    example = (torch.zeros(EXAMPLE_BATCH, features, dtype=dtype), pooled)
    batch = torch.export.Dim("batch", min=1)
    with torch.no_grad():
        exported = torch.export.export(dense, example, dynamic_shapes=({0: batch}, {0: batch}))
    torch._inductor.aoti_compile_and_package(exported, package_path=str(path), inductor_configs={"freezing": True})


def load_package(path: str) -> Any:
    """The package's runner, after checking its bytes against its record (a corrupt file is not served)."""
    return torch._inductor.aoti_load_package(str(require_verified(path)))


class AOTIBuild:
    name = "aoti"
    order = 3
    base = "fused"
    about = "fused, its dense part an AOTInductor package built once (cached on disk) and loaded"
    dense_precision = None
    weight_precision = None

    def make(self, model: Any, base: Any, *, precision: str, table_precision: str) -> Any:
        module = base.sibling()  # the same tables, not a copy
        return self.packaged(module, export_dense, {"precision": precision})

    def packaged(self, module: Any, export: Any, made_by: JsonObject) -> Any:
        """`module` with its dense part served from the package `export(module, path)` writes: cached under a key of
        the dense weights, the spec, `made_by` and the machine (`infer.artefacts`), then loaded."""
        artefact = dense_package(self.name, module, ".pt2", export, made_by)
        module.package, module.package_reason = str(artefact.path), artefact.reason
        module.compiled = load_package(module.package)
        return module

    def skip(self, base_dense_ms: float | None) -> str | None:
        return too_small_to_compile(base_dense_ms, "a package build of seconds per weights")

    def for_snapshot(self, module: Any) -> Any:
        module.compiled = None  # a loaded package does not pickle; each instance loads it
        return module

    def in_instance(self, module: Any, device: Any, *, precision: str, table_precision: str) -> Any:
        if device.type == "cuda":  # the package holds CPU kernels
            raise RuntimeError(f"the {self.name} build is made for the CPU: on a GPU serve eager, fused or compiled")
        module.compiled = load_package(module.package)
        return module


BUILD = AOTIBuild()

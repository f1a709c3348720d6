"""`aoti`: the whole batch, table lookup included, in one AOTInductor package made once and loaded by instances.

From assembled ids and dense features to scores, a batch is one call of the package's C++ runner: the tables'
pooled lookup (fbgemm's inference op or the lab's, as `infer.table_lookup` chose; AOTInductor runs either as a
fallback op), the bottom MLP, the interaction, the top MLP and the sigmoid. The graph is exported with
`torch.export` at the served precision (a dynamic batch dimension), compiled with the C++ wrapper, and cached on
disk under a content key (`infer.artefacts`). `aoti` keeps the dense weights as plain constants (each GEMM packs
them as it runs); `aoti_frozen` compiles the same graph with Inductor's freezing (the weights prepacked for oneDNN at
build time, the post-ops fused), which wins at small batches and loses at large ones on some shapes and precisions
(kaggle bf16 at 256 samples 0.70 against 0.74 ms; DLRMv2 fp16 at 2,048 89 against 72 ms, AMX): `auto` measures both.

The lookup is called directly with the TBE's layout held as buffers (`table_lookup.PooledLookup`), not through the
TBE module. The tables themselves are not in the package: they are an input of every call, the tensor each instance
mapped from the snapshot, so co-located instances share one copy (the package holds only the small dense weights;
`package_constants_in_so=False` with user-managed buffers would share them too, but loses the prepacked constants
that `aoti_frozen`'s freezing makes at compile time).

`aoti_tuned` is the same graph compiled with `max_autotune` and Inductor's C++ GEMM template beside ATen's
(AMX and AVX-512 micro-kernels generated for these shapes, epilogues fused): measured against `aoti`, as every
build is.
"""

from __future__ import annotations

import warnings
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dlrm_lab.config.values import JsonObject
from dlrm_lab.errors import first_line
from dlrm_lab.infer.artefacts import dense_package, record_of, require_verified
from dlrm_lab.infer.builds import BuildFailed
from dlrm_lab.infer.builds.compiled import too_small_to_compile
from dlrm_lab.infer.gemm_widths import padded
from dlrm_lab.infer.interaction import uses_native
from dlrm_lab.infer.table_lookup import NATIVE, PooledLookup, table_weights
from dlrm_lab.model import native

EXAMPLE_BATCH = 64  # the batch the graph is traced at; the batch dimension is exported as dynamic
# batch sizes each package is checked at before it serves, beside its traced one: a shape Inductor kept from the trace
# (torch 2.13's max_autotune wrote the interaction's bmm operand at the traced 64 rows, and the package raised at a
# batch of 1) fails here, not in a served batch
CHECK_SIZES = (1, 2, EXAMPLE_BATCH + 1)
CHECK_TOLERANCE = 0.02  # a score's largest change with the batch size (bf16 kernels differ by M; a bad shape more)
# what the package's graph is and how its kernels are compiled, in its cache key: a package of another graph (other
# inputs) or compiled otherwise is never loaded for it
GRAPH = "whole batch: fused lookup and dense part, from assembled ids; gathers unchecked; the interaction padded (3)"
# Inductor checks every indirect index of its kernels against its bounds (vector compares around a masked gather).
# The graph's only indirect indexing is the dot interaction's triangle, a constant index in range by construction
# (the ids go to the lookup op, not to Inductor's kernels, and the server checks them at submit): unchecked, kaggle's
# interaction at 256 samples took 189-195 us against 257-287 (torch.compile of the same ops, one thread, AMX).
UNCHECKED_GATHER: JsonObject = {"assert_indirect_indexing": False}


class WholeBatch(nn.Module):
    """A FusedDLRM's batch as one graph: `forward(dense [B, num_dense] fp32, ids int32, offsets int32 [F * B + 1],
    tables uint8) -> scores [B] fp32`, its tables looked up the module's way (`infer.table_lookup`). `dense_part`
    replaces the model's (aoti_int8: its quantised graph)."""

    def __init__(self, module: Any, dense_part: nn.Module | None = None) -> None:
        super().__init__()
        self.lookup = PooledLookup(module.tables, module.lookup_way)
        self.dense_part = module.dense if dense_part is None else dense_part
        self.dtype = module.dtype

    def forward(
        self, dense: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor, tables: torch.Tensor
    ) -> torch.Tensor:
        return torch.sigmoid(self.dense_part(dense.to(self.dtype), self.lookup(tables, ids, offsets)).float())


def example_batch(module: Any, size: int = EXAMPLE_BATCH) -> tuple[torch.Tensor, ...]:
    """A batch of `size` samples of one id per bag (ids 0): what the graph is traced at."""
    features = len(module.spec.feature_names)
    ids = torch.zeros(features * size, dtype=torch.int32)
    offsets = torch.arange(features * size + 1, dtype=torch.int32)
    return torch.zeros(size, module.spec.num_dense), ids, offsets, table_weights(module.tables)


def export_whole(
    module: Any,
    path: Path,
    dense_part: nn.Module | None = None,
    inductor_configs: JsonObject | None = None,
    frozen: bool = False,
    samples: int | None = None,
) -> None:
    """Export a FusedDLRM's whole batch (`WholeBatch`) and compile it by AOTInductor into the package `path`,
    `frozen` with Inductor's freezing or not, for any batch size or for batches of `samples` alone (a static shape:
    `aoti_buckets`)."""
    whole = WholeBatch(module, dense_part)
    whole.training = False  # itself only: the dense part is in eval already (a PT2E graph refuses `.eval()`)
    batch, ids = torch.export.Dim("batch", min=1), torch.export.Dim("ids", min=0)
    features = len(module.spec.feature_names)
    shapes: tuple[Any, ...] = ({0: batch}, {0: ids}, {0: features * batch + 1}, None)
    if samples is not None:  # the ids of a batch still vary (ragged bags); its samples do not
        shapes = (None, {0: ids}, None, None)
    # grad off through the compile too: Inductor freezes (prepacks oneDNN weights, lowers PT2E's int8 patterns)
    # only where grad is disabled, and otherwise compiles unfrozen without a word (every package was, for days)
    with torch.no_grad(), warnings.catch_warnings():
        example = example_batch(module, samples or EXAMPLE_BATCH)
        exported = torch.export.export(whole, example, dynamic_shapes=shapes, strict=False)
        # torch 2.13's own compile deep-copies a graph holding a LeafSpec: its notice
        warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
        torch._inductor.aoti_compile_and_package(
            exported,
            package_path=str(path),
            inductor_configs={"freezing": frozen, **UNCHECKED_GATHER, **(inductor_configs or {})},
        )


def load_package(path: str) -> Any:
    """The C++ runner of the whole-batch package at `path` (checked whole), the lab's kernels it calls loaded first."""
    record = record_of(path)  # what the package calls: the lab's kernels are called by name, loaded first
    if NATIVE in (record.get("interaction"), record.get("lookup")) and (why := native.load()) is not None:
        raise RuntimeError(f"{path}: {why}")
    return torch._inductor.aoti_load_package(str(require_verified(path))).loader.run


def package_calls(module: Any) -> JsonObject:
    """What a package of `module`'s whole batch calls by name (the lab's kernels), for its key and its record: an
    instance loads those kernels before the package."""
    return {
        **({"interaction": "native"} if uses_native(module) else {}),
        **({"lookup": NATIVE} if module.lookup_way == NATIVE else {}),
    }


class PackagedBatch:
    """A loaded whole-batch package: `run([dense, ids, offsets, tables])` is the C++ runner itself (one native
    call, no Python between the inputs and the scores); `tables` is the input every call hands it. `static`: batch
    size -> the path of a package made for batches of that size alone (`aoti_buckets`), loaded into `static_runs`;
    the runner pads a batch up to the one that holds it."""

    def __init__(self, path: str, tables: torch.Tensor, static: dict[int, str] | None = None) -> None:
        self.run = load_package(path)
        self.tables = tables
        self.static = dict(static or {})
        self.static_runs = {n: load_package(p) for n, p in self.static.items()}

    def add_static(self, samples: int, path: str, run: Any) -> None:
        """The package at `path` (its runner `run`, loaded) serves batches of `samples` from now on."""
        self.static[samples], self.static_runs[samples] = path, run

    def __call__(self, dense: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        run = self.static_runs.get(dense.shape[0], self.run)
        return run([dense, ids, offsets, self.tables])[0]


def check_batch_sizes(name: str, module: Any, whole: PackagedBatch, sizes: tuple[int, ...] = CHECK_SIZES) -> None:
    """BuildFailed unless the package `whole` runs at each of `sizes` and scores each sample as it does within a
    batch of its traced size (the same samples: random dense features, ids 0)."""
    spec = module.spec
    features = len(spec.feature_names)
    largest = max(max(sizes), EXAMPLE_BATCH)
    dense = torch.randn(largest, spec.num_dense, generator=torch.Generator().manual_seed(0))

    def scores(n: int) -> torch.Tensor:
        ids = torch.zeros(features * n, dtype=torch.int32)
        offsets = torch.arange(features * n + 1, dtype=torch.int32)
        with torch.inference_mode():
            return whole(dense[:n].contiguous(), ids, offsets).float()

    try:
        traced = scores(EXAMPLE_BATCH).reshape(-1)
    except RuntimeError as e:
        raise BuildFailed(f"{name}: its package fails at a batch of {EXAMPLE_BATCH}: {first_line(e)}") from None
    for n in sizes:
        try:
            got = scores(n)
        except RuntimeError as e:
            raise BuildFailed(f"{name}: its package fails at a batch of {n}: {first_line(e)}") from None
        common = min(n, EXAMPLE_BATCH)
        if got.numel() != n or not torch.isfinite(got).all():
            raise BuildFailed(f"{name}: its package returned {tuple(got.shape)} scores for a batch of {n}")
        got = got.reshape(-1)
        worst = float((got[:common] - traced[:common]).abs().max())
        if worst > CHECK_TOLERANCE:
            raise BuildFailed(
                f"{name}: its package scores a batch of {n} otherwise than a batch of {EXAMPLE_BATCH} (a score "
                f"changed by {worst:.3g}, over {CHECK_TOLERANCE})"
            )


class AOTIBuild:
    name = "aoti"
    order = 3
    base: str | None = "fused"
    about = "the whole batch (fbgemm's lookup and the dense part) in one AOTInductor package, cached on disk"
    dense_precision: str | None = None
    weight_precision: str | None = None
    inductor_configs: JsonObject = {}
    frozen = False  # compiled with Inductor's freezing (the weights prepacked at build time)
    even_k = False  # every GEMM given an even K where the precision is 16-bit (the template's AMX kernel)
    whole_batch = True  # a package of the whole batch: calls the table lookup `infer.table_lookup` chose

    def make(self, model: Any, base: Any, *, precision: str, table_precision: str) -> Any:
        module = base.sibling()  # the same tables, not a copy
        return self.packaged(
            module, partial(self.export, precision=precision), self.made_by(module, precision, table_precision)
        )

    def made_by(self, module: Any, precision: str, table_precision: str) -> JsonObject:
        """How this build compiles `module`'s whole batch, for its package's key and record (`keyed` adds the rest)."""
        widths = dict(module.gemm_widths)  # `infer.gemm_widths` chose them, before the packages are made
        return {
            "precision": precision,
            "table_precision": table_precision,
            "graph": GRAPH,
            **({"inductor": self.inductor_configs} if self.inductor_configs else {}),
            **({"k": "even"} if self._even_k(precision) else {}),
            **({"widths": widths} if widths else {}),
        }

    def export(self, module: Any, path: Path, *, precision: str, samples: int | None = None) -> None:
        """`module`'s whole batch exported and compiled as this build compiles it into the package `path` (for
        batches of `samples` alone where given: `aoti_buckets`)."""
        dense_part = padded(module.dense, dict(module.gemm_widths), even=self._even_k(precision))
        export_whole(
            module, path, dense_part, inductor_configs=self.inductor_configs, frozen=self.frozen, samples=samples
        )

    def _even_k(self, precision: str) -> bool:
        return self.even_k and precision in ("bf16", "fp16")

    def keyed(self, module: Any, made_by: JsonObject) -> JsonObject:
        """`made_by` with what else a package's key holds: whether it is frozen, the lab's kernels it calls."""
        return {**made_by, **({"frozen": True} if self.frozen else {}), **package_calls(module)}

    def packaged(self, module: Any, export: Any, made_by: JsonObject) -> Any:
        """`module` served whole by the package `export(module, path)` writes: cached under a key of the dense
        weights, the spec, `made_by`, whether it is frozen and the machine (`infer.artefacts`), then loaded."""
        artefact = dense_package(self.name, module, ".pt2", export, self.keyed(module, made_by))
        module.package, module.package_reason = str(artefact.path), artefact.reason
        module.whole = PackagedBatch(module.package, table_weights(module.tables))
        check_batch_sizes(self.name, module, module.whole)
        return module

    def skip(self, base_dense_ms: float | None, smallest: int | None = None) -> str | None:
        return too_small_to_compile(base_dense_ms, "a package build of seconds per weights")

    def for_snapshot(self, module: Any) -> Any:
        module.whole = None  # a loaded package does not pickle; each instance loads it
        return module

    def in_instance(self, module: Any, device: Any, *, precision: str, table_precision: str) -> Any:
        if device.type == "cuda":  # the package holds CPU kernels
            raise RuntimeError(f"the {self.name} build is made for the CPU: on a GPU serve eager, fused or compiled")
        module.whole = PackagedBatch(module.package, table_weights(module.tables))  # shared
        return module

    def artefact(self, module: Any) -> str | None:
        return str(module.package)

    def from_artefact(self, module: Any, artefact: str) -> Any:
        other = module.sibling()  # the tables this instance mapped, not a copy
        other.package = artefact
        other.whole = PackagedBatch(artefact, table_weights(other.tables))
        return other


BUILD = AOTIBuild()

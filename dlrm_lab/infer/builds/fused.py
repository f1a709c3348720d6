"""`fused`: every table in one fused fbgemm lookup and the dense weights stored in the precision served.

A DLRM's tables go into one fbgemm inference TBE (TorchRec's quantised inference tables at the table
precision, fp32 included), its dense weights are cast once (no casts per call), and the batch reaches the
kernels as they take it (dense rows, ids and offsets: no KeyedJaggedTensor, no per-table calls). The HSTU
ranker's sequence tables go into one fused lookup (TorchRec's quantised `EmbeddingCollection`) and every
other weight is stored in the served precision (no autocast).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from dlrm_lab.infer.serving_parts import serving_of
from dlrm_lab.infer.tables import quantize_tables
from dlrm_lab.metrics.precision import DTYPES


class _DensePart(nn.Module):
    """Bottom MLP, interaction and top MLP over the pooled embeddings (B X F X D, or flat for cat)."""

    def __init__(self, model: nn.Module, pooled_shape: tuple[int, int] | None) -> None:
        super().__init__()
        self.dense_arch, self.inter_arch, self.over_arch = model.dense_arch, model.inter_arch, model.over_arch
        self.pooled_shape = pooled_shape  # (F, D); None: the cat interaction takes them flat

    def interact(self, embedded: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        sparse = pooled if self.pooled_shape is None else pooled.view(-1, *self.pooled_shape)
        return self.inter_arch(embedded, sparse)

    def top(self, interaction: torch.Tensor) -> torch.Tensor:
        return self.over_arch(interaction).squeeze(-1)

    def forward(self, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        return self.top(self.interact(self.dense_arch(dense), pooled))


class FusedDLRM(nn.Module):
    """A DLRM as served by the `fused` and `compiled` builds.

    `forward(dense: B X num_dense float32, ids: int32 [all ids, feature-major], offsets: int32
    [F * B + 1]) -> scores: B float32` (click probabilities). The tables are one fbgemm
    inference TBE (`IntNBitTableBatchedEmbeddingBagsCodegen`, made by TorchRec's
    `quantize_embeddings`, whose output is already in the served precision); the dense weights
    are stored in `precision`. `stages` times lookup, dense and interaction separately
    (`score_in_stages`); compiled, the dense part and the interaction are one graph.
    """

    def __init__(self, model: nn.Module, *, precision: str, table_precision: str) -> None:
        super().__init__()
        self.precision, self.table_precision = precision, table_precision
        self.spec = model.spec  # what a sample is: its family scores and serves it
        dtype = DTYPES[precision]
        quantised = quantize_tables(model, table_precision, output_dtype=dtype)
        modules = quantised.sparse_arch.embedding_bag_collection._emb_modules
        if len(modules) != 1:  # one storage type and pooling for all tables: one TBE
            raise ValueError(f"expected one fused table module, got {len(modules)}")
        self.tables = modules[0]
        sparse = model.sparse_arch
        names = [n for conf in sparse.embedding_bag_collection.embedding_bag_configs() for n in conf.feature_names]
        if names != list(model.spec.feature_names):
            raise ValueError("the tables' features are not in the spec's order: ids would meet the wrong table")
        shape = None if sparse.D is None else (sparse.F, sparse.D)
        model.sparse_arch = None  # copied without its tables (they live in the TBE only): no second copy of them
        try:
            dense = copy.deepcopy(model)
        finally:
            model.sparse_arch = sparse
        self.dense = _DensePart(dense, shape).to(dtype)
        self.dtype = dtype
        self.compiled: Callable[..., torch.Tensor] | None = None  # the dense part compiled (compiled, openvino)
        # the whole batch, lookup included, as one native call (aoti's package): (dense, ids, offsets) -> scores
        self.whole: Callable[..., torch.Tensor] | None = None
        self.lookup_way = "fbgemm"  # the lookup its packages call (`infer.table_lookup.choose_lookup` sets it)
        # the widths its packages compute each GEMM's input at, by layer (`infer.gemm_widths.choose_widths` sets them)
        self.gemm_widths: dict[str, int] = {}

    def sibling(self) -> FusedDLRM:
        """A copy sharing every tensor (tables included) but not the module's registries: a build made from this
        one (`compiled`, `aoti`) sets its own dense runner without touching this build's."""
        other = copy.copy(self)
        other._modules, other._parameters, other._buffers = (
            dict(self._modules),
            dict(self._parameters),
            dict(self._buffers),
        )
        return other

    def compile_dense(self) -> None:
        """Compile the dense part with Inductor (freezing: weights are constants, prepacked by oneDNN;
        dynamic batch: one graph for every batch size). In the instance process: a compiled
        graph does not pickle."""
        self.compiled = torch.compile(self.dense, dynamic=True, options={"freezing": True})

    def lookup(self, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self.tables(ids, offsets)

    def forward(self, dense: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        if self.whole is not None:
            return self.whole(dense, ids, offsets)
        pooled = self.lookup(ids, offsets)
        part = self.dense if self.compiled is None else self.compiled
        return torch.sigmoid(part(dense.to(self.dtype), pooled).float())

    def score_in_stages(
        self, dense: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor
    ) -> tuple[torch.Tensor, tuple[float, float, float | None]]:
        """Scores, and the seconds of (lookup, dense MLPs, interaction); the interaction is None
        when compiled (fused into the dense graph)."""
        t0 = time.perf_counter()
        pooled = self.lookup(ids, offsets)
        t1 = time.perf_counter()
        x = dense.to(self.dtype)
        if self.compiled is not None:
            scores = torch.sigmoid(self.compiled(x, pooled).float())
            return scores, (t1 - t0, time.perf_counter() - t1, None)
        embedded = self.dense.dense_arch(x)
        t2 = time.perf_counter()
        inter = self.dense.interact(embedded, pooled)
        t3 = time.perf_counter()
        scores = torch.sigmoid(self.dense.top(inter).float())
        t4 = time.perf_counter()
        return scores, (t1 - t0, (t2 - t1) + (t4 - t3), t3 - t2)


def fused_ranker(model: nn.Module, *, precision: str, table_precision: str) -> nn.Module:
    """The HSTU ranker as the `fused` build serves it: its sequence tables in one fused fbgemm lookup
    (TorchRec's `QuantEmbeddingCollection` at `table_precision`, fp32 included, its output in
    `precision`) and every other weight stored in `precision`. `served_precision` tells the runner
    not to autocast. The model is copied without its float tables: no second copy of them."""
    dtype = DTYPES[precision]
    tables = model.tables
    holder = nn.Module()  # quantize_embeddings swaps children, never the module it is given
    holder.tables = tables
    quantised = quantize_tables(holder, table_precision, output_dtype=dtype).tables  # a copy: the tables unmarked
    model.tables = None
    try:
        served = copy.deepcopy(model).to(dtype)
    finally:
        model.tables = tables
    served.tables = quantised
    served.served_precision = precision
    return served


class FusedBuild:
    name = "fused"
    order = 1
    base = None
    about = "fused fbgemm table lookups, dense weights stored in the served precision"
    dense_precision = None
    weight_precision = None

    def make(self, model: Any, base: Any, *, precision: str, table_precision: str) -> Any:
        return serving_of(model.spec).make_fused(model, precision=precision, table_precision=table_precision).eval()

    def skip(self, base_dense_ms: float | None, smallest: int | None = None) -> str | None:
        return None

    def for_snapshot(self, module: Any) -> Any:
        return module

    def in_instance(self, module: Any, device: Any, *, precision: str, table_precision: str) -> Any:
        if device.type == "cuda":  # the fused tables are built on the device that serves them
            return self.make(module, None, precision=precision, table_precision=table_precision)
        return module

    def artefact(self, module: Any) -> str | None:
        return None  # the module itself: fbgemm's tables and its dense part

    def from_artefact(self, module: Any, artefact: str) -> Any:
        raise NotImplementedError(f"{self.name} is not served from one file")


BUILD = FusedBuild()

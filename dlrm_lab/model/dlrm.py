"""DLRM assembled from TorchRec modules.

Notation as in TorchRec: B batch size, F sparse features, D embedding dimension.
For the dot and dcnv2 interactions the module tree (and so every parameter name) is
that of `torchrec.models.dlrm.DLRM` / `DLRM_DCN`, so their state dicts load both ways
and outputs agree on identical weights. Two parameter-free pieces are our own, faster
equivalents (see `PooledSparseArch`, `DotInteractionArch`); the rest is TorchRec's.
The cat interaction is facebookresearch/dlrm's `--arch-interaction-op=cat`, which
TorchRec lacks; it allows differing table dims.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import torch
from torch import nn
from torchrec.models.dlrm import DenseArch, InteractionDCNArch, OverArch
from torchrec.modules.crossnet import LowRankCrossNet
from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from dlrm_lab.config import INTERACTIONS, ModelSpec

# Storage precision of table rows in the fbgemm kernels once sharded.
_TABLE_DTYPES = {"fp32": DataType.FP32, "fp16": DataType.FP16}


def pooled_in_order(pooled: KeyedTensor, names: list[str]) -> torch.Tensor:
    """The pooled embeddings of `names`, side by side, in that order (a view when possible)."""
    if pooled.keys() == names:
        return pooled.values()
    by_name = pooled.to_dict()
    return torch.cat([by_name[name] for name in names], dim=1)


def pooled_with_triangle(pooled: KeyedTensor, names: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """The pooled embeddings side by side in the collection's own order (no regrouping copy), and
    where the dot interaction's pairs lie in the flattened Gram matrix of [dense, those embeddings]:
    pair by pair in `names` order, each pair's first member as the row, so the interaction's output
    is the same whatever order the collection returns (a sharded one returns its ranks' tables in
    turn: regrouping them cost 1.3 ms forward and ~1 ms backward of a 45 ms two-rank kaggle step)."""
    values = pooled.values()
    return values, _triangle_index(tuple(pooled.keys()), tuple(names), values.device)


@functools.lru_cache(maxsize=32)
def _triangle_index(keys: tuple[str, ...], names: tuple[str, ...], device: torch.device) -> torch.Tensor:
    n = len(names) + 1  # the dense output, then every feature
    slot = {key: k + 1 for k, key in enumerate(keys)}
    with torch.inference_mode(False):  # cached: a first call under inference mode must not taint training
        place = torch.tensor([0] + [slot[name] for name in names])
        rows, cols = torch.triu_indices(n, n, offset=1)
        return (place[rows] * n + place[cols]).to(device)


# Leaves for torch.fx: TorchRec's training pipeline traces the model, and the key checks
# above are control flow on the traced value.
torch.fx.wrap("pooled_in_order")
torch.fx.wrap("pooled_with_triangle")


class PooledSparseArch(nn.Module):
    """Pooled embeddings of every feature, in `feature_names` order.

    Returns B X F X D (dot, dcnv2: all features share one D), or with `flat=True`
    B X (sum of feature dims) (cat, where dims may differ). TorchRec's `SparseArch` splits
    the collection's output into one tensor per feature and concatenates them again; the
    collection's `KeyedTensor.values()` already holds them side by side, so when its keys
    come in feature order this is a view, not two copies (other orders are regrouped).
    With `any_order=True` (the dot interaction, which needs only the pairs) nothing is regrouped:
    it returns the B X F X D embeddings in the collection's order and the triangle index that
    `DotInteractionArch` takes to pick the pairs in feature order (`pooled_with_triangle`).

    Example (two tables of dim 8, the first looked up by two features; 2 samples):

    >>> import torch
    >>> from torchrec.modules.embedding_configs import EmbeddingBagConfig
    >>> from torchrec.modules.embedding_modules import EmbeddingBagCollection
    >>> from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
    >>> ebc = EmbeddingBagCollection(tables=[
    ...     EmbeddingBagConfig(name="t_ab", num_embeddings=10, embedding_dim=8, feature_names=["a", "b"]),
    ...     EmbeddingBagConfig(name="t_c", num_embeddings=5, embedding_dim=8, feature_names=["c"]),
    ... ])
    >>> kjt = KeyedJaggedTensor.from_lengths_sync(  # feature "b" looks up two ids per sample
    ...     keys=["a", "b", "c"],
    ...     values=torch.tensor([1, 2, 3, 4, 5, 6, 0, 4]),
    ...     lengths=torch.tensor([1, 1, 2, 2, 1, 1]),
    ... )
    >>> PooledSparseArch(ebc)(kjt).shape  # B X F X D
    torch.Size([2, 3, 8])
    >>> PooledSparseArch(ebc, flat=True)(kjt).shape  # B X (8 + 8 + 8)
    torch.Size([2, 24])
    >>> values, triangle = PooledSparseArch(ebc, any_order=True)(kjt)  # in order here: the default triangle
    >>> values.shape, triangle.tolist()
    (torch.Size([2, 3, 8]), [1, 2, 3, 6, 7, 11])
    >>> mixed = EmbeddingBagCollection(tables=[
    ...     EmbeddingBagConfig(name="t_a", num_embeddings=10, embedding_dim=8, feature_names=["a"]),
    ...     EmbeddingBagConfig(name="t_b", num_embeddings=10, embedding_dim=4, feature_names=["b"]),
    ... ])
    >>> PooledSparseArch(mixed)
    Traceback (most recent call last):
        ...
    ValueError: B X F X D output needs one embedding_dim for all tables, got t_a: 8, t_b: 4; use flat=True
    """

    def __init__(
        self, embedding_bag_collection: EmbeddingBagCollection, flat: bool = False, any_order: bool = False
    ) -> None:
        super().__init__()
        if flat and any_order:
            raise ValueError("any_order is for the dot interaction's B X F X D output, not flat=True")
        self.any_order = any_order
        self.embedding_bag_collection: EmbeddingBagCollection = embedding_bag_collection
        configs = embedding_bag_collection.embedding_bag_configs()
        self.sparse_feature_names: list[str] = [name for conf in configs for name in conf.feature_names]
        if not self.sparse_feature_names:
            raise ValueError("the embedding bag collection has no features: at least one table with one is needed")
        repeated = sorted({f for f in self.sparse_feature_names if self.sparse_feature_names.count(f) > 1})
        if repeated:
            raise ValueError(f"feature names must be unique across tables; repeated: {', '.join(repeated)}")
        self.F: int = len(self.sparse_feature_names)
        # Output width: B X F X D, or with flat=True B X out_features.
        self.out_features: int = sum(conf.embedding_dim * len(conf.feature_names) for conf in configs)
        self.D: int | None = None if flat else configs[0].embedding_dim
        if not flat and any(conf.embedding_dim != self.D for conf in configs):
            dims = ", ".join(f"{conf.name}: {conf.embedding_dim}" for conf in configs)
            raise ValueError(f"B X F X D output needs one embedding_dim for all tables, got {dims}; use flat=True")

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        pooled = self.embedding_bag_collection(features)
        if self.any_order:
            values, triangle = pooled_with_triangle(pooled, self.sparse_feature_names)
            return values.view(-1, self.F, self.D), triangle
        values = pooled_in_order(pooled, self.sparse_feature_names)
        return values if self.D is None else values.view(-1, self.F, self.D)


class DotInteractionArch(nn.Module):
    """Pairwise dot products of the bottom-MLP output and the pooled embeddings.

    Input B X D and B X F X D; output B X (D + (F + 1) choose 2), equal to TorchRec's
    `InteractionArch`: the dense output, then the upper triangle of the (F + 1) X (F + 1)
    Gram matrix row by row. It selects the triangle from the flattened matrix by a flat index
    (`dot_interaction`), trained with its own backward (`_DotInteraction`); TorchRec's 2-D
    advanced indexing backs up through a serial `index_put` (about twice as slow on CPU).

    Example (B = 2, F = 3, D = 8: 8 + (3 + 1) choose 2 = 14 outputs):

    >>> import torch
    >>> DotInteractionArch(num_sparse_features=3)(torch.rand(2, 8), torch.rand(2, 3, 8)).shape
    torch.Size([2, 14])
    >>> DotInteractionArch(num_sparse_features=0)
    Traceback (most recent call last):
        ...
    ValueError: num_sparse_features = 0: must be an integer >= 1
    """

    def __init__(self, num_sparse_features: int) -> None:
        super().__init__()
        if isinstance(num_sparse_features, bool) or not isinstance(num_sparse_features, int) or num_sparse_features < 1:
            raise ValueError(f"num_sparse_features = {num_sparse_features!r}: must be an integer >= 1")
        self.F: int = num_sparse_features
        rows, cols = torch.triu_indices(self.F + 1, self.F + 1, offset=1)
        self.register_buffer("triu_flat_indices", rows * (self.F + 1) + cols, persistent=False)
        # None: the Gram matrix in autocast's dtype where autocast is on (bmm: bf16); a dtype: in that one, out of
        # autocast (set by a training run's measured choice, `train.choices.choose_run_interaction`)
        self.gram_dtype: torch.dtype | None = None
        # the lab's C++ kernel (`model.native`) in place of torch's ops: set only by a measured choice (training's,
        # the serving plan's), never by default
        self.native = False

    def use(self, way: str) -> None:
        """The Gram matrix by the lab's kernel ("native"), torch's ops in fp32 ("fp32") or as autocast casts them."""
        self.gram_dtype = torch.float32 if way == "fp32" else None
        self.native = way == "native"

    @staticmethod
    def within(model: nn.Module) -> list[DotInteractionArch]:
        return [m for m in model.modules() if isinstance(m, DotInteractionArch)]

    def forward(
        self, dense_features: torch.Tensor, sparse_features: torch.Tensor, triangle: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`triangle`: where the pairs lie when `sparse_features` come in another order than the
        features' (`pooled_with_triangle`); by default they come in order."""
        pairs = self.triu_flat_indices if triangle is None else triangle
        return dot_interaction(dense_features, sparse_features, pairs, self.gram_dtype, self.native)


def dot_interaction(
    dense: torch.Tensor,
    sparse: torch.Tensor,
    pairs: torch.Tensor,
    gram_dtype: torch.dtype | None,
    native: bool = False,
) -> torch.Tensor:
    """`[dense, the entries `pairs` of each sample's Gram matrix of [dense, sparse...]]` (B X D, B X F X D -> B X
    (D + pairs)), the Gram matrix in `gram_dtype` out of autocast where one is given (a training run's measured
    choice), else in autocast's dtype where it is on. `native`: the lab's kernel (one op, its own backward; it
    exports and compiles as one call). Otherwise training in eager mode takes `_DotInteraction`'s forward and
    backward; traced, exported and no-grad calls the plain ops."""
    if native:
        return _native_interaction(dense, sparse, pairs, gram_dtype)
    trained = dense.requires_grad or sparse.requires_grad
    if trained and torch.is_grad_enabled() and not torch.compiler.is_compiling():
        return _DotInteraction.apply(dense, sparse, pairs, _compute_dtype(dense, sparse, gram_dtype))
    if gram_dtype is not None:  # the measured choice: out of autocast, in this dtype
        with torch.autocast(dense.device.type, enabled=False):
            return _plain_interaction(dense.to(gram_dtype), sparse.to(gram_dtype), pairs)
    return _plain_interaction(dense, sparse, pairs)


def _native_interaction(
    dense: torch.Tensor, sparse: torch.Tensor, pairs: torch.Tensor, gram_dtype: torch.dtype | None
) -> torch.Tensor:
    """The lab's kernel in one compute dtype (`_compute_dtype`), its sums fp32; fp32 embeddings go in as they are
    (it rounds them as it reads them, and writes their gradient in fp32: no cast op either way, BENCHMARKS.md)."""
    from dlrm_lab.model import native

    # loaded before any trace (`infer.interaction.put`, training's choice): a compile does not trace the loader
    if not torch.compiler.is_compiling() and (why := native.load()) is not None:
        raise RuntimeError(why)
    dtype = _compute_dtype(dense, sparse, gram_dtype)
    wide = sparse.dtype == torch.float32 and dtype in (torch.bfloat16, torch.float16)
    with torch.autocast(dense.device.type, enabled=False):
        return torch.ops.dlrm_lab.dot_interaction(dense.to(dtype), sparse if wide else sparse.to(dtype), pairs)


def _compute_dtype(dense: torch.Tensor, sparse: torch.Tensor, gram_dtype: torch.dtype | None) -> torch.dtype:
    """A trained or native interaction's dtype: `gram_dtype`, else autocast's where it is on (as it runs bmm),
    else the wider input's."""
    if gram_dtype is not None:
        return gram_dtype
    if torch.is_autocast_enabled(device := dense.device.type):
        return torch.get_autocast_dtype(device)
    return torch.promote_types(dense.dtype, sparse.dtype)


def _plain_interaction(dense: torch.Tensor, sparse: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
    combined = torch.cat((dense.unsqueeze(1), sparse), dim=1)
    gram = torch.bmm(combined, combined.transpose(1, 2)).flatten(1)
    return torch.cat((dense, gram.index_select(1, pairs)), dim=1)


# A leaf for torch.fx: TorchRec's training pipeline traces the model, and a traced autograd.Function is not one call
torch.fx.wrap("dot_interaction")


class _DotInteraction(torch.autograd.Function):
    """The dot interaction with its own forward and backward, equal to autograd's through the plain ops (a test).
    Forward: [dense, sparse...] written once into one buffer in the Gram matrix's dtype (no concatenation in the
    wider dtype and cast after it), the pairs gathered straight into the output's columns after the dense ones
    (no second concatenation, no copy), by `gather` over an expanded index (0.60 against `index_select`'s 1.16 ms
    along dim 1 of kaggle's 2048 x 729 bf16 Gram matrices, 2 cores, AMX). Backward: autograd's backward of `C @ C^T`
    runs two batched GEMMs (one for each use of C) and adds them; here one, `(G + G^T) @ C`, G + G^T the pairs'
    gradient copied into both triangles (`index_copy_`: 0.84 ms against a `scatter_` pair's 1.39 and one gather's
    1.03). At kaggle's batch of 2048 under bf16 autocast, forward and backward with a bottom MLP's last layer: 5.60
    -> 4.57 ms against the pairs-only Function before it (itself 1.49-1.58x autograd's)."""

    @staticmethod
    def forward(
        ctx: Any, dense: torch.Tensor, sparse: torch.Tensor, pairs: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        batch, width = dense.shape
        n = sparse.shape[1] + 1
        with torch.autocast(dense.device.type, enabled=False):
            combined = torch.empty(batch, n, width, dtype=dtype, device=dense.device)
            combined[:, 0] = dense
            combined[:, 1:] = sparse
            gram = torch.bmm(combined, combined.transpose(1, 2)).view(batch, n * n)
            out = torch.empty(
                batch, width + len(pairs), dtype=torch.promote_types(dense.dtype, dtype), device=dense.device
            )
            out[:, :width] = dense
            index = pairs.expand(batch, -1)
            if out.dtype == gram.dtype:
                torch.gather(gram, 1, index, out=out[:, width:])
            else:  # a wider dense output than the Gram matrix (fp32 without autocast's cast of it)
                out[:, width:] = torch.gather(gram, 1, index)
        ctx.save_for_backward(combined, pairs)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None, None]:
        combined, pairs = ctx.saved_tensors
        batch, n, width = combined.shape
        both = _gram_gradient(batch, n, combined.dtype, combined.device)
        pair_grad = grad[:, width:].to(combined.dtype)
        both.index_copy_(1, pairs, pair_grad).index_copy_(1, pairs % n * n + pairs // n, pair_grad)  # G, then G^T
        to_combined = torch.bmm(both.view(batch, n, n), combined)
        # autograd casts each to its input's dtype
        return to_combined[:, 0] + grad[:, :width], to_combined[:, 1:], None, None


# The Gram matrix's gradient buffer of the last shape trained: the triangles' copies overwrite all but the diagonal
# each step, which stays the zero it was made with (no 3 MB fill a step at kaggle's batch of 2048).
_GRAM_GRADIENT: dict[tuple[int, int, torch.dtype, torch.device], torch.Tensor] = {}


def _gram_gradient(batch: int, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    key = (batch, n, dtype, device)
    if (buffer := _GRAM_GRADIENT.get(key)) is None:
        _GRAM_GRADIENT.clear()
        buffer = _GRAM_GRADIENT[key] = torch.zeros(batch, n * n, dtype=dtype, device=device)
    return buffer


class ConcatInteractionArch(nn.Module):
    """facebookresearch/dlrm's cat interaction: [dense_out, pooled embeddings]. Input B X D_dense and B X (sum of
    feature dims); output B X (D_dense + sum of dims).

    >>> import torch
    >>> ConcatInteractionArch()(torch.rand(2, 8), torch.rand(2, 22)).shape
    torch.Size([2, 30])
    """

    def forward(self, dense_features: torch.Tensor, sparse_features: torch.Tensor) -> torch.Tensor:
        return torch.cat((dense_features, sparse_features), dim=1)


def _check_sizes(spec: ModelSpec) -> None:
    """The sizes `DLRM` builds from agree: a `ModelSpec` guarantees it, a spec-like object may not."""
    if spec.interaction not in INTERACTIONS:
        raise ValueError(f"interaction {spec.interaction!r}: allowed: {', '.join(INTERACTIONS)}")
    if not spec.tables:
        raise ValueError("at least one embedding table is required, got none")
    for t in spec.tables:
        if t.num_embeddings < 1 or t.embedding_dim < 1:
            raise ValueError(f"table {t.name!r}: {t.num_embeddings} rows of dim {t.embedding_dim}: both must be >= 1")
    if spec.num_dense < 1:
        raise ValueError(f"num_dense = {spec.num_dense}: the bottom MLP needs at least one dense feature")
    bottom, top = list(spec.bottom_mlp), list(spec.top_mlp)
    if not bottom or not top:
        raise ValueError(f"bottom_mlp {bottom} and top_mlp {top} need at least one layer each")
    if top[-1] != 1:
        raise ValueError(f"top_mlp {top} ends at {top[-1]} outputs, but the model gives one logit per sample (1)")
    if spec.interaction in ("dot", "dcnv2"):
        if len({t.embedding_dim for t in spec.tables}) != 1:
            dims = ", ".join(f"{t.name}: {t.embedding_dim}" for t in spec.tables)
            raise ValueError(f"interaction {spec.interaction!r} needs one embedding dim for all tables, got {dims}")
        dim = spec.tables[0].embedding_dim
        if bottom[-1] != dim:
            raise ValueError(
                f"interaction {spec.interaction!r} needs the bottom MLP's output dim ({bottom[-1]}) "
                f"equal to the embedding dim ({dim})"
            )
    if spec.interaction == "dcnv2" and not (spec.dcn_num_layers >= 1 and spec.dcn_low_rank >= 1):
        raise ValueError(
            f"interaction 'dcnv2' needs dcn_num_layers ({spec.dcn_num_layers}) "
            f"and dcn_low_rank ({spec.dcn_low_rank}) >= 1"
        )


class DLRM(nn.Module):
    """Bottom MLP over dense features, pooled embedding lookups, interaction, top MLP.

    `forward(dense: B X num_dense, sparse: KJT over spec.feature_names) -> logits: B`.

    A `ModelSpec` is checked when constructed; the sizes the modules depend on are checked
    again here, for spec-like objects, with `ValueError`s naming the sizes that disagree.

    Example (the tiny preset's 4 features, one id each, for 2 samples):

    >>> import torch
    >>> from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
    >>> import dlrm_lab
    >>> from dlrm_lab.model import DLRM
    >>> spec = dlrm_lab.load_preset("tiny")
    >>> spec.feature_names
    ['cat_0', 'cat_1', 'cat_2', 'cat_3']
    >>> kjt = KeyedJaggedTensor.from_lengths_sync(
    ...     keys=spec.feature_names,
    ...     values=torch.tensor([3, 7, 0, 1, 5, 9, 2, 2]),
    ...     lengths=torch.ones(8, dtype=torch.int64),
    ... )
    >>> model = DLRM(spec)
    >>> model(torch.rand(2, spec.num_dense), kjt).shape
    torch.Size([2])
    >>> DLRM(spec, table_precision="int8")
    Traceback (most recent call last):
        ...
    ValueError: table_precision 'int8': allowed: fp32, fp16
    """

    def __init__(
        self,
        spec: ModelSpec,
        device: torch.device | None = None,
        table_device: torch.device | None = None,
        table_precision: str = "fp32",
    ) -> None:
        super().__init__()
        if table_precision not in _TABLE_DTYPES:
            raise ValueError(f"table_precision {table_precision!r}: allowed: {', '.join(_TABLE_DTYPES)}")
        _check_sizes(spec)
        self.spec = spec
        configs = [
            EmbeddingBagConfig(
                name=t.name,
                num_embeddings=t.num_embeddings,
                embedding_dim=t.embedding_dim,
                feature_names=list(t.feature_names),
                pooling=PoolingType.SUM,
                data_type=_TABLE_DTYPES[table_precision],
            )
            for t in spec.tables
        ]
        ebc = EmbeddingBagCollection(tables=configs, device=table_device or device)
        # Registered in TorchRec's order (sparse, dense, inter, over) so state dicts list alike.
        self.sparse_arch = PooledSparseArch(ebc, flat=spec.interaction == "cat", any_order=spec.interaction == "dot")
        self.dense_arch = DenseArch(in_features=spec.num_dense, layer_sizes=list(spec.bottom_mlp), device=device)
        num_features = self.sparse_arch.F
        dense_out = spec.bottom_mlp[-1]
        if spec.interaction == "dot":  # dense output, then the Gram matrix's upper triangle
            over_in = dense_out + num_features * (num_features + 1) // 2
        else:  # cat and dcnv2: the dense output beside every pooled embedding
            over_in = dense_out + self.sparse_arch.out_features
        if spec.interaction == "cat":
            self.inter_arch: nn.Module = ConcatInteractionArch()
        elif spec.interaction == "dot":
            self.inter_arch = DotInteractionArch(num_sparse_features=num_features)
        else:
            crossnet = LowRankCrossNet(in_features=over_in, num_layers=spec.dcn_num_layers, low_rank=spec.dcn_low_rank)
            self.inter_arch = InteractionDCNArch(num_sparse_features=num_features, crossnet=crossnet)
        if device is not None:  # none of the three takes a device argument (the dot one's pairs are a buffer)
            self.inter_arch.to(device)
        self.over_arch = OverArch(in_features=over_in, layer_sizes=list(spec.top_mlp), device=device)
        # None: the dense part computes in its weights' dtype as autocast casts them; a dtype: its weights are in that
        # dtype (`train.dense_weights`) and the forward casts at the boundaries alone: the dense input, the pooled
        # embeddings, the interaction's output (a Gram matrix kept in fp32) and the logits (back to fp32)
        self.dense_dtype: torch.dtype | None = None

    def forward(self, dense_features: torch.Tensor, sparse_features: KeyedJaggedTensor) -> torch.Tensor:
        dtype = self.dense_dtype
        embedded_dense = self.dense_arch(dense_features if dtype is None else dense_features.to(dtype))
        if self.sparse_arch.any_order:  # the dot interaction: the embeddings as they come, and where the pairs lie
            embedded_sparse, triangle = self.sparse_arch(sparse_features)
            if dtype is not None:
                embedded_sparse = embedded_sparse.to(dtype)
            interaction = self.inter_arch(embedded_dense, embedded_sparse, triangle)
        else:
            embedded_sparse = self.sparse_arch(sparse_features)
            if dtype is not None:
                embedded_sparse = embedded_sparse.to(dtype)
            interaction = self.inter_arch(dense_features=embedded_dense, sparse_features=embedded_sparse)
        if dtype is None:
            return self.over_arch(interaction).squeeze(-1)
        return self.over_arch(interaction.to(dtype)).squeeze(-1).float()

    def forward_in_stages(
        self, dense_features: torch.Tensor, sparse_features: KeyedJaggedTensor
    ) -> tuple[torch.Tensor, tuple[float, float, float]]:
        """`forward`, and the seconds it spent in (lookup, dense MLPs, interaction): what a served
        batch records of itself (CPU; on a GPU each stage would need a sync). Not traced."""
        t0 = time.perf_counter()
        embedded_dense = self.dense_arch(dense_features)
        t1 = time.perf_counter()
        embedded_sparse = self.sparse_arch(sparse_features)
        t2 = time.perf_counter()
        if self.sparse_arch.any_order:
            values, triangle = embedded_sparse
            interaction = self.inter_arch(embedded_dense, values, triangle)
        else:
            interaction = self.inter_arch(dense_features=embedded_dense, sparse_features=embedded_sparse)
        t3 = time.perf_counter()
        logits = self.over_arch(interaction).squeeze(-1)
        t4 = time.perf_counter()
        return logits, (t2 - t1, (t1 - t0) + (t4 - t3), t3 - t2)


def build_model(
    spec: ModelSpec,
    device: str | torch.device = "cpu",
    table_device: str | torch.device | None = None,
    table_precision: str = "fp32",
) -> DLRM:
    """Build the DLRM of `spec` with dense layers on `device`.

    `table_device="meta"` leaves the embedding tables unallocated, to be materialised
    shard by shard by `DistributedModelParallel`; by default they live on `device`.

    >>> import dlrm_lab
    >>> spec = dlrm_lab.load_preset("tiny")
    >>> model = build_model(spec, table_device="meta")
    >>> [p.is_meta for p in model.sparse_arch.parameters()]
    [True, True, True, True]
    >>> sum(p.numel() for p in model.parameters()) == spec.num_parameters
    True
    """
    dev = torch.device(device)
    return DLRM(
        spec,
        device=dev,
        table_device=torch.device(table_device) if table_device else dev,
        table_precision=table_precision,
    )

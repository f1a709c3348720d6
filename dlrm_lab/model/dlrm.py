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

import torch
from torch import nn
from torchrec.models.dlrm import DenseArch, InteractionDCNArch, OverArch
from torchrec.modules.crossnet import LowRankCrossNet
from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.modules.mlp import Perceptron
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from dlrm_lab.config import INTERACTIONS, ModelSpec
from dlrm_lab.model.interaction import ConcatInteractionArch, DotInteractionArch

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


def _relu_in_place(*arches: nn.Module) -> None:
    """TorchRec's `Perceptron` applies `torch.relu`, a new tensor; in place on the layer's own fresh output it writes
    where it reads (kaggle's bottom MLP, 2,048 samples, bf16, forward and backward: 1.015-1.025x, Zen 5, interleaved).
    Autograd keeps that output for the backward as before; the parameters, and so the state dict, are unchanged."""
    for arch in arches:
        for layer in arch.modules():
            if isinstance(layer, Perceptron) and getattr(layer, "_activation_fn", None) is torch.relu:
                layer._activation_fn = torch.relu_


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
        _relu_in_place(self.dense_arch, self.over_arch)
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

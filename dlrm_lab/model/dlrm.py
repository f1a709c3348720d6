"""DLRM assembled from TorchRec modules.

Notation as in TorchRec: B batch size, F sparse features, D embedding dimension.
For the dot and dcnv2 interactions the module tree (and so every parameter name) is
that of `torchrec.models.dlrm.DLRM` / `DLRM_DCN`, so their state dicts load both ways
and outputs agree on identical weights. The cat interaction is facebookresearch/dlrm's
`--arch-interaction-op=cat`, which TorchRec lacks; it allows differing table dims.
"""

from __future__ import annotations

import torch
from torch import nn
from torchrec.models.dlrm import DenseArch, InteractionArch, InteractionDCNArch, OverArch, SparseArch
from torchrec.modules.crossnet import LowRankCrossNet
from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dlrm_lab.config import ModelSpec

# Storage precision of table rows in the fbgemm kernels once sharded.
_TABLE_DTYPES = {"fp32": DataType.FP32, "fp16": DataType.FP16}


class ConcatSparseArch(nn.Module):
    """Pooled embeddings of every feature side by side: B X (sum of feature dims).

    TorchRec's `SparseArch` reshapes to B X F X D and so needs one D for all tables;
    the cat interaction does not. Features come out in `feature_names` order whatever
    order a sharded collection returns them in.

    Example::

        arch = ConcatSparseArch(ebc)         # tables of dims 8 and 4
        arch(kjt).shape                      # torch.Size([B, 12])
    """

    def __init__(self, embedding_bag_collection: EmbeddingBagCollection) -> None:
        super().__init__()
        self.embedding_bag_collection: EmbeddingBagCollection = embedding_bag_collection
        self.sparse_feature_names: list[str] = [
            name for conf in embedding_bag_collection.embedding_bag_configs() for name in conf.feature_names
        ]

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        pooled = self.embedding_bag_collection(features).to_dict()
        return torch.cat([pooled[name] for name in self.sparse_feature_names], dim=1)


class ConcatInteractionArch(nn.Module):
    """facebookresearch/dlrm's cat interaction: [dense_out, pooled embeddings].

    Input B X D_dense and B X (sum of feature dims); output B X (D_dense + sum of dims).
    """

    def forward(self, dense_features: torch.Tensor, sparse_features: torch.Tensor) -> torch.Tensor:
        return torch.cat((dense_features, sparse_features), dim=1)


class DLRM(nn.Module):
    """Bottom MLP over dense features, pooled embedding lookups, interaction, top MLP.

    `forward(dense: B X num_dense, sparse: KJT over spec.feature_names) -> logits: B`.

    Example::

        spec = dlrm_lab.load_preset("tiny")
        model = DLRM(spec)
        logits = model(torch.rand(2, spec.num_dense), kjt)   # shape [2]
    """

    def __init__(
        self,
        spec: ModelSpec,
        device: torch.device | None = None,
        table_device: torch.device | None = None,
        table_precision: str = "fp32",
    ) -> None:
        super().__init__()
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
        self.sparse_arch: nn.Module = ConcatSparseArch(ebc) if spec.interaction == "cat" else SparseArch(ebc)
        self.dense_arch = DenseArch(in_features=spec.num_dense, layer_sizes=list(spec.bottom_mlp), device=device)
        num_features = spec.num_features
        if spec.interaction == "cat":
            self.inter_arch: nn.Module = ConcatInteractionArch()
        elif spec.interaction == "dot":
            self.inter_arch = InteractionArch(num_sparse_features=num_features)
        else:
            crossnet = LowRankCrossNet(
                in_features=spec.over_arch_in_features,
                num_layers=spec.dcn_num_layers,
                low_rank=spec.dcn_low_rank,
            )
            self.inter_arch = InteractionDCNArch(num_sparse_features=num_features, crossnet=crossnet)
            if device is not None:
                self.inter_arch.to(device)  # LowRankCrossNet takes no device argument
        self.over_arch = OverArch(in_features=spec.over_arch_in_features, layer_sizes=list(spec.top_mlp), device=device)

    def forward(self, dense_features: torch.Tensor, sparse_features: KeyedJaggedTensor) -> torch.Tensor:
        embedded_dense = self.dense_arch(dense_features)
        embedded_sparse = self.sparse_arch(sparse_features)
        interaction = self.inter_arch(dense_features=embedded_dense, sparse_features=embedded_sparse)
        return self.over_arch(interaction).squeeze(-1)


def build_model(
    spec: ModelSpec,
    device: str | torch.device = "cpu",
    table_device: str | torch.device | None = None,
    table_precision: str = "fp32",
) -> DLRM:
    """Build the DLRM of `spec` with dense layers on `device`.

    `table_device="meta"` leaves the embedding tables unallocated, to be materialised
    shard by shard by `DistributedModelParallel`; by default they live on `device`.
    """
    dev = torch.device(device)
    return DLRM(spec, device=dev, table_device=torch.device(table_device) if table_device else dev)

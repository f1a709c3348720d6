"""Sharding the embedding tables with TorchRec and wrapping the model for training.

Embedding tables are model-parallel (TorchRec's planner places them), their optimizer
is fused into the fbgemm backward kernel (no dense gradient of a table ever exists),
and the dense MLPs are data-parallel (DDP inside `DistributedModelParallel`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.distributed.types import ShardingPlan, ShardingType
from torchrec.optim import RowWiseAdagrad
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

from dlrm_lab.distributed.context import DistContext
from dlrm_lab.model.dlrm import DLRM

# The planner's advice that topologies should come from its factory does not apply:
# we pass the real world size and device, which is all it reads for our use.
logging.getLogger("torchrec.distributed.planner.types").setLevel(logging.ERROR)


@dataclass(frozen=True)
class EmbeddingOptimizer:
    """The table optimizer (names as in `config.EMBEDDING_OPTIMIZERS`, validated there)."""

    name: str = "rowwise_adagrad"
    lr: float = 0.05
    eps: float = 1e-8

    def apply(self, model: DLRM) -> None:
        """Attach the optimizer to the tables; sharding fuses it into the fbgemm kernel."""
        params = model.sparse_arch.embedding_bag_collection.parameters()
        if self.name == "rowwise_adagrad":
            apply_optimizer_in_backward(RowWiseAdagrad, params, {"lr": self.lr, "eps": self.eps})
        else:
            apply_optimizer_in_backward(torch.optim.SGD, params, {"lr": self.lr})


def shard_model(
    model: DLRM,
    ctx: DistContext,
    embedding_optimizer: EmbeddingOptimizer,
    sharding_type: str = ShardingType.TABLE_WISE.value,
) -> tuple[DistributedModelParallel, ShardingPlan]:
    """Plan the tables over the ranks, materialise them shard by shard, wrap dense in DDP."""
    embedding_optimizer.apply(model)
    sharder = EmbeddingBagCollectionSharder()
    constraints = {
        t.name: ParameterConstraints(
            sharding_types=[sharding_type],
            compute_kernels=[EmbeddingComputeKernel.FUSED.value],
            pooling_factors=[t.pooling_factor] * len(t.feature_names),
        )
        for t in model.spec.tables
    }
    topology = Topology(world_size=ctx.world_size, compute_device=ctx.device.type)
    planner = EmbeddingShardingPlanner(topology=topology, constraints=constraints)
    plan = planner.collective_plan(model, [sharder], dist.GroupMember.WORLD)
    dmp = DistributedModelParallel(module=model, device=ctx.device, plan=plan, sharders=[sharder])
    return dmp, plan


def describe_plan(plan: ShardingPlan, model_spec: Any, world_size: int) -> dict[str, Any]:
    """Per table: sharding type, ranks and bytes; per rank: total table bytes."""
    rows = {t.name: t for t in model_spec.tables}
    tables: list[dict[str, Any]] = []
    per_rank = [0] * world_size
    for module_plan in plan.plan.values():
        for name, p in module_plan.items():  # type: ignore[union-attr]
            table = rows[name]
            shards = p.sharding_spec.shards if p.sharding_spec is not None else []
            ranks: list[int] = []
            if shards:
                for shard in shards:
                    r = shard.placement.rank()
                    ranks.append(r)
                    per_rank[r] += 4 * shard.shard_sizes[0] * shard.shard_sizes[1]
            else:  # data_parallel: a full replica on every rank
                ranks = list(p.ranks or range(world_size))
                for r in ranks:
                    per_rank[r] += 4 * table.num_parameters
            tables.append(
                {
                    "table": name,
                    "sharding_type": p.sharding_type,
                    "compute_kernel": p.compute_kernel,
                    "ranks": ranks,
                    "bytes": 4 * table.num_parameters,
                }
            )
    return {"tables": tables, "bytes_per_rank": per_rank}

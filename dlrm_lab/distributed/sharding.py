"""Sharding the embedding tables with TorchRec and wrapping the model for training.

Embedding tables are model-parallel (TorchRec's planner places them), their optimizer
is fused into the fbgemm backward kernel (no dense gradient of a table ever exists),
and the dense MLPs are data-parallel (DDP inside `DistributedModelParallel`).
"""

from __future__ import annotations

import logging
import os
import warnings
from dataclasses import dataclass
from typing import Any

import psutil
import torch
import torch.distributed as dist
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
from torchrec.distributed.planner.storage_reservations import FixedPercentageStorageReservation
from torchrec.distributed.planner.types import ParameterConstraints, PlannerError
from torchrec.distributed.types import ShardingPlan, ShardingType
from torchrec.optim import RowWiseAdagrad
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

from dlrm_lab.distributed.context import DistContext
from dlrm_lab.errors import UserError
from dlrm_lab.model.dlrm import DLRM

# The planner's advice that topologies should come from its factory does not apply:
# we pass the real world size and device, which is all it reads for our use.
logging.getLogger("torchrec.distributed.planner.types").setLevel(logging.ERROR)
# TorchRec's own deprecation notices about its internals; nothing a user can act on.
warnings.filterwarnings("ignore", category=FutureWarning, module=r"torchrec\.")
logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)

# Share of each device's memory the planner keeps free for activations, dense
# parameters and the input batch.
RESERVED_MEMORY_SHARE = 0.15


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
    batch_size: int = 512,
) -> tuple[DistributedModelParallel, ShardingPlan]:
    """Plan the tables over the ranks, materialise them shard by shard, wrap dense in DDP.

    The plan is made against the real memory of this machine, so tables that cannot fit
    are refused (UserError naming the sizes) before anything is allocated.
    """
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
    topology = machine_topology(ctx)
    planner = EmbeddingShardingPlanner(
        topology=topology,
        batch_size=batch_size,
        constraints=constraints,
        storage_reservation=FixedPercentageStorageReservation(RESERVED_MEMORY_SHARE),
    )
    try:
        plan = planner.collective_plan(model, [sharder], dist.GroupMember.WORLD)
    except PlannerError as exc:
        table_bytes = sum(4 * t.num_parameters for t in model.spec.tables)
        memory = topology.devices[0].storage
        raise UserError(
            f"the embedding tables of {model.spec.name} ({table_bytes / 2**30:.2f} GiB fp32, plus optimizer "
            f"state) do not fit {ctx.world_size} rank(s) with {memory.ddr / 2**30:.2f} GiB host / "
            f"{memory.hbm / 2**30:.2f} GiB device memory each: scale the tables (--table-scale, --max-rows) "
            f"or add ranks [planner: {str(exc).splitlines()[0][:200]}]"
        ) from None
    dmp = DistributedModelParallel(module=model, device=ctx.device, plan=plan, sharders=[sharder])
    return dmp, plan


def machine_topology(ctx: DistContext) -> Topology:
    """The planner's view of the job: ranks, compute device and real memory per rank."""
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", ctx.world_size))
    host_per_rank = psutil.virtual_memory().available // max(1, local_world)
    if ctx.device.type == "cuda":
        hbm = torch.cuda.get_device_properties(ctx.device).total_memory
        return Topology(
            world_size=ctx.world_size,
            compute_device="cuda",
            hbm_cap=hbm,
            ddr_cap=host_per_rank,
            local_world_size=local_world,
        )
    # On CPU the tables live in host memory ("ddr"); there is no HBM tier.
    return Topology(
        world_size=ctx.world_size,
        compute_device="cpu",
        hbm_cap=0,
        ddr_cap=host_per_rank,
        local_world_size=local_world,
    )


def describe_plan(plan: ShardingPlan, model_spec: Any, world_size: int, bytes_per_value: int = 4) -> dict[str, Any]:
    """Per table: sharding type, ranks and bytes; per rank: total table bytes.

    `bytes_per_value` is the stored row precision (4 for fp32 tables, 2 for fp16).
    """
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
                    per_rank[r] += bytes_per_value * shard.shard_sizes[0] * shard.shard_sizes[1]
            else:  # data_parallel: a full replica on every rank
                ranks = list(p.ranks or range(world_size))
                for r in ranks:
                    per_rank[r] += bytes_per_value * table.num_parameters
            tables.append(
                {
                    "table": name,
                    "sharding_type": p.sharding_type,
                    "compute_kernel": p.compute_kernel,
                    "ranks": ranks,
                    "bytes": bytes_per_value * table.num_parameters,
                }
            )
    return {"tables": tables, "bytes_per_rank": per_rank}

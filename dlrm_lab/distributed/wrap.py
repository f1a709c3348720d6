"""Wrapping the model for training: the table optimizer, the plan applied, DDP for the dense layers.

Embedding tables are model-parallel (placed by `distributed.plan`), their optimizer is
fused into the fbgemm backward kernel (no dense gradient of a table ever exists), and the
dense MLPs are data-parallel (DDP inside `DistributedModelParallel`, from two ranks on:
`DenseReplicas`).
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.model_parallel import DataParallelWrapper, DefaultDataParallelWrapper
from torchrec.distributed.types import ModuleSharder, ShardingPlan
from torchrec.modules.embedding_modules import EmbeddingCollection
from torchrec.optim import RowWiseAdagrad
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

from dlrm_lab.config.family import family_of
from dlrm_lab.distributed.context import DistContext
from dlrm_lab.distributed.plan import PlannerStages, check_sharding, plan_sharding

# TorchRec's own deprecation notices about its internals; nothing a user can act on.
warnings.filterwarnings("ignore", category=FutureWarning, module=r"torchrec\.")
logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)


@dataclass(frozen=True)
class EmbeddingOptimizer:
    """The table optimizer (names as in `config.EMBEDDING_OPTIMIZERS`, validated there)."""

    name: str = "rowwise_adagrad"
    lr: float = 0.05
    eps: float = 1e-8

    def apply(self, model: torch.nn.Module) -> None:
        """Attach the optimizer to the tables; sharding fuses it into the fbgemm kernel."""
        params = table_collection(model).parameters()
        if self.name == "rowwise_adagrad":
            apply_optimizer_in_backward(RowWiseAdagrad, params, {"lr": self.lr, "eps": self.eps})
        else:
            apply_optimizer_in_backward(torch.optim.SGD, params, {"lr": self.lr})


def table_collection(model: torch.nn.Module) -> torch.nn.Module:
    """The TorchRec table module of either family: a DLRM's pooled EmbeddingBagCollection, the HSTU
    ranker's sequence EmbeddingCollection."""
    tables = getattr(model, "tables", None)
    return tables if isinstance(tables, EmbeddingCollection) else model.sparse_arch.embedding_bag_collection


class SequenceSharder(EmbeddingCollectionSharder):
    """TorchRec's sharder of sequence tables (table-, column-, row-wise and data-parallel), less
    data-parallel on CPU: there TorchRec 1.8's replicated sequence lookup fails on the first batch
    (`split_with_sizes expects split_sizes to sum exactly to 80 ...`, 2 ranks, gloo), so the planner
    must not pick it."""

    def sharding_types(self, compute_device_type: str) -> list[str]:
        kinds = super().sharding_types(compute_device_type)
        return [k for k in kinds if k != "data_parallel"] if compute_device_type == "cpu" else kinds


def table_sharder(spec: Any) -> ModuleSharder[Any]:
    """The sharder of a model's tables, as its family shards them (a DLRM's pooled tables: `AnyDeviceSharder`;
    the HSTU ranker's sequence tables: `SequenceSharder`)."""
    return family_of(spec).sharder(spec)


class DenseReplicas(DataParallelWrapper):
    """TorchRec's DDP for the dense layers when there are replicas to keep in step, nothing
    on one rank: there DDP has no peer to all-reduce with and would only copy every gradient
    into its buckets and back each step, a cost of the lab and not of the machine."""

    def wrap(self, dmp: DistributedModelParallel, env: Any, device: torch.device) -> None:
        if env.world_size > 1:
            DefaultDataParallelWrapper().wrap(dmp, env, device)


def shard_model(
    model: torch.nn.Module,
    ctx: DistContext,
    embedding_optimizer: EmbeddingOptimizer,
    sharding: str = "auto",
    per_table: dict[str, str] | None = None,
    batch_size: int = 512,
    wrapper: torch.nn.Module | None = None,
    stages: PlannerStages | None = None,
) -> tuple[DistributedModelParallel, ShardingPlan]:
    """Plan the tables over the ranks, materialise them shard by shard, wrap dense in DDP.

    `sharding` is "auto" (TorchRec's planner chooses per table among all types) or one
    sharding type for every table; `per_table` overrides it for named tables; `stages`
    swaps stages of the planner (`plan.PlannerStages`). The plan is made against this
    machine's real memory, so tables that cannot fit are refused (UserError naming the
    sizes) before anything is allocated. `wrapper` (a module holding `model`, e.g. the
    training pipeline's batch-to-loss module) is what gets wrapped.
    """
    root = wrapper if wrapper is not None else model
    check_sharding(sharding)
    embedding_optimizer.apply(model)  # before planning: the sharder fuses what is attached
    sharder = table_sharder(model.spec)
    plan = plan_sharding(root, model, ctx, sharder, sharding, per_table, batch_size, stages)
    dmp = DistributedModelParallel(
        module=root, device=ctx.device, plan=plan, sharders=[sharder], data_parallel_wrapper=DenseReplicas()
    )
    return dmp, plan

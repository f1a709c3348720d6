"""Sharding policy: which sharding types each table may take, and the plan TorchRec's planner makes.

Policy (the `sharding` and per-table choices, turned into `ParameterConstraints`) is kept
apart from mechanism (`distributed.wrap` applies the plan). New planning behaviour (a cost
estimator, a proposer, a partitioner) comes in through `PlannerStages`, as a stage of
TorchRec's planner pipeline, rather than as another option threaded through the loop.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psutil
import torch
import torch.distributed as dist
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.distributed.planner.storage_reservations import FixedPercentageStorageReservation
from torchrec.distributed.planner.types import (
    ParameterConstraints,
    Partitioner,
    PerfModel,
    PlannerError,
    Proposer,
    ShardEstimator,
)
from torchrec.distributed.types import ShardingPlan, ShardingType

from dlrm_lab.config import SHARDING_CHOICES, SHARDING_TYPES
from dlrm_lab.config.values import JsonObject
from dlrm_lab.distributed.context import DistContext
from dlrm_lab.errors import FieldError, UserError

# The planner's advice that topologies should come from its factory does not apply:
# we pass the real world size and device, which is all it reads for our use.
logging.getLogger("torchrec.distributed.planner.types").setLevel(logging.ERROR)

# Share of each device's memory the planner keeps free for activations, dense
# parameters and the input batch.
RESERVED_MEMORY_SHARE = 0.15

assert set(SHARDING_TYPES) <= {t.value for t in ShardingType}


class AnyDeviceSharder(EmbeddingBagCollectionSharder):
    """TorchRec's sharder with every sharding type allowed on every device.

    TorchRec lists row_wise and table_row_wise for CUDA only, although on CPU/gloo they
    plan and train correctly (max difference to an unsharded reference ~2e-9, see
    shared/STACK.md and tests/test_distributed.py); this lifts that restriction only.
    """

    def sharding_types(self, compute_device_type: str) -> list[str]:
        return list(SHARDING_TYPES)


def check_sharding(sharding: str) -> None:
    """`sharding` is "auto", "planner" or one of TorchRec's sharding types ("auto" that reaches the planner,
    unresolved, means the planner)."""
    if sharding not in SHARDING_CHOICES:
        raise FieldError("sharding", f"{sharding!r}: allowed: {', '.join(SHARDING_CHOICES)}")


def parse_table_sharding(items: list[str] | tuple[str, ...], table_names: list[str]) -> dict[str, str]:
    """`["t_cat_3=row_wise", ...]` -> {table: sharding type}, validated."""
    out: dict[str, str] = {}
    for item in items:
        if "=" not in item:
            raise FieldError("shard", f"{item!r}: expected TABLE=TYPE, e.g. t_cat_3=row_wise")
        table, kind = (x.strip() for x in item.split("=", 1))
        if table not in table_names:
            shown = ", ".join(table_names[:6]) + (", ..." if len(table_names) > 6 else "")
            raise FieldError("shard", f"{item!r}: no table {table!r}; tables: {shown}")
        if kind not in SHARDING_TYPES:
            raise FieldError("shard", f"{item!r}: sharding type {kind!r}; allowed: {', '.join(SHARDING_TYPES)}")
        out[table] = kind
    return out


def check_table_types(model: str, kinds: list[str], sharding: str, per_table: dict[str, str]) -> None:
    """`--sharding` and `--shard` name only types the model's tables take (`kinds`, its sharder's)."""
    asks = [(sharding, "sharding", sharding)] + [(k, "shard", f"{t}={k}") for t, k in per_table.items()]
    for asked, field, what in asks:
        if asked in SHARDING_TYPES and asked not in kinds:
            raise FieldError(field, f"{what}: {model}'s tables take {', '.join(kinds)}")


def sharding_constraints(
    model: torch.nn.Module, sharding: str, per_table: dict[str, str], world_size: int = 2
) -> dict[str, ParameterConstraints]:
    """Allowed sharding types and kernels per table. `auto` on one rank is table_wise: every
    type then keeps each whole table on rank 0, but the planner, whose estimates are made
    for several ranks, picks row_wise for large tables, which adds an id-bucketing pass and
    a larger output distribution to every step for nothing (docs/benchmarks-history.md, issue 13)."""
    out = {}
    auto = ShardingType.TABLE_WISE.value if world_size == 1 else None
    for t in model.spec.tables:
        kind = per_table.get(t.name) or (auto if sharding in ("auto", "planner") else sharding)
        kinds = [kind] if kind else list(SHARDING_TYPES)
        kernels = []
        if any(k != ShardingType.DATA_PARALLEL.value for k in kinds):
            kernels.append(EmbeddingComputeKernel.FUSED.value)  # optimizer fused into backward
        if ShardingType.DATA_PARALLEL.value in kinds:
            kernels.append(EmbeddingComputeKernel.DENSE.value)  # replicas all-reduced by DDP
        out[t.name] = ParameterConstraints(
            sharding_types=kinds,
            compute_kernels=kernels,
            pooling_factors=[t.pooling_factor] * len(t.feature_names),
        )
    return out


@dataclass(frozen=True)
class PlannerStages:
    """Stages swapped into TorchRec's planner pipeline; a stage left None is TorchRec's default.

    Each field is a factory, called once per plan, because TorchRec's stages keep state
    between plans. `estimators` replaces the enumerator's perf and storage estimators (the
    place for a measured cost model); `proposers`, `partitioner` and `performance_model`
    replace those stages. The default (all None) builds exactly TorchRec's planner.
    """

    estimators: Callable[[Topology, dict[str, ParameterConstraints]], list[ShardEstimator]] | None = None
    proposers: Callable[[], list[Proposer]] | None = None
    partitioner: Callable[[], Partitioner] | None = None
    performance_model: Callable[[Topology], PerfModel] | None = None

    def planner_kwargs(
        self, topology: Topology, batch_size: int, constraints: dict[str, ParameterConstraints]
    ) -> dict[str, Any]:
        """Keyword arguments for `EmbeddingShardingPlanner`: only the stages that are set."""
        out: dict[str, Any] = {}
        if self.estimators is not None:
            out["enumerator"] = EmbeddingEnumerator(
                topology=topology,
                batch_size=batch_size,
                constraints=constraints,
                estimator=self.estimators(topology, constraints),
            )
        if self.proposers is not None:
            out["proposer"] = self.proposers()
        if self.partitioner is not None:
            out["partitioner"] = self.partitioner()
        if self.performance_model is not None:
            out["performance_model"] = self.performance_model(topology)
        return out


def plan_sharding(
    root: torch.nn.Module,
    model: torch.nn.Module,
    ctx: DistContext,
    sharder: Any,
    sharding: str = "auto",
    per_table: dict[str, str] | None = None,
    batch_size: int = 512,
    stages: PlannerStages | None = None,
) -> ShardingPlan:
    """One plan agreed by every rank (a collective), made against this machine's real memory.

    Tables that cannot fit are refused (UserError naming the sizes) before anything is
    allocated. `root` is the module that will be wrapped; `model` the DLRM or HSTU ranker inside it (its `spec`
    names the tables).
    """
    check_table_types(model.spec.name, sharder.sharding_types(ctx.device.type), sharding, per_table or {})
    constraints = sharding_constraints(model, sharding, per_table or {}, ctx.world_size)
    topology = machine_topology(ctx)
    planner = EmbeddingShardingPlanner(
        topology=topology,
        batch_size=batch_size,
        constraints=constraints,
        storage_reservation=FixedPercentageStorageReservation(RESERVED_MEMORY_SHARE),
        **(stages or PlannerStages()).planner_kwargs(topology, batch_size, constraints),
    )
    # Rank 0 plans and sends the plan, or its refusal, to every rank (TorchRec's collective_plan would leave the
    # other ranks waiting in the broadcast when rank 0's planner raises).
    shared: list[Any] = [None]
    if ctx.rank == 0:
        try:
            shared[0] = planner.plan(root, [sharder])
        except PlannerError as exc:
            shared[0] = str(exc).splitlines()[0][:200]
    if ctx.world_size > 1:
        dist.broadcast_object_list(shared, src=0)
    if isinstance(shared[0], str):
        table_bytes = sum(4 * t.num_parameters for t in model.spec.tables)
        memory = topology.devices[0].storage
        how = "" if sharding in ("auto", "planner") else f" as {sharding}"
        raise UserError(
            f"the embedding tables of {model.spec.name} ({table_bytes / 2**30:.2f} GiB fp32, plus optimizer "
            f"state) do not fit {ctx.world_size} rank(s){how} with {memory.ddr / 2**30:.2f} GiB host / "
            f"{memory.hbm / 2**30:.2f} GiB device memory each: scale the tables (--table-scale, --max-rows) "
            f"or add ranks [planner: {shared[0]}]"
        )
    plan: ShardingPlan = shared[0]
    return plan


def machine_topology(ctx: DistContext) -> Topology:
    """The planner's view of the job: ranks, compute device and real memory per rank."""
    local_world = ctx.local_world_size
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


def describe_plan(plan: ShardingPlan, model_spec: Any, world_size: int, bytes_per_value: int = 4) -> JsonObject:
    """Per table: sharding type, ranks and bytes; per rank: total table bytes.

    `bytes_per_value` is the stored row precision (4 for fp32 tables, 2 for fp16).
    """
    rows = {t.name: t for t in model_spec.tables}
    tables: list[JsonObject] = []
    per_rank = [0] * world_size
    for module_plan in plan.plan.values():
        for name, p in module_plan.items():
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

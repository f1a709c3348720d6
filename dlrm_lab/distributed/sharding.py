"""Sharding the embedding tables with TorchRec and wrapping the model for training.

Embedding tables are model-parallel (TorchRec's planner places them), their optimizer
is fused into the fbgemm backward kernel (no dense gradient of a table ever exists),
and the dense MLPs are data-parallel (DDP inside `DistributedModelParallel`, from two
ranks on: `DenseReplicas`).
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from typing import Any

import psutil
import torch
import torch.distributed as dist
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DataParallelWrapper, DefaultDataParallelWrapper
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
from torchrec.distributed.planner.storage_reservations import FixedPercentageStorageReservation
from torchrec.distributed.planner.types import ParameterConstraints, PlannerError
from torchrec.distributed.types import ShardingPlan, ShardingType
from torchrec.optim import RowWiseAdagrad
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

from dlrm_lab.config import SHARDING_TYPES
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


assert set(SHARDING_TYPES) <= {t.value for t in ShardingType}


class AnyDeviceSharder(EmbeddingBagCollectionSharder):
    """TorchRec's sharder with every sharding type allowed on every device.

    TorchRec lists row_wise and table_row_wise for CUDA only, although on CPU/gloo they
    plan and train correctly (max difference to an unsharded reference ~2e-9, see
    shared/STACK.md and tests/test_distributed.py); this lifts that restriction only.
    """

    def sharding_types(self, compute_device_type: str) -> list[str]:
        return list(SHARDING_TYPES)


def parse_table_sharding(items: list[str] | tuple[str, ...], table_names: list[str]) -> dict[str, str]:
    """`["t_cat_3=row_wise", ...]` -> {table: sharding type}, validated."""
    out: dict[str, str] = {}
    for item in items:
        if "=" not in item:
            raise UserError(f"--shard {item!r}: expected TABLE=TYPE, e.g. t_cat_3=row_wise")
        table, kind = (x.strip() for x in item.split("=", 1))
        if table not in table_names:
            shown = ", ".join(table_names[:6]) + (", ..." if len(table_names) > 6 else "")
            raise UserError(f"--shard {item!r}: no table {table!r}; tables: {shown}")
        if kind not in SHARDING_TYPES:
            raise UserError(f"--shard {item!r}: sharding type {kind!r}; allowed: {', '.join(SHARDING_TYPES)}")
        out[table] = kind
    return out


def _constraints(
    model: DLRM, sharding: str, per_table: dict[str, str], world_size: int = 2
) -> dict[str, ParameterConstraints]:
    """Allowed sharding types and kernels per table. `auto` on one rank is table_wise: every
    type then keeps each whole table on rank 0, but the planner, whose estimates are made
    for several ranks, picks row_wise for large tables, which adds an id-bucketing pass and
    a larger output distribution to every step for nothing (BENCHMARKS.md, issue 13)."""
    out = {}
    auto = ShardingType.TABLE_WISE.value if world_size == 1 else None
    for t in model.spec.tables:
        kind = per_table.get(t.name) or (auto if sharding == "auto" else sharding)
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


class DenseReplicas(DataParallelWrapper):
    """TorchRec's DDP for the dense layers when there are replicas to keep in step, nothing
    on one rank: there DDP has no peer to all-reduce with and would only copy every gradient
    into its buckets and back each step, a cost of the lab and not of the machine."""

    def wrap(self, dmp: DistributedModelParallel, env: Any, device: torch.device) -> None:
        if env.world_size > 1:
            DefaultDataParallelWrapper().wrap(dmp, env, device)


def shard_model(
    model: DLRM,
    ctx: DistContext,
    embedding_optimizer: EmbeddingOptimizer,
    sharding: str = "auto",
    per_table: dict[str, str] | None = None,
    batch_size: int = 512,
    wrapper: torch.nn.Module | None = None,
) -> tuple[DistributedModelParallel, ShardingPlan]:
    """Plan the tables over the ranks, materialise them shard by shard, wrap dense in DDP.

    `sharding` is "auto" (TorchRec's planner chooses per table among all types) or one
    sharding type for every table; `per_table` overrides it for named tables. The plan is
    made against this machine's real memory, so tables that cannot fit are refused
    (UserError naming the sizes) before anything is allocated. `wrapper` (a module holding
    `model`, e.g. the training pipeline's batch-to-loss module) is what gets wrapped.
    """
    root = wrapper if wrapper is not None else model
    if sharding != "auto" and sharding not in SHARDING_TYPES:
        raise UserError(f"--sharding {sharding!r}: allowed: auto, {', '.join(SHARDING_TYPES)}")
    embedding_optimizer.apply(model)
    sharder = AnyDeviceSharder()
    constraints = _constraints(model, sharding, per_table or {}, ctx.world_size)
    topology = machine_topology(ctx)
    planner = EmbeddingShardingPlanner(
        topology=topology,
        batch_size=batch_size,
        constraints=constraints,
        storage_reservation=FixedPercentageStorageReservation(RESERVED_MEMORY_SHARE),
    )
    try:
        plan = planner.collective_plan(root, [sharder], dist.GroupMember.WORLD)
    except PlannerError as exc:
        table_bytes = sum(4 * t.num_parameters for t in model.spec.tables)
        memory = topology.devices[0].storage
        raise UserError(
            f"the embedding tables of {model.spec.name} ({table_bytes / 2**30:.2f} GiB fp32, plus optimizer "
            f"state) do not fit {ctx.world_size} rank(s) with {memory.ddr / 2**30:.2f} GiB host / "
            f"{memory.hbm / 2**30:.2f} GiB device memory each: scale the tables (--table-scale, --max-rows) "
            f"or add ranks [planner: {str(exc).splitlines()[0][:200]}]"
        ) from None
    dmp = DistributedModelParallel(
        module=root, device=ctx.device, plan=plan, sharders=[sharder], data_parallel_wrapper=DenseReplicas()
    )
    return dmp, plan


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


def gather_tables(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every embedding table in full, on every rank (a collective: all ranks must call it).

    Sharded tables are reassembled from each rank's shards and their offsets; replicated
    (data-parallel) tables are taken as they are. Meant for checks and exports of
    tables that fit in one process's memory.
    """
    local: dict[str, Any] = {}
    for key, value in model.state_dict().items():
        if "embedding_bags" not in key or not key.endswith(".weight"):
            continue
        name = key.split(".")[-2]
        if hasattr(value, "local_shards"):
            meta = value.metadata()
            local[name] = (
                tuple(meta.size),
                [(tuple(s.metadata.shard_offsets), s.tensor.detach().cpu()) for s in value.local_shards()],
            )
        else:
            local[name] = (tuple(value.shape), [((0, 0), value.detach().cpu())])
    parts: list[Any] = [local]
    if dist.is_initialized() and dist.get_world_size() > 1:
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, local)
    full: dict[str, torch.Tensor] = {}
    for rank_tables in parts:
        for name, (size, shards) in rank_tables.items():
            table = full.setdefault(name, torch.zeros(size))
            for (row, col), t in shards:
                table[row : row + t.shape[0], col : col + t.shape[1]] = t.float()
    return full


INIT_ROW_BLOCK = 1 << 16  # rows drawn together when initialising a table


@torch.no_grad()
def init_tables(model: torch.nn.Module, seed: int) -> None:
    """Give every table the same initial rows however it is sharded.

    Rows are drawn uniform in +-sqrt(1 / rows) (TorchRec's default) from generators
    seeded by (seed, table, block of 65,536 rows), and each rank writes only its own
    shards' rows and columns. Runs with 1 and N ranks, and with any sharding type,
    therefore start from identical tables, so their losses can be compared step by step.
    """
    for key, value in model.state_dict().items():
        if "embedding_bags" not in key or not key.endswith(".weight"):
            continue
        name = key.split(".")[-2]
        if hasattr(value, "local_shards"):
            rows, dim = value.metadata().size
            shards = [(tuple(s.metadata.shard_offsets), s.tensor) for s in value.local_shards()]
        else:
            rows, dim = value.shape
            shards = [((0, 0), value)]
        bound = (1.0 / rows) ** 0.5
        table_seed = int.from_bytes(name.encode()[:8].ljust(8, b"\0"), "little") ^ (seed * 0x9E3779B1)
        for (row0, col0), tensor in shards:
            n_rows, n_cols = tensor.shape
            for first in range(row0 - row0 % INIT_ROW_BLOCK, row0 + n_rows, INIT_ROW_BLOCK):
                g = torch.Generator().manual_seed((table_seed + first) % (1 << 63))
                block = torch.rand(min(INIT_ROW_BLOCK, rows - first), dim, generator=g) * (2 * bound) - bound
                lo, hi = max(first, row0), min(first + INIT_ROW_BLOCK, row0 + n_rows)
                part = block[lo - first : hi - first, col0 : col0 + n_cols]
                tensor[lo - row0 : hi - row0].copy_(part.to(tensor.dtype))

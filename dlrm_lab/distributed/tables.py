"""Embedding tables whatever their sharding: the same initial rows, and the full tables gathered.

Both work on a plain model and on one wrapped by `distributed.wrap`, so runs with any rank
count and sharding type can be started alike and compared table by table.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def gather_tables(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every embedding table in full, on every rank (a collective: all ranks must call it).

    Sharded tables are reassembled from each rank's shards and their offsets; replicated
    (data-parallel) tables are taken as they are. Meant for checks and exports of
    tables that fit in one process's memory.
    """
    local: dict[str, tuple[tuple[int, ...], list[tuple[tuple[int, ...], torch.Tensor]]]] = {}  # size, shards
    for key, value in model.state_dict().items():
        if not _is_table(key):
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


def _is_table(key: str) -> bool:
    """A state-dict key of a TorchRec table (a DLRM's pooled bags, the HSTU ranker's sequence tables)."""
    return ("embedding_bags." in key or "embeddings." in key) and key.endswith(".weight")


INIT_ROW_BLOCK = 1 << 16  # rows drawn together when initialising a table


@torch.no_grad()
def init_tables(model: torch.nn.Module, seed: int, bounds: dict[str, float] | None = None) -> None:
    """Give every table the same initial rows however it is sharded.

    Rows are drawn uniform in +-bounds[table] (`TableSpec.init_bound`: TorchRec's
    sqrt(1 / rows) of the published table; without `bounds`, of the table as built) from generators
    seeded by (seed, table, block of 65,536 rows), and each rank writes only its own
    shards' rows and columns. Runs with 1 and N ranks, and with any sharding type,
    therefore start from identical tables, so their losses can be compared step by step.
    """
    for key, value in model.state_dict().items():
        if not _is_table(key):
            continue
        name = key.split(".")[-2]
        if hasattr(value, "local_shards"):
            rows, dim = value.metadata().size
            shards = [(tuple(s.metadata.shard_offsets), s.tensor) for s in value.local_shards()]
        else:
            rows, dim = value.shape
            shards = [((0, 0), value)]
        bound = bounds[name] if bounds and name in bounds else (1.0 / rows) ** 0.5
        table_seed = int.from_bytes(name.encode()[:8].ljust(8, b"\0"), "little") ^ (seed * 0x9E3779B1)
        for (row0, col0), tensor in shards:
            n_rows, n_cols = tensor.shape
            for first in range(row0 - row0 % INIT_ROW_BLOCK, row0 + n_rows, INIT_ROW_BLOCK):
                # drawn where the shard lives: a GPU's tables (24 GiB of dcnv2 at scale 0.25) drawn on the host
                # took most of a minute; a device's generator draws its own stream, the same on every rank
                g = torch.Generator(device=tensor.device).manual_seed((table_seed + first) % (1 << 63))
                block = (
                    torch.rand(min(INIT_ROW_BLOCK, rows - first), dim, generator=g, device=tensor.device) * (2 * bound)
                    - bound
                )
                lo, hi = max(first, row0), min(first + INIT_ROW_BLOCK, row0 + n_rows)
                part = block[lo - first : hi - first, col0 : col0 + n_cols]
                tensor[lo - row0 : hi - row0].copy_(part.to(tensor.dtype))

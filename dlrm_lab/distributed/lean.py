"""A leaner pooled all-to-all for table-wise tables (`train --distribution lean`, opt-in, never the default).

TorchRec's CPU `PooledEmbeddingsAllToAll` copies the pooled rows into a fresh buffer before the collective,
concatenates the ranks' blocks after it, and regroups the gradient by rank in two copies (`.contiguous()` per
block, then a concatenation). The least a step can do on one host is the all-to-all straight from the lookup's
output, one concatenation forward and one regrouping copy backward: the same collectives of the same bytes,
so the same numbers (TorchRec's gradient division kept). Measured in benchmarks/lean_pooled.py (AMX, kaggle
weak over MPI: 1-2 ms of a 38-42 ms 2-rank step). Written by hand because TorchRec offers no such variant; the
lab measures TorchRec as users deploy it unless this is asked for, and the manifest says which ran.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from dlrm_lab.config.values import JsonObject


class _LeanPooled(torch.autograd.Function):
    """Pooled embeddings of this rank's tables for every rank's samples -> every table's for this rank's."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, pg: Any, dims: list[int]) -> torch.Tensor:
        world, me = pg.size(), pg.rank()
        b = local.shape[0] // world
        out = torch.empty(b * sum(dims), dtype=local.dtype, device=local.device)
        dist.all_to_all_single(
            out, local.contiguous().view(-1), [b * d for d in dims], [b * dims[me]] * world, group=pg
        )
        ctx.pg, ctx.dims, ctx.b = pg, dims, b
        blocks = out.split([b * d for d in dims])
        return torch.cat([blk.view(b, d) for blk, d in zip(blocks, dims, strict=True)], dim=1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        from torchrec.distributed import comm_ops

        pg, dims, b = ctx.pg, ctx.dims, ctx.b
        world, me = pg.size(), pg.rank()
        send = torch.empty(b * sum(dims), dtype=grad.dtype, device=grad.device)
        at = col = 0
        for d in dims:  # one copy: each rank's columns into its contiguous block
            send[at : at + b * d].view(b, d).copy_(grad[:, col : col + d])
            at, col = at + b * d, col + d
        recv = torch.empty(world * b * dims[me], dtype=grad.dtype, device=grad.device)
        dist.all_to_all_single(recv, send, [b * dims[me]] * world, [b * d for d in dims], group=pg)
        if comm_ops.get_gradient_division():  # as TorchRec's own backward does
            recv.div_(world)
        return recv.view(world * b, dims[me]), None, None


class LeanPooledAllToAll(torch.nn.Module):
    """Stands in for TorchRec's `PooledEmbeddingsAllToAll` of one table-wise sharding; a batch that is not
    the same size on every rank goes through TorchRec's own (`fallback`)."""

    def __init__(self, pg: Any, dims: list[int], fallback: torch.nn.Module) -> None:
        super().__init__()
        self.pg, self.dims, self.fallback = pg, list(dims), fallback

    def forward(self, local_embs: torch.Tensor, batch_size_per_rank: list[int] | None = None) -> Any:
        from torchrec.distributed.types import NoWait

        if batch_size_per_rank is not None and len(set(batch_size_per_rank)) > 1:
            return self.fallback(local_embs, batch_size_per_rank=batch_size_per_rank)
        return NoWait(_LeanPooled.apply(local_embs, self.pg, self.dims))


def use_lean_distribution(model: torch.nn.Module) -> JsonObject:
    """Put every table-wise pooled output distribution of `model` (a sharded DLRM) on `LeanPooledAllToAll`;
    the other sharding types keep TorchRec's. Returns the manifest's record: how many were replaced, and why
    any were not."""
    from torchrec.distributed.sharding.tw_sharding import TwPooledEmbeddingDist

    replaced, kept = 0, []
    for module in model.modules():
        for out_dist in getattr(module, "_output_dists", []):
            if not isinstance(out_dist, TwPooledEmbeddingDist):
                kept.append(f"{type(out_dist).__name__}: not table-wise")
                continue
            if out_dist._callbacks or out_dist._codecs is not None:  # noqa: SLF001 - no public way to ask
                kept.append("a table-wise distribution with callbacks or codecs")
                continue
            if out_dist._dist is None:  # noqa: SLF001 - TorchRec makes it at the first batch
                out_dist._create_output_dist_module()  # noqa: SLF001
            if not isinstance(out_dist._dist, LeanPooledAllToAll):  # noqa: SLF001
                out_dist._dist = LeanPooledAllToAll(out_dist._pg, out_dist._dim_sum_per_rank, out_dist._dist)  # noqa: SLF001
                replaced += 1
    return {"distribution": "lean", "replaced": replaced, "kept_torchrec": sorted(set(kept))}

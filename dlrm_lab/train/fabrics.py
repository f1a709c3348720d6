"""What a training step would take on a cluster of published figures: the projection of
`dlrm-lab scale --project` (issue 18, part 4).

One rank's measured step here, its compute carried to a named GPU's roofline at the fraction of
its roof it reached on this machine, and every collective on the fabric's links (`FABRICS`:
NVLink and InfiniBand nodes, with their sources); `planner_choice` is the sharding TorchRec's
planner would pick at that size. The model of this machine's own steps is `scaling_model`.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, TypedDict

from dlrm_lab.train.scaling_model import INPUT_DIST_COLLECTIVES


@dataclass(frozen=True)
class Fabric:
    """A named cluster: per-GPU link bandwidths (one direction) and the GPU's peaks."""

    name: str
    description: str
    ranks_per_node: int
    intra_bytes_per_s: float  # per rank, inside a node
    inter_bytes_per_s: float  # per rank, between nodes
    latency_s: float  # per collective (ring step for all-reduce)
    peer_s: float  # per peer of an all-to-all (one send and one receive each)
    step_floor_s: float  # a training step's fixed cost on this GPU: kernel launches, synchronisation
    flops_per_s: float  # dense peak at the precision named in `description`
    memory_bytes_per_s: float
    memory_bytes: float
    source: str

    def all_to_all_s(self, nbytes: float, ranks: int) -> float:
        """Pairwise exchange: traffic to the node's peers over NVLink, the rest over the NIC."""
        if ranks <= 1 or nbytes <= 0:
            return 0.0
        local = min(ranks, self.ranks_per_node) - 1
        intra, inter = nbytes * local / (ranks - 1), nbytes * (ranks - 1 - local) / (ranks - 1)
        wire = max(intra / self.intra_bytes_per_s, inter / self.inter_bytes_per_s)
        return self.latency_s + (ranks - 1) * self.peer_s + wire

    def all_reduce_s(self, nbytes: float, ranks: int) -> float:
        """Ring (tree latency): bus bytes at the slowest link the ring crosses."""
        if ranks <= 1 or nbytes <= 0:
            return 0.0
        link = self.intra_bytes_per_s if ranks <= self.ranks_per_node else self.inter_bytes_per_s
        return 2 * math.log2(ranks) * self.latency_s + nbytes / link


ACHIEVED_SHARE = 0.8  # of a link's peak that nccl-tests style collectives reach (assumption)
# A DLRM training step launches a few hundred kernels at ~5 us each (assumption): no GPU
# step is shorter than this, however small its roofline time.
STEP_FLOOR_S = 1e-3
FABRICS = {
    f.name: f
    for f in (
        Fabric(
            "h100-nvlink-ndr",
            "8 x H100 SXM per node, NVLink 4 inside, 8 x 400 Gb/s NDR InfiniBand between; TF32 dense",
            8,
            ACHIEVED_SHARE * 450e9,
            ACHIEVED_SHARE * 50e9,
            5e-6,
            1e-6,
            STEP_FLOOR_S,
            494.7e12,
            3.35e12,
            80e9,
            "NVIDIA H100 datasheet (NVLink 900 GB/s both ways, TF32 494.7 TFLOP/s dense, HBM3 3.35 TB/s); "
            "ConnectX-7 400 Gb/s per GPU",
        ),
        Fabric(
            "a100-nvlink-hdr",
            "8 x A100 SXM 80GB per node, NVLink 3 inside, 8 x 200 Gb/s HDR InfiniBand between; TF32 dense",
            8,
            ACHIEVED_SHARE * 300e9,
            ACHIEVED_SHARE * 25e9,
            5e-6,
            1e-6,
            STEP_FLOOR_S,
            156e12,
            2.039e12,
            80e9,
            "NVIDIA A100 datasheet (NVLink 600 GB/s both ways, TF32 156 TFLOP/s dense, HBM2e 2,039 GB/s); "
            "ConnectX-6 200 Gb/s per GPU",
        ),
    )
}


class ProjectedRow(TypedDict):
    """A rank count of `project`: one rank's step on the fabric, its parts (ms), throughput and efficiency."""

    ranks: int
    batch_size_per_rank: int
    compute_ms: float
    input_dist_ms: float
    pooled_all_to_all_ms: float
    all_reduce_ms: float
    step_ms: float
    samples_per_s: float
    efficiency: float  # against N x one rank on the fabric
    all_to_all_dominates: bool  # the all-to-alls take longer than the compute


def project(
    work: dict[str, float],
    one_rank_fraction: float | None,
    comm_bytes_at: Any,
    ranks: list[int],
    fabric: Fabric,
    batch_size_per_rank: int,
    mode: str,
) -> tuple[list[ProjectedRow], list[str]]:
    """Per rank count on `fabric`: compute at the GPU's roofline divided by the fraction of
    its roof one rank reached here, every collective on the fabric, and the efficiency
    against N x one rank. `work` is one rank's step at `batch_size_per_rank` (flops,
    gather_bytes, stream_bytes); `comm_bytes_at(global_batch, ranks)` the cost model's bytes."""
    fraction = one_rank_fraction if one_rank_fraction and one_rank_fraction > 0 else 0.5
    assumptions = [
        f"compute: the GPU's roofline time / {fraction:.2f}, the fraction of its roof one rank reached here"
        + ("" if one_rank_fraction else " (assumed: no roofline for the one-rank run)"),
        f"compute at least {fabric.step_floor_s * 1e3:g} ms a step (kernel launches)",
        f"links at {ACHIEVED_SHARE:.0%} of their peak; {fabric.latency_s * 1e6:g} us per collective (per ring step "
        f"for all-reduce) and {fabric.peer_s * 1e6:g} us per all-to-all peer",
        "no overlap of communication with compute; ids and embeddings spread uniformly over ranks",
        f"{mode} scaling: " + ("each rank keeps its batch" if mode == "weak" else "the global batch is split"),
    ]

    def compute_s(scale: float) -> float:
        flops_s = work["flops"] * scale / fabric.flops_per_s
        bytes_s = (work["gather_bytes"] * scale + work["stream_bytes"]) / fabric.memory_bytes_per_s
        return max(max(flops_s, bytes_s) / fraction, fabric.step_floor_s)

    base = batch_size_per_rank / compute_s(1.0)  # one rank's samples/s on the fabric's GPU
    rows: list[ProjectedRow] = []
    for n in ranks:
        per_rank = batch_size_per_rank if mode == "weak" else max(1, batch_size_per_rank // n)
        compute = compute_s(per_rank / batch_size_per_rank)
        b = comm_bytes_at(per_rank * n, n)
        input_dist = fabric.all_to_all_s(b["input_dist"], n) * (INPUT_DIST_COLLECTIVES if n > 1 else 0)
        pooled = 2 * fabric.all_to_all_s(b["pooled_all_to_all"] / 2, n)
        all_reduce = fabric.all_reduce_s(b["gradient_all_reduce"], n)
        step = compute + input_dist + pooled + all_reduce
        rate = per_rank * n / step
        rows.append(
            {
                "ranks": n,
                "batch_size_per_rank": per_rank,
                "compute_ms": compute * 1e3,
                "input_dist_ms": input_dist * 1e3,
                "pooled_all_to_all_ms": pooled * 1e3,
                "all_reduce_ms": all_reduce * 1e3,
                "step_ms": step * 1e3,
                "samples_per_s": rate,
                "efficiency": rate / (base * n),
                "all_to_all_dominates": input_dist + pooled > compute,
            }
        )
    return rows, assumptions


def planner_choice(spec: Any, ranks: int, fabric: Fabric, batch_size_per_rank: int) -> dict[str, int]:
    """Sharding types TorchRec's planner picks for `spec`'s tables on `ranks` GPUs of
    `fabric` (table counts per type). Minutes beyond a few hundred ranks (59 s at 512 on a
    2-core EPYC; over 10 minutes at 4,096)."""
    from collections import Counter

    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology

    from dlrm_lab.distributed.plan import AnyDeviceSharder, sharding_constraints
    from dlrm_lab.model.dlrm import build_model

    model = build_model(spec, table_device="meta")
    topology = Topology(
        world_size=ranks,
        compute_device="cuda",
        hbm_cap=int(fabric.memory_bytes),
        ddr_cap=int(fabric.memory_bytes) * 4,
        local_world_size=min(ranks, fabric.ranks_per_node),
    )
    planner = EmbeddingShardingPlanner(
        topology=topology, batch_size=batch_size_per_rank, constraints=sharding_constraints(model, "auto", {}, ranks)
    )
    quiet = [logging.getLogger(), logging.getLogger("torchrec.distributed.planner.storage_reservations")]
    levels = [log.level for log in quiet]
    for log in quiet:  # a dry run: TorchRec warns once per table that nothing is materialised
        log.setLevel(logging.ERROR)
    try:
        plan = planner.plan(model, [AnyDeviceSharder()])
    finally:
        for log, level in zip(quiet, levels, strict=True):
            log.setLevel(level)
    return dict(Counter(p.sharding_type for m in plan.plan.values() for p in m.values()))

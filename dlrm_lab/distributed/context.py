"""Process-group set-up: whoever launched us, one `DistContext` comes out.

Launched by torchrun (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT in the
environment) the job joins that group; started as a plain process it becomes a group
of one, so single-process and multi-rank training run the same sharded code path.
Backend: NCCL on CUDA, gloo on CPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from dlrm_lab.errors import UserError

DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def resolve_device(device: str, local_rank: int = 0) -> torch.device:
    """`cpu` or `cuda` (one GPU per local rank), with a clear error where CUDA is absent."""
    if device not in DEVICES:
        raise UserError(f"--device {device!r}: allowed: {', '.join(DEVICES)}")
    if device == "cuda":
        if not torch.cuda.is_available():
            raise UserError(
                "--device cuda: no CUDA device is visible to this torch build "
                f"(torch {torch.__version__}); use --device cpu or install a CUDA build (README, GPU machines)"
            )
        if local_rank >= torch.cuda.device_count():
            raise UserError(f"local rank {local_rank} has no GPU: only {torch.cuda.device_count()} visible")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_distributed(device: str = "cpu", timeout_s: float = 300.0) -> DistContext:
    """Join (or create) the default process group and pick this rank's device."""
    env_rank = os.environ.get("RANK")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = resolve_device(device, local_rank)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    if not dist.is_initialized():
        timeout = timedelta(seconds=timeout_s)
        if env_rank is not None:
            dist.init_process_group(backend=backend, timeout=timeout)
        else:
            # A group of one needs no rendezvous: an in-memory store will do.
            dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return DistContext(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=local_rank,
        device=dev,
        backend=dist.get_backend(),
    )


def shutdown_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()

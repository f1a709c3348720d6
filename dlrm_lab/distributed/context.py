"""Process-group set-up: whoever launched us, one `DistContext` comes out.

The launcher is read from the environment it leaves behind:
- torchrun (and anything that sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT);
- SLURM `srun` (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID; rendezvous on the first node
  of the allocation, port MASTER_PORT or derived from the job id);
- mpiexec (MPICH's PMI_RANK / Open MPI's OMPI_COMM_WORLD_RANK / PMIx): mpi4py gives rank,
  size and the node-local rank, rank 0 picks an address and a free port and broadcasts
  them. Collectives stay gloo/NCCL (PyPI torch has no MPI backend) unless asked to run over
  MPI (`collectives="mpi"`: the `distributed.mpi` process group);
- nothing: a plain process becomes a group of one, so single-process and multi-rank
  training run the same sharded code path.
Backend: NCCL on CUDA (one GPU per local rank), gloo (or MPI, see above) on CPU.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from dlrm_lab.errors import FieldError, RankFailure, UserError

__all__ = ["DistContext", "LaunchInfo", "RankFailure", "detect_launch", "init_distributed", "resolve_device"]

DEVICES = ("cpu", "cuda")
DEFAULT_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class LaunchInfo:
    launcher: str  # torchrun | slurm | mpi | none
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int


@dataclass(frozen=True)
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    launcher: str = "none"
    local_world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def resolve_device(device: str, local_rank: int = 0) -> torch.device:
    """`cpu` or `cuda` (one GPU per local rank), with a clear error where CUDA is absent."""
    if device not in DEVICES:
        raise FieldError("device", f"{device!r}: allowed: {', '.join(DEVICES)}")
    if device == "cuda":
        if not torch.cuda.is_available():
            raise FieldError(
                "device",
                "cuda: no CUDA device is visible to this torch build "
                f"(torch {torch.__version__}); use {{device}} cpu or install a CUDA build (README, GPU machines)",
                "device",
            )
        if local_rank >= torch.cuda.device_count():
            raise UserError(f"local rank {local_rank} has no GPU: only {torch.cuda.device_count()} visible")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def first_slurm_node(nodelist: str) -> str:
    """The first host of a SLURM node list (`node[03-05,9],gpu1` -> `node03`)."""
    try:
        out = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=10, check=True
        ).stdout.split()
        if out:
            return out[0]
    except (OSError, subprocess.SubprocessError):
        pass
    first = re.split(r",(?![^\[]*\])", nodelist)[0]
    m = re.match(r"^(.*?)\[([^\],-]+)", first)
    return m.group(1) + m.group(2) if m else first


def detect_launch(environ: dict[str, str] | None = None) -> LaunchInfo:
    """Who started this process, and where the rendezvous is."""
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return LaunchInfo(
            "torchrun",
            int(env["RANK"]),
            int(env["WORLD_SIZE"]),
            int(env.get("LOCAL_RANK", "0")),
            int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])),
            env.get("MASTER_ADDR", "127.0.0.1"),
            int(env.get("MASTER_PORT", "29500")),
        )
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env and int(env["SLURM_NTASKS"]) > 1:
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or "127.0.0.1"
        port = int(env.get("MASTER_PORT", 20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000))
        local_world = int(env.get("SLURM_NTASKS_PER_NODE", "0").split("(")[0] or 0) or int(env["SLURM_NTASKS"])
        return LaunchInfo(
            "slurm",
            int(env["SLURM_PROCID"]),
            int(env["SLURM_NTASKS"]),
            int(env.get("SLURM_LOCALID", "0")),
            local_world,
            env.get("MASTER_ADDR") or first_slurm_node(nodelist),
            port,
        )
    mpi_vars = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS")
    if any(v in env for v in mpi_vars):
        return _mpi_launch(env)
    return LaunchInfo("none", 0, 1, 0, 1, "127.0.0.1", 0)


def _mpi_launch(env: Mapping[str, str]) -> LaunchInfo:
    try:
        from mpi4py import MPI
    except ImportError:
        raise UserError("started by mpiexec but mpi4py is missing: pip install 'dlrm-lab[mpi]'") from None
    except RuntimeError as exc:  # mpi4py without an MPI library
        raise UserError(f"mpi4py cannot load an MPI library ({exc}); install the mpich wheel") from None
    comm = MPI.COMM_WORLD
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    if comm.Get_rank() == 0:
        addr = env.get("MASTER_ADDR") or socket.gethostbyname(socket.gethostname())
        if comm.Get_size() == local.Get_size():
            addr = "127.0.0.1"  # everyone on this node: loopback needs no name resolution
        rendezvous = (addr, int(env.get("MASTER_PORT", 0)) or _free_port())
    else:
        rendezvous = None
    addr, port = comm.bcast(rendezvous, root=0)
    info = LaunchInfo("mpi", comm.Get_rank(), comm.Get_size(), local.Get_rank(), local.Get_size(), addr, port)
    local.Free()
    return info


def init_distributed(
    device: str = "cpu",
    timeout_s: float = DEFAULT_TIMEOUT_S,
    collectives: str = "gloo",
    launch: LaunchInfo | None = None,
) -> DistContext:
    """Join (or create) the default process group and pick this rank's device.

    `timeout_s` bounds every collective: a dead or stuck rank fails the others after it
    instead of hanging them (gloo's; MPI's blocking calls have no timeout). `collectives`
    "mpi" runs CPU ranks' collectives over MPI (`distributed.mpi`, ranks started by mpiexec).
    `launch`: what `detect_launch` found, when the caller has it already (under mpiexec it is a collective).
    """
    launch = launch or detect_launch()
    dev = resolve_device(device, launch.local_rank)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    if collectives == "mpi" and dev.type == "cpu" and launch.world_size > 1:
        from dlrm_lab.distributed.mpi import BACKEND, register

        if launch.launcher != "mpi":
            raise FieldError("collectives", f"mpi: the ranks were started by {launch.launcher}, not mpiexec")
        register()
        backend = BACKEND
    if not dist.is_initialized():
        timeout = timedelta(seconds=timeout_s)
        if launch.world_size == 1:
            # A group of one needs no rendezvous: an in-memory store will do.
            dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        else:
            dist.init_process_group(
                backend=backend,
                init_method=f"tcp://{launch.master_addr}:{launch.master_port}",
                rank=launch.rank,
                world_size=launch.world_size,
                timeout=timeout,
            )
    return DistContext(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=launch.local_rank,
        device=dev,
        backend=dist.get_backend(),
        launcher=launch.launcher,
        local_world_size=launch.local_world_size,
    )


def shutdown_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def pin_to_cores(ctx: DistContext) -> list[int]:
    """Pin this rank to `torch.get_num_threads()` cores of its own (by node-local rank).

    Its data thread then shares those cores, as it would on a loaded node; without pinning
    a single rank borrows the idle cores of the ranks that are not there, which flatters
    it in a scaling comparison.
    """
    if not hasattr(os, "sched_setaffinity"):
        return []
    available = sorted(os.sched_getaffinity(0))
    per_rank = torch.get_num_threads()
    first = ctx.local_rank * per_rank
    if first + per_rank > len(available):
        raise FieldError(
            "pin_cores",
            f": local rank {ctx.local_rank} x {per_rank} threads needs {first + per_rank} cores; "
            f"{len(available)} available (lower OMP_NUM_THREADS or the ranks per node)",
        )
    cores = available[first : first + per_rank]
    os.sched_setaffinity(0, cores)
    return cores

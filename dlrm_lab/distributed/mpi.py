"""Training collectives over MPI: a torch.distributed process group backed by mpi4py (issue 18).

PyPI's torch has no MPI backend, so ranks started by mpiexec used gloo for every collective. On
one host MPICH moves data through shared memory, which the machine probe measured several times
faster than gloo's TCP loopback for the few-MB messages of a DLRM step (docs/benchmarks-history.md, issue 18).
`MpiProcessGroup` is a Python `ProcessGroup` whose collectives call MPI on the tensors' memory
(CPU tensors, zero-copy numpy views): TorchRec's all-to-alls, reduce-scatters and all-gathers and
DDP's bucketed all-reduce run over it unchanged. Registered as the c10d backend `mpi4py`.

Every collective completes before it returns (MPI's blocking calls: what TorchRec and DDP wait on
right after anyway on a CPU rank with one core); its Work is already done. Subgroups split
MPI_COMM_WORLD by their global ranks.

`choose_collectives` decides between gloo and MPI for a run (`--collectives auto`) from the
probed collectives of this machine: the step's communication (the cost model's bytes) timed at
each transport's measured speed.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from dlrm_lab.errors import FieldError

BACKEND = "mpi4py"  # the c10d backend name
COLLECTIVES = ("auto", "gloo", "mpi")
_registered = threading.Lock()


def _mpi() -> Any:
    try:
        from mpi4py import MPI
    except ImportError:
        raise FieldError("collectives", "mpi: mpi4py is missing: pip install 'dlrm-lab[mpi]'") from None
    return MPI


def _done(result: Any) -> Any:
    from torch._C._distributed_c10d import _create_work_from_future  # type: ignore[attr-defined]  # not in its stubs
    from torch.futures import Future

    future: Future = Future()
    future.set_result(result)
    return _create_work_from_future(future)


def _buffer(t: torch.Tensor, reduced: bool = False) -> np.ndarray:
    """The tensor's memory as a flat numpy array (CPU, contiguous: what c10d hands a backend). MPI has
    no bfloat16: such tensors move as 16-bit words, and cannot be reduced."""
    if t.device.type != "cpu":
        raise FieldError("collectives", f"mpi: a {t.device.type} tensor reached the MPI process group (CPU only)")
    if not t.is_contiguous():
        raise ValueError("MPI process group: a non-contiguous tensor")
    if t.dtype == torch.bfloat16:
        if reduced:
            raise NotImplementedError("MPI process group: reducing bfloat16 (use --collectives gloo)")
        return t.detach().view(-1).view(torch.int16).numpy()
    return t.detach().view(-1).numpy()


class MpiProcessGroup(dist.ProcessGroup):
    """c10d collectives on MPI (see the module docstring)."""

    def __init__(self, comm: Any, rank: int, size: int) -> None:
        super().__init__(rank, size)
        self.comm = comm
        self._group_name = ""

    # c10d names the group after creating it; the Python subclass keeps the name itself
    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    @property
    def group_name(self) -> str:
        return self._group_name

    def getBackendName(self) -> str:  # noqa: N802 - c10d's name
        return BACKEND

    def size(self) -> int:
        return self.comm.Get_size()

    def rank(self) -> int:
        return self.comm.Get_rank()

    def _op(self, op: Any) -> Any:
        MPI = _mpi()
        for name, mpi_op in (("SUM", MPI.SUM), ("MAX", MPI.MAX), ("MIN", MPI.MIN), ("PRODUCT", MPI.PROD)):
            if op == getattr(dist.ReduceOp, name):
                return mpi_op
        raise NotImplementedError(f"MPI process group: reduce op {op} (use --collectives gloo)")

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        op = self._op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        for t in tensors:
            self.comm.Allreduce(_mpi().IN_PLACE, _buffer(t, reduced=True), op=op)
        return _done(tensors)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        return self.allreduce(tensors, opts)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        for t in tensors:
            self.comm.Bcast(_buffer(t), root=opts.rootRank if opts is not None else 0)
        return _done(tensors)

    def barrier(self, opts: Any = None) -> Any:
        self.comm.Barrier()
        return _done(None)

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> Any:
        for outs, inp in zip(outputs, inputs, strict=True):
            gathered = torch.empty((self.size(), *inp.shape), dtype=inp.dtype)
            self.comm.Allgather(_buffer(inp.contiguous()), _buffer(gathered))
            for k, out in enumerate(outs):
                out.copy_(gathered[k])
        return _done(outputs)

    def all_gather_single(self, output: torch.Tensor, inp: torch.Tensor, opts: Any = None) -> Any:
        """`dist.all_gather_into_tensor`."""
        self.comm.Allgather(_buffer(inp.contiguous()), _buffer(output))
        return _done([output])

    def reduce_scatter_single(self, output: torch.Tensor, inp: torch.Tensor, opts: Any = None) -> Any:
        """`dist.reduce_scatter_tensor`: equal blocks of `inp`, reduced, block r to rank r."""
        op = self._op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        self.comm.Reduce_scatter_block(_buffer(inp.contiguous(), reduced=True), _buffer(output), op=op)
        return _done([output])

    def reduce_scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None) -> Any:
        """`dist.reduce_scatter`: per output, the list of one block per rank."""
        for out, blocks in zip(outputs, inputs, strict=True):
            self.reduce_scatter_single(out, torch.cat([b.reshape(-1) for b in blocks]), opts)
        return _done(outputs)

    def alltoall_base(
        self,
        output: torch.Tensor,
        inp: torch.Tensor,
        output_splits: list[int],
        input_splits: list[int],
        opts: Any = None,
    ) -> Any:
        """All-to-all of one buffer in row blocks (`dist.all_to_all_single`); empty splits: equal blocks."""
        n = self.size()
        inp = inp.contiguous()
        row_in = int(np.prod(inp.shape[1:])) if inp.dim() > 1 else 1
        row_out = int(np.prod(output.shape[1:])) if output.dim() > 1 else 1
        send = np.asarray(input_splits if input_splits else [inp.shape[0] // n] * n, dtype=np.int64) * row_in
        recv = np.asarray(output_splits if output_splits else [output.shape[0] // n] * n, dtype=np.int64) * row_out
        a, b = _buffer(inp), _buffer(output)
        MPI = _mpi()
        kind = MPI._typedict[a.dtype.char]
        self.comm.Alltoallv(
            [a, send, np.cumsum(send) - send, kind], [b, recv, np.cumsum(recv) - recv, MPI._typedict[b.dtype.char]]
        )
        return _done([output])

    all_to_all_single = alltoall_base


def _create(options: Any, _backend_options: Any) -> MpiProcessGroup:
    """c10d's creator (its extended API, which names the group's global ranks)."""
    MPI = _mpi()
    world = MPI.COMM_WORLD
    ranks = list(options.global_ranks_in_group or range(world.Get_size()))
    comm = world if len(ranks) == world.Get_size() else world.Create_group(world.group.Incl(ranks))
    return MpiProcessGroup(comm, options.group_rank, options.group_size)


def probed_transport(backend: str) -> str:
    """The machine probe's name for a run's c10d backend (its `comms` keys: gloo/N, mpi/N, nccl/N)."""
    return "mpi" if backend == BACKEND else backend


def register() -> None:
    """Make `mpi4py` a c10d backend (once per process)."""
    with _registered:
        if BACKEND.upper() not in dist.Backend._plugins:
            dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu"])


def choose_collectives(
    requested: str, launcher: str, device: str, world_size: int, comm_s: Any = None
) -> tuple[str, str]:
    """("gloo" | "mpi" | "nccl", why) for a run's collectives.

    `comm_s(transport)` gives a step's communication seconds at a probed transport ("gloo/N",
    "mpi/N"), None when that transport was not probed. auto: NCCL on GPUs; one rank: nothing to
    exchange; MPI when mpiexec started the ranks and the probed MPI collectives make the step's
    communication shorter than gloo's; gloo otherwise."""
    if requested not in COLLECTIVES:
        raise FieldError("collectives", f"{requested!r}: allowed: {', '.join(COLLECTIVES)}")
    if device == "cuda":
        if requested == "mpi":
            raise FieldError("collectives", "mpi: CPU ranks only; on GPUs the collectives are NCCL's")
        return "nccl", "GPUs: NCCL"
    if world_size == 1:  # a one-rank point of a scaling sweep may ask for MPI: it has nothing to exchange
        return "gloo", "one rank: no collectives to speak of"
    if requested == "mpi" and launcher != "mpi":
        raise FieldError(
            "collectives",
            f"mpi: the ranks were started by {launcher}, not mpiexec "
            "(dlrm-lab launch --launcher mpi --nproc N -- train ...)",
        )
    if requested != "auto":
        return requested, f"asked for (--collectives {requested})"
    if launcher != "mpi":
        return "gloo", f"auto: started by {launcher}; MPI's collectives need ranks started by mpiexec"
    gloo = comm_s(f"gloo/{world_size}") if comm_s else None
    mpi = comm_s(f"mpi/{world_size}") if comm_s else None
    if gloo is None or mpi is None:
        return "gloo", (
            f"auto: gloo and MPI not both probed at {world_size} ranks on this machine (dlrm-lab launch --launcher "
            f"mpi --nproc {world_size} -- machine probe --comms-only); gloo"
        )
    pick = "mpi" if mpi < gloo else "gloo"
    return pick, (
        f"auto: a step's collectives at the probed speeds take {mpi * 1e3:.1f} ms over MPI, {gloo * 1e3:.1f} ms over "
        f"gloo: {pick}"
    )

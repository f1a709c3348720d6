"""Run under `mpiexec -n 2`: every collective of the MPI process group against its known answer;
prints one line per check, then `ok`. Used by tests/test_launch.py."""

import sys

import torch
import torch.distributed as dist
from mpi4py import MPI

from dlrm_lab.distributed.mpi import BACKEND, register

register()
rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
assert size == 2, size
dist.init_process_group(BACKEND, rank=rank, world_size=size, store=dist.HashStore())
r = float(rank)


def check(name: str, got: torch.Tensor, want: list) -> None:
    if got.tolist() != want:
        print(f"rank {rank} {name}: {got.tolist()} != {want}", flush=True)
        sys.exit(1)


t = torch.tensor([1.0, 2.0]) + r
dist.all_reduce(t)
check("all_reduce sum", t, [3.0, 5.0])
t = torch.tensor([r, -r])
dist.all_reduce(t, op=dist.ReduceOp.MAX)
check("all_reduce max", t, [1.0, 0.0])
t = torch.tensor([7, 8]) if rank == 1 else torch.zeros(2, dtype=torch.int64)
dist.broadcast(t, src=1)
check("broadcast", t, [7, 8])
outs = [torch.zeros(2), torch.zeros(2)]
dist.all_gather(outs, torch.tensor([r, r + 10]))
check("all_gather", torch.stack(outs), [[0.0, 10.0], [1.0, 11.0]])
out = torch.zeros(2, 3)
dist.all_gather_single(out, torch.full((1, 3), r))
check("all_gather_single", out, [[0.0] * 3, [1.0] * 3])
out = torch.zeros(2)
dist.reduce_scatter_single(out, torch.arange(4.0) + r)
check("reduce_scatter_single", out, [[1.0, 3.0], [5.0, 7.0]][rank])
# uneven splits, rows of 2 values: rank 0 sends 1 row to 0 and 2 to 1; rank 1 sends 3 rows to 0 and 0 to 1
send = torch.arange(6.0).view(3, 2) + 100 * r
splits_in = [[1, 2], [3, 0]][rank]
splits_out = [[1, 3], [2, 0]][rank]
out = torch.zeros(sum(splits_out), 2)
dist.all_to_all_single(out, send, splits_out, splits_in)
want = [[[0.0, 1.0], [100.0, 101.0], [102.0, 103.0], [104.0, 105.0]], [[2.0, 3.0], [4.0, 5.0]]][rank]
check("all_to_all_single uneven", out, want)
work = dist.all_reduce(torch.ones(1), async_op=True)
work.wait()
objs = [{"plan": "table_wise"} if rank == 0 else None]
dist.broadcast_object_list(objs, src=0)
assert objs[0] == {"plan": "table_wise"}, objs
dist.barrier()
ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 1, bias=False))
ddp(torch.full((1, 2), r + 1)).sum().backward()
check("ddp gradient mean", ddp.module.weight.grad, [[1.5, 1.5]])
dist.destroy_process_group()
print(f"rank {rank} ok", flush=True)

"""`dlrm-lab launch`: start N ranks of a dlrm-lab command with torchrun or mpiexec."""

from __future__ import annotations

from typing import Annotated, Optional

import typer


def launch_command(
    ctx: typer.Context,
    nproc: Annotated[int, typer.Option(help="Ranks per node.")] = 2,
    launcher: Annotated[str, typer.Option(help="torchrun or mpi (mpiexec; mpi4py bootstraps the ranks).")] = "torchrun",
    nnodes: Annotated[int, typer.Option(help="Nodes (torchrun; run the same command on each).")] = 1,
    rdzv_endpoint: Annotated[Optional[str], typer.Option(help="HOST:PORT of the c10d rendezvous (nnodes > 1).")] = None,
) -> None:
    """Run `dlrm-lab <command>` as N ranks: dlrm-lab launch --nproc 2 -- train --preset tiny.

    Threads per rank default to this node's cores divided by the ranks (OMP_NUM_THREADS
    overrides). The exit code is non-zero when any rank failed.
    """
    from dlrm_lab.distributed.launch import launch

    code = launch(nproc, launcher, list(ctx.args), nnodes, rdzv_endpoint)
    raise typer.Exit(code)

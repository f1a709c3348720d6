"""`dlrm-lab launch`: start N ranks of a dlrm-lab command with torchrun or mpiexec, or write the Kubernetes
manifests that start them on a cluster (`--emit kubernetes`)."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Annotated, Optional

import typer


def launch_command(
    ctx: typer.Context,
    nproc: Annotated[int, typer.Option(help="Ranks per node (per pod with --emit).")] = 2,
    launcher: Annotated[str, typer.Option(help="torchrun or mpi (mpiexec; mpi4py bootstraps the ranks).")] = "torchrun",
    nnodes: Annotated[int, typer.Option(help="Nodes (torchrun; run the same command on each), or pods.")] = 1,
    rdzv_endpoint: Annotated[
        Optional[str], typer.Option(help="HOST:PORT of the c10d rendezvous (nnodes > 1; --emit: pod 0's name).")
    ] = None,
    emit: Annotated[
        Optional[str], typer.Option(help="kubernetes: write the manifests of the job instead of launching it.")
    ] = None,
    kind: Annotated[
        str, typer.Option(help="--emit: job (indexed Job + headless Service) or trainjob (Kubeflow).")
    ] = "job",
    image: Annotated[Optional[str], typer.Option(help="--emit: the pods' image, with the lab installed.")] = None,
    name: Annotated[str, typer.Option(help="--emit: the job's name (and its Service's).")] = "dlrm-lab",
    namespace: Annotated[Optional[str], typer.Option(help="--emit: the namespace (else kubectl's).")] = None,
    gpus: Annotated[int, typer.Option(help="--emit: GPUs a pod (nvidia.com/gpu); pass --device cuda to train.")] = 0,
    cpu: Annotated[Optional[int], typer.Option(help="--emit: cores a pod; threads a rank = cpu / nproc.")] = None,
    memory: Annotated[Optional[str], typer.Option(help="--emit: memory a pod, a quantity (e.g. 64Gi).")] = None,
    metrics_volume: Annotated[
        str, typer.Option(help="--emit: PersistentVolumeClaim mounted at the command's --metrics-dir.")
    ] = "dlrm-lab-runs",
    out: Annotated[Optional[Path], typer.Option(help="--emit: write the manifests here (else stdout).")] = None,
) -> None:
    """Run `dlrm-lab <command>` as N ranks: dlrm-lab launch --nproc 2 -- train --preset tiny.

    Threads per rank default to this node's cores divided by the ranks (OMP_NUM_THREADS
    overrides). The exit code is non-zero when any rank failed. With --emit kubernetes
    nothing runs: the manifests are written (launch/kubernetes.md).
    """
    if emit is not None:
        from dlrm_lab.distributed.kubernetes import emit as emit_manifests
        from dlrm_lab.errors import FieldError, UserError

        inner = list(ctx.args)
        try:  # a typo or a bad value fails here, not in the pods after the job was scheduled
            root = ctx.find_root()
            note = check_pods_command(inner, set(root.command.list_commands(root)))
        except UserError as exc:
            raise UserError(f"the pods' command {shlex.join(inner)!r}: {exc}") from None
        if note:
            typer.echo(f"note: {note}", err=True)
        try:
            text = emit_manifests(
                emit,
                list(ctx.args),
                launcher,
                kind=kind,
                image=image,
                name=name,
                namespace=namespace,
                nnodes=nnodes,
                nproc=nproc,
                gpus=gpus,
                cpu=cpu,
                memory=memory,
                metrics_volume=metrics_volume,
                rdzv_endpoint=rdzv_endpoint,
            )
        except FieldError as exc:  # every field here is one of this command's flags
            raise UserError(exc.named(lambda field: "--" + field.replace("_", "-"))) from None
        if out is None:
            typer.echo(text, nl=False)
        else:
            try:
                out.write_text(text)
            except OSError as exc:  # a missing directory, a read-only mount, a full disk
                raise UserError(f"--out {out}: cannot write the manifests ({exc.strerror or exc})") from None
            typer.echo(f"wrote {out}: kubectl apply -f {out}", err=True)
        return
    from dlrm_lab.distributed.launch import launch

    code = launch(nproc, launcher, list(ctx.args), nnodes, rdzv_endpoint)
    if code < 0:  # the launcher itself killed by a signal: said, not a bare exit status of 256 minus it
        from dlrm_lab.errors import exit_description

        typer.echo(f"error: the {launcher} launcher {exit_description(code)}", err=True)
        raise typer.Exit(1)
    raise typer.Exit(code)


def check_pods_command(words: list[str], known: set[str]) -> str | None:
    """The command the pods will run, checked here as far as it can be without running it: one of the CLI's `known`
    commands, its options as that command checks them (`commands.check_command_words`), a sweep's grid file read and
    checked. Where the file is not on this machine (only in the image), it is left to the pods: the note says so."""
    from dlrm_lab.commands import check_command_words
    from dlrm_lab.errors import UserError

    if not words or words[0] not in known:
        raise UserError(f"{words[0] if words else '(none)'!r}: not a dlrm-lab command ({', '.join(sorted(known))})")
    if check_command_words(words) is None and words[0] == "sweep" and len(words) > 1:
        if not Path(words[1]).is_file():
            return f"the grid file {words[1]} is not on this machine: the pods read it from their image, unchecked here"
        from dlrm_lab.sweep.grid import load_spec

        load_spec(words[1])
    return None

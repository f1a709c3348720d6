"""Command lines for starting N ranks of a dlrm-lab command on this node (or several)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from dlrm_lab.errors import FieldError, UserError

LAUNCHERS = ("torchrun", "mpi")


def threads_for(cores: int, nproc: int) -> int:
    """Threads per rank (OMP_NUM_THREADS) where `nproc` ranks share `cores`: at least one each."""
    return max(1, cores // nproc)


def threads_per_rank(nproc: int) -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return threads_for(cores, nproc)


def launch_command(
    nproc: int,
    launcher: str,
    args: list[str],
    nnodes: int = 1,
    rdzv_endpoint: str | None = None,
) -> list[str]:
    """The command that starts `nproc` ranks per node of `python -m dlrm_lab ARGS`."""
    if launcher not in LAUNCHERS:
        raise FieldError("launcher", f"{launcher!r}: allowed: {', '.join(LAUNCHERS)}")
    if nproc < 1:
        raise FieldError("nproc", f"{nproc}: must be an integer >= 1")
    if not args:
        raise UserError("nothing to launch: give the command after --, e.g. -- train --preset tiny")
    target = ["-m", "dlrm_lab", *args]
    if launcher == "torchrun":
        # torch's launcher, run by our wrapper: a failed job ends in one line and the manifest names the rank
        run = [sys.executable, "-m", "dlrm_lab.torchrun", f"--nproc-per-node={nproc}"]
        if nnodes > 1:
            if not rdzv_endpoint:
                raise FieldError(
                    "nnodes", "> 1 needs {rdzv_endpoint} HOST:PORT (the same on every node)", "rdzv_endpoint"
                )
            run += [
                f"--nnodes={nnodes}",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint={rdzv_endpoint}",
                "--rdzv-id=dlrm-lab",
            ]
        else:
            run += ["--standalone"]
        return [*run, *target]
    mpiexec = shutil.which(
        "mpiexec", path=os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    )
    if mpiexec is None:
        raise FieldError("launcher", "mpi: no mpiexec found; install the mpi extra (pip install 'dlrm-lab[mpi]')")
    version = subprocess.run([mpiexec, "--version"], capture_output=True, text=True).stdout.lower()
    extra = []
    if "open mpi" in version:
        extra = ["--oversubscribe", "-x", "OMP_NUM_THREADS"] + (["--allow-run-as-root"] if os.geteuid() == 0 else [])
    return [mpiexec, "-n", str(nproc), *extra, sys.executable, *target]


def launch(
    nproc: int,
    launcher: str,
    args: list[str],
    nnodes: int = 1,
    rdzv_endpoint: str | None = None,
    log: Path | None = None,
) -> int:
    """Run the ranks to completion; the exit code is the launcher's (non-zero if any rank failed).

    With `log`, the ranks' output goes to that file instead of the terminal.
    """
    cmd = launch_command(nproc, launcher, args, nnodes, rdzv_endpoint)
    env = {**os.environ}
    env.setdefault("OMP_NUM_THREADS", str(threads_per_rank(nproc)))
    if log is None:
        return subprocess.run(cmd, env=env).returncode
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        return subprocess.run(cmd, env=env, stdout=out, stderr=subprocess.STDOUT).returncode

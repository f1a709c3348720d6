"""TorchX components: `dlrm-lab train`, `scale` and `sweep` as jobs on any TorchX scheduler.

    torchx run -s local_cwd dlrm_lab/torchx.py:train --nproc_per_node 2 -- --preset tiny --steps 20
    torchx run -s slurm -cfg partition=gpu dlrm_lab/torchx.py:train --nnodes 2 --nproc_per_node 8 \
        --gpu 8 -- --device cuda --preset dcnv2 --table-scale 0.1

From Python: `torchx.runner.get_runner().run(train("--preset", "tiny", nproc_per_node=2), "local_cwd")`.
Only the scheduler changes between a laptop and a cluster (launch/torchx.md has the lines for SLURM,
Kubernetes and Ray).

`train` is TorchX's own `dist.ddp` (one role of `nnodes` replicas, torchrun with the c10d rendezvous on
the first replica's host, wherever the scheduler placed it) with its launcher swapped for the lab's
torchrun wrapper, so that a failed job marks its runs failed as `dlrm-lab launch` does. The ranks find
each other from torchrun's variables, as under plain torchrun (`detect_launch`: launcher `torchrun`).
`scale` and `sweep` are one process on one node that starts each point's ranks there, as on this machine;
a point that spans nodes is a `train` job of its own (`dlrm-lab sweep GRID --dry-run` prints each point's
train options).

`torchx run FILE:FUNCTION` executes this file outside the package, and reads the component signatures:
hence absolute imports only, typing's Dict/List/Optional (its linter accepts nothing else), and no
`from __future__ import annotations` (its argument parser is built from the annotations themselves).
"""

import shlex
from typing import Dict, List, Optional  # noqa: UP035 - TorchX's component linter reads these names

from dlrm_lab.errors import UserError

try:
    import torchx
    from torchx import specs
    from torchx.components.dist import ddp
    from torchx.components.utils import python as one_process
    from torchx.specs.finder import ComponentValidationException
except ImportError:
    raise UserError("the TorchX components need torchx: pip install 'dlrm-lab[torchx]'") from None


class ComponentArgumentError(UserError, ComponentValidationException):
    """A bad component argument, in one line: a UserError to the lab, and the error `torchx run` prints
    without a traceback (it reports its own validation errors so)."""


_TORCHRUN = "torchrun "  # how dist.ddp's command line starts (torchx 0.7)


def train(
    *args: str,
    nnodes: int = 1,
    nproc_per_node: int = 2,
    name: str = "dlrm-lab/dlrm-lab-train",
    image: str = torchx.IMAGE,
    cpu: int = 2,
    gpu: int = 0,
    memMB: int = 4096,
    h: Optional[str] = None,
    env: Optional[Dict[str, str]] = None,  # noqa: UP006
    max_retries: int = 0,
    rdzv_port: int = 29500,
    mounts: Optional[List[str]] = None,  # noqa: UP006
    python: str = "python",
) -> specs.AppDef:
    """`dlrm-lab train ARGS` as nnodes x nproc_per_node ranks, started by the lab's torchrun wrapper.

    Args:
        args: `dlrm-lab train` options (after `--`), checked by train's own command line before submitting
        nnodes: nodes (replicas); the c10d rendezvous is on the first one
        nproc_per_node: ranks per node (one per GPU with --device cuda)
        name: job name, `{experiment}/{run}` as in dist.ddp
        image: container image holding the lab and its stack (kubernetes, docker); the working directory
            is used on local_cwd and slurm, the workspace on ray
        cpu: cores per node; each rank gets cpu // nproc_per_node threads (OMP_NUM_THREADS, unless env sets it)
        gpu: GPUs per node
        memMB: memory per node in MB
        h: a named TorchX resource, instead of cpu, gpu and memMB
        env: environment of the ranks (e.g. NCCL_DEBUG=INFO,OMP_NUM_THREADS=8)
        max_retries: scheduler retries of a failed job
        rdzv_port: the rendezvous port on the first node (several nodes only)
        mounts: volumes, as dist.ddp takes them (type=bind,src=/data,dst=/data)
        python: the interpreter on the nodes that has the lab installed
    """
    _check_counts(nnodes=nnodes, nproc_per_node=nproc_per_node, cpu=cpu)
    _check_train_options(list(args))
    env = dict(env or {})
    env.setdefault("OMP_NUM_THREADS", str(max(1, cpu // nproc_per_node)))
    app = ddp(
        "train",
        *args,
        m="dlrm_lab",
        name=name,
        image=image,
        h=h,
        cpu=cpu,
        gpu=gpu,
        memMB=memMB,
        j=f"{nnodes}x{nproc_per_node}",
        env=env,
        max_retries=max_retries,
        rdzv_port=rdzv_port,
        mounts=mounts,
    )
    (role,) = app.roles
    shell, command = role.args  # ["-c", "torchrun --rdzv_backend c10d ... -m dlrm_lab train ARGS"]
    if shell != "-c" or not command.startswith(_TORCHRUN):
        raise RuntimeError(f"torchx {torchx.__version__}: dist.ddp's command changed ({command[:60]!r}...)")
    role.args = [shell, f"{shlex.quote(python)} -m dlrm_lab.torchrun {command[len(_TORCHRUN) :]}"]
    return app


def scale(
    *args: str,
    name: str = "dlrm-lab-scale",
    image: str = torchx.IMAGE,
    cpu: int = 2,
    gpu: int = 0,
    memMB: int = 4096,
    h: Optional[str] = None,
    env: Optional[Dict[str, str]] = None,  # noqa: UP006
    python: str = "python",
) -> specs.AppDef:
    """`dlrm-lab scale ARGS` on one node: each rank count's ranks are started there by the lab's launcher.

    Args:
        args: `dlrm-lab scale` options, then `--` and the train options
        name: job name
        image: container image holding the lab and its stack (kubernetes, docker)
        cpu: cores of the node (scale divides them among the largest rank count)
        gpu: GPUs of the node
        memMB: memory of the node in MB
        h: a named TorchX resource, instead of cpu, gpu and memMB
        env: environment of the job
        python: the interpreter on the node that has the lab installed
    """
    return _one_node("scale", list(args), name, image, cpu, gpu, memMB, h, env, python)


def sweep(
    grid: str,
    *args: str,
    name: str = "dlrm-lab-sweep",
    image: str = torchx.IMAGE,
    cpu: int = 2,
    gpu: int = 0,
    memMB: int = 4096,
    h: Optional[str] = None,
    env: Optional[Dict[str, str]] = None,  # noqa: UP006
    python: str = "python",
) -> specs.AppDef:
    """`dlrm-lab sweep GRID ARGS` on one node: multi-rank points' ranks are started there by the lab's launcher.

    Args:
        grid: the grid file (TOML), relative to the job's working directory
        args: `dlrm-lab sweep` options (e.g. --metrics-dir runs --no-progress)
        name: job name
        image: container image holding the lab and its stack (kubernetes, docker)
        cpu: cores of the node
        gpu: GPUs of the node
        memMB: memory of the node in MB
        h: a named TorchX resource, instead of cpu, gpu and memMB
        env: environment of the job
        python: the interpreter on the node that has the lab installed
    """
    return _one_node("sweep", [grid, *args], name, image, cpu, gpu, memMB, h, env, python)


def _one_node(command, args, name, image, cpu, gpu, memMB, h, env, python):
    _check_counts(cpu=cpu)
    app = one_process(command, *args, m="dlrm_lab", name=name, image=image, cpu=cpu, gpu=gpu, memMB=memMB, h=h)
    (role,) = app.roles
    role.entrypoint = python
    role.env.update(env or {})
    return app


def _check_counts(**counts: int) -> None:
    for flag, value in counts.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ComponentArgumentError(f"--{flag} {value!r}: must be a whole number >= 1")


def _check_train_options(words: list[str]) -> None:
    """A typo or a bad value (an unknown preset, --steps 0) fails here, in one line, not on the cluster after the
    job waited in its queue: train's own options, then the preset and the training config they would build."""
    from dlrm_lab.commands import train_setup, train_words

    try:
        train_setup(train_words(words))
    except UserError as exc:
        raise ComponentArgumentError(f"train options {shlex.join(words)!r}: {exc}") from None

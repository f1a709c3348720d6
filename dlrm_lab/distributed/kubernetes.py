"""Kubernetes manifests for N nodes x M ranks of a dlrm-lab command, without TorchX (launch/kubernetes.md).

Two kinds, each a list of plain dicts (`dump` writes them as one YAML stream):
- `job`: an indexed `batch/v1` Job (one pod a node, `completionMode: Indexed`, parallelism = completions =
  nnodes) and a headless `v1` Service of the same name, so that pod i resolves as `<name>-<i>.<name>`. Each
  pod runs the lab's torchrun wrapper with torchrun's c10d rendezvous on pod 0 (`<name>-0.<name>:29500`).
  The pod's `JOB_COMPLETION_INDEX` tells pod 0 it hosts the rendezvous (`--rdzv-conf is_host=1`) rather than
  leaving it to find its own name in DNS; the c10d rendezvous then numbers the nodes itself, in the order of
  their names (torchrun ignores --node-rank but for its static rendezvous), which puts rank 0 on pod 0;
- `trainjob`: a Kubeflow Trainer v2 `TrainJob` (trainer.kubeflow.org/v1alpha1) on the `torch-distributed`
  runtime: Trainer starts numNodes pods and gives each torchrun's settings as PET_* variables (nodes, ranks a
  node, node rank, master address and port), which torchrun reads as its own options.

Either way the ranks find each other from torchrun's variables (`detect_launch`: launcher `torchrun`), a failed
rank marks its runs failed as `dlrm-lab launch` does, and the run directories go to a PersistentVolumeClaim
mounted where the command's `--metrics-dir` points. OMP_NUM_THREADS is the node's cores over its ranks, as
`dlrm-lab launch` sets it (`launch.threads_for`).
"""

from __future__ import annotations

import json
import re
import shlex
from typing import Any

from dlrm_lab.distributed.launch import threads_for
from dlrm_lab.errors import FieldError, UserError

KINDS = ("job", "trainjob")
RENDEZVOUS_PORT = 29500
METRICS_MOUNT = "/runs"  # where the runs' volume goes when the command does not name --metrics-dir
# Commands that write run directories, under --metrics-dir (the others get no volume)
METRICS_COMMANDS = ("train", "scale", "sweep", "infer", "serve")
TRAINER_RUNTIME = "torch-distributed"  # Kubeflow Trainer's ClusterTrainingRuntime for PyTorch
TRAINER_NODE = "node"  # the runtime's replicated job and container name
TRAINER_PATCH_MANAGER = "dlrm-lab/launch"  # owns this job's entry in TrainJob.spec.runtimePatches
CONTAINER = "dlrm-lab"
# matched whole (`fullmatch`): `$` alone also matches before a final newline, which YAML would then carry
_NAME = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_QUANTITY = re.compile(r"(\d+(\.\d*)?|\.\d+)([KMGTPE]i|[numkMGTPE]|[eE][+-]?\d+)?")
MAX_NODES, MAX_RANKS_A_NODE = 10_000, 1_024  # beyond any cluster's pods and any node's cores
MAX_CORES_A_POD = 4_096
_IMAGE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/:@+-]{0,254}")  # a container image reference: no space, no newline
_ENDPOINT = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9]([A-Za-z0-9.-]{0,252}[A-Za-z0-9])?):([0-9]{1,5})")
Manifest = dict[str, Any]


def manifests(
    args: list[str],
    *,
    kind: str = "job",
    image: str | None,
    name: str = "dlrm-lab",
    namespace: str | None = None,
    nnodes: int = 1,
    nproc: int = 1,
    gpus: int = 0,
    cpu: int | None = None,
    memory: str | None = None,
    metrics_volume: str = "dlrm-lab-runs",
    rdzv_endpoint: str | None = None,
    python: str = "python",
) -> list[Manifest]:
    """The manifests that run `dlrm-lab ARGS` as `nnodes` pods of `nproc` ranks each.

    `cpu` (cores), `memory` (a Kubernetes quantity, e.g. 64Gi) and `gpus` are each pod's requests and limits;
    `metrics_volume` names the claim mounted at the command's --metrics-dir (added as /runs where absent);
    `rdzv_endpoint` (job only) overrides `<name>-0.<name>:29500`; `python` is the pods' interpreter."""
    _check(kind, image, name, nnodes, nproc, gpus, cpu, memory, metrics_volume, namespace)
    if rdzv_endpoint is not None and not (
        isinstance(rdzv_endpoint, str) and (m := _ENDPOINT.fullmatch(rdzv_endpoint)) and 1 <= int(m.group(3)) <= 65535
    ):
        raise FieldError("rdzv_endpoint", f"{rdzv_endpoint!r}: must be HOST:PORT (a port in 1-65535)")
    args, metrics_dir = _with_metrics_dir(list(args))
    labels = {"app.kubernetes.io/name": "dlrm-lab", "app.kubernetes.io/instance": name}
    metadata = {"name": name, **({"namespace": namespace} if namespace else {}), "labels": labels}
    env = [{"name": "OMP_NUM_THREADS", "value": str(threads_for(cpu, nproc))}] if cpu else []
    volumes = [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]  # NCCL and gloo want more than 64 MiB
    mounts = [{"name": "dshm", "mountPath": "/dev/shm"}]
    if metrics_dir is not None:
        volumes.append({"name": "runs", "persistentVolumeClaim": {"claimName": metrics_volume}})
        mounts.append({"name": "runs", "mountPath": metrics_dir})
    resources = _resources(gpus, cpu, memory)
    target = [python, "-m", "dlrm_lab.torchrun"]
    if kind == "trainjob":
        script = _script(cpu, nproc, shlex.join([*target, "-m", "dlrm_lab", *args]))
        trainer: dict[str, Any] = {
            "image": image,
            "command": ["/bin/sh", "-c", script],
            "numNodes": nnodes,
            "numProcPerNode": nproc,
        }
        trainer |= {"resourcesPerNode": resources} if resources else {}
        trainer |= {"env": env} if env else {}
        pod = {"containers": [{"name": TRAINER_NODE, "volumeMounts": mounts}], "volumes": volumes}
        job = {"name": TRAINER_NODE, "template": {"spec": {"template": {"spec": pod}}}}
        patch = {
            "manager": TRAINER_PATCH_MANAGER,
            "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [job]}}},
        }
        spec = {"runtimeRef": {"name": TRAINER_RUNTIME}, "trainer": trainer, "runtimePatches": [patch]}
        return [{"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob", "metadata": metadata, "spec": spec}]
    endpoint = rdzv_endpoint or f"{name}-0.{name}:{RENDEZVOUS_PORT}"
    rendezvous = [
        *(shlex.quote(word) for word in (f"--nnodes={nnodes}", f"--nproc-per-node={nproc}")),
        *(shlex.quote(word) for word in ("--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={name}")),
        '--rdzv-conf=is_host="$is_host"',
    ]
    script = _script(cpu, nproc, shlex.join(target), *rendezvous, shlex.join(["-m", "dlrm_lab", *args]), indexed=True)
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": image,
        "command": ["/bin/sh", "-c", script],
        "ports": [{"name": "rendezvous", "containerPort": RENDEZVOUS_PORT}],
        "volumeMounts": mounts,
    }
    container |= {"env": env} if env else {}
    container |= {"resources": resources} if resources else {}
    pod = {"subdomain": name, "restartPolicy": "Never", "containers": [container], "volumes": volumes}
    job_spec = {
        "completionMode": "Indexed",
        "completions": nnodes,
        "parallelism": nnodes,
        "backoffLimit": 0,  # one failed pod fails the job: the others' rendezvous cannot take a new one in
        "template": {"metadata": {"labels": labels}, "spec": pod},
    }
    service_spec = {
        "clusterIP": "None",
        "selector": labels,
        "publishNotReadyAddresses": True,  # pods resolve each other before any is ready
        "ports": [{"name": "rendezvous", "port": RENDEZVOUS_PORT, "targetPort": RENDEZVOUS_PORT}],
    }
    return [
        {"apiVersion": "v1", "kind": "Service", "metadata": metadata, "spec": service_spec},
        {"apiVersion": "batch/v1", "kind": "Job", "metadata": metadata, "spec": job_spec},
    ]


def dump(docs: list[Manifest], header: str = "") -> str:
    """One YAML stream (`kubectl apply -f`); JSON documents, which are YAML too, where PyYAML is absent."""
    comment = "".join(f"# {line}\n" for line in header.splitlines())
    try:
        import yaml
    except ImportError:
        return comment + "---\n".join(json.dumps(doc, indent=2) + "\n" for doc in docs)

    class Dumper(yaml.SafeDumper):
        def ignore_aliases(self, data: Any) -> bool:  # each document whole, no anchors
            return True

    def text(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
        style = "|" if "\n" in value else None  # the pod's script as it reads
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)

    Dumper.add_representer(str, text)
    return comment + yaml.dump_all(docs, Dumper=Dumper, sort_keys=False, width=120, explicit_start=True)


def _script(cpu: int | None, nproc: int, *words: str, indexed: bool = False) -> str:
    """The pod's shell script: its environment, then `exec` of the shell `words` (quoted by the caller)."""
    lines = ["set -e"]
    if not cpu:  # no cores asked for: the pod's own, as launch/torchrun.sh counts them
        threads = f"$(( $(nproc) / {nproc} > 0 ? $(nproc) / {nproc} : 1 ))"
        lines.append(f'export OMP_NUM_THREADS="${{OMP_NUM_THREADS:-{threads}}}"')
    if indexed:  # pod 0 hosts the c10d store; the others connect to it
        lines.append('if [ "$JOB_COMPLETION_INDEX" = 0 ]; then is_host=1; else is_host=0; fi')
    lines.append("exec " + " ".join(words))
    return "\n".join(lines) + "\n"


def _with_metrics_dir(args: list[str]) -> tuple[list[str], str | None]:
    """The command's words with an absolute --metrics-dir (added where absent), and that directory; None where
    the command writes no runs."""
    for i, word in enumerate(args):
        if word == "--":
            break
        if word == "--metrics-dir" or word.startswith("--metrics-dir="):
            value = word.partition("=")[2] if "=" in word else (args[i + 1] if i + 1 < len(args) else "")
            if not value.startswith("/"):
                raise FieldError(
                    "metrics_dir", f"{value!r}: in a pod it must be absolute: the runs' volume is mounted there"
                )
            return args, value.rstrip("/") or "/"
    if not args or args[0] not in METRICS_COMMANDS:
        return args, None
    at = args.index("--") if "--" in args else len(args)
    return [*args[:at], "--metrics-dir", METRICS_MOUNT, *args[at:]], METRICS_MOUNT


def _resources(gpus: int, cpu: int | None, memory: str | None) -> dict[str, dict[str, str]]:
    amounts = {"cpu": str(cpu) if cpu else None, "memory": memory, "nvidia.com/gpu": str(gpus) if gpus else None}
    given = {key: value for key, value in amounts.items() if value is not None}
    # requests = limits: the Guaranteed class, whose pods the kubelet's static CPU manager gives whole cores
    return {"requests": dict(given), "limits": dict(given)} if given else {}


def _check(kind, image, name, nnodes, nproc, gpus, cpu, memory, metrics_volume, namespace=None) -> None:
    if kind not in KINDS:
        raise FieldError("kind", f"{kind!r}: allowed: {', '.join(KINDS)}")
    if not image:
        raise FieldError("image", "is needed: an image with the lab and its stack installed (launch/kubernetes.md)")
    if not isinstance(image, str) or not _IMAGE.fullmatch(image):
        raise FieldError("image", f"{image!r}: must be an image reference (letters, digits, . _ / : @ + -; no space)")
    labels = [("name", name, 50), ("metrics_volume", metrics_volume, 50)]
    for field, value, longest in labels + ([("namespace", namespace, 63)] if namespace is not None else []):
        if not isinstance(value, str) or not _NAME.fullmatch(value) or len(value) > longest:
            raise FieldError(
                field, f"{value!r}: must be a DNS label (a-z, 0-9, '-'; a letter first), {longest} characters at most"
            )
    for field, value, least, most in (
        ("nnodes", nnodes, 1, MAX_NODES),
        ("nproc", nproc, 1, MAX_RANKS_A_NODE),
        ("gpus", gpus, 0, MAX_RANKS_A_NODE),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= most:
            raise FieldError(field, f"{value!r}: must be an integer in [{least}, {most}]")
    if cpu is not None and (isinstance(cpu, bool) or not isinstance(cpu, int) or not 1 <= cpu <= MAX_CORES_A_POD):
        raise FieldError("cpu", f"{cpu!r}: must be an integer in [1, {MAX_CORES_A_POD}] (cores a pod)")
    if memory is not None and not (isinstance(memory, str) and _QUANTITY.fullmatch(memory)):
        raise FieldError("memory", f"{memory!r}: must be a Kubernetes quantity, e.g. 64Gi or 500M")
    if gpus and nproc > gpus:
        raise FieldError(
            "nproc", f"{nproc}: more ranks a pod than its {{gpus}} ({gpus}): each rank takes a GPU", "gpus"
        )


EMITS = ("kubernetes",)


def emit(target: str, args: list[str], launcher: str = "torchrun", **options: Any) -> str:
    """`dlrm-lab launch --emit TARGET`: the manifests as text, nothing launched (`manifests` takes `options`)."""
    if target not in EMITS:
        raise FieldError("emit", f"{target!r}: allowed: {', '.join(EMITS)}")
    if launcher != "torchrun":
        raise FieldError(
            "launcher", f"{launcher}: the pods start their ranks with torchrun; leave {{emit}} alone", "emit"
        )
    if not args:
        raise UserError("nothing to launch: give the command after --, e.g. -- train --preset tiny")
    docs = manifests(args, **options)
    header = (
        f"dlrm-lab launch --emit {target} --kind {options.get('kind', 'job')}: {', '.join(d['kind'] for d in docs)}\n"
        "apply with: kubectl apply -f THIS_FILE (launch/kubernetes.md)"
    )
    return dump(docs, header)

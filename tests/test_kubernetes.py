"""`dlrm-lab launch --emit kubernetes`: the manifests of an indexed Job + headless Service, or of a Kubeflow
TrainJob, checked against the published schemas of their kinds (launch/schemas/), and the pods' command run
here as two pods would run it."""

import copy
import json
import os
import shlex
import socket
import subprocess
import sys

import jsonschema
import pytest
from conftest import DECIDED, ROOT, run_cli_in_process

from dlrm_lab.distributed.kubernetes import dump, manifests

SCHEMAS = ROOT / "launch" / "schemas"
TRAIN = ["train", "--preset", "tiny", "--steps", "4", "--batch-size", "16", "--no-progress"]
VARIANTS = {
    "job, one pod, defaults": dict(kind="job"),
    "job, 2 pods x 8 GPUs": dict(kind="job", nnodes=2, nproc=8, gpus=8, cpu=64, memory="480Gi", namespace="recsys"),
    "job, 4 pods x 2 CPU ranks": dict(kind="job", nnodes=4, nproc=2, cpu=16, memory="64Gi", metrics_volume="runs-pvc"),
    "trainjob, one node, defaults": dict(kind="trainjob"),
    "trainjob, 2 nodes x 8 GPUs": dict(kind="trainjob", nnodes=2, nproc=8, gpus=8, cpu=96, memory="900Gi"),
}
COMMANDS = {
    "train": TRAIN,
    "scale": ["scale", "--ranks", "1,2", "--", "--preset", "tiny"],
    "probe": ["machine", "probe", "--comms-only"],  # writes no runs: no volume
    "train to /data/runs": [*TRAIN, "--metrics-dir", "/data/runs"],
}


def _validators() -> dict[tuple[str, str], jsonschema.Draft7Validator]:
    """(apiVersion, kind) -> a validator of the vendored schema of that kind."""
    out = {}
    for path in SCHEMAS.glob("*.json"):
        schema = json.loads(path.read_text())
        for key, ref in schema["kinds"].items():
            api_version, kind = key.rsplit("/", 1)
            whole = {**ref, "definitions": schema["definitions"]}
            jsonschema.Draft7Validator.check_schema(whole)
            out[api_version, kind] = jsonschema.Draft7Validator(whole)
    return out


VALIDATORS = _validators()


def _errors(doc: dict, kind: tuple[str, str] | None = None) -> list[str]:
    validator = VALIDATORS[kind or (doc["apiVersion"], doc["kind"])]
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]


def _read(text: str) -> list[dict]:
    """The stream as kubectl reads it (YAML; JSON documents where PyYAML was absent)."""
    try:
        import yaml
    except ImportError:
        return [json.loads(part) for part in text.split("---\n") if part.strip() and not part.startswith("#")]
    return [doc for doc in yaml.safe_load_all(text) if doc]


def test_the_vendored_schemas_cover_every_kind_emitted():
    assert set(VALIDATORS) == {("batch/v1", "Job"), ("v1", "Service"), ("trainer.kubeflow.org/v1alpha1", "TrainJob")}


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_every_emitted_variant_validates_against_its_published_schema(variant, command):
    options = VARIANTS[variant]
    docs = _read(dump(manifests(COMMANDS[command], image="registry.example.com/dlrm-lab:cu128", **options)))
    kinds = [doc["kind"] for doc in docs]
    assert kinds == (["Service", "Job"] if options["kind"] == "job" else ["TrainJob"])
    for doc in docs:
        assert _errors(doc) == [], (variant, command, doc["kind"])
    pod = _pod(docs)
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["name"]: m["mountPath"] for m in pod["mounts"]}
    if command == "probe":
        assert "runs" not in volumes and "--metrics-dir" not in pod["script"]
    else:  # the runs go to the claim, mounted where --metrics-dir points
        where = "/data/runs" if command == "train to /data/runs" else "/runs"
        assert mounts["runs"] == where and f"--metrics-dir {where}" in pod["script"]
        assert volumes["runs"]["persistentVolumeClaim"]["claimName"] == options.get("metrics_volume", "dlrm-lab-runs")
    if command == "scale":  # the lab's own options stay before the train options
        assert "--metrics-dir /runs -- --preset tiny" in pod["script"]
    if options.get("cpu"):
        threads = str(options["cpu"] // options.get("nproc", 1))
        assert pod["env"] == [{"name": "OMP_NUM_THREADS", "value": threads}]
        assert pod["resources"]["limits"]["cpu"] == str(options["cpu"])
    else:  # the pod's own cores, as launch/torchrun.sh counts them
        assert "OMP_NUM_THREADS" in pod["script"] and "resources" not in pod
    if options.get("gpus"):
        assert pod["resources"]["limits"]["nvidia.com/gpu"] == pod["resources"]["requests"]["nvidia.com/gpu"] == "8"


def _pod(docs: list[dict]) -> dict:
    """What a pod of either kind runs: its script, environment, resources, volumes and mounts."""
    (doc,) = [d for d in docs if d["kind"] in ("Job", "TrainJob")]
    if doc["kind"] == "Job":
        spec = doc["spec"]["template"]["spec"]
        (container,) = spec["containers"]
        return {
            "script": container["command"][2],
            "env": container.get("env", []),
            "volumes": spec["volumes"],
            "mounts": container["volumeMounts"],
            **({"resources": container["resources"]} if "resources" in container else {}),
        }
    trainer = doc["spec"]["trainer"]
    (patch,) = doc["spec"]["runtimePatches"]
    (job,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    spec = job["template"]["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    return {
        "script": trainer["command"][2],
        "env": trainer.get("env", []),
        "volumes": spec["volumes"],
        "mounts": container["volumeMounts"],
        **({"resources": trainer["resourcesPerNode"]} if "resourcesPerNode" in trainer else {}),
    }


def test_a_broken_manifest_fails_validation():
    """The schemas are not vacuous: a wrong type, an unknown field or a missing one is refused where it is."""
    job, trainjob = manifests(TRAIN, image="x", nnodes=2)[1], manifests(TRAIN, kind="trainjob", image="x")[0]
    breaks = {
        "spec.completions": lambda d: d["spec"].update(completions="2"),
        "spec.template.spec.containers.0": lambda d: d["spec"]["template"]["spec"]["containers"][0].update(gpus=1),
        "spec.template.spec.containers.0.resources.limits.cpu": lambda d: d["spec"]["template"]["spec"]["containers"][
            0
        ].update(resources={"limits": {"cpu": ["8"]}}),
        "kind": lambda d: d.update(kind="Jobs"),
    }
    for where, broken in breaks.items():
        doc = copy.deepcopy(job)
        broken(doc)
        errors = _errors(doc, ("batch/v1", "Job"))
        assert errors and any(e.startswith(where + ":") for e in errors), (where, errors)
    trainjob_breaks = {
        "spec.trainer.numNodes": lambda d: d["spec"]["trainer"].update(numNodes="2"),
        "spec.trainer": lambda d: d["spec"]["trainer"].update(nodes=2),
        "spec": lambda d: d["spec"].pop("runtimeRef"),
    }
    for where, broken in trainjob_breaks.items():
        doc = copy.deepcopy(trainjob)
        broken(doc)
        errors = _errors(doc)
        assert errors and any(e.startswith(where + ":") for e in errors), (where, errors)


def test_the_cli_writes_the_manifests_and_refuses_bad_options_in_one_line(tmp_path):
    out = tmp_path / "job.yaml"
    args = ["launch", "--emit", "kubernetes", "--kind", "trainjob", "--image", "reg/lab:1", "--nnodes", "2"]
    code, _, err = run_cli_in_process(*args, "--nproc", "8", "--gpus", "8", "--out", str(out), "--", *TRAIN)
    assert code == 0 and "kubectl apply -f" in err
    (doc,) = _read(out.read_text())
    assert _errors(doc) == [] and doc["spec"]["trainer"]["numNodes"] == 2
    code, text, _ = run_cli_in_process("launch", "--emit", "kubernetes", "--image", "reg/lab:1", "--", *TRAIN)
    assert code == 0 and [d["kind"] for d in _read(text)] == ["Service", "Job"]
    for bad, message in {
        (): "--image is needed",
        ("--image", "x", "--gpus", "1"): "--nproc 2: more ranks a pod than its --gpus (1)",
        ("--image", "x", "--kind", "pytorchjob"): "--kind 'pytorchjob': allowed: job, trainjob",
        ("--image", "x", "--memory", "lots"): "--memory 'lots': must be a Kubernetes quantity",
        ("--image", "x", "--name", "DLRM_1"): "--name 'DLRM_1': must be a DNS label",
        ("--image", "x", "--launcher", "mpi"): "--launcher mpi: the pods start their ranks with torchrun",
        ("--image", "x", "--emit", "slurm"): "--emit 'slurm': allowed: kubernetes",
        # matched whole: a final newline would reach the YAML (issue 57 E25), and counts no cluster holds
        ("--image", "x", "--name", "lab\n"): "--name 'lab\\n': must be a DNS label",
        ("--image", "x", "--memory", "64Gi\n"): "--memory '64Gi\\n': must be a Kubernetes quantity",
        ("--image", "x", "--namespace", "Team_A"): "--namespace 'Team_A': must be a DNS label",
        ("--image", "x", "--nproc", "1000000000"): "--nproc 1000000000: must be an integer in [1, 1024]",
        ("--image", "x", "--nnodes", "1000000000"): "--nnodes 1000000000: must be an integer in [1, 10000]",
        ("--image", "x\n"): "--image 'x\\n': must be an image reference",
        ("--image", "x", "--rdzv-endpoint", "host:1\n"): "--rdzv-endpoint 'host:1\\n': must be HOST:PORT",
        ("--image", "x", "--rdzv-endpoint", "host:99999"): "--rdzv-endpoint 'host:99999': must be HOST:PORT",
        ("--image", "x", "--cpu", "1000000000"): "--cpu 1000000000: must be an integer in [1, 4096]",
        ("--image", "x", "--out", "/nonexistent/dir/job.yaml"): "--out /nonexistent/dir/job.yaml: cannot write the "
        "manifests (No such file or directory)",
    }.items():
        emit = [] if "--emit" in bad else ["--emit", "kubernetes"]
        code, _, err = run_cli_in_process("launch", *emit, *bad, "--", *TRAIN)
        assert code == 2 and err.startswith(f"error: {message}") and len(err.splitlines()) == 1, err
    # every command the library declares is checked as it checks itself, and the command must exist at all
    for inner, said in ((["train", "--preset", "kagle"], "unknown model preset 'kagle'"),
                        (["train", "--preset", "tiny", "--steps", "0"], "--steps 0: must be an integer >= 1"),
                        (["infer", "run", "--preset", "kagle"], "unknown model preset 'kagle'"),
                        (["infer", "search", "--preset", "tiny", "--sla-ms", "x"], "--sla-ms 'x': must be a number"),
                        (["serve", "--preset", "tiny", "--port", "-3"], "--port -3: must be in [0, 65535]"),
                        (["frobnicate"], "'frobnicate': not a dlrm-lab command")):  # fmt: skip
        code, _, err = run_cli_in_process("launch", "--emit", "kubernetes", "--image", "x", "--", *inner)
        assert code == 2 and err.startswith(f"error: the pods' command '{inner[0]}") and said in err, err
    code, _, err = run_cli_in_process("launch", "--emit", "kubernetes", "--image", "x", "--", "sweep", "in-image.toml")
    assert code == 0 and "note: the grid file in-image.toml is not on this machine" in err  # the pods' to read
    code, _, err = run_cli_in_process(
        "launch", "--emit", "kubernetes", "--image", "x", "--", *TRAIN, "--metrics-dir", "runs"
    )
    assert code == 2 and "--metrics-dir 'runs': in a pod it must be absolute" in err


def test_the_trainjob_pod_command_takes_its_settings_from_kubeflow_trainer(monkeypatch):
    """Trainer's torch plugin gives each pod torchrun's settings as PET_* variables (v2.3.0,
    pkg/runtime/framework/plugins/torch): the pod's torchrun reads them as its own options."""
    from torch.distributed.run import parse_args

    (doc,) = manifests(TRAIN, kind="trainjob", image="x", nnodes=2, nproc=4)
    words = shlex.split(doc["spec"]["trainer"]["command"][2].splitlines()[-1])
    assert words[:4] == ["exec", "python", "-m", "dlrm_lab.torchrun"]
    trainer = {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "4", "PET_NODE_RANK": "1",
               "PET_MASTER_ADDR": "lab-node-0-0.lab", "PET_MASTER_PORT": "29400"}  # fmt: skip
    for key, value in trainer.items():
        monkeypatch.setenv(key, value)
    args = parse_args(words[4:])
    assert (args.nnodes, args.nproc_per_node, args.node_rank) == ("2", "4", 1)
    assert (args.master_addr, args.master_port) == ("lab-node-0-0.lab", 29400)
    assert args.training_script == "dlrm_lab" and args.module and args.training_script_args[:1] == ["train"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.multiprocess
def test_the_job_pod_command_runs_as_two_pods_and_the_ranks_read_torchrun(tmp_path):
    """The Job's container command, run here as its two pods run it (JOB_COMPLETION_INDEX 0 and 1, the
    rendezvous on this host): one rank each, world size 2, and the lab reads the launcher as torchrun."""
    service, job = manifests(
        [*TRAIN, *DECIDED, "--metrics-dir", str(tmp_path)], image="x", nnodes=2, nproc=1, cpu=2,
        rdzv_endpoint=f"localhost:{_free_port()}", python=sys.executable,
    )  # fmt: skip
    assert service["spec"]["clusterIP"] == "None" and job["spec"]["completionMode"] == "Indexed"
    (container,) = job["spec"]["template"]["spec"]["containers"]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", **{e["name"]: e["value"] for e in container["env"]}}
    pods = [
        subprocess.Popen(container["command"], cwd=ROOT, env={**env, "JOB_COMPLETION_INDEX": str(index)},
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for index in (0, 1)
    ]  # fmt: skip
    try:
        outputs = [pod.communicate(timeout=300)[0] for pod in pods]
    finally:
        for pod in pods:
            pod.kill()
    assert [pod.returncode for pod in pods] == [0, 0], "\n".join(o[-2000:] for o in outputs)
    (run_dir,) = list(tmp_path.iterdir())
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["status"] == "ok"
    assert (manifest["config"]["launcher"], manifest["config"]["world_size"]) == ("torchrun", 2)

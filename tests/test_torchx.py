"""TorchX: the lab's components (dlrm_lab/torchx.py) on TorchX's schedulers."""

import importlib
import importlib.util
import json
import os
import shlex
import subprocess
import sys

import pyarrow.parquet as pq
import pytest
from conftest import DECIDED, ROOT

from dlrm_lab.distributed.context import detect_launch
from dlrm_lab.errors import UserError

COMPONENT = "dlrm_lab/torchx.py"


def test_without_torchx_the_components_say_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchx", None)  # `import torchx` now fails as if it were not installed
    monkeypatch.delitem(sys.modules, "dlrm_lab.torchx", raising=False)
    with pytest.raises(UserError, match=r"need torchx: pip install 'dlrm-lab\[torchx\]'"):
        importlib.import_module("dlrm_lab.torchx")


@pytest.fixture(scope="module")
def tx():
    """The components module; its tests are skipped where torchx could not be installed (no package index)."""
    if importlib.util.find_spec("torchx") is None:
        pytest.skip("torchx is not installed: pip install 'dlrm-lab[torchx]' (needs PyPI)")
    return importlib.import_module("dlrm_lab.torchx")


def _command(app) -> list[str]:
    """The role's command line as a scheduler runs it (its macros filled in as the local scheduler does)."""
    from torchx.specs import macros

    (role,) = app.roles
    role = macros.Values(img_root="", app_id="app-1", replica_id="0", rank0_env="TORCHX_RANK0_HOST").apply(role)
    assert role.entrypoint == "bash" and role.args[0] == "-c"
    return shlex.split(role.args[1])


def test_train_is_ddps_job_started_by_the_labs_torchrun(tx):
    from torch.distributed.run import parse_args

    app = tx.train("--preset", "dcnv2", "--device", "cuda", nnodes=2, nproc_per_node=8, cpu=64, gpu=8, memMB=400_000)
    (role,) = app.roles
    assert role.num_replicas == 2 and (role.resource.cpu, role.resource.gpu, role.resource.memMB) == (64, 8, 400_000)
    assert role.env["OMP_NUM_THREADS"] == "8"  # the node's cores shared by its ranks
    cmd = _command(app)
    # the lab's wrapper, so that a failed job marks its runs failed; then `dlrm-lab train` and its options
    assert cmd[:3] == ["python", "-m", "dlrm_lab.torchrun"] and cmd[-7:] == [
        "-m", "dlrm_lab", "train", "--preset", "dcnv2", "--device", "cuda"]  # fmt: skip
    # what dist.ddp writes, torch's launcher reads: 2 nodes x 8, c10d on the host the scheduler names first
    args = parse_args(cmd[3:])
    assert (args.nnodes, args.nproc_per_node, args.rdzv_backend, args.rdzv_id) == ("2", "8", "c10d", "app-1")
    assert args.rdzv_endpoint == "${TORCHX_RANK0_HOST:=localhost}:29500" and args.module
    assert tx.train(nproc_per_node=4, cpu=2, env={"OMP_NUM_THREADS": "3"}).roles[0].env["OMP_NUM_THREADS"] == "3"


def _doc_commands(scheduler: str) -> list[list[str]]:
    """Every `torchx run -s SCHEDULER ...` line of launch/torchx.md, as words."""
    text = (ROOT / "launch" / "torchx.md").read_text().replace("\\\n", " ")
    return [shlex.split(line) for line in text.splitlines() if line.startswith(f"torchx run -s {scheduler} ")]


def test_launch_docs_slurm_lines_are_heterogeneous_sbatch_jobs_of_the_labs_launcher(tx, monkeypatch):
    """launch/torchx.md's SLURM lines as typed, dry-run: the request TorchX would submit (no cluster needed)."""
    from torchx.runner import get_runner

    monkeypatch.chdir(ROOT)
    train_line, scale_line = _doc_commands("slurm")
    requests = []
    for words in (train_line, scale_line):
        assert words[:5] == ["torchx", "run", "-s", "slurm", "-cfg"]
        with get_runner() as runner:
            cfg = runner.scheduler_run_opts("slurm").cfg_from_str(words[5])
            requests.append(str(runner.dryrun_component(words[6], words[7:], "slurm", cfg=cfg)))
    train_job, scale_job = requests
    assert "#SBATCH hetjob" in train_job and train_job.count("--partition=gpu") == 2  # one group per node
    assert train_job.count("python -m dlrm_lab.torchrun") == 2 and "--nproc_per_node 8" in train_job
    assert "${SLURM_JOB_NODELIST_HET_GROUP_0:=localhost}:29500" in train_job  # rendezvous on the first node
    assert "hetjob" not in scale_job and "python -m dlrm_lab scale --ranks 1,2,4,8" in scale_job


def test_torchruns_variables_win_over_the_schedulers_own():
    """Under TorchX every rank is torchrun's child, even inside a SLURM job: rank discovery reads torchrun's."""
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "gpu[1-2]", "TORCHX_RANK0_HOST": "gpu1",
           "RANK": "11", "WORLD_SIZE": "16", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "8", "MASTER_ADDR": "gpu1",
           "MASTER_PORT": "29500"}  # fmt: skip
    info = detect_launch(env)
    assert (info.launcher, info.rank, info.world_size, info.local_rank, info.master_addr) == (
        "torchrun", 11, 16, 3, "gpu1")  # fmt: skip


def test_scale_and_sweep_run_on_one_node_whose_points_the_lab_launches(tx):
    app = tx.scale("--ranks", "1,2,4", "--", "--preset", "tiny", cpu=32, env={"X": "1"})
    (role,) = app.roles
    assert (role.num_replicas, role.entrypoint, role.resource.cpu, role.env["X"]) == (1, "python", 32, "1")
    assert role.args == ["-m", "dlrm_lab", "scale", "--ranks", "1,2,4", "--", "--preset", "tiny"]
    (role,) = tx.sweep("grids/batch.toml", "--no-progress", python="/opt/venv/bin/python").roles
    assert role.entrypoint == "/opt/venv/bin/python"
    assert role.args == ["-m", "dlrm_lab", "sweep", "grids/batch.toml", "--no-progress"]


def test_bad_options_fail_before_the_job_is_submitted(tx, monkeypatch):
    from torchx.runner import get_runner
    from torchx.specs.finder import ComponentValidationException

    monkeypatch.chdir(ROOT)
    # as `torchx run` calls it: its own validation error, which it prints in one line without a traceback
    with get_runner() as runner, pytest.raises(ComponentValidationException, match="unrecognized arguments: --stepz"):
        runner.dryrun_component(f"{COMPONENT}:train", ["--nproc_per_node", "2", "--", "--stepz", "4"], "local_cwd")
    with pytest.raises(UserError, match="train options '--stepz 4': train: unrecognized arguments: --stepz 4"):
        tx.train("--stepz", "4")
    with pytest.raises(UserError, match="train options '--preset kagle': unknown model preset 'kagle'"):
        tx.train("--preset", "kagle")
    with pytest.raises(UserError, match="train options '--preset tiny --steps 0': --steps 0: must be"):
        tx.train("--preset", "tiny", "--steps", "0")
    with pytest.raises(UserError, match="--nproc_per_node 0: must be a whole number >= 1"):
        tx.train("--preset", "tiny", nproc_per_node=0)
    with pytest.raises(UserError, match="--cpu 0"):
        tx.scale(cpu=0)


@pytest.mark.multiprocess
def test_torchx_local_cwd_runs_two_ranks_the_lab_discovers(tx, tmp_path):
    """`torchx run -s local_cwd FILE:train` as a user types it: TorchX's job, torchrun's ranks, the lab's run."""
    bin_dir = os.path.dirname(sys.executable)  # `torchx` and the `python` the job runs: this environment's
    env = {**os.environ, "PATH": os.pathsep.join([bin_dir, os.environ.get("PATH", "")]), "PYTHONWARNINGS": "ignore"}
    runs, logs = tmp_path / "runs", tmp_path / "logs"
    out = subprocess.run(
        [os.path.join(bin_dir, "torchx"), "run", "-s", "local_cwd", "-cfg", f"log_dir={logs}", f"{COMPONENT}:train",
         "--nproc_per_node", "2", "--cpu", "2", "--", "--preset", "tiny", "--steps", "4", "--batch-size", "16",
         "--metrics-dir", str(runs), "--no-progress", *DECIDED],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    (run_dir,) = list(runs.iterdir())  # one run for the job, every rank's rows in it
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["status"] == "ok"
    config = manifest["config"]
    # the lab's rank discovery read torchrun's variables, set under the job TorchX started
    assert (config["launcher"], config["world_size"], config["backend"]) == ("torchrun", 2, "gloo")
    assert config["torch_threads"] == 1  # the component's OMP_NUM_THREADS: 2 cores over 2 ranks
    assert set(pq.read_table(run_dir / "steps.parquet").column("rank").to_pylist()) == {0, 1}
    # TorchX's app id named torchrun's rendezvous: its ranks' logs sit under TorchX's log directory
    (app_dir,) = (logs / "torchx").iterdir()
    assert (app_dir / "SUCCESS").is_file()
    assert list((app_dir / "torchelastic" / "dlrm_lab").glob(f"{app_dir.name}_*/attempt_0/1"))

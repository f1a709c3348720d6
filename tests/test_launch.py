"""Starting ranks: launcher detection, launch recipes, `dlrm-lab launch` and `scale`."""

import json
import os
import subprocess
import sys

import pyarrow.parquet as pq
import pytest
from conftest import ROOT, run_cli, run_cli_in_process

from dlrm_lab.distributed.context import detect_launch, first_slurm_node
from dlrm_lab.distributed.launch import launch_command
from dlrm_lab.errors import UserError


def test_torchrun_environment():
    env = {
        "RANK": "3",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "4",
        "MASTER_ADDR": "node7",
        "MASTER_PORT": "29411",
    }
    info = detect_launch(env)
    assert (info.launcher, info.rank, info.world_size, info.local_rank, info.local_world_size) == (
        "torchrun",
        3,
        8,
        1,
        4,
    )
    assert (info.master_addr, info.master_port) == ("node7", 29411)


def test_slurm_environment_rendezvous_on_the_first_node():
    env = {
        "SLURM_PROCID": "5",
        "SLURM_NTASKS": "16",
        "SLURM_LOCALID": "1",
        "SLURM_NTASKS_PER_NODE": "8(x2)",
        "SLURM_JOB_NODELIST": "gpu[003-004]",
        "SLURM_JOB_ID": "123456",
    }
    info = detect_launch(env)
    assert (info.launcher, info.rank, info.world_size, info.local_rank, info.local_world_size) == ("slurm", 5, 16, 1, 8)
    assert info.master_addr == "gpu003" and info.master_port == 20000 + 123456 % 20000


@pytest.mark.parametrize(
    "nodelist, first", [("node[03-05,9]", "node03"), ("a1,b2", "a1"), ("host", "host"), ("x[7],y[1-2]", "x7")]
)
def test_first_slurm_node(nodelist, first):
    assert first_slurm_node(nodelist) == first


def test_plain_process_is_a_group_of_one():
    info = detect_launch({})
    assert (info.launcher, info.rank, info.world_size) == ("none", 0, 1)


def test_launch_commands():
    cmd = launch_command(4, "torchrun", ["train", "--preset", "tiny"])
    assert "--standalone" in cmd and "--nproc-per-node=4" in cmd and cmd[-3:] == ["train", "--preset", "tiny"]
    multi = launch_command(8, "torchrun", ["train"], nnodes=2, rdzv_endpoint="n0:29400")
    assert "--nnodes=2" in multi and "--rdzv-endpoint=n0:29400" in multi and "--rdzv-backend=c10d" in multi
    mpi = launch_command(2, "mpi", ["train"])
    assert os.path.basename(mpi[0]) == "mpiexec" and mpi[1:3] == ["-n", "2"]
    with pytest.raises(UserError, match="--rdzv-endpoint"):
        launch_command(2, "torchrun", ["train"], nnodes=2)
    with pytest.raises(UserError, match="--launcher 'slurm'"):
        launch_command(2, "slurm", ["train"])


def _two_rank_run(run_dir):
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["status"] == "ok" and manifest["config"]["world_size"] == 2
    steps = pq.read_table(run_dir / "steps.parquet")
    assert set(steps.column("rank").to_pylist()) == {0, 1}
    return manifest


@pytest.mark.multiprocess
def test_dlrm_lab_launch_with_mpiexec(tmp_path):
    out = run_cli(
        "launch",
        "--nproc",
        "2",
        "--launcher",
        "mpi",
        "--",
        "train",
        "--preset",
        "tiny",
        "--steps",
        "4",
        "--batch-size",
        "16",
        "--metrics-dir",
        str(tmp_path),
        "--no-progress",
    )
    assert out.returncode == 0, out.stderr[-2000:]
    (run_dir,) = list(tmp_path.iterdir())
    assert _two_rank_run(run_dir)["config"]["launcher"] == "mpi"


@pytest.mark.multiprocess
def test_torchrun_recipe_runs_as_is(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable}
    out = subprocess.run(
        [
            "bash",
            "launch/torchrun.sh",
            "2",
            "--preset",
            "tiny",
            "--steps",
            "4",
            "--batch-size",
            "16",
            "--metrics-dir",
            str(tmp_path),
            "--no-progress",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    (run_dir,) = list(tmp_path.iterdir())
    assert _two_rank_run(run_dir)["config"]["launcher"] == "torchrun"


@pytest.mark.multiprocess
def test_weak_scaling_sweep_reports_efficiency(tmp_path):
    out = run_cli(
        "scale",
        "--ranks",
        "1,2",
        "--mode",
        "weak",
        "--batch-size",
        "64",
        "--metrics-dir",
        str(tmp_path),
        "--",
        "--preset",
        "tiny",
        "--steps",
        "12",
        "--prefetch",
        "0",
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    (sweep,) = [p for p in tmp_path.iterdir() if p.name.startswith("scale-")]
    points = pq.read_table(sweep / "summary.parquet").to_pylist()
    assert [p["ranks"] for p in points] == [1, 2]
    assert [p["global_batch_size"] for p in points] == [64, 128] and points[1]["batch_size_per_rank"] == 64
    one, two = points
    assert one["efficiency"] == pytest.approx(1.0)
    assert two["speedup"] == pytest.approx(two["samples_per_s"] / one["samples_per_s"])
    assert two["efficiency"] == pytest.approx(two["speedup"] / 2)
    launched = (sweep / "points" / "p0001-r0" / "point.log").read_text().splitlines()[0]
    assert launched.startswith("$ OMP_NUM_THREADS=") and "torch.distributed.run" in launched  # 2 ranks: torchrun
    assert "weak scaling" in out.stdout and "efficiency" in out.stdout


def test_scale_refuses_bad_sweeps():
    code, _, err = run_cli_in_process("scale", "--ranks", "1,two")
    assert code == 2 and "--ranks '1,two'" in err
    code, _, err = run_cli_in_process("scale", "--ranks", "1,3", "--mode", "strong", "--batch-size", "100")
    assert code == 2 and "make it divisible" in err

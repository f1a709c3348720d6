"""Starting ranks: launcher detection, launch recipes, `dlrm-lab launch` and `scale`."""

import json
import os
import re
import subprocess
import sys

import pyarrow.parquet as pq
import pytest
from conftest import DECIDED, ROOT, run_cli_in_process, store_profile

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
    with pytest.raises(UserError, match="^nnodes > 1 needs rdzv_endpoint"):
        launch_command(2, "torchrun", ["train"], nnodes=2)
    with pytest.raises(UserError, match="^launcher 'slurm'"):
        launch_command(2, "slurm", ["train"])


def _two_rank_run(run_dir):
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["status"] == "ok" and manifest["config"]["world_size"] == 2
    steps = pq.read_table(run_dir / "steps.parquet")
    assert set(steps.column("rank").to_pylist()) == {0, 1}
    return manifest


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """This module's 2-process jobs, independent of each other, started together (one after another, each left a
    core idle while its launcher and ranks started): `dlrm-lab launch --launcher mpi -- train`, the torchrun recipe
    launch/torchrun.sh, and mpiexec of the MPI process group's check. name -> (exit code, output, metrics dir)."""
    tmp = tmp_path_factory.mktemp("launched")
    # --sharding auto stays (its test checks the choice); the other choices are given, not timed
    mpi_train = [sys.executable, "-m", "dlrm_lab", "launch", "--nproc", "2", "--launcher", "mpi", "--", "train",
                 "--preset", "tiny", "--steps", "4", "--batch-size", "16", "--metrics-dir", str(tmp / "mpi"),
                 "--no-progress", "--collectives", "mpi", "--precision", "fp32", "--table-pages", "base",
                 "--table-update", "fbgemm", "--prefetch", "0"]  # fmt: skip
    recipe = ["bash", "launch/torchrun.sh", "2", "--preset", "tiny", "--steps", "4", "--batch-size", "16",
              "--metrics-dir", str(tmp / "recipe"), "--no-progress", *DECIDED]  # fmt: skip
    mpiexec = launch_command(2, "mpi", ["train"])[0]
    check = [mpiexec, "-n", "2", sys.executable, str(ROOT / "tests" / "mpi_collectives_worker.py")]
    jobs = {
        "mpi": (mpi_train, {**os.environ, "PYTHONWARNINGS": "ignore"}),
        "recipe": (recipe, {**os.environ, "PYTHON": sys.executable}),
        "mpi collectives": (check, None),
    }
    procs = {}
    try:
        for name, (cmd, env) in jobs.items():
            with open(tmp / f"{name}.log", "w") as log:  # files, not pipes: the jobs write while others are waited
                procs[name] = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        codes = {name: proc.wait(timeout=300) for name, proc in procs.items()}
    finally:
        for proc in procs.values():
            proc.kill()
    return {name: (codes[name], (tmp / f"{name}.log").read_text(), tmp / name) for name in jobs}


@pytest.mark.multiprocess
def test_dlrm_lab_launch_with_mpiexec(launched):
    code, output, metrics_dir = launched["mpi"]
    assert code == 0, output[-2000:]
    (run_dir,) = list(metrics_dir.iterdir())
    manifest = _two_rank_run(run_dir)
    assert manifest["config"]["launcher"] == "mpi"
    # every collective of the trial and the run (all-to-all, reduce-scatter, DDP's all-reduce) over MPI
    assert manifest["config"]["backend"] == "mpi4py"
    assert manifest["config"]["collectives_choice"]["collectives"] == "mpi"
    # --sharding auto on 2 CPU ranks: candidate plans timed, the fastest planned
    choice = manifest["config"]["sharding_choice"]
    assert len(choice["step_ms"]) >= 2 and choice["sharding"] == min(choice["step_ms"], key=choice["step_ms"].get)
    planned = {t["sharding_type"] for t in manifest["config"]["sharding_plan"]["tables"]}
    assert choice["sharding"] == "planner" or planned == {choice["sharding"]}


@pytest.mark.multiprocess
def test_torchrun_recipe_runs_as_is(launched):
    code, output, metrics_dir = launched["recipe"]
    assert code == 0, output[-2000:]
    (run_dir,) = list(metrics_dir.iterdir())
    assert _two_rank_run(run_dir)["config"]["launcher"] == "torchrun"


@pytest.mark.multiprocess
def test_weak_scaling_sweep_reports_efficiency(tmp_path, monkeypatch):
    """One real 1-and-2-rank sweep: efficiency, the ceiling, the prediction, the named gap
    (gap.parquet, summing to the measured gap) and a projection to a published fabric."""
    comms = {
        "gloo/2": [
            {"collective": c, "bytes": b, "time_ms": t, "busbw_bytes_per_s": bw}
            for c in ("all_to_all", "all_reduce")
            for b, t, bw in ((1024, 0.5, 2e6), (1 << 20, 2.0, 5e8))
        ]
    }
    store_profile(tmp_path / "machines", comms=comms, ceiling={2: 0.8})
    monkeypatch.setenv("DLRM_LAB_MACHINE_DIR", str(tmp_path / "machines"))
    # the sweep in this process (its points are the processes: one rank, then two under torchrun)
    code, stdout, stderr = run_cli_in_process(
        "scale", "--ranks", "1,2", "--mode", "weak", "--batch-size", "64", "--metrics-dir", str(tmp_path),
        "--project", "8,64", "--plan-up-to", "8",
        "--", "--preset", "tiny", "--steps", "12", "--profile-steps", "2",
        *DECIDED,  # both points: the steps, not the choices a 2-rank run would time at start-up
    )  # fmt: skip
    assert code == 0, stdout[-2000:] + stderr[-2000:]
    (sweep,) = [p for p in tmp_path.iterdir() if p.name.startswith("scale-")]
    one, two = pq.read_table(sweep / "summary.parquet").to_pylist()
    assert one["ceiling_efficiency"] == 1.0 and two["ceiling_efficiency"] == 0.8
    assert two["efficiency_vs_ceiling"] == pytest.approx(two["efficiency"] / 0.8)
    assert one["predicted_step_ms"] == pytest.approx(one["rank_step_ms"])
    assert two["predicted_step_ms"] > one["predicted_step_ms"] / 0.8  # slower compute plus collectives
    assert two["prediction_error"] == pytest.approx(two["rank_step_ms"] / two["predicted_step_ms"] - 1)
    # the roof: compute at the 0.8 ceiling alone would allow 0.8, the collectives take some of it
    assert 0 < two["roof_efficiency"] < 0.8 and one["roof_efficiency"] is None
    assert two["library_roof_efficiency"] == two["roof_efficiency"]  # no TorchRec rows in this profile
    assert two["efficiency_vs_roof"] == pytest.approx(two["efficiency"] / two["roof_efficiency"])
    assert "this machine allows" in stdout
    gap = pq.read_table(sweep / "gap.parquet").to_pylist()
    assert {g["ranks"] for g in gap} == {2} and sum(g["ms"] for g in gap) == pytest.approx(two["gap_ms"])
    assert two["gap_named_ms"] == pytest.approx(two["gap_ms"])
    # --profile-steps: every rank's operators, in the 2-rank point's profile.parquet
    (two_rank_run,) = (sweep / "points" / "p0001-r0").glob("train-*")
    profiled = pq.read_table(two_rank_run / "profile.parquet").to_pylist()
    assert {r["rank"] for r in profiled} == {0, 1} and all(r["steps"] == 2 for r in profiled)
    assert any("alltoall" in r["op"] or "all_to_all" in r["op"].lower() or "allreduce" in r["op"] for r in profiled)
    assert "2 ranks: the per-rank step beyond one rank's" in stdout
    assert "projected on h100-nvlink-ndr" in stdout and "assumed: compute" in stdout
    assert re.search(r"\b(TW|RW|CW|TRW|TCW|DP) \d+", stdout), stdout[-3000:]  # the planner's pick, per type
    points = pq.read_table(sweep / "summary.parquet").to_pylist()
    assert [p["ranks"] for p in points] == [1, 2]
    assert [p["global_batch_size"] for p in points] == [64, 128] and points[1]["batch_size_per_rank"] == 64
    one, two = points
    assert one["efficiency"] == pytest.approx(1.0)
    assert two["speedup"] == pytest.approx(two["samples_per_s"] / one["samples_per_s"])
    assert two["efficiency"] == pytest.approx(two["speedup"] / 2)
    launched = (sweep / "points" / "p0001-r0" / "point.log").read_text().splitlines()[0]
    assert launched.startswith("$ OMP_NUM_THREADS=") and "dlrm_lab.torchrun" in launched  # 2 ranks: torchrun
    assert "weak scaling" in stdout and "efficiency" in stdout


def test_scale_refuses_bad_sweeps():
    code, _, err = run_cli_in_process("scale", "--ranks", "1,two")
    assert code == 2 and "--ranks '1,two'" in err
    code, _, err = run_cli_in_process("scale", "--ranks", "1,3", "--mode", "strong", "--batch-size", "100")
    assert code == 2 and "make it divisible" in err
    code, _, err = run_cli_in_process("scale", "--ranks", "1,2", "--project", "8", "--fabric", "dgx-1")
    assert code == 2 and "--fabric 'dgx-1'" in err and "h100-nvlink-ndr" in err
    code, _, err = run_cli_in_process("scale", "--ranks", "2,4", "--project", "8,64")
    assert code == 2 and "include 1 in --ranks" in err
    code, _, err = run_cli_in_process("scale", "--ranks", "1,2", "--project", "8,x")
    assert code == 2 and "--project '8,x'" in err


def _failure(rank: int, exitcode: int, second: int):
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    failure = ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file="<N/A>")
    failure.timestamp = second
    return failure


def test_the_launcher_names_the_rank_that_failed_first():
    from dlrm_lab.distributed.elastic import describe_failure, root_failure

    # rank 1 killed; rank 0's collective failed in the same second (listed first): rank 1 is the cause
    rank, failure = root_failure({0: _failure(0, 1, 100), 1: _failure(1, -9, 100)})
    assert rank == 1
    assert describe_failure(rank, failure) == (
        "rank 1 (pid 1001) was killed by signal SIGKILL (out of memory, or killed by hand); "
        "the launcher stopped the other ranks"
    )
    # rank 0 gave up on a stuck rank 1, which the launcher killed after its grace: rank 0 is the cause
    rank, failure = root_failure({0: _failure(0, 1, 100), 1: _failure(1, -9, 105)})
    assert (rank, describe_failure(rank, failure, world_size=1)) == (0, "rank 0 (pid 1000) exited with code 1")
    rank, failure = root_failure({1: _failure(1, -11, 100)})
    assert "killed by signal SIGSEGV; the launcher" in describe_failure(rank, failure)


def test_the_launcher_writes_its_reason_into_the_runs_the_ranks_created(tmp_path, monkeypatch):
    from dlrm_lab.metrics.run import RUN_RECORD_ENV, Run, read_manifest
    from dlrm_lab.torchrun import mark_runs_failed

    record = tmp_path / "record"
    monkeypatch.setenv(RUN_RECORD_ENV, str(record))
    stopped = Run.create(tmp_path / "runs", kind="train", config={})
    stopped.finish("failed", error="Terminated: terminated by signal SIGTERM (a launcher stopped the job)")
    reasoned = Run.create(tmp_path / "runs", kind="train", config={})
    reasoned.finish("failed", error="RankFailure: rank 0: no training progress for 6s")
    left = Run.create(tmp_path / "runs", kind="infer", config={})
    left.update_manifest(pid=2**22 + 12345)  # its process is gone without closing it
    done = Run.create(tmp_path / "runs", kind="train", config={})
    done.finish("ok")
    assert len(record.read_text().splitlines()) == 4  # each run created told the launcher where it is

    marked = mark_runs_failed(record, "rank 1 (pid 7) was killed by signal SIGKILL", killed=True)
    assert marked == [stopped.dir, reasoned.dir, left.dir]
    for run in (stopped, reasoned, left):
        manifest = read_manifest(run.dir)
        assert (manifest["status"], manifest["error"]) == (
            "failed",
            "RankFailure: rank 1 (pid 7) was killed by signal SIGKILL",
        )
    assert read_manifest(done.dir)["status"] == "ok"
    # a rank that exited with its own reason keeps it: the launcher's line only adds the exit code
    mark_runs_failed(record, "rank 0 (pid 6) exited with code 1", killed=False)
    assert read_manifest(reasoned.dir)["error"].startswith("RankFailure: rank 1 (pid 7)")
    assert mark_runs_failed(tmp_path / "missing", "x", killed=True) == []


@pytest.mark.multiprocess
def test_the_mpi_process_group_gives_every_collectives_answer(launched):
    code, output, _ = launched["mpi collectives"]  # mpiexec -n 2 tests/mpi_collectives_worker.py
    assert code == 0, output[-4000:]
    assert "rank 0 ok" in output and "rank 1 ok" in output


def test_collectives_are_chosen_by_the_probed_speeds_or_refused_in_one_line():
    from dlrm_lab.distributed.mpi import choose_collectives

    fast_mpi = {"gloo/2": 0.014, "mpi/2": 0.004}.get
    assert choose_collectives("auto", "mpi", "cpu", 2, fast_mpi)[0] == "mpi"
    assert "4.0 ms over MPI, 14.0 ms over gloo" in choose_collectives("auto", "mpi", "cpu", 2, fast_mpi)[1]
    assert choose_collectives("auto", "mpi", "cpu", 2, {"gloo/2": 0.004, "mpi/2": 0.014}.get)[0] == "gloo"
    assert choose_collectives("auto", "mpi", "cpu", 2, {"gloo/2": 0.004}.get)[1].startswith("auto: gloo and MPI not")
    assert choose_collectives("auto", "torchrun", "cpu", 2, fast_mpi)[0] == "gloo"  # MPI needs mpiexec
    assert choose_collectives("auto", "none", "cpu", 1, fast_mpi)[0] == "gloo"
    assert choose_collectives("mpi", "none", "cpu", 1)[0] == "gloo"  # a sweep's one-rank point
    assert choose_collectives("auto", "mpi", "cuda", 2, fast_mpi)[0] == "nccl"
    assert choose_collectives("gloo", "mpi", "cpu", 2, fast_mpi) == ("gloo", "asked for (--collectives gloo)")
    for args, message in (
        (("mpi", "torchrun", "cpu", 2), "started by torchrun, not mpiexec"),
        (("mpi", "mpi", "cuda", 2), "on GPUs the collectives are NCCL's"),
        (("tcp", "mpi", "cpu", 2), "allowed: auto, gloo, mpi"),
    ):
        with pytest.raises(UserError, match=message):
            choose_collectives(*args)
    code, _, err = run_cli_in_process("train", "--preset", "tiny", "--collectives", "shm")
    assert code != 0 and "--collectives" in err and "Traceback" not in err

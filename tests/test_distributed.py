"""Two ranks under torchrun train exactly like one rank over the same global batches."""

import json
import os
import shlex
import subprocess
import sys

import pyarrow.parquet as pq
import pytest
import torch
from conftest import DECIDED, ENDLESS_TRAIN, ROOT, wait_for_files

import dlrm_lab
from dlrm_lab.config import SHARDING_TYPES
from dlrm_lab.distributed.tables import gather_tables, init_tables

GLOBAL_BATCH, STEPS = 64, 6


HSTU_SHARDINGS = ("table_wise", "row_wise", "column_wise")
# one process per rank count runs them all: tiny under every sharding type, the HSTU ranker under its types
JOBS = [
    f"tiny:{GLOBAL_BATCH}:{','.join(SHARDING_TYPES)},table_wise+lean",
    f"hstu-tiny:{GLOBAL_BATCH // 4}:{','.join(HSTU_SHARDINGS)}",
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One process on one rank and a 2-rank job under torchrun, side by side, each running every job in turn; the
    2-rank job also runs the resume test's trajectory and the table-update test's `dlrm-lab train`."""
    one, two = tmp_path_factory.mktemp("one"), tmp_path_factory.mktemp("two")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    table_update = ["train", "--preset", "tiny", "--sharding", "table_wise", "--steps", "40", "--batch-size", "16",
                    "--precision", "fp32", "--table-pages", "base",  # not measured: only the table update is
                    "--dot-interaction", "autocast",  # fixed: its own trial would share the window of steps
                    "--metrics-dir", str(two / "table-update"), "--no-progress"]  # fmt: skip
    two_only = ["resume", "cli:" + shlex.join(table_update)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "tests/dist_worker.py"]
    log = two / "ranks.log"  # a file, not a pipe: nothing reads it while the one-rank process runs
    with open(log, "w") as ranks_log:
        pair = subprocess.Popen([*cmd, str(two), str(STEPS), *JOBS, *two_only], cwd=ROOT, env=env,
                                stdout=ranks_log, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        ref = subprocess.run([sys.executable, "tests/dist_worker.py", str(one), str(STEPS), *JOBS], cwd=ROOT,
                             capture_output=True, text=True, timeout=300, env=env)  # fmt: skip
        pair.wait(timeout=300)
    finally:
        pair.kill()
    assert ref.returncode == 0, ref.stderr[-3000:]
    assert pair.returncode == 0, log.read_text()[-3000:]
    return one, two


@pytest.mark.multiprocess
@pytest.mark.parametrize("sharding", SHARDING_TYPES)
def test_two_ranks_match_one_rank(runs, sharding):
    one, two = runs
    a = json.loads((one / f"tiny-{sharding}.json").read_text())
    b = json.loads((two / f"tiny-{sharding}.json").read_text())
    assert {t["sharding_type"] for t in b["plan"]["tables"]} == {sharding}
    # two ranks update their shards by batched torch ops (auto under table-wise: either), one rank by fbgemm
    assert a["table_update"] == "fbgemm"
    assert b["table_update"] == ("fbgemm" if sharding == "data_parallel" else b["table_update"] if
                                 sharding == "table_wise" else "batched")  # fmt: skip
    if sharding != "data_parallel":  # model-parallel: the tables are spread over both ranks
        assert all(sum(b["plan"]["bytes_per_rank"]) >= t["bytes"] for t in b["plan"]["tables"])
    for la, lb in zip(a["losses"], b["losses"], strict=True):
        assert abs(la - lb) <= 1e-5 * abs(la), (a["losses"], b["losses"])
    # the pooled all-to-all's backward is timed apart where the tables are spread (0 on one rank and data-parallel)
    a2a_back = b["phases"]["embedding_all_to_all_backward_ms"]
    assert all(ms > 0 for ms in a2a_back) if sharding != "data_parallel" else set(a2a_back) == {0.0}, a2a_back
    assert set(a["phases"]["embedding_all_to_all_backward_ms"]) == {0.0}
    for k, step_ms in enumerate(b["phases"]["step_time_ms"]):
        assert sum(ms[k] for name, ms in b["phases"].items() if name != "step_time_ms") <= step_ms * 1.001
    wa, wb = torch.load(one / f"tiny-{sharding}.pt"), torch.load(two / f"tiny-{sharding}.pt")
    for name, table in wa["tables"].items():
        torch.testing.assert_close(wb["tables"][name], table, rtol=1e-5, atol=1e-6)
    # the tables really trained (else equal weights would prove nothing)
    plain = dlrm_lab.build_model(dlrm_lab.load_preset("tiny"))
    init_tables(plain, seed=3)
    initial = gather_tables(plain)
    for name, table in wa["tables"].items():
        assert not torch.equal(table, initial[name]), name
    for key, value in wa["dense"].items():
        torch.testing.assert_close(wb["dense"][key], value, rtol=1e-5, atol=1e-6)


@pytest.mark.multiprocess
def test_the_lean_distribution_takes_torchrecs_steps(runs):
    """--distribution lean: the same collectives of the same bytes, so the same losses and tables as TorchRec's
    table-wise distribution on two ranks and as one rank."""
    one, two = runs
    lean, torchrec = (json.loads((two / f"tiny-{name}.json").read_text()) for name in ("table_wise+lean", "table_wise"))
    assert lean["lean_dists"] >= 1 and torchrec["lean_dists"] == 0
    assert json.loads((one / "tiny-table_wise+lean.json").read_text())["lean_dists"] == 0  # one rank: TorchRec's
    assert lean["losses"] == pytest.approx(torchrec["losses"], rel=1e-6)
    wl, wt = torch.load(two / "tiny-table_wise+lean.pt"), torch.load(two / "tiny-table_wise.pt")
    for name, table in wt["tables"].items():
        torch.testing.assert_close(wl["tables"][name], table, rtol=1e-6, atol=1e-7)
    assert lean["phases"]["embedding_all_to_all_backward_ms"] and all(
        ms > 0 for ms in lean["phases"]["embedding_all_to_all_backward_ms"]
    )  # its backward is still timed as the all-to-all's


@pytest.mark.multiprocess
def test_hstu_two_ranks_match_one_rank(runs):
    """The HSTU ranker's sequence tables sharded over 2 ranks train as on one rank, to 1e-4 rather than
    DLRM's 1e-5: besides float summation order (DDP averages two half-batch gradients), attention divides by
    the longest sequence of the batch it runs in (the reference's normaliser), and a rank's half-batch can
    have a shorter longest sequence than the whole."""
    one, two = runs
    for sharding in HSTU_SHARDINGS:
        a = json.loads((one / f"hstu-tiny-{sharding}.json").read_text())
        b = json.loads((two / f"hstu-tiny-{sharding}.json").read_text())
        assert {t["sharding_type"] for t in b["plan"]["tables"]} == {sharding}
        # the sequence tables' shards too (nobag lookups), by batched torch ops on two ranks
        assert a["table_update"] == "fbgemm" and b["table_update"] in ("batched", "fbgemm")
        assert sharding == "table_wise" or b["table_update"] == "batched"
        assert {t["table"] for t in b["plan"]["tables"]} == {"item", "item_category", "user"}
        for la, lb in zip(a["losses"], b["losses"], strict=True):
            assert abs(la - lb) <= 1e-4 * abs(la), (a["losses"], b["losses"])
        wa, wb = torch.load(one / f"hstu-tiny-{sharding}.pt"), torch.load(two / f"hstu-tiny-{sharding}.pt")
        for name, table in wa["tables"].items():
            torch.testing.assert_close(wb["tables"][name], table, rtol=1e-4, atol=1e-4)
        for key, value in wa["dense"].items():  # the DDP-replicated layers too
            torch.testing.assert_close(wb["dense"][key], value, rtol=1e-4, atol=1e-4)
    first = torch.load(one / f"hstu-tiny-{HSTU_SHARDINGS[0]}.pt")["tables"]
    from dlrm_lab.config import load_any_preset
    from dlrm_lab.model import build_model

    model = build_model(load_any_preset("hstu-tiny"))
    init_tables(model, seed=3)
    initial = gather_tables(model)
    assert set(initial) == set(first) and not torch.equal(first["item"], initial["item"])


def _start_two_ranks(metrics_dir, timeout_s: int, grace_s: int | None = None) -> subprocess.Popen:
    """A long 2-rank run started as `dlrm-lab launch` starts it."""
    from dlrm_lab.distributed.launch import launch_command

    # rows flushed every second: the victim is chosen once both ranks have some on disk
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "DLRM_LAB_FLUSH_SECONDS": "1"}
    if grace_s is not None:  # the launcher's SIGTERM-to-SIGKILL grace for ranks left after a failure
        env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] = str(grace_s)
    cmd = launch_command(
        2,
        "torchrun",
        [*ENDLESS_TRAIN, *DECIDED, "--timeout", str(timeout_s), "--metrics-dir", str(metrics_dir)],
    )
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def failed_jobs(tmp_path_factory):
    """Two long 2-rank runs, started together; once both ranks of both flushed steps, rank 1 of one is killed
    (SIGKILL) and rank 1 of the other stopped (SIGSTOP: alive but silent, so only the timeout can end that job,
    `--timeout 3`, and its launcher then kills the stopped rank after a 1 s grace; torch's is 30 s). Side by side,
    the stopped job's wait for its timeout is the killed job's end. kind -> (metrics dir, launcher, its stderr,
    {rank: process})."""
    import signal

    import psutil

    dirs = {kind: tmp_path_factory.mktemp(kind) for kind in ("killed", "stuck")}
    jobs = {"killed": _start_two_ranks(dirs["killed"], timeout_s=60),
            "stuck": _start_two_ranks(dirs["stuck"], timeout_s=3, grace_s=1)}  # fmt: skip
    try:
        ranks = {}
        for kind, proc in jobs.items():
            wait_for_files(dirs[kind], "*/_parts/steps/part-r00001-*.parquet")
            children = psutil.Process(proc.pid).children(recursive=True)
            ranks[kind] = {int(p.environ()["RANK"]): p for p in children if "RANK" in p.environ()}
            assert set(ranks[kind]) == {0, 1}, f"{kind}: ranks {sorted(ranks[kind])} found"
        ranks["stuck"][1].send_signal(signal.SIGSTOP)
        ranks["killed"][1].kill()
        errs = {kind: proc.communicate(timeout=120)[1] for kind, proc in jobs.items()}
    finally:
        for proc in jobs.values():
            _kill_tree(proc)
    return {kind: (dirs[kind], jobs[kind], errs[kind], ranks[kind]) for kind in jobs}


@pytest.mark.multiprocess
def test_killing_one_rank_ends_the_job_and_keeps_the_steps(failed_jobs):
    import pyarrow.parquet as pq

    from dlrm_lab.metrics import recover_run

    metrics_dir, proc, err, ranks = failed_jobs["killed"]
    victim = ranks[1]
    assert proc.returncode == 1
    # the launcher's failure is one line naming the dead rank and its signal, not torchrun's traceback
    line = f"error: launcher: rank 1 (pid {victim.pid}) was killed by signal SIGKILL"
    assert line in err and "Traceback" not in err and "ChildFailedError" not in err, err[-2000:]
    (run_dir,) = list(metrics_dir.iterdir())
    manifest = recover_run(run_dir)  # a no-op: the launcher closed it
    assert manifest["status"] == "failed", manifest["status"]
    assert manifest["error"].startswith(f"RankFailure: rank 1 (pid {victim.pid}) was killed by signal SIGKILL")
    ranks = set(pq.read_table(run_dir / "steps.parquet").column("rank").to_pylist())
    assert ranks == {0, 1}  # both ranks' flushed steps survived


@pytest.mark.multiprocess
def test_two_rank_resume_continues_the_same_trajectory(runs):
    out = runs[1] / "resume"  # 16 straight steps, then 8, a checkpoint and 8 resumed (dist_worker.py)
    losses = json.loads((out / "losses.json").read_text())
    assert len(losses["resumed"]) == 8
    assert losses["resumed"] == pytest.approx(losses["straight"][8:], rel=1e-5)
    assert sorted(p.name for p in (out / "ckpt").iterdir()) == ["latest", "step-00000008", "step-00000016"]
    # served by one process with whole tables: DCP reshards the two ranks' row-wise shards, and the served model
    # scores the held-out samples as the two ranks evaluated them together
    import dlrm_lab
    from dlrm_lab.config.family import family_of
    from dlrm_lab.infer.accuracy import auc, score_build
    from dlrm_lab.infer.served import ServedModel
    from dlrm_lab.model.checkpoint import read_checkpoint

    checkpoint = read_checkpoint(out / "ckpt")
    assert checkpoint.step == 16 and checkpoint.about["world_size"] == 2
    served = ServedModel("tiny", dlrm_lab.load_preset("tiny"), checkpoint=read_checkpoint(out / "ckpt"))
    family = family_of(served.spec)
    model = family.serving_model(served, 0, lambda _line: None)[0]
    scored = family.held_out(served, None, 0).slice(0, checkpoint.about["eval"]["samples"])
    assert auc(score_build(model, scored, "fp32"), scored.labels) == pytest.approx(checkpoint.held_out_auc, abs=1e-6)


@pytest.mark.multiprocess
def test_a_stuck_rank_ends_the_job_after_the_timeout_naming_the_rank(failed_jobs):
    from dlrm_lab.metrics import read_manifest

    # rank 1 stopped: rank 0 ends itself, naming the rank and the timeout; the launcher then kills the stopped rank
    metrics_dir, proc, err, ranks = failed_jobs["stuck"]
    assert proc.returncode == 1
    assert not ranks[1].is_running()
    # either the collective's own timeout or the watchdog ends rank 0, naming it; the launcher names rank 0 too
    assert "error: rank 0: " in err and "--timeout 3s" in err, err[-2000:]
    assert f"error: launcher: rank 0 (pid {ranks[0].pid}) exited with code 1" in err, err[-2000:]
    (run_dir,) = list(metrics_dir.iterdir())
    manifest = read_manifest(run_dir)
    assert manifest["status"] == "failed" and "RankFailure: rank 0: " in manifest["error"]  # its own reason kept


def _kill_tree(proc) -> None:
    """Leave no rank behind (a stopped one included), whatever the test's outcome."""
    import psutil

    if proc.poll() is None:
        for child in psutil.Process(proc.pid).children(recursive=True):
            child.kill()
        proc.kill()


def test_a_planner_stage_plugs_in_through_planner_stages():
    """New planning behaviour is a stage of the planner (plan.PlannerStages), not a flag: an
    estimator given there costs every table's options, and TorchRec's own estimators given
    the same way reproduce the default plan."""
    from torchrec.distributed.planner.shard_estimators import EmbeddingPerfEstimator, EmbeddingStorageEstimator

    from dlrm_lab.distributed.context import init_distributed
    from dlrm_lab.distributed.plan import PlannerStages, describe_plan
    from dlrm_lab.distributed.wrap import EmbeddingOptimizer, shard_model

    costed: set[str] = set()

    class CountingPerf(EmbeddingPerfEstimator):
        def estimate(self, sharding_options, sharder_data_map=None):
            costed.update(option.name for option in sharding_options)
            super().estimate(sharding_options, sharder_data_map)

    stages = PlannerStages(
        estimators=lambda topology, constraints: [
            CountingPerf(topology, constraints),
            EmbeddingStorageEstimator(topology, constraints),
        ]
    )
    ctx = init_distributed("cpu")
    spec = dlrm_lab.load_preset("tiny")
    plans = {}
    for name, chosen in (("default", None), ("staged", stages)):
        model = dlrm_lab.build_model(spec, table_device="meta")
        _, plan = shard_model(model, ctx, EmbeddingOptimizer(), batch_size=32, stages=chosen)
        plans[name] = describe_plan(plan, spec, ctx.world_size)
    assert costed == {t.name for t in spec.tables}
    assert plans["staged"] == plans["default"]


@pytest.mark.multiprocess
def test_two_ranks_decide_the_table_update_on_their_own_steps(runs):
    """Timed apart (each rank's tables alone, before the run), the table update is decided again over a window of
    the run's steps with both ranks running them; the manifest keeps both timings and the conditions of each."""
    from dlrm_lab.metrics.run import read_manifest

    # `dlrm-lab train --preset tiny --sharding table_wise --steps 40 --batch-size 16` on both ranks (`runs`)
    (run_dir,) = list((runs[1] / "table-update").iterdir())
    config = read_manifest(run_dir)["config"]
    update = config["table_update_choice"]
    apart, trial = update["apart"], update["trial"]
    assert set(apart["backward_ms"]) == {"batched", "fbgemm"} and apart["conditions"]["ranks"] == 2
    assert apart["conditions"]["timed"].startswith("apart")
    assert update["table_update"] == trial["table_update"] in ("batched", "fbgemm") and len(trial["ranks_ms"]) == 2
    assert trial["steps"] == [2, 17] and trial["conditions"]["ranks"] == 2 and "at once" in update["reason"]
    assert config["train"]["table_update"] == update["table_update"]
    summary = pq.read_table(run_dir / "summary.parquet").to_pylist()[0]
    assert summary["table_update"] == update["table_update"]

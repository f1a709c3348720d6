"""Sweeps: grid files checked up front, points x repeats as runs, statistics, resume after a kill."""

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import pyarrow.parquet as pq
import pytest
from conftest import ROOT, run_cli_in_process

from dlrm_lab.errors import UserError
from dlrm_lab.metrics.run import Run
from dlrm_lab.sweep.grid import load_spec, point_args
from dlrm_lab.sweep.results import PointResult, SweepResult
from dlrm_lab.sweep.tables import aggregate
from dlrm_lab.train.records import SUMMARY_SCHEMA


def grid_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "grid.toml"
    path.write_text(text)
    return path


def test_grid_and_zip_make_the_points(tmp_path):
    spec = load_spec(
        grid_file(
            tmp_path,
            """
command = "train"
repeats = 2
[options]
preset = "tiny"
progress = false
shard = ["t_cat_0=table_wise", "t_cat_1=column_wise"]
[grid]
batch-size = [32, 64]
precision = ["fp32", "bf16"]
[zip]
embedding-optimizer = ["sgd", "rowwise_adagrad"]
embedding-lr = [0.1, 0.05]
""",
        )
    )
    assert len(spec.points) == 2 * 2 * 2 and spec.repeats == 2
    assert spec.points[0] == {"batch-size": 32, "precision": "fp32", "embedding-optimizer": "sgd", "embedding-lr": 0.1}
    assert spec.points[1]["embedding-optimizer"] == "rowwise_adagrad" and spec.points[1]["embedding-lr"] == 0.05
    args = point_args(spec, spec.points[0])
    assert args[:3] == ["train", "--preset", "tiny"] and "--no-progress" in args
    assert args.count("--shard") == 2  # a list in [options] repeats the option
    assert load_spec(spec.path, repeats=5).repeats == 5


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('command = "serve-me"', "command = 'serve-me'"),
        ('command = "train"\n[grid]\nbatch-size = 32', "must be a non-empty list"),
        ('command = "train"\n[zip]\nsteps = [1, 2]\nseed = [1]', "equal lengths"),
        ('command = "train"\n[options]\nmetrics-dir = "x"', "set by the sweep itself"),
        ('command = "train"\n[grid]\nbogus-option = [1]', "unknown option --bogus-option"),
        ('command = "train"\n[grid]\nsteps = ["many"]', "--steps 'many': must be a whole number"),
        ('command = "train"\n[grid]\nbatch-size = [0]', "--batch-size 0"),
        ('command = "infer run"\n[grid]\nqps = [-1]', "every rate must be > 0"),
        ('command = "infer run"\n[options]\nmax-batch = 1.5', "--max-batch 1.5: must be a whole number"),
        ('command = "infer run"\n[grid]\nsteps = [1]', "unknown option --steps"),
        ('command = "train"\nrepeats = 0', "repeats = 0"),
        ('command = "train"\nout = 3', "out = 3: must be a directory's path"),
        ('command = "train"\nout = ""', "out = '': must be a directory's path"),
        ('command = "train"\nmetrics = "auc"', "metrics = 'auc': must be a list"),
        ('command = "train"\nbogus = 1', "unknown field(s) bogus"),
        ("command = [", "invalid TOML"),
    ],
)
def test_bad_grid_files_fail_before_anything_runs(tmp_path, text, message):
    with pytest.raises(UserError, match="grid.toml") as err:
        load_spec(grid_file(tmp_path, text))
    assert message in str(err.value)


def test_repeats_are_summarised_with_median_interval_and_stability(tmp_path):
    spec = load_spec(grid_file(tmp_path, 'command = "train"\nrepeats = 5\n[grid]\nbatch-size = [32, 64]'))
    result = SweepResult(tmp_path)
    rates = {0: [100.0, 101.0, 99.0, 100.5, 99.5], 1: [200.0, 150.0, 260.0, 180.0, 230.0]}  # point 1 is noisy
    for point, values in rates.items():
        for repeat, rate in enumerate(values):
            with Run.create(tmp_path / f"p{point}r{repeat}", kind="train", config={}) as run:
                run.write_summary([{"samples_per_s": rate, "eval_auc": 0.7}], SUMMARY_SCHEMA)
            result.points.append(PointResult(point, repeat, spec.points[point], "ok", run.dir))
    result.points.append(PointResult(1, 5, spec.points[1], "failed", None))  # not counted
    rows = {r["point"]: r for r in aggregate(result, spec)}
    steady, noisy = rows[0], rows[1]
    assert steady["samples_per_s_median"] == 100.0 and steady["samples_per_s_n"] == 5
    assert steady["samples_per_s_ci_low"] <= 100.0 <= steady["samples_per_s_ci_high"]
    assert steady["samples_per_s_unstable"] is False and steady["samples_per_s_cv"] < 0.01
    assert noisy["samples_per_s_median"] == 200.0 and noisy["samples_per_s_unstable"] is True
    assert noisy["repeats_ok"] == 5 and noisy["repeats"] == 6
    assert json.loads(noisy["params_json"]) == {"batch-size": 64} and noisy["param_batch-size"] == "64"


def _statuses(sweep_dir: Path) -> dict[str, str]:
    out = {}
    for manifest in sweep_dir.glob("points/*/*/manifest.json"):
        out[manifest.parent.parent.name] = json.loads(manifest.read_text())["status"]
    return out


@pytest.mark.multiprocess
def test_a_killed_sweep_resumes_without_duplicate_or_lost_rows(tmp_path):
    grid = grid_file(
        tmp_path,
        f"""
command = "train"
out = "{tmp_path / "sweep"}"
[options]
preset = "tiny"
steps = 6
batch-size = 32
eval-batches = 1
# the choices a run would measure at start-up, given: a point here is its steps
precision = "fp32"
table-pages = "base"
table-update = "fbgemm"
prefetch = 0
[grid]
seed = [1, 2]
""",
    )
    sweep_dir = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "dlrm_lab", "sweep", str(grid), "--no-progress"]
    first = subprocess.Popen(cmd, cwd=ROOT, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (
        _statuses(sweep_dir).get("p0000-r0") == "ok" and (sweep_dir / "points" / "p0001-r0").exists()
    ):
        time.sleep(0.05)
    os.killpg(first.pid, signal.SIGKILL)  # the sweep and the point it is running, mid-way
    first.wait()
    assert _statuses(sweep_dir).get("p0000-r0") == "ok", first.stderr.read().decode()[-2000:]
    done_before = next((sweep_dir / "points" / "p0000-r0").glob("*/manifest.json")).parent.name

    code, stdout, stderr = run_cli_in_process("sweep", str(grid), "--no-progress")  # its point: a process
    assert code == 0, stderr[-2000:]
    assert "1 from an earlier invocation" in stdout
    points = pq.read_table(sweep_dir / "points.parquet").to_pylist()
    assert [(p["point"], p["repeat"], p["status"]) for p in points] == [(0, 0, "ok"), (1, 0, "ok")]
    assert points[0]["child_run_id"] == done_before  # skipped, not run again
    assert points[0]["attempts"] == 1  # as the first invocation recorded it
    assert points[1]["attempts"] == 2 and (sweep_dir / "_incomplete" / "p0001-r0-0").exists()
    steps = duckdb.sql(f"select run_id, step from '{sweep_dir}/points/*/*/steps.parquet'").fetchall()
    assert len(steps) == len(set(steps)) == 2 * 6  # every step of every point once
    summary = pq.read_table(sweep_dir / "summary.parquet").to_pylist()
    assert [r["point"] for r in summary] == [0, 1] and all(r["samples_per_s_median"] > 0 for r in summary)
    manifest = json.loads((sweep_dir / "manifest.json").read_text())
    assert manifest["kind"] == "sweep" and manifest["status"] == "ok" and manifest["resumed"] == 1
    assert run_cli_in_process("sweep", str(grid), "--no-progress")[0] == 0  # all done: nothing runs again
    assert len(pq.read_table(sweep_dir / "points.parquet")) == 2


@pytest.mark.parametrize(("command", "setup"), [("train", "train_setup"), ("infer run", "infer_setup")])
def test_sweep_checks_accept_exactly_the_cli_options(command, setup):
    """The library's option set (what a sweep point may name) is the command's, no more, no less."""
    import typer

    from dlrm_lab import commands
    from dlrm_lab.cli import app

    cmd = typer.main.get_command(app)
    for word in command.split():
        cmd = cmd.commands[word]
    cli = {p.name.rstrip("_") for p in cmd.params} - commands.CLI_ONLY
    for name in cli:  # every CLI option is accepted (its default value builds)
        default = next(p.default for p in cmd.params if p.name.rstrip("_") == name)
        getattr(commands, setup)({name: default})
    with pytest.raises(UserError, match="unknown option --not-an-option"):
        getattr(commands, setup)({"not-an-option": 1})


def test_the_ibench_sweep_in_docs_is_valid_and_holds_the_samples_per_second():
    """docs/ibench.toml: clients x query size at one total samples/s, every point's command line parsed by the CLI."""
    from conftest import ROOT

    spec = load_spec(ROOT / "docs" / "ibench.toml")
    assert len(spec.points) == 9 and spec.repeats == 3
    assert {p["concurrency"] for p in spec.points} == {1, 4, 16}
    assert {int(p["query-size"].split(":")[1]) * p["qps"] for p in spec.points} == {6400}
    args = point_args(spec, spec.points[-1])
    assert args[:2] == ["infer", "run"] and "--target" in args and "--price-per-hour" in args
    assert {"cost_per_1m_queries", "energy_per_query_j"} <= set(spec.metrics)


def test_repeats_run_interleaved_so_compared_points_share_the_hosts_drift(tmp_path, monkeypatch):
    import dlrm_lab.sweep.run as sweep

    spec = load_spec(grid_file(tmp_path, 'command = "train"\nrepeats = 3\n[grid]\nbatch-size = [32, 64]'))
    spec = dataclasses.replace(spec, out=tmp_path / "sweep")
    ran: list[tuple[int, int]] = []

    def fake_point(spec_, params, slot):  # a point-repeat that "ran" and left an ok run behind
        point, repeat = int(slot.name[1:5]), int(slot.name.split("-r")[1])
        ran.append((point, repeat))
        with Run.create(slot / "train-x", kind="train", config={}) as run:
            run.write_summary([{"samples_per_s": 100.0, "eval_auc": 0.7}], SUMMARY_SCHEMA)
        return "ok", 0.0

    monkeypatch.setattr(sweep, "_run_point", fake_point)
    monkeypatch.setattr(sweep, "_done_run", lambda slot: next(iter(sorted(slot.glob("train-*"))), None))
    result = sweep.run_sweep(spec, metrics_dir=tmp_path)
    assert ran == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2)]
    assert [(p.point, p.repeat) for p in result.points] == sorted(ran)  # the tables keep point order

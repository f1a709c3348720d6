"""Run directories: manifest, crash-safe Parquet tables, reading across runs."""

import json
import os
import signal
import subprocess
import sys
import textwrap

import duckdb
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from dlrm_lab.errors import UserError
from dlrm_lab.metrics import Run, find_runs, read_manifest, recover_run

SCHEMA = pa.schema([("step", pa.int64()), ("loss", pa.float64())])
SUMMARY = pa.schema([("samples_per_s", pa.float64())])


def make_run(root, n_steps, sps):
    with Run.create(root, kind="train", config={"steps": n_steps}, argv=["dlrm-lab", "train"]) as run:
        table = run.table("steps", SCHEMA, flush_rows=3)
        for i in range(n_steps):
            table.append({"step": i, "loss": 1.0 / (i + 1)})
        run.write_summary([{"samples_per_s": sps}], SUMMARY)
    return run


def test_manifest_pins_config_versions_hardware_and_status(tmp_path):
    run = make_run(tmp_path, 5, 100.0)
    m = read_manifest(run.dir)
    assert m["status"] == "ok" and m["kind"] == "train" and m["run_id"] == run.dir.name
    assert m["config"] == {"steps": 5}
    assert m["command_line"] == ["dlrm-lab", "train"]
    assert m["packages"]["torch"].startswith("2.13") and m["packages"]["pyarrow"]
    hw = m["hardware"]
    assert hw["logical_cores"] >= 1 and hw["memory_bytes"] > 0 and hw["cpu_model"]
    assert len(hw["fingerprint_id"]) == 16
    assert "available" in hw["gpus"]
    assert m["start_time"] <= m["end_time"] and m["duration_s"] >= 0
    assert "commit" in m["git"]


def test_tables_read_across_runs_with_pyarrow_and_duckdb(tmp_path):
    a = make_run(tmp_path, 7, 100.0)
    b = make_run(tmp_path, 4, 300.0)
    assert not (a.dir / "_parts").exists()  # parts merged on close
    steps = ds.dataset([str(r / "steps.parquet") for r in (a.dir, b.dir)], format="parquet").to_table()
    assert steps.num_rows == 11 and set(steps.column("run_id").to_pylist()) == {a.run_id, b.run_id}
    rows = duckdb.sql(
        f"select run_id, samples_per_s from '{tmp_path}/*/summary.parquet' order by samples_per_s"
    ).fetchall()
    assert rows == [(a.run_id, 100.0), (b.run_id, 300.0)]
    per_run = duckdb.sql(f"select run_id, count(*) from '{tmp_path}/*/steps.parquet' group by 1 order by 2").fetchall()
    assert per_run == [(b.run_id, 4), (a.run_id, 7)]
    assert [p.name for p in find_runs(tmp_path)] == [a.dir.name, b.dir.name]


def test_exceptions_mark_the_run_and_keep_its_rows(tmp_path):
    with pytest.raises(KeyboardInterrupt):
        with Run.create(tmp_path, kind="train", config={}) as run:
            run.table("steps", SCHEMA).append({"step": 0, "loss": 0.5})
            raise KeyboardInterrupt
    assert read_manifest(run.dir)["status"] == "interrupted"
    assert pq.read_table(run.dir / "steps.parquet").num_rows == 1
    with pytest.raises(RuntimeError):
        with Run.create(tmp_path, kind="train", config={}) as run2:
            raise RuntimeError("boom")
    m = read_manifest(run2.dir)
    assert m["status"] == "failed" and m["error"] == "RuntimeError: boom"


def test_unknown_columns_are_refused_not_dropped(tmp_path):
    with Run.create(tmp_path, kind="train", config={}) as run:
        with pytest.raises(KeyError, match="latency"):
            run.table("steps", SCHEMA).append({"step": 0, "latency": 3.0})


def test_flushed_rows_survive_a_killed_process(tmp_path):
    script = textwrap.dedent(
        f"""
        import os, pyarrow as pa
        from dlrm_lab.metrics import Run
        run = Run.create({str(tmp_path)!r}, kind="train", config={{}})
        t = run.table("steps", pa.schema([("step", pa.int64())]), flush_rows=10)
        for i in range(25):
            t.append({{"step": i}})
        print(run.dir, flush=True)
        os.kill(os.getpid(), 9)
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL
    run_dir = proc.stdout.strip()
    assert read_manifest(run_dir)["status"] == "running"
    manifest = recover_run(run_dir)
    assert manifest["status"] == "failed" and "crash" in manifest["error"]
    steps = pq.read_table(os.path.join(run_dir, "steps.parquet")).column("step").to_pylist()
    assert steps == list(range(20))  # two full flushes; the 5 buffered rows died with the process
    assert json.loads(open(os.path.join(run_dir, "manifest.json")).read())["status"] == "failed"


def test_existing_run_directory_and_missing_metrics_dir(tmp_path):
    Run.create(tmp_path, kind="train", config={}, run_id="same")
    with pytest.raises(UserError, match="already exists"):
        Run.create(tmp_path, kind="train", config={}, run_id="same")
    with pytest.raises(UserError, match="no such directory"):
        find_runs(tmp_path / "nope")

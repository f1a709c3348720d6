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
from conftest import run_cli_in_process

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


def _snapshot(root):
    """Every path under `root` with, for files, its mtime and bytes: equal before and after
    means nothing was created, removed or rewritten."""
    return {
        str(p.relative_to(root)): (p.stat().st_mtime_ns, p.read_bytes()) if p.is_file() else "dir"
        for p in sorted(root.rglob("*"))
    }


def _dead_pid():
    proc = subprocess.Popen(["true"])
    proc.wait()  # reaped: the pid is gone
    return proc.pid


def _line_of(output, run_id):
    return next(line for line in output.splitlines() if line.startswith(f"│ {run_id} "))


def test_runs_list_only_reads_and_runs_recover_merges_a_dead_run(tmp_path):
    done = make_run(tmp_path, 4, 100.0)
    dead = Run.create(tmp_path, kind="train", config={})
    steps = dead.table("steps", SCHEMA, flush_rows=3)
    for i in range(7):  # two parts of 3 rows flushed; the 7th row dies with the "process"
        steps.append({"step": i, "loss": 0.5})
    dead.update_manifest(pid=_dead_pid())
    live = Run.create(tmp_path, kind="train", config={})  # pid: this process, alive
    before = _snapshot(tmp_path)
    assert sorted(before) == sorted(
        [done.dir.name, f"{done.dir.name}/manifest.json", f"{done.dir.name}/steps.parquet"]
        + [f"{done.dir.name}/summary.parquet", dead.dir.name, f"{dead.dir.name}/manifest.json"]
        + [f"{dead.dir.name}/_parts", f"{dead.dir.name}/_parts/steps"]
        + [f"{dead.dir.name}/_parts/steps/part-r00000-00000{k}.parquet" for k in (0, 1)]
        + [live.dir.name, f"{live.dir.name}/manifest.json"]
        + [f"{r.dir.name}/.space-reserve" for r in (dead, live)]  # room for their last manifest
        + [f"{r.dir.name}/fault.log" for r in (dead, live)]  # where a fatal signal's report would go
    )

    code, out, err = run_cli_in_process("runs", "list", str(tmp_path))
    assert code == 0, err
    assert _snapshot(tmp_path) == before  # listing wrote, moved or removed nothing
    assert "│ ok " in _line_of(out, done.run_id)
    row = _line_of(out, dead.run_id)
    assert "│ running (dead) " in row and "│     6 │" in row  # steps counted from the unmerged parts
    assert "│ running " in _line_of(out, live.run_id) and "dead" not in _line_of(out, live.run_id)
    (note,) = [line for line in out.splitlines() if line.startswith(f"{dead.run_id}: ")]
    pid = read_manifest(dead.dir)["pid"]
    assert f"pid {pid} is gone" in note
    assert f"'dlrm-lab runs recover {dead.dir}' would merge 2 part files (steps) and mark it failed" in note
    assert not any(line.startswith(f"{live.run_id}: ") for line in out.splitlines())

    code, out, err = run_cli_in_process("runs", "recover", str(tmp_path))
    assert code == 0, err
    recovered = [line for line in out.splitlines() if line.startswith("recovered ")]
    assert recovered == [
        f"recovered {dead.run_id}: marked failed (pid {pid} gone); merged 2 part files into steps.parquet"
    ]
    assert f"left alone {live.run_id}: pid {os.getpid()} is alive" in out
    m = read_manifest(dead.dir)
    assert m["status"] == "failed" and "crash" in m["error"]
    assert pq.read_table(dead.dir / "steps.parquet").column("step").to_pylist() == list(range(6))
    assert not (dead.dir / "_parts").exists() and not (dead.dir / ".space-reserve").exists()
    assert read_manifest(live.dir)["status"] == "running"  # a live run is not touched
    assert read_manifest(done.dir) == json.loads((done.dir / "manifest.json").read_text())
    code, out, _ = run_cli_in_process("runs", "list", str(tmp_path))
    assert code == 0 and "│ failed " in _line_of(out, dead.run_id) and "│     6 │" in _line_of(out, dead.run_id)
    code, out, _ = run_cli_in_process("runs", "recover", str(dead.dir))  # a second time: nothing left to do
    assert code == 0 and "nothing to recover" in out and "recovered" not in out


def test_runs_list_marks_a_corrupt_run_unreadable_and_lists_the_others(tmp_path):
    good = make_run(tmp_path, 3, 250.0)
    bad_manifest = make_run(tmp_path, 3, 100.0)
    text = (bad_manifest.dir / "manifest.json").read_text()
    (bad_manifest.dir / "manifest.json").write_text(text[: len(text) // 2])  # truncated
    bad_summary = make_run(tmp_path, 3, 100.0)
    data = (bad_summary.dir / "summary.parquet").read_bytes()
    (bad_summary.dir / "summary.parquet").write_bytes(data[: len(data) // 2])  # truncated

    code, out, err = run_cli_in_process("runs", "list", str(tmp_path))
    assert code == 0, err
    assert "Traceback" not in out + err
    good_row = _line_of(out, good.run_id)
    assert "│ ok " in good_row and "│       250 │" in good_row and "│     3 │" in good_row
    assert "│ unreadable " in _line_of(out, bad_manifest.run_id)
    assert "│ unreadable " in _line_of(out, bad_summary.run_id)
    notes = {line.split(": ", 1)[0]: line for line in out.splitlines() if line.startswith("train-")}
    assert set(notes) == {bad_manifest.run_id, bad_summary.run_id}
    assert notes[bad_manifest.run_id].startswith(f"{bad_manifest.run_id}: unreadable: manifest.json: JSONDecodeError")
    assert notes[bad_summary.run_id].startswith(f"{bad_summary.run_id}: unreadable: summary.parquet: ")
    assert "(manifest status ok)" in notes[bad_summary.run_id]
    # recover cannot read the truncated manifest either: it says so and goes on
    code, out, err = run_cli_in_process("runs", "recover", str(tmp_path))
    assert code == 0 and "Traceback" not in out + err
    assert f"skipped {bad_manifest.dir}: unreadable: manifest.json: JSONDecodeError" in out


def test_a_full_disk_ends_training_in_one_line_and_keeps_the_rows_written(tmp_path, monkeypatch):
    import errno

    import pyarrow.parquet as pq
    from conftest import run_cli_in_process

    from dlrm_lab.metrics import tables

    real_init, real_write = tables.TableWriter.__init__, pq.write_table
    monkeypatch.setattr(
        tables.TableWriter, "__init__", lambda self, *a, **k: real_init(self, *a, **{**k, "flush_rows": 4})
    )
    written = []

    def filling_disk(table, where, *args, **kwargs):  # the 4th part file of steps finds the disk full
        if "_parts/steps" in str(where) and len(written) == 3:
            with open(where, "wb") as f:
                f.write(b"PAR1 half a file")  # what a writer leaves when the disk fills up
            raise OSError(errno.ENOSPC, "No space left on device")
        if "_parts/steps" in str(where):
            written.append(where)
        return real_write(table, where, *args, **kwargs)

    monkeypatch.setattr(pq, "write_table", filling_disk)
    code, _, stderr = run_cli_in_process(
        "train", "--preset", "tiny", "--steps", "40", "--batch-size", "16", "--precision", "fp32",
        "--no-progress", "--metrics-dir", str(tmp_path),
    )  # fmt: skip
    monkeypatch.setattr(pq, "write_table", real_write)
    lines = stderr.strip().splitlines()
    assert code == 1 and lines[-1].startswith("error: ") and "Traceback" not in stderr, stderr
    assert "No space left on device" in lines[-1] and "bytes free" in lines[-1] and "_parts/steps" in lines[-1]
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["status"] == "failed" and manifest["error"].startswith("DiskFull: ")
    parts = sorted((run_dir / "_parts" / "steps").glob("*.parquet"))
    assert [pq.read_table(p).num_rows for p in parts] == [4, 4, 4]  # every part written is readable
    assert not list((run_dir / "_parts" / "steps").glob(".*tmp*"))  # the partial file was removed
    assert not (run_dir / ".space-reserve").exists()  # given up for the last manifest
    code, out, err = run_cli_in_process("runs", "list", str(tmp_path))
    assert code == 0 and "failed" in out and "Traceback" not in out + err


def test_recovering_a_killed_training_run_rebuilds_its_summary_from_the_steps(tmp_path):
    from conftest import run_cli_in_process

    import dlrm_lab
    from dlrm_lab.config import TrainConfig
    from dlrm_lab.train import preflight, train

    result = train(preflight(dlrm_lab.load_preset("tiny"), TrainConfig(steps=12, batch_size=32)), metrics_dir=tmp_path)
    want = result.summary
    run_dir = result.run_dir
    (run_dir / "summary.parquet").unlink()  # as a SIGKILL before the end leaves it: steps, no summary
    manifest = json.loads((run_dir / "manifest.json").read_text())
    manifest.update(status="running", pid=_dead_pid())
    (run_dir / "manifest.json").write_text(json.dumps(manifest))

    code, out, err = run_cli_in_process("runs", "recover", str(tmp_path))
    assert code == 0, err
    assert "summary.parquet rebuilt from its steps" in out
    (got,) = pq.read_table(run_dir / "summary.parquet").to_pylist()
    assert got["status"] == "failed" and got["steps"] == 12 and got["preset"] == "tiny"
    assert got["samples_per_s"] == pytest.approx(want["samples_per_s"])  # the same steps, the same rule
    assert got["warmup_steps"] == want["warmup_steps"] and got["eval_auc"] is None  # never measured: null
    code, out, _ = run_cli_in_process("runs", "list", str(tmp_path))
    assert code == 0 and f"{got['samples_per_s']:,.0f}" in out


def test_a_kind_registers_its_own_recovery_and_the_run_layer_imports_no_kind(tmp_path, monkeypatch):
    import dlrm_lab.train.records as records  # the training kind registers itself where it is defined
    from dlrm_lab.metrics import run as runs

    assert runs._RECOVERIES["train"] is records.recovered_summary
    monkeypatch.setattr(runs, "_RECOVERIES", {})
    seen = []
    runs.register_recovery("probed", lambda run_dir, manifest: seen.append((run_dir, manifest["kind"])) or "written")
    dead = {}
    for kind in ("probed", "other"):
        created = Run.create(tmp_path, kind=kind, config={})
        created.update_manifest(pid=_dead_pid())
        dead[kind] = created.dir
    manifest, rebuilt = runs.recover_run_and_summary(dead["probed"])
    assert manifest["status"] == "failed" and rebuilt and seen == [(dead["probed"], "probed")]
    manifest, rebuilt = runs.recover_run_and_summary(dead["other"])  # no kind registered: merged and marked only
    assert manifest["status"] == "failed" and not rebuilt and len(seen) == 1
    # the sweep's CLI registers training's as a function that imports training only when a dead point is met
    from dlrm_lab.cli import sweep as sweep_cli

    with monkeypatch.context() as blocked:
        blocked.setitem(sys.modules, "dlrm_lab.train.records", None)  # importing it now fails
        runs.register_recovery("train", sweep_cli._recovered_training_summary, fallback=True)  # not importing it
        with pytest.raises(ImportError):  # called, it imports training
            runs._RECOVERIES["train"](tmp_path, {"kind": "train"})

    monkeypatch.undo()
    runs.register_recovery("train", sweep_cli._recovered_training_summary, fallback=True)
    assert runs._RECOVERIES["train"] is records.recovered_summary  # a fallback never replaces the kind's own
    # the run directories and the launcher below them load no run kind (train, infer): only the transports' registry
    # (infer.targets, torch- and gRPC-free), which the package root fills
    code = (
        "import sys, dlrm_lab.metrics.run, dlrm_lab.distributed.elastic; "
        "print([m for m in sys.modules if m.startswith(('dlrm_lab.train', 'dlrm_lab.infer'))"
        " and m not in ('dlrm_lab.infer', 'dlrm_lab.infer.targets')])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_flush_interval_is_five_seconds_or_the_environments(tmp_path, monkeypatch):
    from dlrm_lab.errors import UserError
    from dlrm_lab.metrics.tables import TableWriter, flush_interval_s

    schema = pa.schema([("x", pa.int64())])
    assert TableWriter(tmp_path, "a", schema, "r").flush_seconds == 5.0
    monkeypatch.setenv("DLRM_LAB_FLUSH_SECONDS", "0.5")
    assert TableWriter(tmp_path, "b", schema, "r").flush_seconds == 0.5
    assert TableWriter(tmp_path, "c", schema, "r", flush_seconds=2.0).flush_seconds == 2.0  # a table's own choice
    for bad in ("0", "-1", "soon"):
        monkeypatch.setenv("DLRM_LAB_FLUSH_SECONDS", bad)
        with pytest.raises(UserError, match=f"DLRM_LAB_FLUSH_SECONDS='{bad}': must be a number of seconds > 0"):
            flush_interval_s()

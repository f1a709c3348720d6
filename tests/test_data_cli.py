"""`dlrm-lab data gen/stats` and training on a generated dataset, as a user runs them."""

import json

from conftest import run_cli_in_process


def test_generated_dataset_passes_its_own_checks_and_trains(tmp_path):
    """In-process, through the CLI's entry point (a real `dlrm-lab` process: tests/test_cli.py's ctrl-c test)."""
    ds = tmp_path / "ds"
    code, stdout, stderr = run_cli_in_process("data", "gen", "--preset", "kaggle", "--max-rows", "50000", "--rows",
                                              "120000", "--shards", "2", "--seed", "4", "--out", str(ds))  # fmt: skip
    assert code == 0, stderr
    assert "teacher AUC" in stderr and "wrote 120,000 samples" in stdout
    code, stdout, stderr = run_cli_in_process("data", "stats", str(ds), "--strict")
    assert code == 0, stdout + stderr
    assert "120,000 samples" in stdout and "77 of 77 checks against the spec within tolerance" in stdout

    # a dataset whose stored spec disagrees with its content is flagged
    info = json.loads((ds / "_dataset.json").read_text())
    for f in info["data_spec"]["features"]:
        f["ids"]["alpha"] = 1.5
    (ds / "_dataset.json").write_text(json.dumps(info))
    code, stdout, _ = run_cli_in_process("data", "stats", str(ds), "--strict")
    assert code == 1
    assert "outside tolerance" in stdout and "zipf alpha" in stdout

    runs = tmp_path / "runs"
    code, _, stderr = run_cli_in_process("train", "--preset", "kaggle", "--max-rows", "50000", "--data", str(ds),
                                         "--steps", "5", "--batch-size", "256", "--metrics-dir", str(runs),
                                         "--no-progress")  # fmt: skip
    assert code == 0, stderr
    (run_dir,) = list(runs.iterdir())
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["config"]["data"]["source"] == "parquet"
    assert manifest["config"]["eval_data"]["source"] == "synthetic"  # held out from the stored spec


def test_data_mistakes_exit_2_with_one_line(tmp_path):
    cases = [
        (["data", "gen", "--out", str(tmp_path / "a"), "--set", "features.cat_0.ids.alpha=0"], "ids.alpha = 0"),
        (["data", "gen", "--out", str(tmp_path / "b"), "--format", "csv"], "--format 'csv'"),
        (["data", "gen", "--out", str(tmp_path / "c"), "--spec", "nope"], "unknown data spec 'nope'"),
        (["data", "stats", str(tmp_path / "missing")], "no such dataset directory or file"),
        (["train", "--data", str(tmp_path / "missing")], "no such dataset directory or file"),
    ]
    for args, message in cases:
        code, _, stderr = run_cli_in_process(*args)
        lines = [line for line in stderr.splitlines() if line.strip()]
        assert code == 2 and len(lines) == 1 and message in lines[0], (args, stderr)


# -- data stats on broken datasets: training's checks, every problem named, exit 1 ----------
ROW_GROUP = 100  # 600 rows in 2 shards of 3 row groups: the row group at fault is not always 0


def _tiny_dataset(out):
    import dlrm_lab
    from dlrm_lab.data import synthetic_generator
    from dlrm_lab.data.parquet import write_dataset

    write_dataset(
        synthetic_generator(dlrm_lab.load_preset("tiny"), seed=5), 600, out, shards=2, row_group_samples=ROW_GROUP
    )
    return out


def _rewrite(path, table):
    """Rewrite one shard with pyarrow, keeping its row groups."""
    import pyarrow.parquet as pq

    pq.write_table(table, path, row_group_size=ROW_GROUP)


def _stats_fails(ds, *more):
    """`data stats DS` (with and without --strict): exit 1, one `error:` line per problem, no traceback."""
    for extra in ([], ["--strict"]):
        code, stdout, stderr = run_cli_in_process("data", "stats", str(ds), *extra, *more)
        assert code == 1, (extra, stdout, stderr)
        assert "Traceback" not in stdout + stderr
        assert "within tolerance" not in stdout  # nothing measured on a broken dataset
        errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
        assert errors and "structural problem(s)" in stderr.splitlines()[-1], stderr
    return errors


def test_stats_passes_a_generated_dataset(tmp_path):
    """Sound: exit 0 and measured (600 samples are too few for every tolerance: no --strict here)."""
    ds = _tiny_dataset(tmp_path / "ds")
    code, stdout, stderr = run_cli_in_process("data", "stats", str(ds))
    assert code == 0, stdout + stderr
    assert "600 samples" in stdout and "checks against the spec within tolerance" in stdout
    assert "error" not in stderr and "structural" not in stderr


def test_stats_refuses_a_dataset_missing_a_feature_column(tmp_path):
    import pyarrow.parquet as pq

    ds = _tiny_dataset(tmp_path / "ds")
    bad = ds / "part-00001.parquet"
    _rewrite(bad, pq.read_table(bad).drop(["cat_2"]))
    (line,) = _stats_fails(ds)
    assert str(bad) in line and "missing column(s) cat_2" in line and "model tiny" in line


def test_stats_refuses_an_id_beyond_its_table_naming_file_row_group_id_and_range(tmp_path):
    """id = the table's rows in row group 1 of the first shard: the very line training stops with."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import pytest

    import dlrm_lab
    from dlrm_lab.data import ParquetSource
    from dlrm_lab.errors import UserError

    tiny = dlrm_lab.load_preset("tiny")
    (table,) = [t for t in tiny.tables if "cat_1" in t.feature_names]
    ds = _tiny_dataset(tmp_path / "ds")
    bad = ds / "part-00000.parquet"
    data = pq.read_table(bad)
    col = data.column("cat_1").combine_chunks()
    ids = col.values.to_numpy().copy()
    ids[col.offsets.to_numpy()[ROW_GROUP + 10]] = table.num_embeddings  # a row of row group 1
    at = data.schema.get_field_index("cat_1")
    _rewrite(bad, data.set_column(at, data.schema.field("cat_1"), pa.ListArray.from_arrays(col.offsets, ids)))

    (line,) = _stats_fails(ds)
    assert str(bad) in line and "row group 1" in line and "column cat_1" in line
    assert f"id {table.num_embeddings} " in line and f"rows [0, {table.num_embeddings})" in line
    with pytest.raises(UserError) as exc:  # training refuses it with the same words
        list(ParquetSource(ds, tiny, 64, epochs=1))
    assert line == f"error: {exc.value}"


def test_stats_names_every_problem_and_rows_against_the_sidecar(tmp_path):
    """Several broken columns, row groups and files: each one line; rows checked against _dataset.json."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    ds = _tiny_dataset(tmp_path / "ds")
    first, second = ds / "part-00000.parquet", ds / "part-00001.parquet"
    data = pq.read_table(first)
    col = data.column("cat_3").combine_chunks()
    ids = col.values.to_numpy().copy()
    ids[0], ids[-1] = -1, 10**6  # row group 0 and row group 2
    at = data.schema.get_field_index("cat_3")
    _rewrite(first, data.set_column(at, data.schema.field("cat_3"), pa.ListArray.from_arrays(col.offsets, ids)))
    _rewrite(second, pq.read_table(second).slice(0, 250))  # the sidecar says 300

    errors = _stats_fails(ds)
    assert len(errors) == 3, errors
    assert any(str(first) in e and "row group 0" in e and "column cat_3: id -1 " in e for e in errors)
    assert any(str(first) in e and "row group 2" in e and f"id {10**6} " in e and "[0, 30)" in e for e in errors)
    assert any(str(second) in e and "250 rows" in e and "_dataset.json says 300" in e for e in errors)

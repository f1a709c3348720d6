"""`dlrm-lab data gen/stats` and training on a generated dataset, as a user runs them."""

import json

from conftest import run_cli, run_cli_in_process


def test_generated_dataset_passes_its_own_checks_and_trains(tmp_path):
    ds = tmp_path / "ds"
    out = run_cli(
        "data",
        "gen",
        "--preset",
        "kaggle",
        "--max-rows",
        "50000",
        "--rows",
        "120000",
        "--shards",
        "2",
        "--seed",
        "4",
        "--out",
        str(ds),
    )
    assert out.returncode == 0, out.stderr
    assert "teacher AUC" in out.stderr and "wrote 120,000 samples" in out.stdout
    code, stdout, stderr = run_cli_in_process("data", "stats", str(ds), "--strict")  # the process: gen, train
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
    trained = run_cli(
        "train",
        "--preset",
        "kaggle",
        "--max-rows",
        "50000",
        "--data",
        str(ds),
        "--steps",
        "5",
        "--batch-size",
        "256",
        "--metrics-dir",
        str(runs),
        "--no-progress",
    )
    assert trained.returncode == 0, trained.stderr
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

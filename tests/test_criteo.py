"""Criteo TSV logs: written from the generator, read and converted the way facebookresearch/dlrm does.

A pipeline built for the real Criteo files must be able to consume what `data gen
--format criteo-tsv` writes, and `convert-criteo` must turn those files (or real ones)
back into exactly the samples they hold. Malformed lines are refused with one line that
names the file.
"""

import json
import re

import numpy as np
import pyarrow.parquet as pq
import pytest
from conftest import run_cli_in_process

import dlrm_lab
from dlrm_lab.data import ParquetSource, synthetic_generator
from dlrm_lab.data.criteo import convert_criteo, read_criteo_tsv, write_criteo_tsv
from dlrm_lab.data.synthetic import SampleBlock
from dlrm_lab.errors import UserError
from dlrm_lab.metrics import read_manifest

SEED = 3
HEX8 = re.compile(r"[0-9a-f]{8}")


@pytest.fixture(scope="module")
def kaggle():
    return dlrm_lab.load_preset("kaggle", max_rows=1000)


@pytest.fixture(scope="module")
def table_rows(kaggle):
    return [t.num_embeddings for t in kaggle.tables for _ in t.feature_names]


def one_line_error(excinfo) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg, f"error message spans several lines: {msg!r}"
    return msg


def assert_same_samples(got: SampleBlock, want: SampleBlock) -> None:
    assert got.dense.dtype == np.float32 and got.labels.dtype == np.float32
    np.testing.assert_array_equal(got.dense, want.dense)
    np.testing.assert_array_equal(got.labels, want.labels)
    assert len(got.values) == len(want.values) == 26
    for f, (g, w) in enumerate(zip(got.values, want.values, strict=True)):
        np.testing.assert_array_equal(g, w, err_msg=f"feature {f}")
        np.testing.assert_array_equal(got.lengths[f], np.ones(got.size, np.int32))


# -- (a) round trip ------------------------------------------------------------------------
def test_tsv_round_trip_reproduces_the_generator_samples(kaggle, tmp_path):
    gen = synthetic_generator(kaggle, seed=SEED)
    rows = 5000
    path = write_criteo_tsv(gen, rows, tmp_path / "day_0")
    assert path == tmp_path / "day_0" and sorted(p.name for p in tmp_path.iterdir()) == ["day_0"]  # no temp left
    ref = gen.samples(0, rows)

    # the file looks like Criteo: 40 tab-separated fields, label, 13 counts, 26 8-hex-digit ids
    lines = path.read_text().split("\n")
    assert lines[-1] == "" and len(lines) == rows + 1  # newline-terminated, one line per sample
    for i, line in enumerate(lines[:-1]):
        fields = line.split("\t")
        assert len(fields) == 40, f"line {i}"
        assert fields[0] in ("0", "1")
        assert all(x.isdigit() for x in fields[1:14]), f"line {i}: {fields[1:14]}"
        assert all(HEX8.fullmatch(x) for x in fields[14:]), f"line {i}: {fields[14:]}"
    first = lines[0].split("\t")
    assert [int(x) for x in first[1:14]] == ref.counts[0].tolist()
    assert [int(x, 16) for x in first[14:]] == [int(v[0]) for v in ref.values]

    blocks = list(read_criteo_tsv(path, kaggle))
    assert sum(b.size for b in blocks) == rows
    assert_same_samples(SampleBlock.concat(blocks), ref)


def test_reader_streams_a_file_larger_than_one_read_block(kaggle, tmp_path):
    """70k lines (~17 MiB) span two CSV read blocks; blocks are contiguous and nothing is lost."""
    gen = synthetic_generator(kaggle, seed=SEED)
    rows = 70_000
    path = write_criteo_tsv(gen, rows, tmp_path / "big.tsv")
    assert path.stat().st_size > 1 << 24
    blocks = list(read_criteo_tsv(path, kaggle, block_rows=25_000))
    assert all(b.size <= 25_000 for b in blocks)
    starts = [b.start for b in blocks]
    assert starts == list(np.cumsum([0] + [b.size for b in blocks[:-1]]))
    assert_same_samples(SampleBlock.concat(blocks), gen.samples(0, rows))


# -- (b) the documented conversion ------------------------------------------------------------
def test_missing_and_negative_fields_convert_as_documented(kaggle, table_rows, tmp_path):
    ints0 = ["", "-5", "3"] + [""] * 10  # missing, negative, 3, missing...
    cats0 = ["ffffffff", "", "0000000A"] + ["0000000a"] * 23  # max value, missing, upper-case hex
    ints1 = ["7"] * 13
    cats1 = ["000003e8"] * 26  # 1000: 0 for 1000-row tables, 1000 % rows for the smaller ones
    text = "\t".join(["1", *ints0, *cats0]) + "\n" + "\t".join(["0", *ints1, *cats1]) + "\n"
    path = tmp_path / "hand.tsv"
    path.write_text(text)

    got = SampleBlock.concat(list(read_criteo_tsv(path, kaggle)))
    assert got.size == 2
    np.testing.assert_array_equal(got.labels, np.array([1, 0], np.float32))
    want_dense = np.log1p(np.array([[0, 0, 3] + [0] * 10, [7] * 13], dtype=np.float64)).astype(np.float32)
    np.testing.assert_array_equal(got.dense, want_dense)
    want0 = [0xFFFFFFFF % table_rows[0], 0, 10 % table_rows[2]] + [10 % r for r in table_rows[3:]]
    want1 = [1000 % r for r in table_rows]
    assert [int(v[0]) for v in got.values] == want0
    assert [int(v[1]) for v in got.values] == want1
    assert want0[0] == 295 and want1[1] == 1000 % 583 == 417  # spelled out once

    # convert_criteo stores exactly these samples; ParquetSource reads them back
    manifest = convert_criteo([path], kaggle, tmp_path / "ds")
    assert manifest["rows"] == 2 and manifest["source"] == "criteo-tsv" and manifest["data_spec"] is None
    info = json.loads((tmp_path / "ds" / "_dataset.json").read_text())
    assert info["files"] == [{"path": "part-00000.parquet", "rows": 2, "input": str(path)}]
    assert info["model"]["tables"][0]["num_embeddings"] == 1000  # which tables the ids were hashed into
    (batch,) = list(ParquetSource(tmp_path / "ds", kaggle, 2, epochs=1))
    np.testing.assert_array_equal(batch.dense_features.numpy(), want_dense)
    np.testing.assert_array_equal(batch.labels.numpy(), [1, 0])
    kjt = batch.sparse_features.to_dict()
    assert [kjt[name].values().tolist() for name in kaggle.feature_names] == [
        [a, b] for a, b in zip(want0, want1, strict=True)
    ]


def test_converted_shards_follow_input_files(kaggle, tmp_path):
    gen = synthetic_generator(kaggle, seed=SEED)
    a = write_criteo_tsv(gen, 300, tmp_path / "day_0")
    b = write_criteo_tsv(gen, 200, tmp_path / "day_1", first_sample=300)
    manifest = convert_criteo([a, b], kaggle, tmp_path / "ds")
    assert manifest["rows"] == 500 and manifest["shards"] == 2
    assert [f["rows"] for f in manifest["files"]] == [300, 200]
    assert [pq.read_metadata(tmp_path / "ds" / f["path"]).num_rows for f in manifest["files"]] == [300, 200]
    (batch,) = list(ParquetSource(tmp_path / "ds", kaggle, 500, epochs=1))
    ref = gen.samples(0, 500)
    np.testing.assert_array_equal(batch.dense_features.numpy(), ref.dense)
    np.testing.assert_array_equal(batch.labels.numpy(), ref.labels)


# -- (c) malformed input ---------------------------------------------------------------------
GOOD = "\t".join(["0"] + ["1"] * 13 + ["0000000a"] * 26)
MALFORMED = {
    # the bad line is the file's second (1-based, as an editor shows it)
    "non-hex categorical": (
        GOOD + "\n" + GOOD.replace("0000000a", "0000zz0a", 1) + "\n",
        ["line 2, column C1", "0000zz0a"],
    ),
    "short categorical": (GOOD + "\n" + GOOD.replace("0000000a", "a0a", 1) + "\n", ["line 2, column C1", "'a0a'"]),
    "39 fields": (GOOD + "\n" + GOOD.rsplit("\t", 1)[0] + "\n", ["line 2: 39 fields, expected 40"]),
    "41 fields": (GOOD + "\n" + GOOD + "\t0000000a\n", ["line 2: 41 fields, expected 40"]),
    "label 2": (GOOD + "\n2" + GOOD[1:] + "\n", ["line 2, column label: 2: must be 0 or 1"]),
    "label missing": (GOOD + "\n" + GOOD[1:] + "\n", ["line 2, column label: None: must be 0 or 1"]),
    "label not a number": (GOOD + "\nyes" + GOOD[1:] + "\n", ["column #0"]),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_tsv_is_refused_with_one_line_naming_the_file(kaggle, tmp_path, case):
    text, fragments = MALFORMED[case]
    path = tmp_path / "day_0"
    path.write_text(text)
    with pytest.raises(UserError) as exc:
        convert_criteo([path], kaggle, tmp_path / "out")
    msg = one_line_error(exc)
    assert str(path) in msg
    for fragment in fragments:
        assert fragment in msg, f"{fragment!r} not in {msg!r}"
    assert not (tmp_path / "out" / "_dataset.json").exists()
    assert not list((tmp_path / "out").glob("*.parquet"))  # nothing that looks like a dataset


@pytest.mark.parametrize("content", ["", "\n"], ids=["empty", "blank-line"])
def test_convert_refuses_an_empty_file(kaggle, tmp_path, content):
    path = tmp_path / "day_0"
    path.write_text(content)
    with pytest.raises(UserError) as exc:
        convert_criteo([path], kaggle, tmp_path / "out")
    assert str(path) in one_line_error(exc)
    assert not list((tmp_path / "out").glob("*.parquet"))


def test_convert_refuses_missing_file_and_non_criteo_model(kaggle, tmp_path):
    with pytest.raises(UserError) as exc:
        convert_criteo([tmp_path / "day_9"], kaggle, tmp_path / "out")
    assert str(tmp_path / "day_9") in one_line_error(exc)
    path = write_criteo_tsv(synthetic_generator(kaggle, seed=SEED), 10, tmp_path / "day_0")
    with pytest.raises(UserError) as exc:
        list(read_criteo_tsv(path, dlrm_lab.load_preset("tiny")))
    msg = one_line_error(exc)
    assert "tiny" in msg and "13" in msg and "26" in msg


def test_failed_conversion_can_be_rerun_into_the_same_directory(kaggle, tmp_path):
    path = tmp_path / "day_0"
    path.write_text(GOOD + "\n2" + GOOD[1:] + "\n")
    with pytest.raises(UserError):
        convert_criteo([path], kaggle, tmp_path / "out")
    path.write_text(GOOD + "\n" + GOOD + "\n")  # the user fixes the file and runs again
    assert convert_criteo([path], kaggle, tmp_path / "out")["rows"] == 2


def test_writer_refuses_specs_tsv_cannot_hold(tmp_path):
    dcn = dlrm_lab.load_preset("dcnv2", max_rows=100)
    with pytest.raises(UserError) as exc:
        write_criteo_tsv(synthetic_generator(dcn), 10, tmp_path / "x.tsv")
    assert "multi-hot" in one_line_error(exc)
    assert not list(tmp_path.iterdir())


# -- (d), (e) the CLI ------------------------------------------------------------------------
def test_cli_gen_convert_stats_train(tmp_path):
    tsv, ds, runs = tmp_path / "day_0", tmp_path / "ds", tmp_path / "runs"
    # in-process, through the CLI's entry point (a real `dlrm-lab` process: tests/test_cli.py's ctrl-c test)
    code, _, stderr = run_cli_in_process(
        "data", "gen", "--preset", "kaggle", "--max-rows", "1000", "--rows", "3000",
        "--format", "criteo-tsv", "--out", str(tsv),
    )  # fmt: skip
    assert code == 0, stderr
    lines = tsv.read_text().splitlines()
    assert len(lines) == 3000 and all(line.count("\t") == 39 for line in lines)

    code, stdout, stderr = run_cli_in_process(
        "data", "convert-criteo", str(tsv), "--out", str(ds), "--preset", "kaggle", "--max-rows", "1000"
    )
    assert code == 0, stderr
    assert "converted 3,000 samples from 1 file(s)" in stdout
    assert json.loads((ds / "_dataset.json").read_text())["rows"] == 3000

    code, stdout, stderr = run_cli_in_process("data", "stats", str(ds))
    assert code == 0, stderr
    assert "3,000 samples" in stdout and "criteo-tsv" in stdout

    code, _, stderr = run_cli_in_process(
        "train", "--preset", "kaggle", "--max-rows", "1000", "--data", str(ds), "--steps", "3",
        "--batch-size", "64", "--metrics-dir", str(runs), "--no-progress",
    )  # fmt: skip
    assert code == 0, stderr
    (run,) = [p for p in runs.iterdir() if (p / "manifest.json").is_file()]
    manifest = read_manifest(run)
    assert manifest["status"] == "ok"
    data = manifest["config"]["data"]
    assert data["source"] == "parquet" and data["path"] == str(ds)
    assert data["dataset"]["source"] == "criteo-tsv" and data["dataset"]["rows"] == 3000
    assert manifest["config"]["eval_data"]["held_out"] is False  # no generator: honest about evaluation
    steps = pq.read_table(run / "steps.parquet").to_pandas()
    assert len(steps) == 3 and np.isfinite(steps["loss"]).all()


def test_cli_criteo_tsv_of_multi_hot_preset_is_one_line_exit_2(tmp_path):
    code, _, stderr = run_cli_in_process(
        "data", "gen", "--preset", "dcnv2", "--max-rows", "100", "--rows", "100",
        "--format", "criteo-tsv", "--out", str(tmp_path / "x.tsv"),
    )  # fmt: skip
    assert code == 2
    err = stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "multi-hot" in err[0], stderr
    assert not list(tmp_path.iterdir())  # refused before anything was written


def test_training_on_converted_criteo_targets_the_presets_published_auc(tmp_path):
    """terabyte publishes MLPerf's 0.8025: on data converted from Criteo it is the default
    --target-auc (recorded with its rule); on synthetic data there is no default target."""
    from dlrm_lab.config.train import TrainConfig, target_auc_for
    from dlrm_lab.train import preflight, train

    terabyte = dlrm_lab.load_preset("terabyte", max_rows=1000)
    assert terabyte.reference_target_auc == 0.8025
    assert dlrm_lab.load_preset("dcnv2").reference_target_auc == 0.80275
    gen = synthetic_generator(terabyte, seed=SEED)
    convert_criteo([write_criteo_tsv(gen, 512, tmp_path / "day_0")], terabyte, tmp_path / "ds")
    # --data-workers asked: a dataset on disk is read on the prefetch thread (workers make synthetic batches only)
    cfg = TrainConfig(steps=2, batch_size=64, eval_batches=1, data=str(tmp_path / "ds"), data_workers=2)
    result = train(preflight(terabyte, cfg), metrics_dir=tmp_path / "runs")
    prefetch = read_manifest(result.run_dir)["config"]["prefetch_choice"]
    assert prefetch["workers"] == 0 and prefetch["reason"].endswith("workers make synthetic batches only")
    numerics = read_manifest(result.run_dir)["config"]["numerics"]
    assert numerics["target_auc"] == 0.8025
    assert numerics["target_auc_rule"].startswith("published 0.8025")
    assert "converted from Criteo" in numerics["target_auc_rule"]
    assert result.summary["target_auc"] == 0.8025  # the run evaluated against it (MLPerf's stopping rule)

    synthetic = {"source": "synthetic", "click_rate": 0.03}
    assert target_auc_for(terabyte, TrainConfig(), synthetic) == (None, "none")
    assert target_auc_for(terabyte, TrainConfig(target_auc=0.7), {"dataset": {"source": "criteo-tsv"}}) == (
        0.7,
        "given (--target-auc)",
    )
    kaggle = dlrm_lab.load_preset("kaggle")  # publishes no target
    assert target_auc_for(kaggle, TrainConfig(), {"dataset": {"source": "criteo-tsv"}}) == (None, "none")


def test_a_bad_published_target_auc_is_refused_in_one_line(tmp_path):
    from dlrm_lab.config.presets import preset_path

    text = preset_path("terabyte").read_text().replace("target_auc = 0.8025", "target_auc = 1.5")
    bad = tmp_path / "bad.toml"
    bad.write_text(text)
    with pytest.raises(UserError) as excinfo:
        dlrm_lab.load_preset(str(bad))
    msg = one_line_error(excinfo)
    assert "reference.target_auc" in msg and "1.5" in msg and "(0.5, 1)" in msg

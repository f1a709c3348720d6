"""Parquet datasets: written from the generator, read back batch for batch, refused when wrong.

A Parquet dataset must feed training exactly what the synthetic source would have fed it
(same rows, same split over ranks), must say where it came from (spec and seed, so the
held-out stream can be regenerated), must not drop rows, and every bad file must be
refused with one line that names the file and the column or row group at fault.
"""

import inspect
import json
import shutil
import threading

import duckdb
import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads
import pyarrow.parquet as pq
import pytest
import torch

import dlrm_lab
from dlrm_lab.data import DataSpec, ParquetSource, SyntheticGenerator, SyntheticSource, synthetic_generator
from dlrm_lab.data.parquet import (
    METADATA_KEY,
    dataset_schema,
    dataset_sidecar,
    read_dataset_info,
    write_dataset,
)
from dlrm_lab.data.prefetch import Prefetcher
from dlrm_lab.data.stats import dataset_stats
from dlrm_lab.errors import UserError

ROWS = 5000  # not a multiple of any batch used below: the tail matters
SEED = 3


# -- helpers -------------------------------------------------------------------------------
def assert_same_batch(got, want, where=""):
    """Dense, labels and the KJT (keys, values, lengths) identical, dtypes included."""
    assert got.dense_features.dtype == torch.float32 and got.labels.dtype == torch.float32, where
    assert torch.equal(got.dense_features, want.dense_features), f"dense differs {where}"
    assert torch.equal(got.labels, want.labels), f"labels differ {where}"
    g, w = got.sparse_features, want.sparse_features
    assert g.keys() == w.keys(), where
    assert g.values().dtype == torch.int64, where
    assert torch.equal(g.lengths().to(torch.int64), w.lengths().to(torch.int64)), f"lengths differ {where}"
    assert torch.equal(g.values(), w.values()), f"ids differ {where}"


def one_line_error(excinfo) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg, f"error message spans several lines: {msg!r}"
    return msg


def corrupt_row_group(path, rg: int) -> None:
    """Overwrite every column chunk of row group `rg`, leaving the footer (schema) intact."""
    md = pq.ParquetFile(path).metadata.row_group(rg)
    spans = []
    for j in range(md.num_columns):
        c = md.column(j)
        start = c.dictionary_page_offset if c.has_dictionary_page and c.dictionary_page_offset else c.data_page_offset
        spans.append((start, start + c.total_compressed_size))
    lo, hi = min(s for s, _ in spans), max(e for _, e in spans)
    data = bytearray(path.read_bytes())
    data[lo:hi] = b"\xab" * (hi - lo)
    path.write_bytes(bytes(data))


def feature_arrays(table: pa.Table, name: str) -> tuple[np.ndarray, np.ndarray]:
    col = table.column(name)
    return (
        pc.list_value_length(col).to_numpy(zero_copy_only=False),
        pc.list_flatten(col).to_numpy(zero_copy_only=False),
    )


# -- fixtures ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    return dlrm_lab.load_preset("tiny")


@pytest.fixture(scope="module")
def dataset(tiny, tmp_path_factory):
    """5,000 tiny samples (seed 3) in 2 shards."""
    out = tmp_path_factory.mktemp("parquet") / "ds"
    manifest = write_dataset(synthetic_generator(tiny, seed=SEED), ROWS, out, shards=2)
    return out, manifest


@pytest.fixture(scope="module")
def rg_corrupt_dataset(tiny, tmp_path_factory):
    """3,000 rows, 2 shards of 3 row groups of 500; row group 1 of the second shard corrupt.

    Rows [0, 2000) are readable; the damage starts at global row 2000.
    """
    out = tmp_path_factory.mktemp("rgcorrupt") / "ds"
    write_dataset(synthetic_generator(tiny, seed=SEED), 3000, out, shards=2, row_group_samples=500)
    bad = out / "part-00001.parquet"
    assert pq.ParquetFile(bad).num_row_groups == 3
    corrupt_row_group(bad, 1)
    return out, bad


# -- (a) round trip ------------------------------------------------------------------------
@pytest.mark.parametrize("world_size, rank", [(1, 0), (2, 0), (2, 1)])
def test_parquet_batches_equal_synthetic_batches(tiny, dataset, world_size, rank):
    path, _ = dataset
    batch = 64
    n = ROWS // (batch * world_size)  # every full global batch, across the shard boundary
    want = SyntheticSource(synthetic_generator(tiny, seed=SEED), batch, rank, world_size, num_batches=n)
    got = ParquetSource(path, tiny, batch, rank, world_size, num_batches=n)
    got_list = list(got)
    assert len(got_list) == n
    for k, (g, w) in enumerate(zip(got_list, want, strict=True)):
        assert g.labels.shape == (batch,)
        assert_same_batch(g, w, f"batch {k} rank {rank}/{world_size}")


@pytest.mark.parametrize("world_size, rank", [(1, 0), (3, 2)])
def test_a_batch_across_several_row_groups_is_their_rows_in_order(tiny, tmp_path, world_size, rank):
    """Row groups are decoded once and a batch is slices of them (`SampleBlock.offsets`): a batch spanning three row
    groups of 100 samples, its features' lists of several lengths, is the same rows as the generator's."""
    path = tmp_path / "ds"
    write_dataset(synthetic_generator(tiny, seed=SEED), 1_000, path, shards=2, row_group_samples=100)
    batch = 110
    n = 1_000 // (batch * world_size) + 2  # into the next epoch
    got = list(ParquetSource(path, tiny, batch, rank, world_size, num_batches=n))
    want = SyntheticSource(synthetic_generator(tiny, seed=SEED), batch, rank, world_size, num_batches=n)
    full = synthetic_generator(tiny, seed=SEED).samples(0, 1_000)
    assert len({int(x) for x in np.concatenate(full.lengths)}) > 1  # lists of several lengths
    for k, (g, w) in enumerate(zip(got, want, strict=False)):
        if (k + 1) * batch * world_size > 1_000:
            break  # the synthetic source does not wrap: the wrap is the test above's
        assert_same_batch(g, w, f"batch {k} rank {rank}/{world_size}")
    assert len(got) == n


def test_endless_source_continues_with_the_next_epoch(tiny, dataset):
    """epochs=None: the dataset repeats; a batch that straddles the end wraps to row 0."""
    path, _ = dataset
    gen = synthetic_generator(tiny, seed=SEED)
    src = ParquetSource(path, tiny, 3000, num_batches=3)
    batches = list(src)
    assert len(batches) == 3
    expected_rows = [np.r_[0:3000], np.r_[3000:5000, 0:1000], np.r_[1000:4000]]
    full = gen.samples(0, ROWS)
    for b, rows in zip(batches, expected_rows, strict=True):
        np.testing.assert_array_equal(b.labels.numpy(), full.labels[rows])
        np.testing.assert_array_equal(b.dense_features.numpy(), full.dense[rows])
    # ids of the wrapped batch: rows 3000..4999 then 0..999
    second = batches[1].sparse_features.to_dict()
    for f, name in enumerate(tiny.feature_names):
        want = np.concatenate([gen.samples(3000, 5000).values[f], gen.samples(0, 1000).values[f]])
        np.testing.assert_array_equal(second[name].values().numpy(), want)


# -- (b) what the dataset records ------------------------------------------------------------
def test_dataset_json_and_file_metadata_record_spec_seed_and_contiguous_shards(tiny, dataset):
    path, manifest = dataset
    gen = synthetic_generator(tiny, seed=SEED)
    info = json.loads((path / "_dataset.json").read_text())
    assert info == json.loads(json.dumps(manifest))  # the returned manifest is what was written
    assert info["source"] == "synthetic"
    assert info["seed"] == SEED
    assert info["rows"] == ROWS and info["shards"] == 2
    assert info["data_spec"] == json.loads(json.dumps(gen.spec.to_dict()))
    assert info["teacher"]["teacher_auc"] == pytest.approx(gen.teacher_auc)
    assert read_dataset_info(path) == info

    # shards: contiguous, disjoint, in order, and together all rows
    files = info["files"]
    assert [f["path"] for f in files] == ["part-00000.parquet", "part-00001.parquet"]
    assert sorted(p.name for p in path.iterdir()) == ["_dataset.json", "part-00000.parquet", "part-00001.parquet"]
    edges = [f["first_sample"] for f in files] + [files[-1]["first_sample"] + files[-1]["rows"]]
    assert edges[0] == 0 and edges[-1] == ROWS
    assert all(f["rows"] > 0 for f in files)
    assert all(edges[k] + files[k]["rows"] == edges[k + 1] for k in range(len(files)))

    for k, f in enumerate(files):
        table = pq.read_table(path / f["path"])
        meta = json.loads(table.schema.metadata[METADATA_KEY])
        assert meta["data_spec"] == info["data_spec"]
        assert meta["seed"] == SEED
        assert meta["shard"] == k and meta["shard_first_sample"] == f["first_sample"]
        assert table.num_rows == f["rows"]
        # the shard holds exactly the generator's samples of its range
        lo, hi = f["first_sample"], f["first_sample"] + f["rows"]
        assert_holds_samples(table, gen.samples(lo, hi), tiny)


def assert_holds_samples(table, ref, spec) -> None:
    """`table` (Arrow) holds exactly the samples `ref`: labels, dense values, every feature's ids."""
    np.testing.assert_array_equal(table.column("label").to_numpy(), ref.labels)
    dense = pc.list_flatten(table.column("dense")).to_numpy().reshape(-1, spec.num_dense)
    np.testing.assert_array_equal(dense, ref.dense)
    for i, name in enumerate(spec.feature_names):
        lengths, values = feature_arrays(table, name)
        np.testing.assert_array_equal(lengths, ref.lengths[i])
        np.testing.assert_array_equal(values, ref.values[i])


def test_stored_spec_regenerates_the_data_including_overrides(tiny, tmp_path):
    """The spec stored is the resolved one (with --set overrides), enough to regenerate every sample."""
    gen = synthetic_generator(tiny, overrides=("features.cat_3.ids.alpha=1.3",), seed=7)
    write_dataset(gen, 1000, tmp_path / "ds")
    shutil.copy(tmp_path / "ds" / "part-00000.parquet", tmp_path / "alone.parquet")
    for where in (tmp_path / "ds", tmp_path / "alone.parquet"):  # the sidecar, then file metadata only
        info = read_dataset_info(where)
        assert info["seed"] == 7
        assert info["data_spec"]["overrides"] == ["features.cat_3.ids.alpha=1.3"]
        again = SyntheticGenerator(DataSpec.from_dict(info["data_spec"]), info["seed"])
        ref, regen = gen.samples(0, 1000), again.samples(0, 1000)
        np.testing.assert_array_equal(regen.labels, ref.labels)
        np.testing.assert_array_equal(regen.dense, ref.dense)
        for a, b in zip(regen.values, ref.values, strict=True):
            np.testing.assert_array_equal(a, b)
    # and the override really changed the data (otherwise this test proves nothing)
    plain = synthetic_generator(tiny, seed=7).samples(0, 1000)
    assert not np.array_equal(plain.values[3], gen.samples(0, 1000).values[3])


# -- (b2) the directory opens as it is in other tools -----------------------------------------
COLUMNS = ["label", "dense", "cat_0", "cat_1", "cat_2", "cat_3"]  # the tiny preset's


def test_arrow_opens_the_directory_with_no_options(tiny, dataset):
    path, _ = dataset
    assert ["label", "dense", *tiny.feature_names] == COLUMNS
    full = synthetic_generator(tiny, seed=SEED).samples(0, ROWS)
    shards = [path / "part-00000.parquet", path / "part-00001.parquet"]
    ds = pads.dataset(path)
    assert sorted(ds.files) == [str(f) for f in shards]  # the sidecar is not taken for a shard
    for table in (ds.to_table(), pq.read_table(path)):
        assert table.num_rows == ROWS
        assert table.column_names == COLUMNS
        assert_holds_samples(table, full, tiny)


def test_duckdb_reads_the_shards_glob(tiny, dataset):
    path, _ = dataset
    full = synthetic_generator(tiny, seed=SEED).samples(0, ROWS)
    rel = duckdb.sql(f"select * from read_parquet('{path}/*.parquet')")
    assert rel.columns == COLUMNS
    count, clicks, cat0_ids, cat3_ids = duckdb.sql(
        "select count(*), sum(label)::bigint, sum(len(cat_0))::bigint, sum(list_sum(cat_3))::hugeint"
        f" from read_parquet('{path}/*.parquet')"
    ).fetchall()[0]
    assert count == ROWS
    assert clicks == int(full.labels.sum())
    assert cat0_ids == int(full.lengths[0].sum())
    assert cat3_ids == int(full.values[3].sum())


def assert_polars_frame_is_the_dataset(df, tiny, full):
    assert df.height == ROWS
    assert df.columns == COLUMNS
    np.testing.assert_array_equal(df["label"].to_numpy(), full.labels)
    np.testing.assert_array_equal(df["dense"].to_numpy(), full.dense)
    for i, name in enumerate(tiny.feature_names):
        np.testing.assert_array_equal(df[name].list.len().to_numpy(), full.lengths[i])
        np.testing.assert_array_equal(df[name].explode().drop_nulls().to_numpy(), full.values[i])


def test_polars_reads_the_shards_glob(tiny, dataset):
    path, _ = dataset
    full = synthetic_generator(tiny, seed=SEED).samples(0, ROWS)
    assert_polars_frame_is_the_dataset(pl.read_parquet(f"{path}/*.parquet"), tiny, full)
    lazy = pl.scan_parquet(f"{path}/*.parquet")
    assert lazy.collect_schema().names() == COLUMNS
    assert lazy.select(pl.len()).collect().item() == ROWS
    assert_polars_frame_is_the_dataset(lazy.collect(), tiny, full)


@pytest.mark.skipif(
    "hidden_file_prefix" not in inspect.signature(pl.scan_parquet).parameters,
    reason="polars < 1.34 has no hidden_file_prefix",
)
def test_polars_scans_the_directory_skipping_the_sidecar(tiny, dataset):
    """polars refuses a directory holding a non-Parquet file; told that `_` hides files, it reads it."""
    path, _ = dataset
    full = synthetic_generator(tiny, seed=SEED).samples(0, ROWS)
    assert_polars_frame_is_the_dataset(pl.scan_parquet(path, hidden_file_prefix="_").collect(), tiny, full)


def test_dataset_with_the_legacy_sidecar_still_opens(tiny, dataset, tmp_path):
    """A dataset written before the rename (sidecar `dataset.json`) reads as before, sidecar included."""
    path, manifest = dataset
    old = tmp_path / "old"
    shutil.copytree(path, old)
    (old / "_dataset.json").rename(old / "dataset.json")
    assert sorted(p.name for p in old.iterdir()) == ["dataset.json", "part-00000.parquet", "part-00001.parquet"]
    assert dataset_sidecar(old) == old / "dataset.json" and dataset_sidecar(path) == path / "_dataset.json"

    # the description comes from the sidecar (the file-metadata fallback has no per-file rows)
    info = read_dataset_info(old)
    assert info == read_dataset_info(path) == json.loads(json.dumps(manifest))
    assert info["files"][1] == {"path": "part-00001.parquet", "rows": ROWS - ROWS // 2, "first_sample": ROWS // 2}

    # training source: same description, same batches
    src_old, src_new = ParquetSource(old, tiny, 1000, epochs=1), ParquetSource(path, tiny, 1000, epochs=1)
    want = {k: v for k, v in src_new.describe().items() if k != "path"}
    assert {k: v for k, v in src_old.describe().items() if k != "path"} == want
    got_batches = list(src_old)
    assert len(got_batches) == ROWS // 1000
    for k, (g, w) in enumerate(zip(got_batches, src_new, strict=True)):
        assert_same_batch(g, w, f"batch {k}")

    # data stats: same measurements, same checks against the stored spec
    st_old, st_new = dataset_stats(old), dataset_stats(path)
    assert st_old["path"] == str(old) and st_new["path"] == str(path)
    assert st_old["checks"] and {**st_old, "path": None} == {**st_new, "path": None}

    # a new sidecar next to an old one wins
    (old / "_dataset.json").write_text(json.dumps({**info, "seed": SEED + 1}))
    assert read_dataset_info(old)["seed"] == SEED + 1


# -- (c) no silent drop ------------------------------------------------------------------------
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_one_epoch_yields_every_row_exactly_once(tiny, dataset, world_size):
    path, _ = dataset
    batch = 64
    g = batch * world_size
    assert ROWS % g != 0
    per_rank = [list(ParquetSource(path, tiny, batch, r, world_size, epochs=1)) for r in range(world_size)]
    n_batches = -(-ROWS // g)
    assert [len(b) for b in per_rank] == [n_batches] * world_size  # every rank steps the same number of times
    for r in range(world_size):
        assert all(b.labels.numel() == batch for b in per_rank[r][:-1])  # only the last batch is short
    assert sum(per_rank[r][-1].labels.numel() for r in range(world_size)) == ROWS % g

    # global order: batch k = rank 0's slice, rank 1's, ...
    ordered = [per_rank[r][k] for k in range(n_batches) for r in range(world_size)]
    full = synthetic_generator(tiny, seed=SEED).samples(0, ROWS)
    labels = torch.cat([b.labels for b in ordered]).numpy()
    dense = torch.cat([b.dense_features for b in ordered]).numpy()
    assert len(labels) == ROWS
    np.testing.assert_array_equal(labels, full.labels)
    np.testing.assert_array_equal(dense, full.dense)
    for f, name in enumerate(tiny.feature_names):
        parts = [b.sparse_features.to_dict()[name] for b in ordered]
        np.testing.assert_array_equal(torch.cat([p.lengths() for p in parts]).numpy(), full.lengths[f])
        np.testing.assert_array_equal(torch.cat([p.values() for p in parts]).numpy(), full.values[f])


def test_two_epochs_then_stop(tiny, dataset):
    path, _ = dataset
    batches = list(ParquetSource(path, tiny, 1000, epochs=2))
    assert [b.labels.numel() for b in batches] == [1000] * 10
    labels = torch.cat([b.labels for b in batches]).numpy()
    np.testing.assert_array_equal(labels[:ROWS], labels[ROWS:])


# -- (d) bad input ---------------------------------------------------------------------------
@pytest.fixture()
def one_file(dataset):
    path, _ = dataset
    return pq.read_table(path / "part-00000.parquet")


def test_missing_column_names_file_and_column(tiny, one_file, tmp_path):
    bad = tmp_path / "part-00000.parquet"
    pq.write_table(one_file.drop(["cat_2"]), bad)
    with pytest.raises(UserError) as exc:
        ParquetSource(tmp_path, tiny, 64)
    msg = one_line_error(exc)
    assert str(bad) in msg and "missing column" in msg and "cat_2" in msg


def test_extra_column_names_file_and_column(tiny, one_file, tmp_path):
    bad = tmp_path / "part-00000.parquet"
    pq.write_table(one_file.append_column("junk", pa.array(np.zeros(one_file.num_rows))), bad)
    with pytest.raises(UserError) as exc:
        ParquetSource(tmp_path, tiny, 64)
    msg = one_line_error(exc)
    assert str(bad) in msg and "junk" in msg


def test_dataset_of_another_model_is_refused_by_column(dataset):
    """A tiny dataset read for kaggle: the columns kaggle needs are named."""
    path, _ = dataset
    kaggle = dlrm_lab.load_preset("kaggle", max_rows=1000)
    with pytest.raises(UserError) as exc:
        ParquetSource(path, kaggle, 64)
    msg = one_line_error(exc)
    assert str(path / "part-00000.parquet") in msg and "missing column" in msg and "cat_4" in msg


def test_wrong_dense_width_for_model(dataset):
    """Same features, different num_dense: refused before any batch, naming column dense."""
    path, _ = dataset
    six = dlrm_lab.load_preset("tiny", num_dense=6)
    with pytest.raises(UserError) as exc:
        ParquetSource(path, six, 64)
    msg = one_line_error(exc)
    assert str(path / "part-00000.parquet") in msg and "column dense" in msg
    assert "4" in msg and "6" in msg


def test_wrong_dense_width_in_hand_made_table(tiny, one_file, tmp_path):
    n = one_file.num_rows
    schema = dataset_schema(3, tiny.feature_names)
    cols = [
        one_file.column("label"),
        pa.FixedSizeListArray.from_arrays(pa.array(np.zeros(3 * n, np.float32)), 3),
        *[one_file.column(name) for name in tiny.feature_names],
    ]
    bad = tmp_path / "mine.parquet"
    pq.write_table(pa.Table.from_arrays(cols, schema=schema), bad)
    with pytest.raises(UserError) as exc:
        ParquetSource(bad, tiny, 64)  # a single file is a dataset too
    msg = one_line_error(exc)
    assert str(bad) in msg and "column dense" in msg and "3" in msg


def test_ids_beyond_table_rows_name_file_row_group_and_column(tmp_path):
    """Generated with --max-rows 1000, read with --max-rows 100: ids past the smaller tables."""
    big = dlrm_lab.load_preset("kaggle", max_rows=1000)
    small = dlrm_lab.load_preset("kaggle", max_rows=100)
    write_dataset(synthetic_generator(big, seed=1), 300, tmp_path / "ds")
    src = ParquetSource(tmp_path / "ds", small, 64)  # the schema is fine: only values are wrong
    with pytest.raises(UserError) as exc:
        next(iter(src))
    msg = one_line_error(exc)
    assert str(tmp_path / "ds" / "part-00000.parquet") in msg
    assert "row group 0" in msg and "column cat_0" in msg and "[0, 100)" in msg


def test_negative_id_and_null_label_are_refused(tiny, one_file, tmp_path):
    ids = one_file.column("cat_1").combine_chunks()
    values = ids.values.to_numpy().copy()
    values[5] = -1
    neg = pa.ListArray.from_arrays(ids.offsets, pa.array(values))
    (tmp_path / "neg").mkdir()
    pq.write_table(
        one_file.set_column(one_file.schema.get_field_index("cat_1"), "cat_1", neg), tmp_path / "neg/a.parquet"
    )
    with pytest.raises(UserError) as exc:
        list(ParquetSource(tmp_path / "neg", tiny, 64, epochs=1))
    msg = one_line_error(exc)
    assert str(tmp_path / "neg/a.parquet") in msg and "row group 0" in msg and "cat_1" in msg and "-1" in msg

    labels = pa.array([None] + [1.0] * (one_file.num_rows - 1), pa.float32())
    (tmp_path / "nul").mkdir()
    pq.write_table(one_file.set_column(0, pa.field("label", pa.float32()), labels), tmp_path / "nul/a.parquet")
    with pytest.raises(UserError) as exc:
        list(ParquetSource(tmp_path / "nul", tiny, 64, epochs=1))
    msg = one_line_error(exc)
    assert str(tmp_path / "nul/a.parquet") in msg and "column label" in msg and "null" in msg


@pytest.mark.parametrize(
    ("column", "value", "message"),
    [
        ("label", float("nan"), "column label: nan at row 5 (1 such); labels are 0 or 1"),
        ("label", 2.0, "column label: 2.0 at row 5 (1 such); labels are 0 or 1"),
        ("label", 0.5, "column label: 0.5 at row 5 (1 such); labels are 0 or 1"),
        ("dense", float("inf"), "column dense: inf at row 1, value 1 (1 such); dense features must be finite numbers"),
        ("dense", float("nan"), "column dense: nan at row 1, value 1 (1 such); dense features must be finite numbers"),
    ],
)
def test_labels_other_than_0_and_1_and_non_finite_dense_values_are_refused(tiny, one_file, tmp_path, column, value,
                                                                           message):  # fmt: skip
    from dlrm_lab.data.stats import dataset_problems

    if column == "label":
        labels = one_file.column("label").to_numpy().copy()
        labels[5] = value
        table = one_file.set_column(0, pa.field("label", pa.float32(), nullable=False), pa.array(labels, pa.float32()))
    else:
        dense = one_file.column("dense").combine_chunks()
        values = dense.values.to_numpy().copy()
        values[tiny.num_dense + 1] = value  # row 1, its second value
        arr = pa.FixedSizeListArray.from_arrays(pa.array(values, pa.float32()), tiny.num_dense)
        table = one_file.set_column(1, one_file.schema.field("dense"), arr)
    (tmp_path / "bad").mkdir()
    pq.write_table(table, tmp_path / "bad/a.parquet")
    with pytest.raises(UserError) as exc:
        list(ParquetSource(tmp_path / "bad", tiny, 64, epochs=1))
    assert one_line_error(exc) == f"{tmp_path / 'bad/a.parquet'}: row group 0: {message}"
    assert any(message in p for p in dataset_problems(tmp_path / "bad"))  # data stats names it the same way


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_unreadable_parquet_file_is_named(tiny, dataset, tmp_path, damage):
    path, _ = dataset
    copy = tmp_path / "ds"
    shutil.copytree(path, copy)
    bad = copy / "part-00001.parquet"
    if damage == "garbage":
        bad.write_bytes(b"this is not a parquet file\n" * 10)
    else:
        data = bad.read_bytes()
        bad.write_bytes(data[: len(data) // 2])
    with pytest.raises(UserError) as exc:
        ParquetSource(copy, tiny, 64)  # refused up front, not halfway through training
    msg = one_line_error(exc)
    assert str(bad) in msg and "not a readable Parquet file" in msg


def test_corrupt_row_group_is_named_at_the_batch_that_needs_it(tiny, rg_corrupt_dataset):
    path, bad = rg_corrupt_dataset
    want = SyntheticSource(synthetic_generator(tiny, seed=SEED), 100, num_batches=20)
    got = iter(ParquetSource(path, tiny, 100, epochs=1))
    for k, w in enumerate(want):  # rows [0, 2000) come through intact
        assert_same_batch(next(got), w, f"batch {k}")
    with pytest.raises(UserError) as exc:
        next(got)
    msg = one_line_error(exc)
    assert str(bad) in msg and "row group 1" in msg


def test_empty_directory_is_refused(tiny, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError) as exc:
        ParquetSource(tmp_path / "empty", tiny, 64)
    msg = one_line_error(exc)
    assert str(tmp_path / "empty") in msg and "no .parquet files" in msg


@pytest.mark.parametrize("name", ["nope", "nope.parquet"])
def test_nonexistent_path_is_refused(tiny, tmp_path, name):
    with pytest.raises(UserError) as exc:
        ParquetSource(tmp_path / name, tiny, 64)
    assert str(tmp_path / name) in one_line_error(exc)
    with pytest.raises(UserError) as exc:
        read_dataset_info(tmp_path / name)
    msg = one_line_error(exc)
    assert str(tmp_path / name) in msg and "no such" in msg


def test_nonexistent_path_message_says_it_does_not_exist(tiny, tmp_path):
    with pytest.raises(UserError, match="no such"):
        ParquetSource(tmp_path / "nope", tiny, 64)


# -- (e) prefetching -------------------------------------------------------------------------
def test_prefetcher_yields_the_same_batches_in_order(tiny):
    want = list(SyntheticSource(synthetic_generator(tiny, seed=SEED), 32, num_batches=12))
    source = SyntheticSource(synthetic_generator(tiny, seed=SEED), 32, num_batches=12)
    pre = Prefetcher(source, depth=2)
    try:
        got = list(pre)
        assert pre.describe()["prefetch_depth"] == 2 and pre.describe()["seed"] == SEED
    finally:
        pre.close()
    assert len(got) == 12
    for k, (g, w) in enumerate(zip(got, want, strict=True)):
        assert_same_batch(g, w, f"batch {k}")


def test_prefetcher_reraises_after_the_batches_made_before_the_error(tiny):
    want = list(SyntheticSource(synthetic_generator(tiny, seed=SEED), 16, num_batches=3))

    def failing():
        yield from SyntheticSource(synthetic_generator(tiny, seed=SEED), 16, num_batches=3)
        raise RuntimeError("source broke at batch 3")

    pre = Prefetcher(failing(), depth=2)
    it = iter(pre)
    try:
        for k, w in enumerate(want):
            assert_same_batch(next(it), w, f"batch {k}")
        with pytest.raises(RuntimeError, match="source broke at batch 3"):
            next(it)
    finally:
        pre.close()


def test_prefetcher_reraises_parquet_error_at_the_corrupt_row_group(tiny, rg_corrupt_dataset):
    path, bad = rg_corrupt_dataset
    want = SyntheticSource(synthetic_generator(tiny, seed=SEED), 100, num_batches=20)
    pre = Prefetcher(ParquetSource(path, tiny, 100, epochs=1), depth=3)
    it = iter(pre)
    try:
        for k, w in enumerate(want):
            assert_same_batch(next(it), w, f"batch {k}")
        with pytest.raises(UserError) as exc:
            next(it)
        msg = one_line_error(exc)
        assert str(bad) in msg and "row group 1" in msg
    finally:
        pre.close()


def test_prefetcher_close_stops_an_endless_source(tiny):
    before = {t for t in threading.enumerate() if t.name == "dlrm-lab-prefetch"}
    pre = Prefetcher(SyntheticSource(synthetic_generator(tiny, seed=SEED), 8), depth=2)
    it = iter(pre)
    next(it), next(it)
    pre.close()
    mine = {t for t in threading.enumerate() if t.name == "dlrm-lab-prefetch"} - before
    assert not any(t.is_alive() for t in mine)

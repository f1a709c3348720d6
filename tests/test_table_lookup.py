"""The tables' pooled lookup in a whole-batch package: the lab's op (`model.native`'s `pooled_lookup`) pools as
fbgemm's inference op does over the same layout, refuses what would read past the tables, exports into a package
that calls it and scores as the eager model, and serves only where timing both on the model's tables chose it."""

from __future__ import annotations

import copy
import zipfile

import numpy as np
import pytest
import torch
from fbgemm_gpu.split_embedding_configs import SparseType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
from fbgemm_gpu.split_table_batched_embeddings_ops_inference import IntNBitTableBatchedEmbeddingBagsCodegen

import dlrm_lab
from dlrm_lab.infer import accuracy, table_lookup
from dlrm_lab.infer.artefacts import record_of
from dlrm_lab.infer.batches import QueryRef
from dlrm_lab.infer.build import make_build
from dlrm_lab.infer.builds import build_named
from dlrm_lab.infer.library import PackedLibrary
from dlrm_lab.infer.serving_parts import make_runner
from dlrm_lab.infer.table_lookup import FBGEMM, NATIVE, PooledLookup, table_weights
from dlrm_lab.model import native
from dlrm_lab.model.dlrm import build_model

pytestmark = pytest.mark.skipif(native.load() is not None, reason="the lab's kernels do not build here")

ROWS = (1000, 37, 5000, 300, 64)  # tables, some smaller than a batch's ids
# rows of 1, 2, 4 and 8 vectors (summed in registers) and of any width (in memory, with a tail)
WIDTHS = {t: (16, 24 if t != "fp16" else 40, 32, 64, 128) for t in ("fp32", "fp16", "int8", "int4")}
TYPES = {"fp32": SparseType.FP32, "fp16": SparseType.FP16, "int8": SparseType.INT8, "int4": SparseType.INT4}
OUTPUTS = {SparseType.FP32: torch.float32, SparseType.FP16: torch.float16, SparseType.BF16: torch.bfloat16}


def _tables(table_type: str, pooling: PoolingMode, output: SparseType) -> IntNBitTableBatchedEmbeddingBagsCodegen:
    torch.manual_seed(0)
    specs = [
        ("", rows, dim, TYPES[table_type], EmbeddingLocation.HOST)
        for rows, dim in zip(ROWS, WIDTHS[table_type], strict=True)
    ]
    tables = IntNBitTableBatchedEmbeddingBagsCodegen(specs, pooling_mode=pooling, output_dtype=output, device="cpu")
    tables.fill_random_weights()  # random bytes: floats made sane below, quantised rows given sane scales and biases
    for (weights, scale_bias), dim in zip(
        tables.split_embedding_weights(split_scale_shifts=True), WIDTHS[table_type], strict=True
    ):
        if table_type in ("fp32", "fp16"):
            values = weights.view(torch.float32 if table_type == "fp32" else torch.float16)[:, :dim]
            values.copy_(torch.randn(values.shape))
        else:
            halves = scale_bias.view(torch.float16)  # each row: scale, bias
            halves[:, 0], halves[:, 1] = torch.rand(len(halves)) * 0.1, torch.rand(len(halves)) * 2 - 1
    return tables


def _ragged_batch(batch: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """`batch` samples whose bags hold 0-4 ids each (empty bags included), feature-major."""
    lengths = torch.randint(0, 5, (len(ROWS), batch), generator=generator)
    ids = torch.cat(
        [torch.randint(0, rows, (int(n),), generator=generator) for rows, n in zip(ROWS, lengths.sum(1), strict=True)]
    )
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.flatten().cumsum(0)])
    return ids.int(), offsets.int()


@pytest.mark.parametrize("table_type", list(TYPES))
@pytest.mark.parametrize("pooling", [PoolingMode.SUM, PoolingMode.MEAN])
@pytest.mark.parametrize("output", list(OUTPUTS))
def test_the_labs_lookup_pools_as_fbgemms_for_every_table_type_pooling_and_output(table_type, pooling, output):
    tables = _tables(table_type, pooling, output)
    weights = table_weights(tables)
    ours, theirs = PooledLookup(tables, NATIVE), PooledLookup(tables, FBGEMM)
    generator = torch.Generator().manual_seed(1)
    for batch in (1, 7, 64):
        ids, offsets = _ragged_batch(batch, generator)
        got, want = ours(weights, ids, offsets), theirs(weights, ids, offsets)
        assert got.dtype == want.dtype == OUTPUTS[output] and got.shape == want.shape == (
            batch,
            sum(WIDTHS[table_type]),
        )
        # the same sums in another order (and, for int8/int4, scale * q + bias fused): one rounding of the output
        ulp = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[got.dtype]
        assert torch.allclose(got.float(), want.float(), rtol=ulp, atol=ulp), (got - want).abs().max()
    empty = torch.zeros(len(ROWS) * 3 + 1, dtype=torch.int32)  # three samples of empty bags: zeros
    assert ours(weights, torch.zeros(0, dtype=torch.int32), empty).float().abs().sum() == 0


def test_the_labs_lookup_of_one_id_a_bag_is_the_rows_themselves():
    tables = _tables("fp32", PoolingMode.SUM, SparseType.FP32)
    weights = table_weights(tables)
    picked = [(rows - 1, 0) for rows in ROWS]  # each table's last and first rows; the second sample's last bag empty
    ids = torch.tensor([i for pair in picked for i in pair][:-1], dtype=torch.int32)
    offsets = torch.tensor([*range(len(ids) + 1), len(ids)], dtype=torch.int32)
    got = PooledLookup(tables, NATIVE)(weights, ids, offsets)
    rows = [w.view(torch.float32) for w, _ in tables.split_embedding_weights(split_scale_shifts=True)]
    at = 0
    for t, width in enumerate(WIDTHS["fp32"]):
        assert torch.equal(got[0, at : at + width], rows[t][ROWS[t] - 1, :width])
        second = torch.zeros(width) if t == len(ROWS) - 1 else rows[t][0, :width]
        assert torch.equal(got[1, at : at + width], second)
        at += width


def test_the_labs_lookup_refuses_ids_past_the_tables_and_offsets_past_the_ids():
    tables = _tables("int8", PoolingMode.SUM, SparseType.FP32)
    weights, lookup = table_weights(tables), PooledLookup(tables, NATIVE)
    n = len(ROWS)
    offsets = torch.arange(n + 1, dtype=torch.int32)
    past = torch.tensor([0] * (n - 1) + [10**8], dtype=torch.int32)  # far past the last table's rows: the buffer's
    with pytest.raises(RuntimeError, match=f"pooled_lookup: id 100000000 of feature {n - 1} past the tables"):
        lookup(weights, past, offsets)
    with pytest.raises(RuntimeError, match="pooled_lookup: id -1 of feature 0"):
        lookup(weights, torch.tensor([-1] + [0] * (n - 1), dtype=torch.int32), offsets)
    with pytest.raises(RuntimeError, match=f"bag offsets 0..{n} outside the {n - 1} ids"):
        lookup(weights, torch.zeros(n - 1, dtype=torch.int32), offsets)
    backwards = torch.tensor([0, 2, 1, *range(3, n + 1)], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="ends .* before it starts"):
        lookup(weights, torch.zeros(n, dtype=torch.int32), backwards)
    with pytest.raises(ValueError, match="table lookup 'torchrec': allowed: fbgemm, native"):
        PooledLookup(tables, "torchrec")


@pytest.fixture(scope="module")
def tiny():
    spec = dlrm_lab.load_preset("tiny", num_embeddings=[50_000] * 4)
    torch.manual_seed(0)
    return build_model(spec).eval(), PackedLibrary.generate(spec, None, 0, 512)


def _eager_scores(model, library, refs):
    from dlrm_lab.infer.batches import assemble_batch

    dense, kjt = assemble_batch(library, refs, list(model.spec.feature_names))
    with torch.inference_mode():
        return torch.sigmoid(model(dense, kjt)).numpy()


def test_a_package_with_the_labs_lookup_calls_it_keys_its_own_package_and_scores_as_the_eager_model(tiny):
    model, library = tiny
    fused = make_build(copy.deepcopy(model), "fused", precision="fp32", table_precision="fp32")
    plain = build_named("aoti").make(model, fused, precision="fp32", table_precision="fp32")
    fused.lookup_way = NATIVE
    packaged = build_named("aoti").make(model, fused, precision="fp32", table_precision="fp32")
    assert packaged.package != plain.package and record_of(packaged.package)["lookup"] == NATIVE
    assert "lookup" not in record_of(plain.package)
    with zipfile.ZipFile(packaged.package) as z:
        graph = [z.read(name) for name in z.namelist() if not name.endswith(".so")]
    assert any(b"dlrm_lab::pooled_lookup" in g for g in graph)
    assert not any(b"int_nbit_split_embedding_codegen_lookup_function" in g for g in graph)
    runner = make_runner(packaged, library, torch.device("cpu"), "fp32")
    for refs in ([QueryRef(0, 1, 3)], [QueryRef(0, 5, 10), QueryRef(1, 40, 200), QueryRef(2, 1, 511)]):
        assert np.abs(runner(refs) - _eager_scores(model, library, refs)).max() <= accuracy.FP32_SCORE_TOLERANCE
    # an instance loads the package from its record's word: a finalist made with either lookup loads anywhere
    other = build_named("aoti").from_artefact(plain, packaged.package)
    assert np.abs(make_runner(other, library, torch.device("cpu"), "fp32")([QueryRef(0, 9, 0)])).max() <= 1


def test_choosing_the_lookup_times_both_on_the_models_tables_and_sets_the_packages(tiny, monkeypatch):
    model, library = tiny
    fused = make_build(copy.deepcopy(model), "fused", precision="fp32", table_precision="fp32")
    lines: list[str] = []
    record = table_lookup.choose_lookup(fused, library, sizes=[1, 32], threads=1, log=lines.append)
    assert set(record["ms"]) == {FBGEMM, NATIVE} and set(record["ms"][NATIVE]) == {"1", "32"}
    assert all(v > 0 for by in record["ms"].values() for v in by.values())
    total = {way: sum(by.values()) for way, by in record["ms"].items()}
    assert record["lookup"] == (NATIVE if total[FBGEMM] >= table_lookup.MARGIN * total[NATIVE] else FBGEMM)
    assert fused.lookup_way == record["lookup"] and fused.sibling().lookup_way == record["lookup"]
    assert lines[-1].startswith(f"table lookup {record['lookup']}: the lab's lookup against fbgemm's, fp32 tables")
    # kernels that do not build: fbgemm's, and why
    monkeypatch.setattr(table_lookup.native, "load", lambda: "the lab's C++ kernels did not build: no compiler")
    record = table_lookup.choose_lookup(fused, library, sizes=[8], threads=1)
    assert record["lookup"] == FBGEMM and "no compiler" in record["reason"] and fused.lookup_way == FBGEMM


def test_the_labs_lookup_refuses_a_layout_whose_table_starts_past_the_tables():
    tables = _tables("fp32", PoolingMode.SUM, SparseType.FP32)
    lookup = PooledLookup(tables, NATIVE)
    lookup.weights_offsets[-1] = table_weights(tables).numel()  # the last feature's table past the buffer's end
    offsets = torch.arange(len(ROWS) + 1, dtype=torch.int32)
    with pytest.raises(RuntimeError, match=f"feature {len(ROWS) - 1}'s table starts past the tables"):
        lookup(table_weights(tables), torch.zeros(len(ROWS), dtype=torch.int32), offsets)
